//! Test kernels written the way WebGPU programs write them, each with a CPU
//! reference, shared by the executor's tests (`shaders/tests/kernels.rs`) and the
//! mesh's (`tests/sharding.rs`). Depends on nothing but std, so both can include it.

#![allow(dead_code)] // each including test uses its own subset

/// A bounds check with `arrayLength` and a ragged last workgroup.
pub const DOUBLE: &str = r#"
@group(0) @binding(0) var<storage, read> input: array<f32>;
@group(0) @binding(1) var<storage, read_write> output: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) global_id: vec3<u32>) {
    let i = global_id.x;
    if (i >= arrayLength(&input)) {
        return;
    }
    output[i] = input[i] * 2.0;
}
"#;

/// A particle step: uniform parameters at 0, particles read at 1 and written at 2.
pub const PARTICLES: &str = r#"
struct Particle {
    pos: vec2<f32>,
    vel: vec2<f32>,
}

struct SimParams {
    dt: f32,
    cohesion_radius: f32,
    separation_radius: f32,
    alignment_radius: f32,
    cohesion: f32,
    separation: f32,
    alignment: f32,
}

@group(0) @binding(0) var<uniform> params: SimParams;
@group(0) @binding(1) var<storage, read> particles_in: array<Particle>;
@group(0) @binding(2) var<storage, read_write> particles_out: array<Particle>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let total = arrayLength(&particles_in);
    let me = gid.x;
    if (me >= total) {
        return;
    }
    var pos = particles_in[me].pos;
    var vel = particles_in[me].vel;
    var center = vec2<f32>(0.0, 0.0);
    var away = vec2<f32>(0.0, 0.0);
    var heading = vec2<f32>(0.0, 0.0);
    var near_center = 0u;
    var near_heading = 0u;
    for (var j = 0u; j < total; j++) {
        if (j == me) {
            continue;
        }
        let other_pos = particles_in[j].pos;
        let d = distance(other_pos, pos);
        if (d < params.cohesion_radius) {
            center += other_pos;
            near_center++;
        }
        if (d < params.separation_radius) {
            away -= other_pos - pos;
        }
        if (d < params.alignment_radius) {
            heading += particles_in[j].vel;
            near_heading++;
        }
    }
    if (near_center > 0u) {
        center = center / f32(near_center) - pos;
    }
    if (near_heading > 0u) {
        heading = heading / f32(near_heading);
    }
    vel += center * params.cohesion + away * params.separation + heading * params.alignment;
    vel = normalize(vel) * clamp(length(vel), 0.0, 0.1);
    pos += vel * params.dt;
    if (pos.x < -1.0) { pos.x = 1.0; }
    if (pos.x > 1.0) { pos.x = -1.0; }
    if (pos.y < -1.0) { pos.y = 1.0; }
    if (pos.y > 1.0) { pos.y = -1.0; }
    particles_out[me] = Particle(pos, vel);
}
"#;

/// The particle kernel's uniform: dt, three radii, three weights.
pub const PARTICLE_PARAMS: [f32; 7] = [0.04, 0.1, 0.025, 0.025, 0.02, 0.05, 0.005];

/// `n` particles in the unit box with small random velocities.
pub fn particles(n: usize, seed: u64) -> Vec<[f32; 4]> {
    let mut rng = Rng(seed);
    (0..n)
        .map(|_| [rng.unit(), rng.unit(), rng.unit() * 0.1, rng.unit() * 0.1])
        .collect()
}

