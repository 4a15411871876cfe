// One gradient of the mean squared error of a linear model y ~ X w:
//   grad_j = scale * sum_i (x_i . w - y_i) * x_ij,   scale = 2 / total rows.
// Each workgroup reduces its rows in workgroup memory and adds its partial into
// grad with a compare-exchange loop over f32 bit patterns (WGSL has no float
// atomics). The output merges across shards with sum-f32.
struct Params {
    rows: u32,
    features: u32,
    scale: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;
@group(0) @binding(3) var<storage, read> w: array<f32>;
@group(0) @binding(4) var<storage, read_write> grad: array<atomic<u32>>;

var<workgroup> partial: array<f32, 256>;

fn add_f32(j: u32, value: f32) {
    var old = atomicLoad(&grad[j]);
    loop {
        let swapped = atomicCompareExchangeWeak(&grad[j], old, bitcast<u32>(bitcast<f32>(old) + value));
        if (swapped.exchanged) {
            break;
        }
        old = swapped.old_value;
    }
}

@compute @workgroup_size(256)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = gid.x;
    let d = params.features;
    let live = i < params.rows;
    var residual = 0.0;
    if (live) {
        var dot = 0.0;
        for (var j = 0u; j < d; j++) {
            dot += x[i * d + j] * w[j];
        }
        residual = dot - y[i];
    }
    for (var j = 0u; j < d; j++) {
        var term = 0.0;
        if (live) {
            term = residual * x[i * d + j];
        }
        partial[li] = term;
        workgroupBarrier();
        for (var stride = 128u; stride > 0u; stride >>= 1u) {
            if (li < stride) {
                partial[li] += partial[li + stride];
            }
            workgroupBarrier();
        }
        if (li == 0u) {
            add_f32(j, partial[0] * params.scale);
        }
        workgroupBarrier();
    }
}
