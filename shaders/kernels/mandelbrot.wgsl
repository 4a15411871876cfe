// Escape-time Mandelbrot: iterations (up to params.max_iter) for each pixel of a
// width x height view of [-2, 0.5] x [-1.25, 1.25].
struct Params {
    width: u32,
    height: u32,
    max_iter: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> iterations: array<u32>;

@compute @workgroup_size(16, 16)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x >= params.width || gid.y >= params.height) {
        return;
    }
    let cx = -2.0 + (f32(gid.x) + 0.5) * (2.5 / f32(params.width));
    let cy = -1.25 + (f32(gid.y) + 0.5) * (2.5 / f32(params.height));
    var x = 0.0;
    var y = 0.0;
    var i = 0u;
    loop {
        if (i >= params.max_iter || x * x + y * y > 4.0) {
            break;
        }
        let xt = x * x - y * y + cx;
        y = 2.0 * x * y + cy;
        x = xt;
        i++;
    }
    iterations[gid.y * params.width + gid.x] = i;
}