/// The particle step on the CPU, in f32, in the kernel's order of operations.
pub fn particles_reference(p: &[[f32; 4]]) -> Vec<f32> {
    let [dt, r_c, r_s, r_a, k_c, k_s, k_a] = PARTICLE_PARAMS;
    p.iter()
        .enumerate()
        .flat_map(|(me, q)| {
            let (mut pos, mut vel) = ([q[0], q[1]], [q[2], q[3]]);
            let (mut center, mut away, mut heading) = ([0f32; 2], [0f32; 2], [0f32; 2]);
            let (mut nc, mut na) = (0u32, 0u32);
            for (j, o) in p.iter().enumerate() {
                if j == me {
                    continue;
                }
                let d = ((o[0] - pos[0]).powi(2) + (o[1] - pos[1]).powi(2)).sqrt();
                if d < r_c {
                    center = [center[0] + o[0], center[1] + o[1]];
                    nc += 1;
                }
                if d < r_s {
                    away = [away[0] - (o[0] - pos[0]), away[1] - (o[1] - pos[1])];
                }
                if d < r_a {
                    heading = [heading[0] + o[2], heading[1] + o[3]];
                    na += 1;
                }
            }
            if nc > 0 {
                center = [
                    center[0] / nc as f32 - pos[0],
                    center[1] / nc as f32 - pos[1],
                ];
            }
            if na > 0 {
                heading = [heading[0] / na as f32, heading[1] / na as f32];
            }
            for k in 0..2 {
                vel[k] += center[k] * k_c + away[k] * k_s + heading[k] * k_a;
            }
            let len = (vel[0] * vel[0] + vel[1] * vel[1]).sqrt();
            let speed = len.clamp(0.0, 0.1);
            vel = [vel[0] / len * speed, vel[1] / len * speed];
            for k in 0..2 {
                pos[k] += vel[k] * dt;
                if pos[k] < -1.0 {
                    pos[k] = 1.0;
                }
                if pos[k] > 1.0 {
                    pos[k] = -1.0;
                }
            }
            [pos[0], pos[1], vel[0], vel[1]]
        })
        .collect()
}

/// How many particles (4 floats each) differ from `want` by more than `tol` in some
/// component. A neighbour exactly at a radius can fall either side of it when a
/// GPU's square root differs from the CPU's in the last bit, so a test allows a few.
pub fn particles_off(got: &[f32], want: &[f32], tol: f32) -> usize {
    assert_eq!(got.len(), want.len());
    got.chunks(4)
        .zip(want.chunks(4))
        .filter(|(g, w)| {
            g.iter()
                .zip(*w)
                .any(|(a, b)| (a - b).abs().is_nan() || (a - b).abs() > tol)
        })
        .count()
}

/// One read_write buffer that is both the input and the output (in place).
pub const COLLATZ: &str = r#"
@group(0) @binding(0) var<storage, read_write> v_indices: array<u32>;

// The number of steps to reach 1, or 0xffffffff if 3n+1 would overflow.
fn collatz_iterations(n_base: u32) -> u32 {
    var n: u32 = n_base;
    var i: u32 = 0u;
    loop {
        if (n <= 1u) {
            break;
        }
        if (n % 2u == 0u) {
            n = n / 2u;
        } else {
            if (n >= 1431655765u) {
                return 4294967295u;
            }
            n = 3u * n + 1u;
        }
        i = i + 1u;
    }
    return i;
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) global_id: vec3<u32>) {
    if (global_id.x >= arrayLength(&v_indices)) {
        return;
    }
    v_indices[global_id.x] = collatz_iterations(v_indices[global_id.x]);
}
"#;

pub fn collatz_reference(n: u32) -> u32 {
    let (mut n, mut i) = (n, 0u32);
    while n > 1 {
        if n % 2 == 0 {
            n /= 2;
        } else {
            if n >= 1_431_655_765 {
                return u32::MAX;
            }
            n = 3 * n + 1;
        }
        i += 1;
    }
    i
}

/// Two read_write buffers indexed by workgroup_id, from a workgroup reduction.
pub const GROUP_STATS: &str = r#"
@group(0) @binding(0) var<storage, read> data: array<u32>;
@group(0) @binding(1) var<storage, read_write> group_sums: array<u32>;
@group(0) @binding(2) var<storage, read_write> group_maxes: array<u32>;

var<workgroup> sums: array<u32, 128>;
var<workgroup> maxes: array<u32, 128>;

@compute @workgroup_size(128)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    var v = 0u;
    if (gid.x < arrayLength(&data)) {
        v = data[gid.x];
    }
    sums[lid] = v;
    maxes[lid] = v;
    workgroupBarrier();
    for (var stride = 64u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            sums[lid] = sums[lid] + sums[lid + stride];
            maxes[lid] = max(maxes[lid], maxes[lid + stride]);
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        group_sums[wid.x] = sums[0];
        group_maxes[wid.x] = maxes[0];
    }
}
"#;

