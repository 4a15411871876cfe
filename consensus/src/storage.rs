//! Durable Raft storage on redb: log entries, hard state, the latest snapshot (with
//! the state machine inside), all committed with fsync before Raft may act on them.
//!
//! Layout: table `meta` (format tag, cluster id, hard state, truncation point),
//! table `snapshot` (the latest snapshot alone) and the log in segments of
//! [`SEGMENT`] entries, a table each (`log.<n>`: index → protobuf `Entry`). The
//! snapshot has a table of its own because redb copies a B-tree leaf on every write
//! to it: beside the hard state, which every Ready rewrites, a snapshot of megabytes
//! would be copied and written again with each append. The log is in segments
//! because compaction then drops whole tables: deleting 9,000 entries one key at a
//! time took redb ~125 ms on the Raft thread, dropping their tables ~7 ms. Entries
//! at or below the truncation point may stay in the segment that holds it until
//! that whole segment is behind; nothing reads them. The unsnapshotted tail of the
//! log is also kept in memory, so raft-rs's frequent `term`/`entries` calls never
//! touch the disk; memory stays bounded because the log is compacted after every
//! snapshot.
//!
//! The applied index is not stored: on restart the state machine is rebuilt from the
//! snapshot and the committed entries after it are replayed (raft-rs hands them over
//! in the first Ready), so the conf state kept here is the snapshot's.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use protobuf::Message as _;
use raft::eraftpb::{ConfState, Entry, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};
use redb::backends::InMemoryBackend;
use redb::{Database, ReadableTable, ReadableTableMetadata, TableDefinition, TableHandle};

use crate::cluster::ClusterId;
use crate::error::{ConsensusError, Result};
use crate::state::{ClusterSettings, StateMachine};

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

/// Log entries per segment table.
pub const SEGMENT: u64 = 1024;

fn segment_of(index: u64) -> u64 {
    index / SEGMENT
}

fn segment_name(segment: u64) -> String {
    format!("log.{segment:012}")
}

type Segment<'txn> = redb::Table<'txn, u64, &'static [u8]>;

/// Opens (creating it if new) the table of log segment `segment`.
fn open_segment(
    txn: &redb::WriteTransaction,
    segment: u64,
) -> std::result::Result<Segment<'_>, redb::TableError> {
    txn.open_table(TableDefinition::new(&segment_name(segment)))
}

/// Deletes the table of log segment `segment` (nothing if there is none).
fn drop_segment(
    txn: &redb::WriteTransaction,
    segment: u64,
) -> std::result::Result<bool, redb::TableError> {
    txn.delete_table(TableDefinition::<u64, &[u8]>::new(&segment_name(segment)))
}

