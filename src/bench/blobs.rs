//! `gpumesh bench blobs`: one blob pulled between two nodes on loopback (by default
//! on the blob lane's direct channel; `--stream` on the lane's stream over Noise and
//! Yamux; `--chunks` over request-response) and fetched into the blob store (hashed,
//! fsync'd), beside raw TCP moving the same bytes. Then the blob store's pack of
//! small blobs compacted, and what that costs the appends made meanwhile.

use std::process::ExitCode;

use gpumesh::node::net::BlobRoute;

#[derive(clap::Args, Debug)]
pub struct BlobsBenchArgs {
    /// MiB per blob.
    #[arg(long, default_value_t = 64)]
    pub mib: usize,
    /// Move the bytes in chunks over request-response, as to a peer without the
    /// blob lane, instead of streaming them on the lane.
    #[arg(long, conflicts_with = "stream")]
    pub chunks: bool,
    /// Stream the bytes on the blob lane's libp2p stream (Noise with the cluster
    /// key, Yamux) instead of its direct channel.
    #[arg(long)]
    pub stream: bool,
    /// Chunk size in KiB with --chunks (default: the node's).
    #[arg(long)]
    pub chunk_kib: Option<u32>,
    /// Chunks in flight at once with --chunks (default: the node's).
    #[arg(long)]
    pub window: Option<usize>,
    /// MiB of live blobs in the pack compacted after the pull.
    #[arg(long, default_value_t = 64)]
    pub pack_live_mib: u64,
    /// MiB of removed blobs among them (what the compaction gives back).
    #[arg(long, default_value_t = 64)]
    pub pack_dead_mib: u64,
    /// KiB per blob in that pack.
    #[arg(long, default_value_t = 16)]
    pub pack_blob_kib: usize,
    /// After the table, one JSON object on the last line: blob_vs_tcp,
    /// blob_stored_vs_tcp, blob_stored_vs_disk, raw_tcp_ms, pull_ms, pull_ahead_ms
    /// and blob_ahead_vs_tcp (the pull opening records ahead), fetch_ms,
    /// disk_ms; compact_ms, compact_mib_per_s (live bytes copied), and the p50,
    /// p99 and slowest 4 KiB append alone and while compacting
    /// (append_p50_ms_alone, append_p99_ms_alone, append_max_ms_alone, and
    /// _compacting).
    #[arg(long)]
    pub json: bool,
}

pub fn blobs(args: BlobsBenchArgs) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let (chunk_bytes, fetch_window) = gpumesh::node::net::blob_transfer_defaults();
    let chunk = args.chunk_kib.map_or(chunk_bytes, |k| k << 10);
    let window = args.window.unwrap_or(fetch_window);
    let report = runtime.block_on(gpumesh::node::net::bench_blob_transfer_with(
        args.mib << 20,
        chunk,
        window,
        if args.chunks {
            BlobRoute::Chunks
        } else if args.stream {
            BlobRoute::Stream
        } else {
            BlobRoute::Direct
        },
    ))?;
    println!("gpumesh bench blobs — two nodes on loopback in one process\n");
    println!("{report}");
    let pack = pack_compaction(&args)?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "compact_ms": pack.compact_ms,
                "compact_mib_per_s": pack.mib_per_s,
                "append_p50_ms_alone": pack.alone[0],
                "append_p99_ms_alone": pack.alone[1],
                "append_max_ms_alone": pack.alone[2],
                "append_p50_ms_compacting": pack.compacting[0],
                "append_p99_ms_compacting": pack.compacting[1],
                "append_max_ms_compacting": pack.compacting[2],
                "blob_vs_tcp": report.pull_ratio(),
                "blob_stored_vs_tcp": report.fetch_ratio(),
                "blob_stored_vs_disk": report.fetch_vs_disk(),
                "raw_tcp_ms": super::ms(report.raw_tcp),
                "pull_ms": super::ms(report.mesh_pull),
                "pull_ahead_ms": report.mesh_pull_ahead.map(super::ms),
                "blob_ahead_vs_tcp": report.pull_ahead_ratio(),
                "fetch_ms": super::ms(report.fetch_blob),
                "disk_ms": super::ms(report.disk),
            })
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The compaction's figures, as printed.
struct PackFigures {
    compact_ms: f64,
    mib_per_s: f64,
    /// p50, p99, slowest (ms).
    alone: [f64; 3],
    compacting: [f64; 3],
}

/// Fills a pack with small blobs, removes some, compacts it while appending, and
/// prints what that took.
fn pack_compaction(args: &BlobsBenchArgs) -> anyhow::Result<PackFigures> {
    let dir = std::env::temp_dir().join(format!("gpumesh-bench-pack-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let report = gpumesh::node::blobs::bench_compaction(
        &dir,
        args.pack_blob_kib.max(1) << 10,
        args.pack_live_mib << 20,
        args.pack_dead_mib << 20,
    );
    let _ = std::fs::remove_dir_all(&dir);
    let r = report?;
    let figures = |times: &[std::time::Duration]| {
        let mut sorted = times.to_vec();
        sorted.sort();
        let at = |p: f64| {
            let i = (sorted.len().saturating_sub(1) as f64 * p).round() as usize;
            sorted.get(i).copied().map_or(0.0, super::ms)
        };
        [at(0.5), at(0.99), at(1.0)]
    };
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let out = PackFigures {
        compact_ms: super::ms(r.compact),
        mib_per_s: mib(r.live_bytes) / r.compact.as_secs_f64().max(1e-9),
        alone: figures(&r.appends_alone),
        compacting: figures(&r.appends_compacting),
    };
    println!(
        "\nthe store's pack of small blobs compacted: {} KiB blobs, {:.0} MiB live, {:.0} MiB removed",
        r.blob_bytes >> 10,
        mib(r.live_bytes),
        mib(r.dead_bytes)
    );
    println!(
        "  file                {:>9.1} MiB -> {:.1} MiB",
        mib(r.before),
        mib(r.after)
    );
    println!(
        "  compaction          {:>9.1} ms ({:.0} MiB/s of live records copied)",
        out.compact_ms, out.mib_per_s
    );
    let kib = gpumesh::node::blobs::BENCH_APPEND >> 10;
    println!(
        "  (while compacting: from its start to {} ms after its end, as the old file is given back)",
        gpumesh::node::blobs::BENCH_AFTER.as_millis()
    );
    for (what, f, n) in [
        ("alone", out.alone, r.appends_alone.len()),
        (
            "while compacting",
            out.compacting,
            r.appends_compacting.len(),
        ),
    ] {
        println!(
            "  {kib} KiB synced append, {what:<16} p50 {:.3} / p99 {:.3} / max {:.3} ms ({n} appends)",
            f[0], f[1], f[2]
        );
    }
    Ok(out)
}
