//! `gpumesh bench mesh`: how fast a blob moves between two nodes, next to how fast the
//! same bytes move over a plain loopback TCP socket, in one run on one machine.
//!
//! Both nodes live in this process and talk over 127.0.0.1 through the full stack
//! (a closed mesh's Noise and Yamux, the blob lane and its direct channel, or
//! request-response; the blob store), so the ratio is the cost of the mesh's framing
//! and encryption relative to the kernel alone.

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpumesh_protocol::BlobId;
use libp2p::identity::Keypair;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{NetConfig, NetHandle};
use crate::blobs::store::BlobStore;
use crate::error::{NodeError, Result};

/// Each figure is the best of this many rounds (each round runs every path once,
/// raw TCP first), so one scheduling hiccup does not decide the result.
const RUNS: usize = 5;

/// Records the second puller opens ahead (see [`BlobTransferReport::mesh_pull_ahead`]).
const OPEN_AHEAD: usize = 2;

/// Which way a blob's bytes go between two nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlobRoute {
    /// Chunks over request-response on the mesh's connection (a peer without the
    /// blob lane).
    Chunks,
    /// One stream on the mesh's connection (Noise, Yamux): the blob lane with the
    /// direct channel off.
    Stream,
    /// The direct channel: a TCP connection of its own, AES-256-GCM under a key
    /// agreed on the lane. The default.
    Direct,
}

/// The outcome of [`bench_blob_transfer`].
#[derive(Clone, Debug)]
pub struct BlobTransferReport {
    pub bytes: usize,
    /// Which way the bytes went.
    pub route: BlobRoute,
    pub chunk_bytes: u32,
    pub fetch_window: usize,
    /// Plain tokio `TcpStream` write → read of the same bytes over loopback.
    pub raw_tcp: Duration,
    /// The chunked, pipelined pull between two nodes, into memory.
    pub mesh_pull: Duration,
    /// The same pull on the direct channel by a node that opens records on blocking
    /// threads while it reads the next ([`OPEN_AHEAD`] of them,
    /// `NetConfig::blob_open_ahead`), its pulls alternating with the other's.
    pub mesh_pull_ahead: Option<Duration>,
    /// [`NetHandle::fetch_blob`] end to end: the pull, the blake3 check, and the
    /// fsync'd write into the blob store.
    pub fetch_blob: Duration,
    /// The same bytes written from memory to a new file beside the store's (allocated
    /// ahead, as the store's), in megabyte writes, and fdatasync'd: what the disk
    /// alone takes to make them durable, a floor under `fetch_blob` that no transfer
    /// removes.
    pub disk: Duration,
}

impl BlobTransferReport {
    fn mib_per_s(&self, d: Duration) -> f64 {
        self.bytes as f64 / (1 << 20) as f64 / d.as_secs_f64().max(1e-9)
    }

    /// Mesh pull throughput as a fraction of raw TCP (1.0 = as fast).
    pub fn pull_ratio(&self) -> f64 {
        self.raw_tcp.as_secs_f64() / self.mesh_pull.as_secs_f64().max(1e-9)
    }

    /// The pull opening records ahead, as a fraction of raw TCP.
    pub fn pull_ahead_ratio(&self) -> Option<f64> {
        self.mesh_pull_ahead
            .map(|d| self.raw_tcp.as_secs_f64() / d.as_secs_f64().max(1e-9))
    }

    /// `fetch_blob` throughput as a fraction of raw TCP.
    pub fn fetch_ratio(&self) -> f64 {
        self.raw_tcp.as_secs_f64() / self.fetch_blob.as_secs_f64().max(1e-9)
    }

    /// `fetch_blob` throughput as a fraction of the disk's alone.
    pub fn fetch_vs_disk(&self) -> f64 {
        self.disk.as_secs_f64() / self.fetch_blob.as_secs_f64().max(1e-9)
    }
}

