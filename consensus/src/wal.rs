//! The Raft log's own file: records appended into space zeroed ahead of time, one
//! `fdatasync` per append.
//!
//! Why not the redb store for the log: a redb commit rewrites B-tree pages across
//! its file (leaf, branches, allocator state, header) before its one fsync; an append
//! here writes its bytes where the previous one ended, into blocks the file already
//! has, so the sync flushes a page or two and no file metadata. Every commit of the
//! mesh waits for two of these (the quorum), so their cost is on every task and call.
//!
//! A log file is `<store>.log-<generation>`: a header (magic, generation, cluster),
//! then records `[u32 length][u32 crc32][u8 kind][payload]` (the length counts the
//! kind byte and the payload, so it is never 0; the checksum covers the same bytes),
//! then zeros: a length of 0, or the file's end, ends the log. One record per
//! append, of one kind: the hard state, and a run of entries (maybe none) that
//! replaces everything in the log from its first index on. The store (redb) names
//! the current generation. A new one begins when a
//! snapshot takes over the log's head (a compaction, or a snapshot from the leader):
//! its file is written whole and synced before the store names it, and the old file
//! is removed after, so whatever instant a crash hits, the store names a whole file.
//!
//! On opening, records are read up to the zeros. A record whose checksum fails, or
//! which runs past the file's end, is a write a crash cut short: only the last record
//! can be one (each append is synced before the next is written), so it is cut off
//! and its bytes zeroed. If a whole record follows the damaged one, the damage is
//! not a cut write and the log is refused.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

use protobuf::Message as _;
use raft::eraftpb::{Entry, HardState};

use crate::cluster::ClusterId;
use crate::error::{ConsensusError, Result};
use crate::zeros::ZerosAhead;

const MAGIC: &[u8; 16] = b"gpumesh-raftlog1";
const HEADER: u64 = 32;
/// Length and checksum in front of each record.
const RECORD_HEAD: usize = 8;
/// The one kind of record: `[u32 length][hard state][u32 length][entry]...`.
const KIND_APPEND: u8 = 1;
/// Zeros are written ahead of the log's end this much at a time (see
/// [`crate::zeros`]).
const ZERO_AHEAD: u64 = 4 << 20;
/// A record longer than this is damage, not a record (a Raft append is bounded far
/// below it by the replica's message size).
const MAX_RECORD: u64 = 1 << 30;

/// What one append wrote, read back: the hard state and the entries (maybe none)
/// that replace the log from the first one's index on.
#[derive(Debug, PartialEq)]
pub struct Record {
    pub hard_state: HardState,
    pub entries: Vec<Entry>,
}

enum Backing {
    File(std::sync::Arc<File>),
    /// For the store's in-memory backend (tests, benchmarks): nothing is synced.
    Memory(Vec<u8>),
}

/// One generation of the log, open for appending.
pub struct Wal {
    backing: Backing,
    /// For error messages.
    path: String,
    generation: u64,
    /// Where the next record goes.
    end: u64,
    /// How far the file is zeroed, ahead of `end`.
    zeros: ZerosAhead,
}

impl std::fmt::Debug for Wal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wal")
            .field("path", &self.path)
            .field("generation", &self.generation)
            .field("end", &self.end)
            .finish()
    }
}

/// The file of generation `generation` of the log of the store at `store`.
pub fn file_of(store: &Path, generation: u64) -> PathBuf {
    let mut name = store.as_os_str().to_owned();
    name.push(format!(".log-{generation:010}"));
    PathBuf::from(name)
}

