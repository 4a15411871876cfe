//! Durable Raft storage: log entries, hard state, the latest snapshot (with the
//! state machine inside), all synced to disk before Raft may act on them.
//!
//! Three files. The redb store holds what changes seldom: table `meta` (format tag,
//! cluster id, truncation point, the log's current generation and the snapshot's,
//! the hard state as of that generation's start). The log (entries and hard states,
//! one append and one `fdatasync` per Ready) is a file of its own beside it,
//! [`crate::wal`]: a redb commit rewrote B-tree pages across its file for each
//! append, and every commit of the mesh waits for two appends. The latest snapshot
//! is a third, [`crate::snapfile`]. Taking or receiving a snapshot starts a new
//! generation of the log file, holding only the entries the snapshot leaves; the
//! old files are then removed, so the log's size on disk is bounded by what
//! compaction keeps plus what came since. A snapshot of our own has its files
//! written off the replica's task ([`RedbStorage::begin_compaction`]).
//!
//! Stores written before the log had a file of its own kept it in redb tables (one
//! table `log`, later segments `log.<n>` of [`SEGMENT`] entries); on opening such a
//! store its entries move to a log file and the tables go, in one step.
//!
//! The unsnapshotted tail of the log is also kept in memory, so raft-rs's frequent
//! `term`/`entries` calls never touch the disk; memory stays bounded because the log
//! is compacted after every snapshot.
//!
//! The applied index is not stored: on restart the state machine is rebuilt from the
//! snapshot and the committed entries after it are replayed (raft-rs hands them over
//! in the first Ready), so the conf state kept here is the snapshot's.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use protobuf::Message as _;
use raft::eraftpb::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};
use redb::backends::InMemoryBackend;
use redb::{Database, ReadableTable, ReadableTableMetadata, TableDefinition, TableHandle};

use crate::cluster::ClusterId;
use crate::error::{ConsensusError, Result};
use crate::state::{ClusterSettings, StateMachine};
use crate::wal::Wal;

const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
/// The one log table of stores written before the log had segments.
const OLD_LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
const SNAPSHOT: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshot");

/// Tags a redb file as ours, so a foreign database is refused instead of misread.
const FORMAT: &[u8] = b"gpumesh-consensus/1";
const KEY_FORMAT: &str = "format";
const KEY_CLUSTER: &str = "cluster_id";
const KEY_HARD_STATE: &str = "hard_state";
const KEY_SNAPSHOT: &str = "snapshot";
const KEY_TRUNCATED: &str = "truncated";
/// The generation of the log file that holds the log (absent in stores from before).
const KEY_LOG_GENERATION: &str = "log_generation";
/// The generation of the snapshot's own file ([`crate::snapfile`]); absent while the
/// snapshot is in the snapshot table (stores from before, the in-memory backend).
const KEY_SNAPSHOT_FILE: &str = "snapshot_file";

/// Log entries per segment table, in stores from before the log file.
pub const SEGMENT: u64 = 1024;

fn segment_of(index: u64) -> u64 {
    index / SEGMENT
}

fn segment_name(segment: u64) -> String {
    format!("log.{segment:012}")
}

/// Deletes the table of log segment `segment` (nothing if there is none).
fn drop_segment(
    txn: &redb::WriteTransaction,
    segment: u64,
) -> std::result::Result<bool, redb::TableError> {
    txn.delete_table(TableDefinition::<u64, &[u8]>::new(&segment_name(segment)))
}

fn parse_segment(table: &str) -> Option<u64> {
    table.strip_prefix("log.")?.parse().ok()
}

/// The log's segments, in order.
fn segments(txn: &redb::WriteTransaction) -> std::result::Result<Vec<u64>, redb::StorageError> {
    let mut found: Vec<u64> = txn
        .list_tables()?
        .filter_map(|t| parse_segment(t.name()))
        .collect();
    found.sort_unstable();
    Ok(found)
}

/// The durable Raft state of one replica.
pub struct RedbStorage {
    db: Database,
    /// For error messages (`<memory>` for the in-memory backend).
    path: String,
    /// The redb file; `None` for the in-memory backend.
    store: Option<PathBuf>,
    /// The log's file, current generation.
    wal: Wal,
    cluster: ClusterId,
    hard_state: HardState,
    /// The latest snapshot, state machine bytes included (empty before init).
    snapshot: Snapshot,
    /// Index and term of the last entry removed from the log (0, 0 if none).
    truncated: (u64, u64),
    /// Entries `truncated.0 + 1 ..= last_index`, mirrored from the log's tables.
    entries: VecDeque<Entry>,
    /// The bytes of their commands, together.
    entry_bytes: u64,
    /// Raft asked for a snapshot newer than the one held; the actor makes one.
    snapshot_wanted: AtomicBool,
    /// Test hook: writes left before every write fails (a simulated crash).
    fail_after: Option<u64>,
    /// Test hook: snapshots of our own whose files fail to be written next (a
    /// disk with no room for them).
    fail_snapshots: u64,
    /// A snapshot of our own whose file is being written (see
    /// [`RedbStorage::begin_compaction`]).
    writing: Option<SnapshotWrite>,
}