/// Writes log entries `(index, bytes)`, in index order, each into its segment;
/// `err` says which store failed.
fn write_log(
    txn: &redb::WriteTransaction,
    entries: impl IntoIterator<Item = (u64, Vec<u8>)>,
    err: impl Fn(redb::Error) -> ConsensusError,
) -> Result<()> {
    let mut open: Option<(u64, Segment<'_>)> = None;
    for (index, bytes) in entries {
        let s = segment_of(index);
        let table = match &mut open {
            Some((n, t)) if *n == s => t,
            _ => {
                open = None;
                let table = open_segment(txn, s).map_err(|e| err(e.into()))?;
                &mut open.insert((s, table)).1
            }
        };
        table
            .insert(index, bytes.as_slice())
            .map_err(|e| err(e.into()))?;
    }
    Ok(())
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
        Self::load(db, path_text, cluster)
    }

    /// Storage in memory (redb's in-memory backend): for tests and benchmarks only.
    pub fn in_memory(cluster: ClusterId) -> Result<Self> {
        let path = "<memory>".to_string();
        let db = Database::builder()
            .create_with_backend(InMemoryBackend::new())
            .map_err(|e| db_err(&path, e))?;
        Self::load(db, path, cluster)
    }

    fn load(db: Database, path: String, cluster: ClusterId) -> Result<Self> {
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
                    // Written before the log had segments: move its entries.
                    let has_old_log = txn
                        .list_tables()
                        .map_err(|e| err(e.into()))?
                        .any(|t| t.name() == "log");
                    if has_old_log {
                        let mut moved = Vec::new();
                        for item in txn
                            .open_table(OLD_LOG)
                            .map_err(|e| err(e.into()))?
                            .iter()
                            .map_err(|e| err(e.into()))?
                        {
                            let (k, v) = item.map_err(|e| err(e.into()))?;
                            moved.push((k.value(), v.value().to_vec()));
                        }
                        write_log(&txn, moved, err)?;
                        txn.delete_table(OLD_LOG).map_err(|e| err(e.into()))?;
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
        let stored = snapshots
            .get(KEY_SNAPSHOT)
            .map_err(|e| err(e.into()))?
            .map(|v| v.value().to_vec());
        let snapshot = match stored {
            Some(b) => {
                Snapshot::parse_from_bytes(&b).map_err(|e| corrupt(format!("snapshot: {e}")))?
            }
            None => Snapshot::default(),
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

        let mut entries = VecDeque::new();
        let mut expect = truncated.0 + 1;
        let from = segment_of(expect);
        for s in in_log.into_iter().filter(|s| *s >= from) {
            let log = txn
                .open_table(TableDefinition::<u64, &[u8]>::new(&segment_name(s)))
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
                entries.push_back(entry);
                expect += 1;
            }
        }
        drop(snapshots);
        drop(meta);
        drop(txn);

        Ok(Self {
            db,
            path,
            cluster,
            hard_state,
            snapshot,
            truncated,
            entry_bytes: entries.iter().map(entry_size).sum(),
            entries,
            snapshot_wanted: AtomicBool::new(false),
            fail_after: None,
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

    /// Index of the last entry in the log (or of the snapshot if the log is empty).
    pub fn last(&self) -> u64 {
        self.truncated.0 + self.entries.len() as u64
    }

    /// Persists one Ready in a single durable write transaction, in raft-rs's order
    /// (called by the replica; public for storage tests):
    /// a received snapshot, then new entries, then the hard state.
    pub fn persist(
        &mut self,
        snapshot: Option<&Snapshot>,
        entries: &[Entry],
        hard_state: Option<&HardState>,
    ) -> Result<()> {
        // Only the commit index moved: it waits for the next write instead of costing
        // an fsync of its own (see `set_commit`: after a crash Raft learns it again).
        if snapshot.is_none_or(|s| s.is_empty()) && entries.is_empty() {
            if let Some(hs) = hard_state {
                if hs.term == self.hard_state.term && hs.vote == self.hard_state.vote {
                    self.set_commit(hs.commit);
                    return Ok(());
                }
            }
        }
        self.count_write()?;
        let mut next = NextState {
            hard_state: self.hard_state.clone(),
            snapshot: None,
            truncated: self.truncated,
        };
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        {
            let mut meta = txn.open_table(META).map_err(|e| self.err(e))?;
            let mut clear_from = None;
            if let Some(snap) = snapshot.filter(|s| !s.is_empty()) {
                let md = snap.get_metadata();
                // A snapshot replaces the whole log (raft-rs restarts from it).
                for s in segments(&txn).map_err(|e| self.err(e))? {
                    drop_segment(&txn, s).map_err(|e| self.err(e))?;
                }
                clear_from = Some(0);
                next.truncated = (md.index, md.term);
                next.hard_state.term = next.hard_state.term.max(md.term);
                next.hard_state.commit = next.hard_state.commit.max(md.index);
                txn.open_table(SNAPSHOT)
                    .map_err(|e| self.err(e))?
                    .insert(KEY_SNAPSHOT, snap.write_to_bytes()?.as_slice())
                    .map_err(|e| self.err(e))?;
                next.snapshot = Some(snap.clone());
            }
            if let Some(first) = entries.first() {
                let last_before = if clear_from.is_some() {
                    next.truncated.0
                } else {
                    self.last()
                };
                if first.index <= next.truncated.0 || first.index > last_before + 1 {
                    return Err(ConsensusError::Storage {
                        path: self.path.clone(),
                        reason: format!(
                            "append at {} does not fit the log ({}..={last_before})",
                            first.index,
                            next.truncated.0 + 1
                        ),
                    });
                }
                // New entries overwrite any conflicting suffix.
                if first.index <= last_before {
                    let from = segment_of(first.index);
                    open_segment(&txn, from)
                        .map_err(|e| self.err(e))?
                        .retain_in(first.index.., |_, _| false)
                        .map_err(|e| self.err(e))?;
                    for s in from + 1..=segment_of(last_before) {
                        drop_segment(&txn, s).map_err(|e| self.err(e))?;
                    }
                }
                self.append(&txn, entries)?;
            }
            if let Some(hs) = hard_state {
                next.hard_state = hs.clone();
            }
            meta.insert(KEY_HARD_STATE, next.hard_state.write_to_bytes()?.as_slice())
                .map_err(|e| self.err(e))?;
            meta.insert(KEY_TRUNCATED, truncation_bytes(next.truncated).as_slice())
                .map_err(|e| self.err(e))?;
        }
        txn.commit().map_err(|e| self.err(e))?;

        // Durable: now mirror it in memory.
        if let Some(snap) = next.snapshot {
            self.entries.clear();
            self.entry_bytes = 0;
            self.snapshot = snap;
        }
        self.truncated = next.truncated;
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
        self.hard_state = next.hard_state;
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

    /// Records a newer commit index in memory; it reaches the disk with the next
    /// write. Losing it in a crash is harmless: Raft learns it again from the leader,
    /// and snapshots (the only thing the applied state depends on) persist their own.
    pub fn set_commit(&mut self, commit: u64) {
        self.hard_state.commit = self.hard_state.commit.max(commit);
    }

    /// Stores a snapshot the local state machine produced at `snapshot`'s index and
    /// drops log entries before `compact_to` (at most the snapshot index + 1), in one
    /// durable transaction.
    pub fn compact(&mut self, snapshot: Snapshot, compact_to: u64) -> Result<()> {
        self.count_write()?;
        let index = snapshot.get_metadata().index;
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
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        {
            let mut meta = txn.open_table(META).map_err(|e| self.err(e))?;
            // Whole segments behind the new truncation point go; the one holding it
            // stays (its entries up to the point are never read again).
            for s in segment_of(self.truncated.0 + 1)..segment_of(truncated.0 + 1) {
                drop_segment(&txn, s).map_err(|e| self.err(e))?;
            }
            txn.open_table(SNAPSHOT)
                .map_err(|e| self.err(e))?
                .insert(KEY_SNAPSHOT, snapshot.write_to_bytes()?.as_slice())
                .map_err(|e| self.err(e))?;
            meta.insert(KEY_TRUNCATED, truncation_bytes(truncated).as_slice())
                .map_err(|e| self.err(e))?;
            meta.insert(KEY_HARD_STATE, hard_state.write_to_bytes()?.as_slice())
                .map_err(|e| self.err(e))?;
        }
        txn.commit().map_err(|e| self.err(e))?;
        let dropped = (truncated.0 - self.truncated.0) as usize;
        let gone: u64 = self.entries.drain(..dropped).map(|e| entry_size(&e)).sum();
        self.entry_bytes -= gone;
        self.truncated = truncated;
        self.snapshot = snapshot;
        self.hard_state = hard_state;
        Ok(())
    }

    /// Fault injection for crash tests: after `writes` more successful writes,
    /// every write fails (before touching the disk), which stops the replica in the
    /// middle of a Ready, as a crash there would.
    #[doc(hidden)]
    pub fn fail_after_writes(&mut self, writes: u64) {
        self.fail_after = Some(writes);
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

    /// Appends `entries` (in order) to the segments they belong in.
    fn append(&self, txn: &redb::WriteTransaction, entries: &[Entry]) -> Result<()> {
        let encoded = entries
            .iter()
            .map(|e| Ok((e.index, e.write_to_bytes()?)))
            .collect::<Result<Vec<_>>>()?;
        write_log(txn, encoded, |e| self.err(e))
    }

    fn err(&self, e: impl Into<redb::Error>) -> ConsensusError {
        db_err(&self.path, e.into())
    }
}

struct NextState {
    hard_state: HardState,
    snapshot: Option<Snapshot>,
    truncated: (u64, u64),
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
