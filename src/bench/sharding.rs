//! The sharding part of `gpumesh bench executor`: (d) the bytes a shard's result
//! holds against the buffer it wrote into, (e) what merging costs per MiB, and (f)
//! sharded against unsharded time for a compute-bound kernel on one adapter.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use gpumesh_protocol::{
    Base, BlobId, BufferChanges, Grid, MergeRule, ShaderSource, ShardChanges, TaskSpec,
};
use gpumesh_shaders::{merge, Executor, Job, Kernel};

use super::{median_of, ms};

/// Each invocation doubles one element behind a bounds check: every shard writes
/// exactly its share of the output.
const DOUBLE: &str = r#"
@group(0) @binding(0) var<storage, read> input: array<f32>;
@group(0) @binding(1) var<storage, read_write> output: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    if (id.x >= arrayLength(&input)) {
        return;
    }
    output[id.x] = input[id.x] * 2.0 + 1.0;
}
"#;

fn double_job(elements: u32, shards: u32) -> anyhow::Result<Job> {
    let input: Vec<u8> = (0..elements)
        .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
        .collect();
    let blob = BlobId::of(&input);
    let size = input.len() as u64;
    let spec = TaskSpec {
        shader: ShaderSource::Wgsl(DOUBLE.into()),
        entry_point: "main".into(),
        bindings: super::input_to_output(blob, size),
        grid: Grid([elements.div_ceil(64), 1, 1]),
        shards,
        merge: MergeRule::Changes,
        merges: Default::default(),
        options: Default::default(),
    };
    let input: Arc<[u8]> = Arc::from(input);
    Ok(Job::new(
        spec,
        Arc::new(Kernel::compile(DOUBLE, "main")?),
        |_| Some(input.clone()),
    )?)
}

pub fn sections(
    ex: &mut Executor,
    runs: usize,
    shard_counts: &[u32],
    spin_job: impl Fn(u32, u32) -> anyhow::Result<Job>,
    spin_groups: u32,
) -> anyhow::Result<()> {
    // A 16 MiB output less 37 words: the last workgroup is ragged.
    let elements: u32 = (4 << 20) - 37;
    println!(
        "\n(d) bytes per shard's result vs the buffer it writes into: a {:.1} MiB output, \
         each shard writes its share",
        f64::from(elements) * 4.0 / f64::from(1 << 20)
    );
    println!(
        "{:>8} {:>14} {:>16} {:>14} {:>12}",
        "shards", "buffer bytes", "result bytes/shard", "share bytes", "result/share"
    );
    let mut eight = None;
    for &shards in shard_counts {
        let job = double_job(elements, shards)?;
        let out = ex.run_shards(&job, &job.plan, None)?;
        let encoded: Vec<usize> = out.iter().map(|s| s.changes.encode().len()).collect();
        let mean = encoded.iter().sum::<usize>() as f64 / encoded.len() as f64;
        let buffer = f64::from(elements) * 4.0;
        let share = buffer / f64::from(shards);
        println!(
            "{shards:>8} {buffer:>14.0} {mean:>16.0} {share:>14.0} {:>12.4}",
            mean / share
        );
        if shards == *shard_counts.iter().max().unwrap_or(&1) {
            eight = Some((job, out));
        }
    }

    println!("\n(e) merge cost on the CPU, median of {runs} runs");
    println!("{:>44} {:>10} {:>10} {:>10}", "case", "MiB", "ms", "MiB/s");
    if let Some((job, out)) = eight {
        let refs: Vec<&ShardChanges> = out.iter().map(|s| &s.changes).collect();
        let mib = f64::from(elements) * 4.0 / f64::from(1 << 20);
        let t = median_of(runs, || -> anyhow::Result<_> {
            let t0 = Instant::now();
            job.merge(&refs)?;
            Ok(t0.elapsed())
        })?;
        println!(
            "{:>44} {mib:>10.1} {:>10.2} {:>10.0}",
            format!("{} shards, disjoint shares", refs.len()),
            ms(t),
            mib / t.as_secs_f64()
        );
    }
    // The slow path: every shard changed every word, to the same values, so each
    // word after the first shard's is compared.
    let size = 16usize << 20;
    let words: Vec<u8> = (0..size / 4)
        .flat_map(|i| (i as u32 | 1).to_le_bytes())
        .collect();
    let whole = ShardChanges(BTreeMap::from([(
        0,
        BufferChanges::diff(Base::Fill([0; 4]), &words),
    )]));
    let refs = vec![&whole; 4];
    let target = merge::Target {
        rule: MergeRule::Changes,
        size: size as u64,
        base: Base::Fill([0; 4]),
        atomic: None,
    };
    let targets = BTreeMap::from([(0u32, target)]);
    let t = median_of(runs, || -> anyhow::Result<_> {
        let t0 = Instant::now();
        merge::merge(&targets, &refs)?;
        Ok(t0.elapsed())
    })?;
    let mib = 4.0 * size as f64 / f64::from(1 << 20);
    println!(
        "{:>44} {mib:>10.1} {:>10.2} {:>10.0}",
        "4 shards, each wrote all of 16 MiB (same)",
        ms(t),
        mib / t.as_secs_f64()
    );
    let t = median_of(runs, || -> anyhow::Result<_> {
        let t0 = Instant::now();
        let d = BufferChanges::diff(Base::Fill([0; 4]), &words);
        std::hint::black_box(d);
        Ok(t0.elapsed())
    })?;
    println!(
        "{:>44} {:>10.1} {:>10.2} {:>10.0}",
        "finding the changed words of 16 MiB",
        16.0,
        ms(t),
        16.0 / t.as_secs_f64()
    );

    println!(
        "\n(f) a compute-bound kernel ({spin_groups} workgroups of hashing) on one adapter, \
         n shards vs 1, median of {runs} runs"
    );
    println!("{:>8} {:>12} {:>12}", "shards", "ms", "vs 1 shard");
    let mut base = None;
    for &shards in shard_counts {
        let job = spin_job(spin_groups, shards)?;
        let t = median_of(runs, || ex.run(&job, None).map(|o| o.elapsed))?;
        let base = *base.get_or_insert(t);
        println!(
            "{shards:>8} {:>12.2} {:>12.3}",
            ms(t),
            t.as_secs_f64() / base.as_secs_f64()
        );
    }
    Ok(())
}
