// 256-bin histogram of the top byte of each u32 value. Each invocation reads
// VALUES_PER_INVOCATION values into a workgroup histogram; the workgroup then adds
// its bins to the output with one atomic per bin.
@group(0) @binding(0) var<storage, read> values: array<u32>;
@group(0) @binding(1) var<storage, read_write> bins: array<atomic<u32>, 256>;

const VALUES_PER_INVOCATION: u32 = 8u;

var<workgroup> local_bins: array<atomic<u32>, 256>;

@compute @workgroup_size(256)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    atomicStore(&local_bins[li], 0u);
    workgroupBarrier();
    let count = arrayLength(&values);
    for (var k = 0u; k < VALUES_PER_INVOCATION; k++) {
        let i = gid.x * VALUES_PER_INVOCATION + k;
        if (i < count) {
            atomicAdd(&local_bins[values[i] >> 24u], 1u);
        }
    }
    workgroupBarrier();
    let mine = atomicLoad(&local_bins[li]);
    if (mine != 0u) {
        atomicAdd(&bins[li], mine);
    }
}
