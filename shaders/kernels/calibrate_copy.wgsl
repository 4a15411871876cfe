// Calibration: streaming reads. Each invocation reads 16 vec4s, 256 invocations
// apart so a workgroup's reads stay contiguous, and the workgroup writes one sum:
// the bytes read dominate, and the readback stays small.
@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> sums: array<vec4<f32>>;

var<workgroup> partial: array<vec4<f32>, 256>;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let base = wid.x * 4096u + li;
    var acc = vec4<f32>(0.0);
    for (var i = 0u; i < 16u; i++) {
        acc += src[base + i * 256u];
    }
    partial[li] = acc;
    workgroupBarrier();
    if (li == 0u) {
        var total = vec4<f32>(0.0);
        for (var i = 0u; i < 256u; i++) {
            total += partial[i];
        }
        sums[wid.x] = total;
    }
}