/// A 2-D grid with the image's dimensions in a uniform, writing transposed.
pub const TRANSPOSE: &str = r#"
struct Dims {
    width: u32,
    height: u32,
}

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(8, 8)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x >= dims.width || gid.y >= dims.height) {
        return;
    }
    let v = src[gid.y * dims.width + gid.x];
    dst[gid.x * dims.height + gid.y] = v * 3u + gid.x;
}
"#;

pub fn transpose_reference(src: &[u32], w: u32, h: u32) -> Vec<u32> {
    let mut out = vec![0u32; (w * h) as usize];
    for y in 0..h {
        for x in 0..w {
            out[(x * h + y) as usize] = src[(y * w + x) as usize] * 3 + x;
        }
    }
    out
}

/// Uniforms, an input, two in-out buffers and an output in one kernel.
pub const MIXED: &str = r#"
struct Affine {
    scale: u32,
    bias: u32,
}

@group(0) @binding(0) var<uniform> affine: Affine;
@group(0) @binding(1) var<storage, read> x: array<u32>;
@group(0) @binding(2) var<storage, read_write> y: array<u32>;
@group(0) @binding(3) var<storage, read_write> visits: array<u32>;
@group(0) @binding(4) var<storage, read_write> odd: array<u32>;
@group(0) @binding(5) var<uniform> limit: vec4<u32>;

@compute @workgroup_size(32)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= limit.x) {
        return;
    }
    y[i] = affine.scale * x[i] + y[i] + affine.bias;
    visits[i] = visits[i] + 1u;
    odd[i] = y[i] & 1u;
}
"#;

/// Every invocation of a 3-D grid of 3-D workgroups records its three ids, as the
/// tutorials that explain workgroups do: one `vec3<u32>` each (16 bytes with its
/// padding) at its invocation's index, the workgroup's index made from
/// `num_workgroups`.
pub const WORKGROUP_IDS: &str = r#"
@group(0) @binding(0) var<storage, read_write> workgroup_ids: array<vec3u>;
@group(0) @binding(1) var<storage, read_write> local_ids: array<vec3u>;
@group(0) @binding(2) var<storage, read_write> global_ids: array<vec3u>;

@compute @workgroup_size(2, 3, 4)
fn main(@builtin(workgroup_id) workgroup_id: vec3u,
        @builtin(local_invocation_id) local_id: vec3u,
        @builtin(global_invocation_id) global_id: vec3u,
        @builtin(local_invocation_index) local_index: u32,
        @builtin(num_workgroups) num_workgroups: vec3u) {
    let workgroup_index = workgroup_id.x
        + workgroup_id.y * num_workgroups.x
        + workgroup_id.z * num_workgroups.x * num_workgroups.y;
    let i = workgroup_index * 24u + local_index;
    workgroup_ids[i] = workgroup_id;
    local_ids[i] = local_id;
    global_ids[i] = global_id;
}
"#;

/// Any negative value sets one flag word: every shard that sees one writes the
/// same 1, so shards agree and the word merges.
pub const ANY_NEGATIVE: &str = r#"
@group(0) @binding(0) var<storage, read> values: array<i32>;
@group(0) @binding(1) var<storage, read_write> found: array<u32, 1>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&values) && values[gid.x] < 0) {
        found[0] = 1u;
    }
}
"#;

/// The classic mistake: a running maximum kept in one word without atomics. Each
/// shard finds its own maximum, so the word differs between shards.
pub const RUNNING_MAX: &str = r#"
@group(0) @binding(0) var<storage, read> values: array<u32>;
@group(0) @binding(1) var<storage, read_write> result: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (lid != 0u) {
        return;
    }
    var best = result[0];
    for (var k = 0u; k < 64u; k++) {
        let i = gid.x + k;
        if (i < arrayLength(&values)) {
            best = max(best, values[i]);
        }
    }
    result[0] = best;
}
"#;

/// An atomic counter beside an append buffer, in one struct.
pub const APPEND: &str = r#"
struct Matches {
    count: atomic<u32>,
    items: array<u32>,
}