/// What [`RedbStorage::finish_compaction`] did.
#[derive(Debug)]
pub enum Compaction {
    /// Nothing was in flight, or the snapshot is named and the log compacted
    /// behind it.
    Done,
    /// The snapshot's files could not be written (a full disk): what was written of
    /// them is removed, and the store and the log are as they were. Another
    /// snapshot may be tried later.
    NotWritten(ConsensusError),
}

/// A snapshot of our own being stored: encoded, its file and the log's next
/// generation (the entries it leaves, as they were then) written and synced, on a
/// thread of their own; the store names them only in
/// [`RedbStorage::finish_compaction`]. Dropped, it waits for the thread (whose
/// files are then left unnamed, and removed with the next generation's).
struct SnapshotWrite {
    generation: u64,
    index: u64,
    /// The truncation point the next generation starts after.
    truncated: (u64, u64),
    /// The last entry the next generation was written with.
    last: u64,
    /// The lowest index appended again since (a new leader's entries replacing
    /// ours): the next generation must have them too.
    rewritten_from: u64,
    /// What the thread made: the snapshot, and the next generation's log open for
    /// appending.
    written: Option<std::sync::mpsc::Receiver<Result<(Snapshot, Wal)>>>,
}

impl SnapshotWrite {
    /// Waits for the files: the snapshot and the next generation's log, open for
    /// appending, or the error that stopped them.
    fn join(&mut self, store: &str) -> Result<(Snapshot, Wal)> {
        let gone = || ConsensusError::Storage {
            path: store.to_string(),
            reason: format!("the writer of snapshot file {} stopped", self.generation),
        };
        let written = self.written.take().ok_or_else(gone)?;
        written.recv().map_err(|_| gone())?
    }
}

/// Runs `work` (writing a snapshot's files, freeing what a compaction dropped) off
/// the replica's task: on the runtime's blocking pool inside one (where a test's
/// paused clock waits for it), else on a thread of its own.
fn off_task(work: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            drop(runtime.spawn_blocking(work));
            Ok(())
        }
        Err(_) => std::thread::Builder::new()
            .name("gpumesh-storage".into())
            .spawn(work)
            .map(drop),
    }
}

impl Drop for SnapshotWrite {
    fn drop(&mut self) {
        let _ = self.join("");
    }
}

impl std::fmt::Debug for RedbStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedbStorage")
            .field("path", &self.path)
            .field("cluster", &self.cluster)
            .field("truncated", &self.truncated)
            .field("last_index", &self.last())
            .finish()
    }
}

impl RedbStorage {
    /// Opens (or creates) the storage at `path` for cluster `cluster`.
    ///
    /// Refuses, with a message saying what to do, a file that is not a gpumesh
    /// consensus store, one that is corrupt, or one that belongs to another cluster.
    pub fn open(path: impl AsRef<Path>, cluster: ClusterId) -> Result<Self> {
        let path_text = path.as_ref().display().to_string();
        let db = Database::create(path.as_ref()).map_err(|e| db_err(&path_text, e))?;
        Self::load(db, path_text, Some(path.as_ref().to_owned()), cluster)
    }

    /// Storage in memory (redb's in-memory backend): for tests and benchmarks only.
    pub fn in_memory(cluster: ClusterId) -> Result<Self> {
        let path = "<memory>".to_string();
        let db = Database::builder()
            .create_with_backend(InMemoryBackend::new())
            .map_err(|e| db_err(&path, e))?;
        Self::load(db, path, None, cluster)
    }

