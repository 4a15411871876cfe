// C = A * B for square row-major f32 matrices of side n (a multiple of 64).
//
// Each 16x16 workgroup computes a 64x64 block of C; each invocation a 4x4 block held
// in registers. A and B pass through workgroup memory 16 columns/rows at a time, so
// every value loaded from A or B is used 64 times.
struct Params {
    n: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> c: array<vec4<f32>>;

const BLOCK: u32 = 64u;
const DEPTH: u32 = 16u;

// 64 rows x 16 columns of A, row-major.
var<workgroup> tile_a: array<f32, 1024>;
// 16 rows x 64 columns of B, as 16 vec4 per row.
var<workgroup> tile_b: array<vec4<f32>, 256>;

@compute @workgroup_size(16, 16)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let n = params.n;
    let n4 = n / 4u;
    let block_row = wid.y * BLOCK;
    let block_col = wid.x * BLOCK;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < n; k0 += DEPTH) {
        for (var i = 0u; i < 4u; i++) {
            let idx = li + i * 256u;
            let r = idx / DEPTH;
            let k = idx % DEPTH;
            tile_a[idx] = a[(block_row + r) * n + k0 + k];
        }
        let kb = li / 16u;
        let cb = li % 16u;
        tile_b[li] = b[(k0 + kb) * n4 + block_col / 4u + cb];
        workgroupBarrier();
        let row = lid.y * 4u * DEPTH;
        for (var k = 0u; k < DEPTH; k++) {
            let bv = tile_b[k * 16u + lid.x];
            acc0 = fma(vec4<f32>(tile_a[row + k]), bv, acc0);
            acc1 = fma(vec4<f32>(tile_a[row + DEPTH + k]), bv, acc1);
            acc2 = fma(vec4<f32>(tile_a[row + 2u * DEPTH + k]), bv, acc2);
            acc3 = fma(vec4<f32>(tile_a[row + 3u * DEPTH + k]), bv, acc3);
        }
        workgroupBarrier();
    }
    let out_row = block_row + lid.y * 4u;
    let out_col4 = block_col / 4u + lid.x;
    c[out_row * n4 + out_col4] = acc0;
    c[(out_row + 1u) * n4 + out_col4] = acc1;
    c[(out_row + 2u) * n4 + out_col4] = acc2;
    c[(out_row + 3u) * n4 + out_col4] = acc3;
}