impl fmt::Display for BlobTransferReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = self.bytes as f64 / (1 << 20) as f64;
        match self.route {
            BlobRoute::Direct => writeln!(
                f,
                "blob transfer over loopback: {mib:.1} MiB on the blob lane's direct channel (best of {RUNS})"
            )?,
            BlobRoute::Stream => writeln!(
                f,
                "blob transfer over loopback: {mib:.1} MiB streamed on the blob lane (best of {RUNS})"
            )?,
            BlobRoute::Chunks => writeln!(
                f,
                "blob transfer over loopback: {mib:.1} MiB, chunks of {} KiB, {} in flight (best of {RUNS})",
                self.chunk_bytes / 1024,
                self.fetch_window
            )?,
        }
        let pull = match self.route {
            BlobRoute::Direct => "mesh pull (direct, AES-256-GCM)",
            BlobRoute::Stream => "mesh pull (noise+key, yamux)",
            BlobRoute::Chunks => "mesh pull (chunks, noise+key)",
        };
        writeln!(
            f,
            "{:<34} {:>10} {:>10} {:>8}",
            "path", "ms", "MiB/s", "vs tcp"
        )?;
        let ahead = self
            .mesh_pull_ahead
            .zip(self.pull_ahead_ratio())
            .map(|(d, r)| ("  the same, opened ahead", d, r));
        let rows = [
            Some(("raw TCP (tokio, loopback)", self.raw_tcp, 1.0)),
            Some((pull, self.mesh_pull, self.pull_ratio())),
            ahead,
            Some((
                "fetch_blob (+blake3 +fsync)",
                self.fetch_blob,
                self.fetch_ratio(),
            )),
            Some((
                "disk alone (write +fdatasync)",
                self.disk,
                self.raw_tcp.as_secs_f64() / self.disk.as_secs_f64().max(1e-9),
            )),
        ];
        for (name, d, ratio) in rows.into_iter().flatten() {
            writeln!(
                f,
                "{name:<34} {:>10.1} {:>10.1} {:>7.0}%",
                d.as_secs_f64() * 1e3,
                self.mib_per_s(d),
                ratio * 100.0
            )?;
        }
        writeln!(
            f,
            "fetch_blob reaches {:.0}% of the disk alone's rate",
            self.fetch_vs_disk() * 100.0
        )?;
        Ok(())
    }
}

/// Measures moving `bytes` between two nodes on loopback with the default tuning.
pub async fn bench_blob_transfer(bytes: usize) -> Result<BlobTransferReport> {
    let (chunk_bytes, fetch_window) = blob_transfer_defaults();
    bench_blob_transfer_with(bytes, chunk_bytes, fetch_window, BlobRoute::Direct).await
}

/// A node's chunk size and chunks in flight when it pulls a blob.
pub fn blob_transfer_defaults() -> (u32, usize) {
    let defaults = NetConfig::new(Keypair::generate_ed25519());
    (defaults.chunk_bytes, defaults.fetch_window)
}