    fn load(
        db: Database,
        path: String,
        store: Option<PathBuf>,
        cluster: ClusterId,
    ) -> Result<Self> {
        let err = |e: redb::Error| db_err(&path, e);
        let corrupt = |what: String| ConsensusError::CorruptStorage {
            path: path.clone(),
            what,
        };

        // Create the tables and stamp format + cluster id on first open.
        let txn = db.begin_write().map_err(|e| err(e.into()))?;
        {
            let mut meta = txn.open_table(META).map_err(|e| err(e.into()))?;
            let mut snapshots = txn.open_table(SNAPSHOT).map_err(|e| err(e.into()))?;
            let format = meta
                .get(KEY_FORMAT)
                .map_err(|e| err(e.into()))?
                .map(|v| v.value().to_vec());
            match format {
                None => {
                    if meta.len().map_err(|e| err(e.into()))? != 0 {
                        return Err(corrupt("a meta table without a format tag".into()));
                    }
                    let foreign = txn
                        .list_tables()
                        .map_err(|e| err(e.into()))?
                        .map(|t| t.name().to_owned())
                        .find(|name| {
                            !["meta", "snapshot"].contains(&name.as_str())
                                && parse_segment(name).is_none()
                        });
                    if let Some(name) = foreign {
                        return Err(corrupt(format!(
                            "not a gpumesh consensus store (it has a table {name:?})"
                        )));
                    }
                    meta.insert(KEY_FORMAT, FORMAT).map_err(|e| err(e.into()))?;
                    meta.insert(KEY_CLUSTER, cluster.0.to_le_bytes().as_slice())
                        .map_err(|e| err(e.into()))?;
                }
                Some(f) if f == FORMAT => {
                    // Written before the snapshot had a table of its own: move it.
                    let old = meta
                        .remove(KEY_SNAPSHOT)
                        .map_err(|e| err(e.into()))?
                        .map(|v| v.value().to_vec());
                    if let Some(old) = old {
                        snapshots
                            .insert(KEY_SNAPSHOT, old.as_slice())
                            .map_err(|e| err(e.into()))?;
                    }
                }
                Some(f) => {
                    return Err(corrupt(format!(
                        "unknown format tag {:?}",
                        String::from_utf8_lossy(&f)
                    )))
                }
            }
        }
        let in_log = segments(&txn).map_err(|e| err(e.into()))?;
        let has_old_log = txn
            .list_tables()
            .map_err(|e| err(e.into()))?
            .any(|t| t.name() == "log");
        txn.commit().map_err(|e| err(e.into()))?;

        let txn = db.begin_read().map_err(|e| err(e.into()))?;
        let meta = txn.open_table(META).map_err(|e| err(e.into()))?;
        let snapshots = txn.open_table(SNAPSHOT).map_err(|e| err(e.into()))?;
        let get = |key: &str| -> Result<Option<Vec<u8>>> {
            Ok(meta
                .get(key)
                .map_err(|e| err(e.into()))?
                .map(|v| v.value().to_vec()))
        };

        let found = get(KEY_CLUSTER)?.ok_or_else(|| corrupt("no cluster id".into()))?;
        let found =
            ClusterId(u64::from_le_bytes(found.as_slice().try_into().map_err(
                |_| corrupt(format!("cluster id of {} bytes", found.len())),
            )?));
        if found != cluster {
            return Err(ConsensusError::ClusterMismatch {
                path,
                expected: cluster,
                found,
            });
        }

        let hard_state = match get(KEY_HARD_STATE)? {
            Some(b) => {
                HardState::parse_from_bytes(&b).map_err(|e| corrupt(format!("hard state: {e}")))?
            }
            None => HardState::default(),
        };
        let snapshot_file = match get(KEY_SNAPSHOT_FILE)? {
            Some(b) => Some(u64::from_le_bytes(b.as_slice().try_into().map_err(
                |_| corrupt(format!("snapshot generation of {} bytes", b.len())),
            )?)),
            None => None,
        };
        let snapshot = match (snapshot_file, store.as_deref()) {
            (Some(generation), Some(file)) => crate::snapfile::read(file, generation, cluster)?,
            (Some(_), None) => {
                return Err(corrupt("an in-memory store with a snapshot file".into()))
            }
            (None, _) => {
                let stored = snapshots
                    .get(KEY_SNAPSHOT)
                    .map_err(|e| err(e.into()))?
                    .map(|v| v.value().to_vec());
                match stored {
                    Some(b) => Snapshot::parse_from_bytes(&b)
                        .map_err(|e| corrupt(format!("snapshot: {e}")))?,
                    None => Snapshot::default(),
                }
            }
        };
        let truncated = match get(KEY_TRUNCATED)? {
            Some(b) if b.len() == 16 => {
                let mut i = [0u8; 8];
                let mut t = [0u8; 8];
                i.copy_from_slice(&b[..8]);
                t.copy_from_slice(&b[8..]);
                (u64::from_le_bytes(i), u64::from_le_bytes(t))
            }
            Some(b) => return Err(corrupt(format!("truncation point of {} bytes", b.len()))),
            None => (0, 0),
        };
        if !snapshot.is_empty() {
            // The state machine inside must decode, or a restart would lose it.
            StateMachine::from_bytes(&snapshot.data)
                .map_err(|e| corrupt(format!("state machine in snapshot: {e}")))?;
        }

        let generation = match get(KEY_LOG_GENERATION)? {
            Some(b) => {
                Some(u64::from_le_bytes(b.as_slice().try_into().map_err(
                    |_| corrupt(format!("log generation of {} bytes", b.len())),
                )?))
            }
            None => None,
        };
        // A store from before the log file: its entries, from its tables.
        let mut legacy = Vec::new();
        if generation.is_none() {
            let mut expect = truncated.0 + 1;
            let from = segment_of(expect);
            let mut tables: Vec<String> = Vec::new();
            if has_old_log {
                tables.push("log".into());
            }
            tables.extend(in_log.into_iter().filter(|s| *s >= from).map(segment_name));
            for name in tables {
                let log = txn
                    .open_table(TableDefinition::<u64, &[u8]>::new(&name))
                    .map_err(|e| err(e.into()))?;
                for item in log.range(expect..).map_err(|e| err(e.into()))? {
                    let (k, v) = item.map_err(|e| err(e.into()))?;
                    let index = k.value();
                    if index != expect {
                        return Err(corrupt(format!(
                            "log has a gap: expected entry {expect}, found {index}"
                        )));
                    }
                    let entry = Entry::parse_from_bytes(v.value())
                        .map_err(|e| corrupt(format!("log entry {index}: {e}")))?;
                    if entry.index != index {
                        return Err(corrupt(format!(
                            "log entry stored at {index} says it is {}",
                            entry.index
                        )));
                    }
                    legacy.push(entry);
                    expect += 1;
                }
            }
        }
        drop(snapshots);
        drop(meta);
        drop(txn);

        let mut hard_state = hard_state;
        let mut entries = VecDeque::new();
        let wal = match (generation, store.as_deref()) {
            (Some(generation), Some(file)) => {
                let (wal, records) = Wal::open(file, generation, cluster)?;
                for record in records {
                    hard_state = record.hard_state;
                    replay(&mut entries, truncated.0, record.entries).map_err(|what| {
                        ConsensusError::CorruptStorage {
                            path: crate::wal::file_of(file, generation).display().to_string(),
                            what,
                        }
                    })?;
                }
                wal
            }
            (Some(_), None) => return Err(corrupt("an in-memory store with a log file".into())),
            (None, file) => {
                // New, or from before the log file: the log starts its first file,
                // and the store names it and drops its old log tables in one commit.
                let wal = Wal::create(file, 1, cluster, &hard_state, &legacy)?;
                let txn = db.begin_write().map_err(|e| err(e.into()))?;
                {
                    let mut meta = txn.open_table(META).map_err(|e| err(e.into()))?;
                    meta.insert(KEY_LOG_GENERATION, 1u64.to_le_bytes().as_slice())
                        .map_err(|e| err(e.into()))?;
                    if has_old_log {
                        txn.delete_table(OLD_LOG).map_err(|e| err(e.into()))?;
                    }
                    for s in segments(&txn).map_err(|e| err(e.into()))? {
                        drop_segment(&txn, s).map_err(|e| err(e.into()))?;
                    }
                }
                txn.commit().map_err(|e| err(e.into()))?;
                entries.extend(legacy);
                wal
            }
        };
        if let Some(file) = &store {
            wal.remove_others(file);
            crate::snapfile::remove_others(file, snapshot_file);
        }
        hard_state.commit = hard_state.commit.max(truncated.0);

        Ok(Self {
            db,
            path,
            store,
            wal,
            cluster,
            hard_state,
            snapshot,
            truncated,
            entry_bytes: entries.iter().map(entry_size).sum(),
            entries,
            snapshot_wanted: AtomicBool::new(false),
            fail_after: None,
            fail_snapshots: 0,
            writing: None,
        })
    }

