// Monte Carlo estimate of pi: each invocation draws params.samples points in the unit
// square from a counter-based hash and counts those inside the quarter circle, in
// integers only (15-bit coordinates), so every adapter counts exactly alike.
// Output: hits per workgroup.
struct Params {
    samples: u32,
    seed: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> hits: array<u32>;

var<workgroup> group_hits: atomic<u32>;

fn hash(v: u32) -> u32 {
    let state = v * 747796405u + 2891336453u;
    let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

@compute @workgroup_size(64)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    if (li == 0u) {
        atomicStore(&group_hits, 0u);
    }
    workgroupBarrier();
    var inside = 0u;
    for (var s = 0u; s < params.samples; s++) {
        let base = (gid.x * params.samples + s) * 2u;
        let x = hash(base ^ params.seed) >> 17u;
        let y = hash((base + 1u) ^ params.seed) >> 17u;
        if (x * x + y * y < 1073741824u) {
            inside++;
        }
    }
    atomicAdd(&group_hits, inside);
    workgroupBarrier();
    if (li == 0u) {
        hits[wid.x] = atomicLoad(&group_hits);
    }
}