@group(0) @binding(0) var<storage, read> values: array<u32>;
@group(0) @binding(1) var<storage, read_write> matches: Matches;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= arrayLength(&values)) {
        return;
    }
    let v = values[i];
    if (v % 7u == 3u) {
        let slot = atomicAdd(&matches.count, 1u);
        matches.items[slot] = v;
    }
}
"#;

/// The same append with its counter and its entries in buffers of their own: the
/// counter alone merges as a sum, the entries do not merge at all.
pub const APPEND_APART: &str = r#"
@group(0) @binding(0) var<storage, read> values: array<u32>;
@group(0) @binding(1) var<storage, read_write> count: atomic<u32>;
@group(0) @binding(2) var<storage, read_write> items: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= arrayLength(&values)) {
        return;
    }
    let v = values[i];
    if (v % 7u == 3u) {
        items[atomicAdd(&count, 1u)] = v;
    }
}
"#;

/// Compaction in two levels, as tuned kernels write it: each workgroup counts its
/// entries on its own counter, one invocation reserves the workgroup's range in
/// the output with one atomicAdd on the global total, and every invocation writes
/// at that base plus its own slot.
pub const APPEND_BY_WORKGROUP: &str = r#"
@group(0) @binding(0) var<storage, read> values: array<u32>;
@group(0) @binding(1) var<storage, read_write> total: atomic<u32>;
@group(0) @binding(2) var<storage, read_write> items: array<u32>;
var<workgroup> local_n: atomic<u32>;
var<workgroup> base: u32;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = gid.x;
    let keep = i < arrayLength(&values) && values[i] % 7u == 3u;
    var slot = 0u;
    if (keep) {
        slot = atomicAdd(&local_n, 1u);
    }
    workgroupBarrier();
    if (lid == 0u) {
        base = atomicAdd(&total, atomicLoad(&local_n));
    }
    let b = workgroupUniformLoad(&base);
    if (keep) {
        items[b + slot] = values[i];
    }
}
"#;

/// Compaction within each workgroup, on a workgroup's own counter: the slots are
/// the workgroup's, so it splits into shards like any kernel.
pub const COMPACT_PER_WORKGROUP: &str = r#"
@group(0) @binding(0) var<storage, read> values: array<u32>;
@group(0) @binding(1) var<storage, read_write> kept: array<u32>;
@group(0) @binding(2) var<storage, read_write> counts: array<u32>;
var<workgroup> n: atomic<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(local_invocation_index) lid: u32,
        @builtin(workgroup_id) wid: vec3<u32>) {
    let i = gid.x;
    if (i < arrayLength(&values) && values[i] % 7u == 3u) {
        let slot = atomicAdd(&n, 1u);
        kept[wid.x * 64u + slot] = values[i];
    }
    workgroupBarrier();
    if (lid == 0u) {
        counts[wid.x] = atomicLoad(&n);
    }
}
"#;

/// A sum in one pass, as reductions without a second dispatch write it: each
/// workgroup stores its partial, takes a ticket on a counter in a buffer, and the
/// workgroup with the last ticket adds up every partial into `total`. Split into
/// shards, no shard's tickets reach the last: `total` would never be written.
pub const LAST_WORKGROUP_SUM: &str = r#"
@group(0) @binding(0) var<storage, read> input: array<u32>;
@group(0) @binding(1) var<storage, read_write> partials: array<u32>;
@group(0) @binding(2) var<storage, read_write> done: atomic<u32>;
@group(0) @binding(3) var<storage, read_write> total: array<u32>;

var<workgroup> sums: array<u32, 64>;
var<workgroup> last: u32;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) l: u32,
        @builtin(workgroup_id) w: vec3<u32>,
        @builtin(num_workgroups) n: vec3<u32>) {
    let i = w.x * 64u + l;
    var v = 0u;
    if (i < arrayLength(&input)) {
        v = input[i];
    }
    sums[l] = v;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s >>= 1u) {
        if (l < s) {
            sums[l] += sums[l + s];
        }
        workgroupBarrier();
    }
    if (l == 0u) {
        partials[w.x] = sums[0];
        storageBarrier();
        let ticket = atomicAdd(&done, 1u);
        last = select(0u, 1u, ticket == n.x - 1u);
    }
    if (workgroupUniformLoad(&last) == 1u && l == 0u) {
        var t = 0u;
        for (var k = 0u; k < n.x; k++) {
            t += partials[k];
        }
        total[0] = t;
    }
}
"#;