impl Wal {
    /// Writes generation `generation` whole (header, one record of `hard_state` and
    /// `entries`, zeros ahead), syncs it and its directory, and opens it for
    /// appending; `store` is `None` for the in-memory backend. A file of that
    /// generation left by an earlier attempt is replaced.
    pub fn create(
        store: Option<&Path>,
        generation: u64,
        cluster: ClusterId,
        hard_state: &HardState,
        entries: &[Entry],
    ) -> Result<Self> {
        let mut bytes = header(generation, cluster);
        encode(hard_state, entries, &mut bytes)?;
        let end = bytes.len() as u64;
        let Some(store) = store else {
            return Ok(Self {
                backing: Backing::Memory(bytes),
                path: "<memory>".into(),
                generation,
                end,
                zeros: ZerosAhead::new(end, "<memory>".into()),
            });
        };
        let path = file_of(store, generation);
        let text = path.display().to_string();
        let io_err = |e: io::Error| storage_err(&text, e);
        let zeroed = end.div_ceil(ZERO_AHEAD).max(1) * ZERO_AHEAD;
        bytes.resize(zeroed as usize, 0);
        write_whole(&path, &[&bytes]).map_err(io_err)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io_err)?;
        Ok(Self {
            backing: Backing::File(std::sync::Arc::new(file)),
            zeros: ZerosAhead::new(zeroed, text.clone()),
            path: text,
            generation,
            end,
        })
    }

    /// Opens generation `generation` of the log of the store at `store` and reads it
    /// back, cutting off a last record a crash cut short (see the module's text).
    pub fn open(store: &Path, generation: u64, cluster: ClusterId) -> Result<(Self, Vec<Record>)> {
        let path = file_of(store, generation);
        let text = path.display().to_string();
        let io_err = |e: io::Error| storage_err(&text, e);
        let corrupt = |what: String| ConsensusError::CorruptStorage {
            path: text.clone(),
            what,
        };
        let file = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(corrupt(format!(
                    "the store names log generation {generation}, whose file is missing"
                )))
            }
            Err(e) => return Err(io_err(e)),
        };
        let len = file.metadata().map_err(io_err)?.len();
        let mut bytes = vec![0u8; len as usize];
        file.read_exact_at(&mut bytes, 0).map_err(io_err)?;
        if bytes.len() < HEADER as usize || &bytes[..16] != MAGIC {
            return Err(corrupt("not a gpumesh Raft log file".into()));
        }
        if bytes[..HEADER as usize] != header(generation, cluster)[..] {
            return Err(corrupt(
                "the log file's header names another generation or cluster".into(),
            ));
        }
        let mut records = Vec::new();
        let mut at = HEADER as usize;
        let end = loop {
            match read_record(&bytes, at) {
                Read::End => break at,
                Read::Record {
                    kind,
                    payload,
                    next,
                } => {
                    records.push(
                        decode(kind, payload)
                            .map_err(|what| corrupt(format!("record at byte {at}: {what}")))?,
                    );
                    at = next;
                }
                Read::Damaged => {
                    if let Some(whole) = whole_record_after(&bytes, at) {
                        return Err(corrupt(format!(
                            "the record at byte {at} is damaged and a whole record \
                             follows it (at byte {whole})"
                        )));
                    }
                    tracing::warn!(
                        path = %text,
                        at,
                        "the log's last record was cut short (a crash while it was \
                         written, before it was acknowledged); dropping it"
                    );
                    break at;
                }
            }
        };
        // Whatever lies past the end (a cut record, or the part of one written
        // before its head) is zeroed, so that appends never end beside old bytes.
        if bytes[end..].iter().any(|b| *b != 0) {
            let zeros = vec![0u8; bytes.len() - end];
            file.write_all_at(&zeros, end as u64).map_err(io_err)?;
            file.sync_data().map_err(io_err)?;
        }
        Ok((
            Self {
                backing: Backing::File(std::sync::Arc::new(file)),
                zeros: ZerosAhead::new(len, text.clone()),
                path: text,
                generation,
                end: end as u64,
            },
            records,
        ))
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Appends one record of `hard_state` and `entries` with one write and, for a
    /// file, one `fdatasync`, into zeros written ahead (see [`crate::zeros`]).
    pub fn append(&mut self, hard_state: &HardState, entries: &[Entry]) -> Result<()> {
        let mut bytes = Vec::new();
        encode(hard_state, entries, &mut bytes)?;
        let len = bytes.len() as u64;
        match &mut self.backing {
            Backing::Memory(buf) => buf.extend_from_slice(&bytes),
            Backing::File(file) => {
                let io_err = |e: io::Error| storage_err(&self.path, e);
                let zeroed = self.zeros.room_for(self.end + len, ZERO_AHEAD);
                if let Some(zeroed) = zeroed {
                    // No room: the next stretch goes in the same write, and the
                    // sync below covers the new length.
                    bytes.resize((zeroed - self.end) as usize, 0);
                }
                file.write_all_at(&bytes, self.end).map_err(io_err)?;
                file.sync_data().map_err(io_err)?;
                self.zeros.wrote(file, self.end + len, zeroed, ZERO_AHEAD);
            }
        }
        self.end += len;
        Ok(())
    }

    /// Removes the files of every other generation of the store's log, and any
    /// half-written one; a file that cannot be removed is only reported.
    pub fn remove_others(&self, store: &Path) {
        remove_generations(store, ".log-", &file_of(store, self.generation), "Raft log");
    }
}

/// Writes `parts`, one after another, as the whole of a new file at `path`: into
/// `<path>.new` a piece at a time ([`crate::zeros::write_paced`]), synced, then
/// renamed over `path` and the directory synced, so whatever instant a crash hits,
/// `path` is absent, the old file, or the whole new one.
pub(crate) fn write_whole(path: &Path, parts: &[&[u8]]) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".new");
    let tmp = PathBuf::from(tmp);
    {
        let file = File::create(&tmp)?;
        let mut at = 0;
        for part in parts {
            crate::zeros::write_paced(&file, at, part)?;
            at += part.len() as u64;
        }
        file.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    sync_dir(path)
}

