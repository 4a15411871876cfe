//! A flock of boids as a GPU actor: the flock (two buffers it steps between) lives
//! on its host's GPU, and each frame is one call, made in turn through each of the
//! three nodes of a local mesh. Positions and velocities are integers on a torus of
//! 65536 units, so the GPU's frames can be checked against a CPU run bit for bit;
//! they are, every 15 frames, read through a different node each time.
//!
//! The kernel is written the way compute tutorials write particle systems: one
//! thread per boid, a bounds check for the ragged last workgroup (1500 boids,
//! workgroups of 64), the rules' radii and weights in a uniform, and two particle
//! buffers it reads from and writes to in turn (frame parity in the uniform).
//!
//! `cargo run --release --example boids_actor`

#[path = "common/mod.rs"]
mod common;

use gpumesh::node::api::StateInit;
use gpumesh::protocol::{ActorCall, BindingRole, BindingSpec, Grid, ShaderSource};

const BOIDS: usize = 1500;
const FRAMES: u32 = 90;
const CHECK_EVERY: u32 = 15;

/// The rules: cohesion, separation and alignment radii, and how strongly each pulls
/// (a divisor: the larger, the weaker), in world units.
#[derive(Clone, Copy)]
struct Rules {
    cohesion: i32,
    separation: i32,
    alignment: i32,
    pull_cohesion: i32,
    push_separation: i32,
    pull_alignment: i32,
    max_speed: i32,
}

const RULES: Rules = Rules {
    cohesion: 6000,
    separation: 1200,
    alignment: 4000,
    pull_cohesion: 100,
    push_separation: 16,
    pull_alignment: 4,
    max_speed: 300,
};

const KERNEL: &str = r#"
struct Params {
    count: u32,
    // 0: read `a`, write `b`; 1: read `b`, write `a`.
    parity: u32,
    r_cohesion: i32,
    r_separation: i32,
    r_alignment: i32,
    pull_cohesion: i32,
    push_separation: i32,
    pull_alignment: i32,
    max_speed: i32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

// Each boid: position (x, y) and velocity (x, y).
@group(0) @binding(0) var<storage, read_write> a: array<vec4<i32>>;
@group(0) @binding(1) var<storage, read_write> b: array<vec4<i32>>;
@group(0) @binding(2) var<uniform> params: Params;

fn boid(i: u32) -> vec4<i32> {
    if (params.parity == 0u) {
        return a[i];
    }
    return b[i];
}

fn set_boid(i: u32, v: vec4<i32>) {
    if (params.parity == 0u) {
        b[i] = v;
    } else {
        a[i] = v;
    }
}

// The shortest offset between two points of the 65536-unit torus.
fn wrap(d: vec2<i32>) -> vec2<i32> {
    return ((d + vec2<i32>(32768)) & vec2<i32>(65535)) - vec2<i32>(32768);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= params.count) {
        return;
    }
    let me = boid(i);
    let reach = max(params.r_cohesion, max(params.r_separation, params.r_alignment));
    var center = vec2<i32>(0);
    var near = 0;
    var apart = vec2<i32>(0);
    var heading = vec2<i32>(0);
    var aligned = 0;
    for (var j = 0u; j < params.count; j++) {
        if (j == i) {
            continue;
        }
        let other = boid(j);
        let d = wrap(other.xy - me.xy);
        if (abs(d.x) >= reach || abs(d.y) >= reach) {
            continue;
        }
        let d2 = d.x * d.x + d.y * d.y;
        if (d2 < params.r_cohesion * params.r_cohesion) {
            center += d;
            near += 1;
        }
        if (d2 < params.r_separation * params.r_separation) {
            apart -= d;
        }
        if (d2 < params.r_alignment * params.r_alignment) {
            heading += other.zw;
            aligned += 1;
        }
    }
    var v = me.zw;
    if (near > 0) {
        v += center / near / params.pull_cohesion;
    }
    v += apart / params.push_separation;
    if (aligned > 0) {
        v += (heading / aligned - v) / params.pull_alignment;
    }
    v = clamp(v, vec2<i32>(-params.max_speed), vec2<i32>(params.max_speed));
    let p = (me.xy + v) & vec2<i32>(65535);
    set_boid(i, vec4<i32>(p, v));
}
"#;

type Boid = [i32; 4];

/// The shortest offset between two coordinates of the torus.
fn wrap(d: i32) -> i32 {
    ((d + 32768) & 65535) - 32768
}

/// One frame on the CPU, the same integer arithmetic (division truncates toward
/// zero in both).
fn cpu_frame(flock: &[Boid], r: Rules) -> Vec<Boid> {
    let reach = r.cohesion.max(r.separation).max(r.alignment);
    flock
        .iter()
        .enumerate()
        .map(|(i, me)| {
            let (mut center, mut near) = ([0i32; 2], 0i32);
            let mut apart = [0i32; 2];
            let (mut heading, mut aligned) = ([0i32; 2], 0i32);
            for (j, other) in flock.iter().enumerate() {
                if j == i {
                    continue;
                }
                let d = [wrap(other[0] - me[0]), wrap(other[1] - me[1])];
                if d[0].abs() >= reach || d[1].abs() >= reach {
                    continue;
                }
                let d2 = d[0] * d[0] + d[1] * d[1];
                for k in 0..2 {
                    if d2 < r.cohesion * r.cohesion {
                        center[k] += d[k];
                    }
                    if d2 < r.separation * r.separation {
                        apart[k] -= d[k];
                    }
                    if d2 < r.alignment * r.alignment {
                        heading[k] += other[2 + k];
                    }
                }
                near += i32::from(d2 < r.cohesion * r.cohesion);
                aligned += i32::from(d2 < r.alignment * r.alignment);
            }
            let mut v = [me[2], me[3]];
            for k in 0..2 {
                if near > 0 {
                    v[k] += center[k] / near / r.pull_cohesion;
                }
                v[k] += apart[k] / r.push_separation;
                if aligned > 0 {
                    v[k] += (heading[k] / aligned - v[k]) / r.pull_alignment;
                }
                v[k] = v[k].clamp(-r.max_speed, r.max_speed);
            }
            [(me[0] + v[0]) & 65535, (me[1] + v[1]) & 65535, v[0], v[1]]
        })
        .collect()
}

