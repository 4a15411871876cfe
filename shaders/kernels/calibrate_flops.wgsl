// Calibration: a long chain of independent vec4 fused multiply-adds per invocation.
// 4 chains x 4 lanes x 2 flops x ROUNDS per invocation.
struct Params {
    rounds: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> sink: array<vec4<f32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let seed = f32(gid.x) * 1e-7;
    var a = vec4<f32>(seed, seed + 0.1, seed + 0.2, seed + 0.3);
    var b = a + vec4<f32>(0.5);
    var c = a + vec4<f32>(0.25);
    var d = a + vec4<f32>(0.75);
    let m = vec4<f32>(0.999999);
    let k = vec4<f32>(1e-6);
    for (var i = 0u; i < params.rounds; i++) {
        a = fma(a, m, k);
        b = fma(b, m, k);
        c = fma(c, m, k);
        d = fma(d, m, k);
    }
    sink[gid.x] = a + b + c + d;
}
