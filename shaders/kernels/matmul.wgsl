// C = A * B for square row-major f32 matrices of side n (a multiple of 64).
//
// Register-tiled: each invocation computes an 8x8 block of C (8 rows x 2 vec4
// columns) in 16 vec4 accumulators, so every value loaded from A or B feeds 8 FMAs;
// an 8x8 workgroup covers a 64x64 block. Reads go straight to storage through the
// caches. A variant staging 64x16 tiles in workgroup memory ran 5x slower on
// lavapipe, where each workgroupBarrier is a coroutine switch, so this one has none.
// The inner body is unrolled by hand: llvmpipe keeps named values in registers but
// spills indexed arrays to memory.
struct Params {
    n: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> b: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> c: array<vec4<f32>>;

@compute @workgroup_size(8, 8)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let n4 = params.n / 4u;
    let col = gid.x * 2u;
    let row = gid.y * 8u;
    var c00 = vec4<f32>(0.0); var c01 = vec4<f32>(0.0);
    var c10 = vec4<f32>(0.0); var c11 = vec4<f32>(0.0);
    var c20 = vec4<f32>(0.0); var c21 = vec4<f32>(0.0);
    var c30 = vec4<f32>(0.0); var c31 = vec4<f32>(0.0);
    var c40 = vec4<f32>(0.0); var c41 = vec4<f32>(0.0);
    var c50 = vec4<f32>(0.0); var c51 = vec4<f32>(0.0);
    var c60 = vec4<f32>(0.0); var c61 = vec4<f32>(0.0);
    var c70 = vec4<f32>(0.0); var c71 = vec4<f32>(0.0);
    for (var k = 0u; k < n4; k++) {
        // Four rows of B (k*4 .. k*4+3), two vec4 columns each.
        let b00 = b[(k * 4u + 0u) * n4 + col];
        let b01 = b[(k * 4u + 0u) * n4 + col + 1u];
        let b10 = b[(k * 4u + 1u) * n4 + col];
        let b11 = b[(k * 4u + 1u) * n4 + col + 1u];
        let b20 = b[(k * 4u + 2u) * n4 + col];
        let b21 = b[(k * 4u + 2u) * n4 + col + 1u];
        let b30 = b[(k * 4u + 3u) * n4 + col];
        let b31 = b[(k * 4u + 3u) * n4 + col + 1u];
        // Eight rows of A, four consecutive k each.
        let a0 = a[(row + 0u) * n4 + k];
        let a1 = a[(row + 1u) * n4 + k];
        let a2 = a[(row + 2u) * n4 + k];
        let a3 = a[(row + 3u) * n4 + k];
        let a4 = a[(row + 4u) * n4 + k];
        let a5 = a[(row + 5u) * n4 + k];
        let a6 = a[(row + 6u) * n4 + k];
        let a7 = a[(row + 7u) * n4 + k];
        c00 = fma(vec4(a0.x), b00, fma(vec4(a0.y), b10, fma(vec4(a0.z), b20, fma(vec4(a0.w), b30, c00))));
        c01 = fma(vec4(a0.x), b01, fma(vec4(a0.y), b11, fma(vec4(a0.z), b21, fma(vec4(a0.w), b31, c01))));
        c10 = fma(vec4(a1.x), b00, fma(vec4(a1.y), b10, fma(vec4(a1.z), b20, fma(vec4(a1.w), b30, c10))));
        c11 = fma(vec4(a1.x), b01, fma(vec4(a1.y), b11, fma(vec4(a1.z), b21, fma(vec4(a1.w), b31, c11))));
        c20 = fma(vec4(a2.x), b00, fma(vec4(a2.y), b10, fma(vec4(a2.z), b20, fma(vec4(a2.w), b30, c20))));
        c21 = fma(vec4(a2.x), b01, fma(vec4(a2.y), b11, fma(vec4(a2.z), b21, fma(vec4(a2.w), b31, c21))));
        c30 = fma(vec4(a3.x), b00, fma(vec4(a3.y), b10, fma(vec4(a3.z), b20, fma(vec4(a3.w), b30, c30))));
        c31 = fma(vec4(a3.x), b01, fma(vec4(a3.y), b11, fma(vec4(a3.z), b21, fma(vec4(a3.w), b31, c31))));
        c40 = fma(vec4(a4.x), b00, fma(vec4(a4.y), b10, fma(vec4(a4.z), b20, fma(vec4(a4.w), b30, c40))));
        c41 = fma(vec4(a4.x), b01, fma(vec4(a4.y), b11, fma(vec4(a4.z), b21, fma(vec4(a4.w), b31, c41))));
        c50 = fma(vec4(a5.x), b00, fma(vec4(a5.y), b10, fma(vec4(a5.z), b20, fma(vec4(a5.w), b30, c50))));
        c51 = fma(vec4(a5.x), b01, fma(vec4(a5.y), b11, fma(vec4(a5.z), b21, fma(vec4(a5.w), b31, c51))));
        c60 = fma(vec4(a6.x), b00, fma(vec4(a6.y), b10, fma(vec4(a6.z), b20, fma(vec4(a6.w), b30, c60))));
        c61 = fma(vec4(a6.x), b01, fma(vec4(a6.y), b11, fma(vec4(a6.z), b21, fma(vec4(a6.w), b31, c61))));
        c70 = fma(vec4(a7.x), b00, fma(vec4(a7.y), b10, fma(vec4(a7.z), b20, fma(vec4(a7.w), b30, c70))));
        c71 = fma(vec4(a7.x), b01, fma(vec4(a7.y), b11, fma(vec4(a7.z), b21, fma(vec4(a7.w), b31, c71))));
    }
    c[(row + 0u) * n4 + col + 0u] = c00;
    c[(row + 0u) * n4 + col + 1u] = c01;
    c[(row + 1u) * n4 + col + 0u] = c10;
    c[(row + 1u) * n4 + col + 1u] = c11;
    c[(row + 2u) * n4 + col + 0u] = c20;
    c[(row + 2u) * n4 + col + 1u] = c21;
    c[(row + 3u) * n4 + col + 0u] = c30;
    c[(row + 3u) * n4 + col + 1u] = c31;
    c[(row + 4u) * n4 + col + 0u] = c40;
    c[(row + 4u) * n4 + col + 1u] = c41;
    c[(row + 5u) * n4 + col + 0u] = c50;
    c[(row + 5u) * n4 + col + 1u] = c51;
    c[(row + 6u) * n4 + col + 0u] = c60;
    c[(row + 6u) * n4 + col + 1u] = c61;
    c[(row + 7u) * n4 + col + 0u] = c70;
    c[(row + 7u) * n4 + col + 1u] = c71;
}
