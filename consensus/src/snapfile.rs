//! The Raft snapshot's own file, beside the store: `<store>.snap-<generation>`, the
//! generation of the log file that began with it.
//!
//! Why not a value in redb, as before: a snapshot of a full record (10,000 finished
//! tasks) is 8.6 MB, and putting it into redb took 53–96 ms and redb's commit 45–47
//! more, of the 150–220 ms a snapshot held its replica's Raft task. Here it is one
//! write, one `fsync`, a rename and the directory's `fsync` (43–52 ms for 8.6 MB in
//! a bench under load; a snapshot 81–155 ms in all), before the store names it (in
//! the same commit as the log's next generation), so whatever instant a crash hits,
//! the store names a whole file; a file of another generation is removed once the
//! store names the next.
//!
//! The file: a header (magic, generation, cluster, the payload's length and crc32),
//! then the snapshot's protobuf bytes. A file whose header or checksum does not
//! match is refused, as damage.

use std::path::{Path, PathBuf};

use protobuf::Message as _;
use raft::eraftpb::Snapshot;

use crate::cluster::ClusterId;
use crate::error::{ConsensusError, Result};
use crate::wal::storage_err;

const MAGIC: &[u8; 16] = b"gpumesh-raftsnp1";
/// Magic, generation, cluster, length, crc32 (and four bytes of padding).
const HEADER: usize = 16 + 8 + 8 + 8 + 8;

/// The snapshot file of generation `generation` of the store at `store`.
pub fn file_of(store: &Path, generation: u64) -> PathBuf {
    let mut name = store.as_os_str().to_owned();
    name.push(format!(".snap-{generation:010}"));
    PathBuf::from(name)
}

/// Writes `snapshot` as generation `generation`'s file, whole and synced.
pub fn write(store: &Path, generation: u64, cluster: ClusterId, snapshot: &Snapshot) -> Result<()> {
    let path = file_of(store, generation);
    let text = path.display().to_string();
    let io_err = |e: std::io::Error| storage_err(&text, e);
    let payload = snapshot.write_to_bytes()?;
    let head = header(generation, cluster, &payload);
    crate::wal::write_whole(&path, &[&head, &payload]).map_err(io_err)
}

/// Reads generation `generation`'s snapshot back, checking it is whole and this
/// cluster's.
pub fn read(store: &Path, generation: u64, cluster: ClusterId) -> Result<Snapshot> {
    let path = file_of(store, generation);
    let text = path.display().to_string();
    let corrupt = |what: String| ConsensusError::CorruptStorage {
        path: text.clone(),
        what,
    };
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(corrupt(format!(
                "the store names snapshot generation {generation}, whose file is missing"
            )))
        }
        Err(e) => return Err(storage_err(&text, e)),
    };
    if bytes.len() < HEADER || bytes[..16] != MAGIC[..] {
        return Err(corrupt("not a gpumesh Raft snapshot file".into()));
    }
    let payload = &bytes[HEADER..];
    if bytes[..HEADER] != header(generation, cluster, payload)[..] {
        return Err(corrupt(
            "the snapshot file's header does not match its generation, cluster, length or \
             checksum"
                .into(),
        ));
    }
    Snapshot::parse_from_bytes(payload).map_err(|e| corrupt(format!("snapshot: {e}")))
}

/// Removes every snapshot file of the store at `store` but generation `keep`'s
/// (every one, with `None`).
pub fn remove_others(store: &Path, keep: Option<u64>) {
    let keep = keep.map_or_else(|| PathBuf::from("/"), |g| file_of(store, g));
    crate::wal::remove_generations(store, ".snap-", &keep, "Raft snapshot");
}

fn header(generation: u64, cluster: ClusterId, payload: &[u8]) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&generation.to_le_bytes());
    h.extend_from_slice(&cluster.0.to_le_bytes());
    h.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    h.extend_from_slice(&u64::from(crc32fast::hash(payload)).to_le_bytes());
    h
}