/// [`bench_blob_transfer`] with a chosen chunk size and number of chunks in flight
/// (for [`BlobRoute::Chunks`]), and the route the bytes take.
pub async fn bench_blob_transfer_with(
    bytes: usize,
    chunk_bytes: u32,
    fetch_window: usize,
    route: BlobRoute,
) -> Result<BlobTransferReport> {
    let loopback = |e: std::io::Error| NodeError::io(Path::new("127.0.0.1"), e);
    let blobs: Vec<Vec<u8>> = (0..RUNS as u64)
        .map(|seed| noise_bytes(bytes, seed))
        .collect();

    let dir = tempfile::tempdir().map_err(|e| NodeError::io(&std::env::temp_dir(), e))?;
    let mut disk = Duration::MAX;
    for (n, blob) in blobs.iter().enumerate() {
        let path = dir.path().join(format!("disk-{n}"));
        let write = {
            let (path, blob) = (path.clone(), blob.clone());
            tokio::task::spawn_blocking(move || durable_write(&path, &blob))
        };
        let took = write
            .await
            .map_err(|e| NodeError::NetSetup(format!("disk write task: {e}")))?
            .map_err(|e| NodeError::io(&path, e))?;
        disk = disk.min(took);
        std::fs::remove_file(&path).map_err(|e| NodeError::io(&path, e))?;
    }
    let cancel = CancellationToken::new();
    let max_blob = bytes as u64 + 1;
    // A closed mesh, as meshes are by default: both nodes hold one cluster key.
    let key = crate::cluster_key::ClusterKey::generate();
    let start_node = |name: &str, open_ahead: usize| {
        let store = BlobStore::open(dir.path().join(name), max_blob);
        let cancel = cancel.clone();
        async move {
            let mut config = NetConfig::new(Keypair::generate_ed25519());
            config.listen = vec!["/ip4/127.0.0.1/tcp/0"
                .parse()
                .map_err(|e| NodeError::NetSetup(format!("loopback address: {e}")))?];
            config.mdns = false;
            config.psk = Some(key.psk());
            config.chunk_bytes = chunk_bytes;
            config.fetch_window = fetch_window;
            config.blob_lane = route != BlobRoute::Chunks;
            config.blob_direct = route == BlobRoute::Direct;
            config.blob_open_ahead = open_ahead;
            // The bench does not read events; a small channel whose overflow is
            // dropped is all it needs.
            let (events, _) = mpsc::channel(16);
            NetHandle::start(config, store?, events, cancel).await
        }
    };
    let (server, server_task) = start_node("server", 0).await?;
    let (client, client_task) = start_node("client", 0).await?;
    let (ahead, ahead_task) = start_node("ahead", OPEN_AHEAD).await?;
    let result = async {
        let mut ids = Vec::new();
        for blob in &blobs {
            ids.push(server.blobs.put(blob)?);
        }
        let addr = server
            .listen_addrs()
            .await?
            .into_iter()
            .next()
            .ok_or_else(|| NodeError::NetSetup("server has no listen address".into()))?;
        let peer = client.dial(addr.clone()).await?;
        let direct = route == BlobRoute::Direct;
        if direct {
            ahead.dial(addr).await?;
        }

        // Each round moves the same bytes over raw TCP and then through the mesh,
        // so that both figures see the machine as it is at that moment.
        let (mut mesh_pull, mut mesh_pull_ahead) = (Duration::MAX, Duration::MAX);
        let mut raw_tcp = Duration::MAX;
        for (id, blob) in ids.iter().zip(&blobs) {
            raw_tcp = raw_tcp.min(
                raw_tcp_transfer(Arc::new(blob.clone()))
                    .await
                    .map_err(loopback)?,
            );
            let pullers = [(&client, &mut mesh_pull), (&ahead, &mut mesh_pull_ahead)];
            // Opening ahead is the direct channel's: one puller on the other routes.
            for (node, best) in pullers.into_iter().take(if direct { 2 } else { 1 }) {
                let t = Instant::now();
                let got = node.pull_blob(peer, *id).await?;
                *best = (*best).min(t.elapsed());
                check_same(*id, &got)?;
            }
        }
        let mut fetch_blob = Duration::MAX;
        for id in &ids {
            let t = Instant::now();
            client.fetch_blob(peer, *id).await?;
            fetch_blob = fetch_blob.min(t.elapsed());
        }
        Ok(BlobTransferReport {
            bytes,
            route,
            chunk_bytes,
            fetch_window,
            raw_tcp,
            mesh_pull,
            mesh_pull_ahead: direct.then_some(mesh_pull_ahead),
            fetch_blob,
            disk,
        })
    }
    .await;
    cancel.cancel();
    let _ = server_task.await;
    let _ = client_task.await;
    let _ = ahead_task.await;
    result
}

fn check_same(id: BlobId, got: &[u8]) -> Result<()> {
    if id.matches(got) {
        Ok(())
    } else {
        Err(NodeError::BlobMismatch {
            id,
            got: BlobId::of(got),
        })
    }
}

/// Sends `data` from one loopback socket to another and times it until the last byte
/// is read, receive buffer included (the mesh pull allocates one too).
async fn raw_tcp_transfer(data: Arc<Vec<u8>>) -> std::io::Result<Duration> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let len = data.len();
    let start = Instant::now();
    let sender = tokio::spawn(async move {
        let mut stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        stream.write_all(&data).await?;
        stream.shutdown().await
    });
    let (mut stream, _) = listener.accept().await?;
    let mut buf = vec![0u8; len];
    stream.read_exact(&mut buf).await?;
    let elapsed = start.elapsed();
    sender.await.map_err(std::io::Error::other)??;
    Ok(elapsed)
}

/// Writes `bytes` to a new file at `path` (allocated ahead, as the store makes a
/// received blob's) a megabyte at a time and fdatasyncs it: how long that took.
fn durable_write(path: &Path, bytes: &[u8]) -> std::io::Result<Duration> {
    use std::io::Write;
    let start = Instant::now();
    let mut file = crate::blobs::store::create_sized(path, bytes.len() as u64)?;
    for piece in bytes.chunks(1 << 20) {
        file.write_all(piece)?;
    }
    file.sync_data()?;
    Ok(start.elapsed())
}

/// Incompressible bytes (xorshift), different per seed, cheap to make.
fn noise_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ seed.wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}
