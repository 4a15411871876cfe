//! `gpumesh bench blobs`: one blob pulled between two nodes on loopback (by default
//! on the blob lane's direct channel; `--stream` on the lane's stream over Noise and
//! Yamux; `--chunks` over request-response) and fetched into the blob store (hashed,
//! fsync'd), beside raw TCP moving the same bytes.

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
    /// After the table, one JSON object on the last line: blob_vs_tcp,
    /// blob_stored_vs_tcp, blob_stored_vs_disk, raw_tcp_ms, pull_ms, pull_ahead_ms
    /// and blob_ahead_vs_tcp (the pull opening records ahead), fetch_ms,
    /// disk_ms.
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
    if args.json {
        println!(
            "{}",
            serde_json::json!({
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