/// Removes the files beside the store at `store` whose names are the store's and
/// `infix` then a generation (`raft.redb.log-…`), but for `keep`; a file that cannot
/// be removed (a `what` file) is only reported.
pub(crate) fn remove_generations(store: &Path, infix: &str, keep: &Path, what: &str) {
    let (Some(dir), Some(name)) = (store.parent(), store.file_name()) else {
        return;
    };
    let prefix = format!("{}{infix}", name.to_string_lossy());
    let Ok(listing) = std::fs::read_dir(if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    }) else {
        return;
    };
    for item in listing.flatten() {
        let path = item.path();
        let ours = item.file_name().to_string_lossy().starts_with(&prefix);
        if ours && path.file_name() != keep.file_name() {
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(path = %path.display(), error = %e, "could not remove an old {what} file");
            }
        }
    }
}

fn header(generation: u64, cluster: ClusterId) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER as usize);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&generation.to_le_bytes());
    h.extend_from_slice(&cluster.0.to_le_bytes());
    h
}

fn encode(hard_state: &HardState, entries: &[Entry], out: &mut Vec<u8>) -> Result<()> {
    let start = out.len();
    out.extend_from_slice(&[0u8; RECORD_HEAD]);
    out.push(KIND_APPEND);
    let hs = hard_state.write_to_bytes()?;
    out.extend_from_slice(&(hs.len() as u32).to_le_bytes());
    out.extend_from_slice(&hs);
    for e in entries {
        let b = e.write_to_bytes()?;
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(&b);
    }
    let body = &out[start + RECORD_HEAD..];
    let len = body.len() as u32;
    let crc = crc32fast::hash(body);
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

enum Read<'a> {
    /// Zeros (or the file's end) here: the log ends.
    End,
    Record {
        kind: u8,
        payload: &'a [u8],
        next: usize,
    },
    /// Not a whole record.
    Damaged,
}

fn read_record(bytes: &[u8], at: usize) -> Read<'_> {
    let Some(head) = bytes.get(at..at + RECORD_HEAD) else {
        return if bytes[at.min(bytes.len())..].iter().all(|b| *b == 0) {
            Read::End
        } else {
            Read::Damaged
        };
    };
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    if len == 0 {
        return if crc == 0 { Read::End } else { Read::Damaged };
    }
    let start = at + RECORD_HEAD;
    let next = start + len;
    match bytes.get(start..next) {
        Some(body) if len as u64 <= MAX_RECORD && crc32fast::hash(body) == crc => Read::Record {
            kind: body[0],
            payload: &body[1..],
            next,
        },
        _ => Read::Damaged,
    }
}

/// Where the first whole record after the damaged one at `at` starts, if any. Its
/// length cannot be trusted, so every offset is tried. Only a cut write may end the
/// log, an append is one record, and a cut append leaves no whole record behind it
/// (nothing after it was ever written), so finding one means other damage: a
/// length, say, that would otherwise hide every record after it.
fn whole_record_after(bytes: &[u8], at: usize) -> Option<usize> {
    (at + 1..bytes.len().saturating_sub(RECORD_HEAD)).find(
        |&i| matches!(read_record(bytes, i), Read::Record { kind, .. } if kind == KIND_APPEND),
    )
}

fn decode(kind: u8, payload: &[u8]) -> std::result::Result<Record, String> {
    if kind != KIND_APPEND {
        return Err(format!("unknown record kind {kind}"));
    }
    let (hs, mut rest) = take(payload, "the hard state")?;
    let hard_state = HardState::parse_from_bytes(hs).map_err(|e| format!("hard state: {e}"))?;
    let mut entries = Vec::new();
    while !rest.is_empty() {
        let (e, tail) = take(rest, "an entry")?;
        entries.push(Entry::parse_from_bytes(e).map_err(|e| format!("log entry: {e}"))?);
        rest = tail;
    }
    Ok(Record {
        hard_state,
        entries,
    })
}

/// Splits `[u32 length][that many bytes]` off the front of `bytes`.
fn take<'a>(bytes: &'a [u8], what: &str) -> std::result::Result<(&'a [u8], &'a [u8]), String> {
    let (len, tail) = bytes
        .split_first_chunk::<4>()
        .ok_or_else(|| format!("{what}'s length cut short"))?;
    let len = u32::from_le_bytes(*len) as usize;
    if tail.len() < len {
        return Err(format!("{what} cut short"));
    }
    Ok(tail.split_at(len))
}

pub(crate) fn sync_dir(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => File::open(dir)?.sync_all(),
        _ => File::open(".")?.sync_all(),
    }
}

pub(crate) fn storage_err(path: &str, e: io::Error) -> ConsensusError {
    ConsensusError::Storage {
        path: path.to_owned(),
        reason: e.to_string(),
    }
}