    pub fn cluster_id(&self) -> ClusterId {
        self.cluster
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// Whether this storage holds a Raft state (initialised, or received from a mesh).
    pub fn is_initialized(&self) -> bool {
        !self.snapshot.is_empty() || !self.entries.is_empty()
    }

    /// Makes this storage the start of a new mesh whose founding voters are
    /// `founders` (raft id, peer id). Every founder must be initialised with the same
    /// list and settings: they then share the same first snapshot.
    pub fn initialize(
        &mut self,
        founders: &[(u64, String)],
        settings: ClusterSettings,
    ) -> Result<()> {
        if self.is_initialized() {
            return Err(ConsensusError::AlreadyInitialized {
                path: self.path.clone(),
            });
        }
        if founders.is_empty() {
            return Err(ConsensusError::Invalid(
                "a mesh needs at least one founder".into(),
            ));
        }
        let mut founders = founders.to_vec();
        founders.sort();
        founders.dedup_by_key(|f| f.0);
        let mut state = StateMachine::bootstrap(&founders, settings);
        // Index 1, term 1, as raft-rs's examples do: the founders start from the same
        // snapshot, and joiners catch up through a snapshot first.
        state.skip(1, 1);
        let mut snapshot = Snapshot {
            data: state.to_bytes()?.into(),
            ..Default::default()
        };
        let meta = snapshot.mut_metadata();
        meta.index = 1;
        meta.term = 1;
        meta.set_conf_state(ConfState::from((founders.iter().map(|f| f.0), Vec::new())));
        self.persist(Some(&snapshot), &[], None)
    }

    /// The state machine held by the latest snapshot (empty before init).
    pub fn snapshot_state(&self) -> Result<StateMachine> {
        if self.snapshot.is_empty() {
            return Ok(StateMachine::empty());
        }
        StateMachine::from_bytes(&self.snapshot.data).map_err(|e| ConsensusError::CorruptStorage {
            path: self.path.clone(),
            what: format!("state machine in snapshot: {e}"),
        })
    }

    pub fn snapshot_metadata(&self) -> &raft::eraftpb::SnapshotMetadata {
        self.snapshot.get_metadata()
    }

    pub fn hard_state(&self) -> &HardState {
        &self.hard_state
    }

    /// Index of the first entry still in the log.
    pub fn first(&self) -> u64 {
        self.truncated.0 + 1
    }

    /// The bytes of the commands in the log held in memory (what a snapshot and
    /// compaction would free, but for the entries kept behind it).
    pub fn log_bytes(&self) -> u64 {
        self.entry_bytes
    }

    /// The first index, at or after `from`, from which the entries up to `upto`
    /// hold at most `bytes` of commands (`upto + 1` if not even entry `upto` fits).
    pub fn keep_from(&self, from: u64, upto: u64, bytes: u64) -> u64 {
        let upto = upto.min(self.last());
        let mut first = upto + 1;
        let mut total = 0u64;
        let offset = self.truncated.0 + 1;
        for index in (from.max(offset)..=upto).rev() {
            total += self.entries[(index - offset) as usize].data.len() as u64;
            if total > bytes {
                break;
            }
            first = index;
        }
        first.max(from)
    }

    /// The entries held in the log up to index `upto`.
    pub fn held_entries(&self, upto: u64) -> impl Iterator<Item = &Entry> {
        let n = upto.saturating_sub(self.truncated.0) as usize;
        self.entries.iter().take(n)
    }

    /// Index of the last entry in the log (or of the snapshot if the log is empty).
    pub fn last(&self) -> u64 {
        self.truncated.0 + self.entries.len() as u64
    }

    /// Persists one Ready, in raft-rs's order (called by the replica; public for
    /// storage tests): a received snapshot, then new entries, then the hard state.
    /// Entries and hard state are one append to the log file; a snapshot starts the
    /// log file's next generation.
    pub fn persist(
        &mut self,
        snapshot: Option<&Snapshot>,
        entries: &[Entry],
        hard_state: Option<&HardState>,
    ) -> Result<()> {
        // Only the commit index moved: it waits for the next write instead of costing
        // an fsync of its own (see `set_commit`: after a crash Raft learns it again).
        if snapshot.is_none_or(|s| s.is_empty()) && entries.is_empty() {
            match hard_state {
                None => return Ok(()),
                Some(hs) if hs.term == self.hard_state.term && hs.vote == self.hard_state.vote => {
                    self.set_commit(hs.commit);
                    return Ok(());
                }
                Some(_) => {}
            }
        }
        self.count_write()?;
        let mut next_hs = self.hard_state.clone();
        let mut truncated = self.truncated;
        let snapshot = snapshot.filter(|s| !s.is_empty());
        if let Some(snap) = snapshot {
            let md = snap.get_metadata();
            truncated = (md.index, md.term);
            next_hs.term = next_hs.term.max(md.term);
            next_hs.commit = next_hs.commit.max(md.index);
        }
        if let Some(hs) = hard_state {
            next_hs = hs.clone();
        }
        if let Some(first) = entries.first() {
            // A snapshot replaces the whole log (raft-rs restarts from it).
            let last_before = if snapshot.is_some() {
                truncated.0
            } else {
                self.last()
            };
            if first.index <= truncated.0 || first.index > last_before + 1 {
                return Err(ConsensusError::Storage {
                    path: self.path.clone(),
                    reason: format!(
                        "append at {} does not fit the log ({}..={last_before})",
                        first.index,
                        truncated.0 + 1
                    ),
                });
            }
        }
        match snapshot {
            Some(snap) => {
                self.start_generation(Some(snap), truncated, &next_hs, entries)?;
                self.entries.clear();
                self.entry_bytes = 0;
                self.snapshot = snap.clone();
                self.truncated = truncated;
            }
            None => {
                // New entries overwrite any conflicting suffix (so they do on replay).
                self.wal.append(&next_hs, entries)?;
                if let (Some(w), Some(first)) = (&mut self.writing, entries.first()) {
                    w.rewritten_from = w.rewritten_from.min(first.index);
                }
            }
        }

        // Durable: now mirror it in memory.
        if let Some(first) = entries.first() {
            let keep = (first.index - self.truncated.0 - 1) as usize;
            let cut: u64 = self
                .entries
                .range(keep.min(self.entries.len())..)
                .map(entry_size)
                .sum();
            self.entries.truncate(keep);
            self.entries.extend(entries.iter().cloned());
            self.entry_bytes = self.entry_bytes - cut + entries.iter().map(entry_size).sum::<u64>();
        }
        self.hard_state = next_hs;
        tracing::trace!(
            path = %self.path,
            appended = ?entries.first().map(|e| (e.index, entries.len())),
            snapshot = ?snapshot.map(|s| s.get_metadata().index),
            first = self.first(),
            last = self.last(),
            "persisted"
        );
        Ok(())
    }

    /// Starts the next generation of the log file holding `kept` (the entries after
    /// the truncation point) and `hard_state`, and of the snapshot's file (if a new
    /// one), then names them in the store (see [`Self::name_generation`]).
    fn start_generation(
        &mut self,
        snapshot: Option<&Snapshot>,
        truncated: (u64, u64),
        hard_state: &HardState,
        kept: &[Entry],
    ) -> Result<()> {
        // Files of ours still being written would be of the same generation.
        drop(self.writing.take());
        let generation = self.wal.generation() + 1;
        let wal = Wal::create(
            self.store.as_deref(),
            generation,
            self.cluster,
            hard_state,
            kept,
        )?;
        let in_file = match (snapshot, self.store.as_deref()) {
            (Some(snap), Some(file)) => {
                crate::snapfile::write(file, generation, self.cluster, snap)?;
                true
            }
            _ => false,
        };
        self.name_generation(snapshot, truncated, hard_state, wal, in_file)
    }

    /// Names `wal`'s generation in the store as the log, with the truncation point
    /// and `snapshot` (in its file of the same generation if `in_file`), in one
    /// commit; the old files go after. A crash before the commit leaves the old
    /// generation named, whole.
    fn name_generation(
        &mut self,
        snapshot: Option<&Snapshot>,
        truncated: (u64, u64),
        hard_state: &HardState,
        wal: Wal,
        in_file: bool,
    ) -> Result<()> {
        let generation = wal.generation();
        let in_file = in_file.then_some(generation);
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        {
            let mut meta = txn.open_table(META).map_err(|e| self.err(e))?;
            if let Some(snap) = snapshot {
                let mut table = txn.open_table(SNAPSHOT).map_err(|e| self.err(e))?;
                match in_file {
                    Some(generation) => {
                        meta.insert(KEY_SNAPSHOT_FILE, generation.to_le_bytes().as_slice())
                            .map_err(|e| self.err(e))?;
                        // One from before the snapshot had a file of its own.
                        table.remove(KEY_SNAPSHOT).map_err(|e| self.err(e))?;
                    }
                    None => {
                        table
                            .insert(KEY_SNAPSHOT, snap.write_to_bytes()?.as_slice())
                            .map_err(|e| self.err(e))?;
                    }
                }
            }
            meta.insert(KEY_HARD_STATE, hard_state.write_to_bytes()?.as_slice())
                .map_err(|e| self.err(e))?;
            meta.insert(KEY_TRUNCATED, truncation_bytes(truncated).as_slice())
                .map_err(|e| self.err(e))?;
            meta.insert(KEY_LOG_GENERATION, generation.to_le_bytes().as_slice())
                .map_err(|e| self.err(e))?;
        }
        txn.commit().map_err(|e| self.err(e))?;
        if let Some(file) = &self.store {
            wal.remove_others(file);
            if in_file.is_some() {
                crate::snapfile::remove_others(file, in_file);
            }
        }
        let old = std::mem::replace(&mut self.wal, wal);
        // Closing the old file frees its blocks (8-10 ms for a log of ~45k entries
        // here), and its zeros may still be in flight: neither on this thread.
        let _ = off_task(move || drop(old));
        Ok(())
    }

    /// Records a newer commit index in memory; it reaches the disk with the next
    /// write. Losing it in a crash is harmless: Raft learns it again from the leader,
    /// and snapshots (the only thing the applied state depends on) persist their own.
    pub fn set_commit(&mut self, commit: u64) {
        self.hard_state.commit = self.hard_state.commit.max(commit);
    }

    /// Stores a snapshot the local state machine produced at `snapshot`'s index and
    /// drops log entries before `compact_to` (at most the snapshot index + 1): the
    /// entries kept start the log file's next generation. Waits for the snapshot's
    /// file; [`Self::begin_compaction`] does not.
    pub fn compact(&mut self, snapshot: Snapshot, compact_to: u64) -> Result<()> {
        let meta = snapshot.get_metadata().clone();
        self.begin_compaction(meta, move || Ok(snapshot.data.to_vec()), compact_to)?;
        match self.finish_compaction()? {
            Compaction::Done => Ok(()),
            Compaction::NotWritten(e) => Err(e),
        }
    }

    /// Starts [`Self::compact`] of the snapshot at `meta` whose state `encode`
    /// makes: the encoding, the snapshot's file and the log's next generation (the
    /// entries from `compact_to` on, as they are now) are done on a thread of
    /// their own while the replica goes on (in line, a snapshot of 10,000 finished
    /// tasks, 8.6 MB, held its Raft task 18-67 ms encoding, 43-52 writing its file
    /// and 19-26 the log's next generation); the receiver fires once they are
    /// written, and [`Self::finish_compaction`] then appends what came since and
    /// names them. Until then the store serves its previous snapshot, and a
    /// snapshot received meanwhile replaces this one (waiting for its thread
    /// first). `None`: nothing to wait for (the in-memory backend compacts at once).
    pub fn begin_compaction(
        &mut self,
        meta: SnapshotMetadata,
        encode: impl FnOnce() -> Result<Vec<u8>> + Send + 'static,
        compact_to: u64,
    ) -> Result<Option<tokio::sync::oneshot::Receiver<()>>> {
        self.count_write()?;
        drop(self.writing.take());
        let index = meta.index;
        let compact_to = compact_to.min(index + 1).min(self.last() + 1);
        let mut truncated = self.truncated;
        if compact_to > self.first() {
            let t = self
                .term_of(compact_to - 1)
                .ok_or_else(|| ConsensusError::Storage {
                    path: self.path.clone(),
                    reason: format!("no term for entry {}", compact_to - 1),
                })?;
            truncated = (compact_to - 1, t);
        }
        let mut hard_state = self.hard_state.clone();
        hard_state.commit = hard_state.commit.max(index);
        let dropped = (truncated.0 - self.truncated.0) as usize;
        let kept: Vec<Entry> = self.entries.range(dropped..).cloned().collect();
        let snapshot = move || -> Result<Snapshot> {
            let mut snapshot = Snapshot {
                data: encode()?.into(),
                ..Default::default()
            };
            snapshot.set_metadata(meta);
            Ok(snapshot)
        };
        let Some(store) = self.store.clone() else {
            let snapshot = snapshot()?;
            self.start_generation(Some(&snapshot), truncated, &hard_state, &kept)?;
            self.compacted(snapshot, truncated, hard_state);
            return Ok(None);
        };
        let (generation, cluster) = (self.wal.generation() + 1, self.cluster);
        let (done, wait) = tokio::sync::oneshot::channel();
        let (tx, written) = std::sync::mpsc::sync_channel(1);
        let fail = self.fail_snapshots > 0;
        self.fail_snapshots = self.fail_snapshots.saturating_sub(1);
        let path = self.path.clone();
        off_task(move || {
            let made = snapshot().and_then(|snap| {
                if fail {
                    return Err(ConsensusError::Storage {
                        path,
                        reason: "no room for the snapshot's file (injected)".into(),
                    });
                }
                crate::snapfile::write(&store, generation, cluster, &snap)?;
                let wal = Wal::create(Some(&store), generation, cluster, &hard_state, &kept)?;
                Ok((snap, wal))
            });
            let _ = tx.send(made);
            let _ = done.send(());
        })
        .map_err(|e| ConsensusError::Storage {
            path: self.path.clone(),
            reason: format!("cannot start the thread writing a snapshot: {e}"),
        })?;
        self.writing = Some(SnapshotWrite {
            generation,
            index,
            truncated,
            last: self.last(),
            rewritten_from: u64::MAX,
            written: Some(written),
        });
        Ok(Some(wait))
    }

    /// Ends what [`Self::begin_compaction`] started: waits for its files (at once if
    /// the receiver fired), appends to the next generation what the log took since
    /// (one append and `fdatasync`, as any), names the generation and the snapshot in
    /// the store and drops the entries before it. Nothing to do if none is in
    /// flight, or a received snapshot replaced it.
    pub fn finish_compaction(&mut self) -> Result<Compaction> {
        let Some(mut write) = self.writing.take() else {
            return Ok(Compaction::Done);
        };
        let (snapshot, mut wal) = match write.join(&self.path) {
            Ok(made) => made,
            Err(e) => {
                // Unnamed, the files are not read again: the store still names the
                // generation before. Removed now rather than with the next one, to
                // give back the room they took.
                if let Some(store) = &self.store {
                    let _ = std::fs::remove_file(crate::snapfile::file_of(store, write.generation));
                    let _ = std::fs::remove_file(crate::wal::file_of(store, write.generation));
                }
                return Ok(Compaction::NotWritten(e));
            }
        };
        let truncated = write.truncated;
        let mut hard_state = self.hard_state.clone();
        hard_state.commit = hard_state.commit.max(write.index);
        let from = write.rewritten_from.min(write.last + 1);
        if from <= truncated.0 {
            // Committed entries never change; were one to, start over in line.
            let dropped = (truncated.0 - self.truncated.0) as usize;
            let kept: Vec<Entry> = self.entries.range(dropped..).cloned().collect();
            drop(wal);
            self.start_generation(Some(&snapshot), truncated, &hard_state, &kept)?;
        } else {
            let since: Vec<Entry> = self
                .entries
                .range(((from - self.truncated.0 - 1) as usize).min(self.entries.len())..)
                .cloned()
                .collect();
            wal.append(&hard_state, &since)?;
            self.name_generation(Some(&snapshot), truncated, &hard_state, wal, true)?;
        }
        self.compacted(snapshot, truncated, hard_state);
        Ok(Compaction::Done)
    }

    /// After a compaction's generation is named: the entries up to `truncated` go
    /// from memory, and `snapshot` is the one served. What goes is freed off this
    /// thread: some 45,000 entries and an 8.6 MB snapshot took 12-20 ms to free.
    fn compacted(&mut self, snapshot: Snapshot, truncated: (u64, u64), hard_state: HardState) {
        let dropped = (truncated.0 - self.truncated.0) as usize;
        let kept = self.entries.split_off(dropped.min(self.entries.len()));
        self.entry_bytes = kept.iter().map(entry_size).sum();
        let gone = std::mem::replace(&mut self.entries, kept);
        let old = std::mem::replace(&mut self.snapshot, snapshot);
        if gone.len() > 1024 {
            let _ = off_task(move || drop((gone, old)));
        }
        self.truncated = truncated;
        self.hard_state = hard_state;
    }

    /// Whether a snapshot's file is being written (see [`Self::begin_compaction`]).
    pub fn compacting(&self) -> bool {
        self.writing.is_some()
    }

    /// Fault injection for crash tests: after `writes` more successful writes,
    /// every write fails (before touching the disk), which stops the replica in the
    /// middle of a Ready, as a crash there would.
    #[doc(hidden)]
    pub fn fail_after_writes(&mut self, writes: u64) {
        self.fail_after = Some(writes);
    }

    /// Fault injection: the files of the next `snapshots` snapshots of our own
    /// fail to be written, as on a disk with no room for them (the log's appends
    /// still succeed).
    #[doc(hidden)]
    pub fn fail_snapshot_writes(&mut self, snapshots: u64) {
        self.fail_snapshots = snapshots;
    }

    fn count_write(&mut self) -> Result<()> {
        match &mut self.fail_after {
            Some(0) => Err(ConsensusError::Storage {
                path: self.path.clone(),
                reason: "injected failure (crash test)".into(),
            }),
            Some(n) => {
                *n -= 1;
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Whether Raft asked for a snapshot newer than the stored one since last asked.
    pub fn take_snapshot_request(&self) -> bool {
        self.snapshot_wanted.swap(false, Ordering::Relaxed)
    }

    fn term_of(&self, idx: u64) -> Option<u64> {
        if idx == self.truncated.0 {
            return Some(self.truncated.1);
        }
        if idx < self.truncated.0 || idx > self.last() {
            return None;
        }
        self.entries
            .get((idx - self.truncated.0 - 1) as usize)
            .map(|e| e.term)
    }

    fn err(&self, e: impl Into<redb::Error>) -> ConsensusError {
        db_err(&self.path, e.into())
    }
}

/// Puts a run of entries read back from the log file into `entries` (the log after
/// `truncated`): entries at or before the truncation point are behind a snapshot
/// already; the rest replace whatever the log held from the run's first index on.
fn replay(
    entries: &mut VecDeque<Entry>,
    truncated: u64,
    run: Vec<Entry>,
) -> std::result::Result<(), String> {
    let last = truncated + entries.len() as u64;
    let mut run = run.into_iter().filter(|e| e.index > truncated).peekable();
    let Some(first) = run.peek().map(|e| e.index) else {
        return Ok(());
    };
    if first > last + 1 {
        return Err(format!(
            "log has a gap: expected entry {} at most, found {first}",
            last + 1
        ));
    }
    entries.truncate((first - truncated - 1) as usize);
    for (expect, entry) in (first..).zip(run) {
        if entry.index != expect {
            return Err(format!(
                "log entry {} where {expect} was expected",
                entry.index
            ));
        }
        entries.push_back(entry);
    }
    Ok(())
}

fn entry_size(e: &Entry) -> u64 {
    (e.data.len() + e.context.len()) as u64
}

fn truncation_bytes((index, term): (u64, u64)) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&index.to_le_bytes());
    b[8..].copy_from_slice(&term.to_le_bytes());
    b
}

fn db_err(path: &str, e: impl Into<redb::Error>) -> ConsensusError {
    match e.into() {
        redb::Error::Corrupted(what) => ConsensusError::CorruptStorage {
            path: path.to_owned(),
            what,
        },
        redb::Error::DatabaseAlreadyOpen => ConsensusError::Storage {
            path: path.to_owned(),
            reason: "already open (is another gpumesh node using this data directory?)".into(),
        },
        redb::Error::Io(io) if io.kind() == std::io::ErrorKind::InvalidData => {
            ConsensusError::CorruptStorage {
                path: path.to_owned(),
                what: io.to_string(),
            }
        }
        other => ConsensusError::Storage {
            path: path.to_owned(),
            reason: other.to_string(),
        },
    }
}

impl Storage for RedbStorage {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState::new(
            self.hard_state.clone(),
            self.snapshot.get_metadata().get_conf_state().clone(),
        ))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        if low <= self.truncated.0 {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last() + 1 || low > high {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let offset = self.truncated.0 + 1;
        let mut out: Vec<Entry> = self
            .entries
            .range((low - offset) as usize..(high - offset) as usize)
            .cloned()
            .collect();
        raft::util::limit_size(&mut out, max_size.into());
        Ok(out)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        if idx < self.truncated.0 {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        self.term_of(idx)
            .ok_or(raft::Error::Store(StorageError::Unavailable))
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.first())
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last())
    }

    fn snapshot(&self, request_index: u64, to: u64) -> raft::Result<Snapshot> {
        let meta = self.snapshot.get_metadata();
        let cs = meta.get_conf_state();
        // raft-rs refuses a snapshot whose conf state lacks the receiver (a learner
        // added after it was taken): ask the actor for a fresh one instead.
        let knows_receiver = cs.voters.contains(&to) || cs.learners.contains(&to);
        if !self.snapshot.is_empty() && meta.index >= request_index && knows_receiver {
            return Ok(self.snapshot.clone());
        }
        self.snapshot_wanted.store(true, Ordering::Relaxed);
        Err(raft::Error::Store(
            StorageError::SnapshotTemporarilyUnavailable,
        ))
    }
}
