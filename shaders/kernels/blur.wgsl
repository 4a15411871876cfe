// 3x3 Gaussian blur (weights 1 2 1 / 2 4 2 / 1 2 1, sum 16) of an RGBA8 image packed
// one pixel per u32, edges clamped. Integer arithmetic, rounded to nearest, so the
// result is exact on every adapter.
struct Params {
    width: u32,
    height: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

fn channels(p: u32) -> vec4<u32> {
    return vec4<u32>(p & 0xffu, (p >> 8u) & 0xffu, (p >> 16u) & 0xffu, p >> 24u);
}

@compute @workgroup_size(16, 16)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let w = params.width;
    let h = params.height;
    if (gid.x >= w || gid.y >= h) {
        return;
    }
    var sum = vec4<u32>(0u);
    for (var dy = 0u; dy < 3u; dy++) {
        for (var dx = 0u; dx < 3u; dx++) {
            let sx = u32(clamp(i32(gid.x) + i32(dx) - 1, 0, i32(w) - 1));
            let sy = u32(clamp(i32(gid.y) + i32(dy) - 1, 0, i32(h) - 1));
            let weight = u32((2 - abs(i32(dx) - 1)) * (2 - abs(i32(dy) - 1)));
            sum += channels(src[sy * w + sx]) * weight;
        }
    }
    let c = (sum + vec4<u32>(8u)) / 16u;
    dst[gid.y * w + gid.x] = c.x | (c.y << 8u) | (c.z << 16u) | (c.w << 24u);
}