fn to_bytes(flock: &[Boid]) -> Vec<u8> {
    flock
        .iter()
        .flatten()
        .flat_map(|w| w.to_le_bytes())
        .collect()
}

fn from_bytes(bytes: &[u8]) -> Vec<Boid> {
    let words: Vec<i32> = bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    words
        .chunks_exact(4)
        .map(|b| [b[0], b[1], b[2], b[3]])
        .collect()
}

/// How aligned each boid's neighbourhood is, averaged over boids: for the boids within
/// the alignment radius (itself included), |sum of velocities| / sum of |velocity|;
/// near 0 when they head every way, 1 when they fly as one.
fn order(flock: &[Boid]) -> f64 {
    let r2 = i64::from(RULES.alignment).pow(2);
    let mut total = 0.0;
    for me in flock {
        let (mut sx, mut sy, mut speed) = (0f64, 0f64, 0f64);
        for other in flock {
            let (dx, dy) = (
                i64::from(wrap(other[0] - me[0])),
                i64::from(wrap(other[1] - me[1])),
            );
            if dx * dx + dy * dy < r2 {
                let (x, y) = (f64::from(other[2]), f64::from(other[3]));
                sx += x;
                sy += y;
                speed += x.hypot(y);
            }
        }
        total += sx.hypot(sy) / speed.max(1.0);
    }
    total / flock.len() as f64
}

fn frame_call(frame: u32) -> ActorCall {
    let r = RULES;
    let params: Vec<u8> = [
        BOIDS as u32,
        frame % 2,
        r.cohesion as u32,
        r.separation as u32,
        r.alignment as u32,
        r.pull_cohesion as u32,
        r.push_separation as u32,
        r.pull_alignment as u32,
        r.max_speed as u32,
        0,
        0,
        0,
    ]
    .iter()
    .flat_map(|w| w.to_le_bytes())
    .collect();
    ActorCall {
        shader: ShaderSource::Wgsl(KERNEL.into()),
        entry_point: "main".into(),
        bindings: vec![BindingSpec {
            binding: 2,
            role: BindingRole::Param { data: params },
        }],
        grid: Grid([BOIDS.div_ceil(64) as u32, 1, 1]),
        deadline_ms: None,
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |below: i32| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % below as u64) as i32
    };
    let mut cpu: Vec<Boid> = (0..BOIDS)
        .map(|_| {
            let v = 2 * RULES.max_speed + 1;
            [
                next(65536),
                next(65536),
                next(v) - RULES.max_speed,
                next(v) - RULES.max_speed,
            ]
        })
        .collect();

    let mesh = common::LocalMesh::start("boids", 3).await?;
    let clients: Vec<gpumesh::Client> = (0..3).map(|i| mesh.client(i)).collect();
    let start = clients[0].upload(to_bytes(&cpu)).await?;
    let bytes = (BOIDS * 16) as u64;
    let state = vec![
        StateInit {
            binding: 0,
            size: bytes,
            blob: Some(start),
        },
        StateInit {
            binding: 1,
            size: bytes,
            blob: None,
        },
    ];
    clients[0].create_actor("flock", state, None).await?;
    println!(
        "actor flock: {BOIDS} boids, {} KiB of state; frame 0 order {:.2}",
        2 * bytes / 1024,
        order(&cpu)
    );

    let started = std::time::Instant::now();
    for frame in 0..FRAMES {
        // Each frame through the next node: any node can step the flock.
        let via = &clients[frame as usize % clients.len()];
        via.call_actor("flock", frame_call(frame), None).await?;
        cpu = cpu_frame(&cpu, RULES);
        let done = frame + 1;
        if done % CHECK_EVERY == 0 {
            // After an even number of frames the flock is back in buffer `a`.
            let binding = done % 2;
            let reader = &clients[(done / CHECK_EVERY) as usize % clients.len()];
            let gpu = from_bytes(&reader.actor_state("flock", binding).await?);
            let differ = gpu.iter().zip(&cpu).filter(|(g, c)| g != c).count();
            anyhow::ensure!(
                differ == 0,
                "frame {done}: {differ} of {BOIDS} boids differ from the CPU's"
            );
            println!(
                "frame {done:>3}: {BOIDS} boids equal to the CPU's (read through node {}); order {:.2}",
                (done / CHECK_EVERY) as usize % clients.len(),
                order(&gpu)
            );
        }
    }
    let elapsed = started.elapsed();
    let a = clients[2].actor("flock").await?;
    println!(
        "{FRAMES} frames, one call each through 3 nodes, in {:.2} s ({:.1} ms a frame); \
         state version {}, hosted by {}",
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1e3 / f64::from(FRAMES),
        a.version,
        a.node
    );
    clients[1].delete_actor("flock").await?;
    mesh.stop().await;
    Ok(())
}