/// A lone atomic counter.
pub const COUNTER: &str = r#"
@group(0) @binding(0) var<storage, read> values: array<u32>;
@group(0) @binding(1) var<storage, read_write> counter: atomic<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&values) && values[gid.x] % 2u == 0u) {
        atomicAdd(&counter, 1u);
    }
}
"#;

/// One step of a bitonic sort, in place, as GPU sorting tutorials write it: the
/// invocation at `i` compares its element with its partner's at `i ^ j` and, if
/// they are out of order for the block of `k`, swaps them, writing its partner's
/// element too. The whole sort is this step dispatched for every (k, j).
pub const BITONIC_STEP: &str = r#"
struct Step { j: u32, k: u32 }
@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read_write> data: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let l = i ^ step.j;
    if (l <= i || l >= arrayLength(&data)) {
        return;
    }
    let a = data[i];
    let b = data[l];
    let ascending = (i & step.k) == 0u;
    if ((ascending && a > b) || (!ascending && a < b)) {
        data[i] = b;
        data[l] = a;
    }
}
"#;

/// The greatest and the least of signed values, kept with `atomicMax` and
/// `atomicMin` in two words of one buffer, as tutorials find a range.
pub const RANGE: &str = r#"
@group(0) @binding(0) var<storage, read> values: array<i32>;
@group(0) @binding(1) var<storage, read_write> greatest: atomic<i32>;
@group(0) @binding(2) var<storage, read_write> least: atomic<i32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x >= arrayLength(&values)) {
        return;
    }
    atomicMax(&greatest, values[gid.x]);
    atomicMin(&least, values[gid.x]);
}
"#;

/// Bits, as a sieve or a visited set keeps them: each value marks its bit in a
/// bitset with `atomicOr`, folds into a parity word with `atomicXor` and into the
/// bits every value shares with `atomicAnd`.
pub const BITS: &str = r#"
@group(0) @binding(0) var<storage, read> values: array<u32>;
@group(0) @binding(1) var<storage, read_write> seen: array<atomic<u32>>;
@group(0) @binding(2) var<storage, read_write> parity: atomic<u32>;
@group(0) @binding(3) var<storage, read_write> shared_bits: atomic<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x >= arrayLength(&values)) {
        return;
    }
    let v = values[gid.x];
    let bit = v % (arrayLength(&seen) * 32u);
    atomicOr(&seen[bit / 32u], 1u << (bit % 32u));
    atomicXor(&parity, v);
    atomicAnd(&shared_bits, v);
}
"#;

/// [`BITS`] on the CPU: the bitset of `words` words, the parity, the shared bits.
pub fn bits_reference(values: &[u32], words: usize) -> (Vec<u32>, u32, u32) {
    let mut seen = vec![0u32; words];
    for v in values {
        let bit = (v % (words as u32 * 32)) as usize;
        seen[bit / 32] |= 1 << (bit % 32);
    }
    let parity = values.iter().fold(0, |a, v| a ^ v);
    let shared = values.iter().fold(u32::MAX, |a, v| a & v);
    (seen, parity, shared)
}

/// A per-element output beside an atomic total: splittable when the total is merged
/// as a sum (`--merge 2=sum-u32`) and the output by changes.
pub const DOUBLE_AND_COUNT: &str = r#"
@group(0) @binding(0) var<storage, read> values: array<u32>;
@group(0) @binding(1) var<storage, read_write> doubled: array<u32>;
@group(0) @binding(2) var<storage, read_write> odd_count: atomic<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= arrayLength(&values)) {
        return;
    }
    doubled[i] = values[i] * 2u;
    if (values[i] % 2u == 1u) {
        atomicAdd(&odd_count, 1u);
    }
}
"#;

/// Deterministic values (splitmix64), so a failure reproduces.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u32) -> u32 {
        (self.next() % u64::from(n)) as u32
    }

    /// Uniform in [-1, 1), exactly representable.
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u32 << 23) as f32 - 1.0
    }
}

pub fn u32_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn u32s(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    u32s(bytes).into_iter().map(f32::from_bits).collect()
}
