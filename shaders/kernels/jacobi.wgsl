// One Jacobi step for A x = b (A dense, row-major, n x n):
//   x_next_i = (b_i - sum_{j != i} A_ij x_j) / A_ii
struct Params {
    n: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read> x: array<f32>;
@group(0) @binding(4) var<storage, read_write> x_next: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let n = params.n;
    if (i >= n) {
        return;
    }
    var sigma = 0.0;
    for (var j = 0u; j < n; j++) {
        if (j != i) {
            sigma += a[i * n + j] * x[j];
        }
    }
    x_next[i] = (b[i] - sigma) / a[i * n + i];
}
