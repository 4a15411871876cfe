//! Small blobs packed one after another in one file of the store, so that keeping
//! one durably is a write into space the file already has and one `fdatasync`.
//!
//! A blob in a file of its own costs a file made, written and fsync'd, a rename and
//! the directory's fsync: two journal commits on top of the data, 0.5 ms and more on
//! this project's test machines for a few KiB. The result of a task and its second
//! copy are kept that way before the task is recorded, so small blobs' cost is on
//! the path of every task whose result is too big for its log entry.
//!
//! The file (`small.pack`) is a header (magic) then records `[u64 length][32-byte
//! id][bytes]`, then zeros: a length of 0 ends it. Zeros are written ahead of the
//! end in growing stretches (to [`ZERO_AHEAD`]), on a thread of their own while the
//! last stretch has room (only a record that finds none has them written with it,
//! see [`gpumesh_consensus::zeros`]), so an append's sync never has new blocks or a
//! new length to record. Appends are written one at a time, in order; each then
//! syncs on its own (syncs of appends made at once overlap), and a blob is found
//! here only once its sync is done. So an append acknowledged (its sync returned)
//! had every earlier record synced with it, and a crash can only cut records that
//! nobody was told are kept. The one exception is a result carried in the Raft log
//! ([`Pack::append_unsynced`]): found at once, it is durable in the log until the
//! replica syncs the pack, before the log may drop it. On opening, every record is
//! checked against its id: one whose bytes do not (a write a crash cut short, or
//! damage since) is skipped and not served, and the records after it are read on; a
//! head that cannot be one (a length over [`PACK_MAX`] or past the file's end) ends
//! the pack, and what follows is zeroed.

//!
//! Blobs nothing needs any more are removed ([`Pack::remove_unused`], called by the
//! blob sweeper): no longer found, their records stay in the file, dead, until a
//! compaction ([`Pack::compact`]) copies the live records into a new file and
//! renames it over the pack. Before that, a few seconds after it died, a dead
//! record is erased from its id on, a hole punched in the file (or zeros written)
//! ([`Pack::erase_dead`], on the sweeper's next round), so a removed blob's bytes (a forgotten task's result)
//! leave the disk, and a node started again finds the record erased (an id of
//! zeros) rather than the blob. Only a record that died in the seconds before a
//! crash is found again: nothing names it, and the next sweep removes it again.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use gpumesh_consensus::{write_paced, ZerosAhead};
use gpumesh_protocol::BlobId;

const MAGIC: &[u8; 16] = b"gpumesh-blobpak1";
const HEADER: u64 = MAGIC.len() as u64;
/// Length and id in front of each record's bytes.
const RECORD_HEAD: u64 = LEN_BYTES + 32;
/// The length at the head of a record.
const LEN_BYTES: u64 = 8;
/// Blobs of at most this many bytes are packed; larger ones get a file each. At
/// 256 KiB (data format 6) a task's 256 KiB result took 1.65-2.1 ms to keep here
/// and on a second node, and 1.24-1.43 ms packed (`gpumesh bench mesh --result-kib
/// 256`, five pairs). A larger limit would make a record written under the tail's
/// lock hold the appends behind it longer. 4 MiB and a little: a shard's result of
/// 4 MiB is that and the few bytes that say where it goes.
pub const PACK_MAX: u64 = (4 << 20) + 4096;
/// The largest stretch of zeros written ahead at once; the first ones are smaller
/// (each the size of the pack so far), so a store holding a few blobs stays small.
const ZERO_AHEAD: u64 = 4 << 20;
const FIRST_ZEROS: u64 = 64 << 10;
/// Dead records are overwritten this many bytes at a time where no hole is punched.
const ERASE_STEP: u64 = 256 << 10;
/// A compaction writes the records it keeps this many bytes at a time.
const COPY_BATCH: usize = 1 << 20;
/// The file a compaction replaced is given back this many bytes at a time.
const RETIRE_STEP: u64 = 4 << 20;
/// A compaction copies the records appended while it ran in rounds of its own
/// while there are at least this many bytes of them, before the last step (which
/// holds appends back) copies the rest.
const CATCH_UP: u64 = 256 << 10;

/// Where a packed blob's bytes are in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub at: u64,
    pub len: u64,
}

/// See the module docs.
#[derive(Debug)]
pub struct Pack {
    path: PathBuf,
    /// The file and where each blob is in it, under one lock: a compaction swaps
    /// both at once, so no reader takes a slot of one file to the other.
    state: RwLock<State>,
    /// Where the next record goes, and how far the file is zeroed; held while a
    /// record is written, so records are written one at a time and in order, and
    /// while a compaction finishes, so none is written to the file it replaces.
    tail: Mutex<Tail>,
    /// Held by a compaction from start to end: one at a time.
    compacting: Mutex<()>,
}

#[derive(Debug)]
struct State {
    /// `None` until the first append makes the file.
    file: Option<Arc<File>>,
    /// Which file this is: each compaction makes the next.
    generation: u64,
    index: HashMap<BlobId, Entry>,
    /// Records in the file that are not found (removed, damaged, written twice),
    /// by where their bytes start: what a compaction leaves out.
    dead: HashSet<u64>,
    /// Their bytes, heads included.
    dead_bytes: u64,
    /// Dead records of the current file whose bytes are still there, and since
    /// when they are dead: [`Pack::erase_dead`] overwrites them.
    erase: Vec<(Slot, Instant)>,
}

#[derive(Debug)]
struct Entry {
    slot: Slot,
    /// When the blob was last written or looked for (milliseconds since the epoch).
    used: AtomicU64,
}

impl Entry {
    fn new(slot: Slot) -> Entry {
        Entry {
            slot,
            used: AtomicU64::new(millis(SystemTime::now())),
        }
    }

    fn mark_used(&self) {
        self.used
            .store(millis(SystemTime::now()), Ordering::Relaxed);
    }
}

fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[derive(Debug)]
struct Tail {
    end: u64,
    zeros: ZerosAhead,
}

/// A record written and not yet found (see [`Pack::write_record`]).
struct Written {
    id: BlobId,
    slot: Slot,
    /// The file it is in, and that file's generation.
    file: Arc<File>,
    generation: u64,
}

/// What [`Pack::remove_unused`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removed {
    /// No longer found; its record (`len` bytes and a head) is dead until a
    /// compaction.
    Yes(u64),
    /// Kept: written or looked for since the cutoff.
    InUse,
    /// Not packed here.
    Absent,
}

/// What a compaction did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Compacted {
    /// The file's length (records and zeros ahead) before and after.
    pub before: u64,
    pub after: u64,
    /// Records copied into the new file, and records left out.
    pub kept: u64,
    pub dropped: u64,
}

/// The name a compaction writes the next file under, beside the pack, until it is
/// whole and renamed over the pack (a leftover is removed at opening).
fn compact_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".compact.tmp");
    PathBuf::from(name)
}

impl Pack {
    /// Opens the pack at `path` if there is one (reading every record and checking
    /// it against its id); else one is made at the first append. A compaction's
    /// unfinished file (a crash during one) is removed: the pack it was to replace
    /// is whole.
    pub fn open(path: PathBuf) -> io::Result<Pack> {
        match std::fs::remove_file(compact_path(&path)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut state = State {
            file: None,
            generation: 0,
            index: HashMap::new(),
            dead: HashSet::new(),
            dead_bytes: 0,
            erase: Vec::new(),
        };
        let (end, zeroed) = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(file) if never_written(&file)? => {
                // Made, but a crash came before its header was synced: no blob was
                // kept in it.
                drop(file);
                std::fs::remove_file(&path)?;
                (HEADER, 0)
            }
            Ok(file) => {
                let read = read_records(&file, &path, &mut state)?;
                state.file = Some(Arc::new(file));
                read
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => (HEADER, 0),
            Err(e) => return Err(e),
        };
        let zeros = ZerosAhead::new(zeroed, path.display().to_string());
        Ok(Pack {
            path,
            state: RwLock::new(state),
            tail: Mutex::new(Tail { end, zeros }),
            compacting: Mutex::new(()),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where blob `id` is, if it is packed here; the blob counts as used now.
    pub fn get(&self, id: &BlobId) -> Option<Slot> {
        let state = self.state.read().ok()?;
        let entry = state.index.get(id)?;
        entry.mark_used();
        Some(entry.slot)
    }

    /// `len` bytes of packed blob `id` from `offset` within it (cut at its end),
    /// and the blob's length; `None` if it is not packed here.
    pub fn read(&self, id: &BlobId, offset: u64, len: u64) -> io::Result<Option<(u64, Vec<u8>)>> {
        let (file, slot) = {
            let state = self.state.read().map_err(|_| poisoned())?;
            let (Some(file), Some(entry)) = (&state.file, state.index.get(id)) else {
                return Ok(None);
            };
            entry.mark_used();
            (file.clone(), entry.slot)
        };
        let start = offset.min(slot.len);
        let len = len.min(slot.len - start);
        let mut buf = vec![0u8; len as usize];
        file.read_exact_at(&mut buf, slot.at + start)?;
        Ok(Some((slot.len, buf)))
    }

    /// Keeps `bytes` as blob `id` (the caller has checked they are): written after
    /// the last record, synced, then found here. A blob already packed is not
    /// written again.
    pub fn append(&self, id: BlobId, bytes: &[u8]) -> io::Result<()> {
        self.write(id, bytes, true)
    }

    /// Keeps `bytes` as blob `id` like [`Self::append`], found at once but not yet
    /// synced: for a blob durable elsewhere until [`Self::sync`] (a result carried
    /// in the Raft log). A later append's sync covers it too.
    pub fn append_unsynced(&self, id: BlobId, bytes: &[u8]) -> io::Result<()> {
        self.write(id, bytes, false)
    }

    /// Makes every record written so far durable.
    pub fn sync(&self) -> io::Result<()> {
        let file = self.state.read().map_err(|_| poisoned())?.file.clone();
        match file {
            Some(file) => file.sync_data(),
            None => Ok(()),
        }
    }

    fn write(&self, id: BlobId, bytes: &[u8], sync: bool) -> io::Result<()> {
        if self.get(&id).is_some() {
            return Ok(());
        }
        let written = self.write_record(id, bytes)?;
        if sync {
            written.file.sync_data()?;
        }
        self.found(written)
    }

    /// Writes blob `id`'s record after the last one; it is not found before
    /// [`Self::found`].
    fn write_record(&self, id: BlobId, bytes: &[u8]) -> io::Result<Written> {
        let len = bytes.len() as u64;
        if len > PACK_MAX {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a blob of {len} bytes is not packed (at most {PACK_MAX})"),
            ));
        }
        let mut tail = self.tail.lock().map_err(|_| poisoned())?;
        let (file, generation) = self.ensure_file(&mut tail)?;
        let mut record = Vec::with_capacity((RECORD_HEAD + len) as usize);
        record.extend_from_slice(&len.to_le_bytes());
        record.extend_from_slice(&id.0);
        record.extend_from_slice(bytes);
        let after = tail.end + record.len() as u64;
        let stretch = tail.zeros.zeroed().clamp(FIRST_ZEROS, ZERO_AHEAD);
        let zeroed = tail.zeros.room_for(after, stretch);
        if let Some(zeroed) = zeroed {
            // No room: the next stretch goes in the same write; the sync covers it.
            record.resize((zeroed - tail.end) as usize, 0);
        }
        let at = tail.end;
        // A write that fails (a full disk) moves nothing: the next one goes here.
        file.write_all_at(&record, at)?;
        tail.end = after;
        tail.zeros.wrote(&file, after, zeroed, stretch);
        Ok(Written {
            id,
            slot: Slot {
                at: at + RECORD_HEAD,
                len,
            },
            file,
            generation,
        })
    }

    /// Finds a record written by [`Self::write_record`] (synced, if it must be).
    fn found(&self, written: Written) -> io::Result<()> {
        let mut state = self.state.write().map_err(|_| poisoned())?;
        if state.generation != written.generation {
            // A compaction finished since: it copied the record into the next file,
            // synced it there and found it.
            return Ok(());
        }
        // Written by two at once: the first record is dead.
        state.find(written.id, written.slot);
        Ok(())
    }

    /// Stops finding blob `id` here (its bytes did not check when read).
    pub fn forget(&self, id: &BlobId) {
        if let Ok(mut state) = self.state.write() {
            state.remove(id);
        }
    }

    /// Stops finding blob `id` here if it was last written or looked for before
    /// `unused_since`; its record stays in the file, dead, until a compaction. The
    /// caller has made sure nothing needs it.
    pub fn remove_unused(&self, id: &BlobId, unused_since: SystemTime) -> Removed {
        let Ok(mut state) = self.state.write() else {
            return Removed::InUse;
        };
        let Some(entry) = state.index.get(id) else {
            return Removed::Absent;
        };
        if entry.used.load(Ordering::Relaxed) >= millis(unused_since) {
            return Removed::InUse;
        }
        let len = entry.slot.len;
        state.remove(id);
        Removed::Yes(len)
    }

    /// Erases the records dead for at least `grace` (removed, or a blob's older
    /// record), the id in their head included: a hole punched, or zeros written
    /// ([`erase`]); then syncs: a
    /// removed blob's bytes leave the disk, and at the next opening the record is
    /// known erased rather than found again. `grace` outlasts any read that found
    /// such a record before it died. Left for the next call while a compaction
    /// runs (it copies from the file); how many records were erased.
    pub fn erase_dead(&self, grace: std::time::Duration) -> io::Result<usize> {
        let Ok(_one) = self.compacting.try_lock() else {
            return Ok(0);
        };
        let (file, due) = {
            let mut state = self.state.write().map_err(|_| poisoned())?;
            let Some(file) = state.file.clone() else {
                return Ok(0);
            };
            let now = Instant::now();
            let (due, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut state.erase)
                .into_iter()
                .partition(|(_, since)| now.duration_since(*since) >= grace);
            state.erase = wait;
            (file, due)
        };
        let erased = || -> io::Result<()> {
            for (slot, _) in &due {
                // From the id on (the length stays, so the records after it are found).
                let at = slot.at - (RECORD_HEAD - LEN_BYTES);
                erase(&file, at, RECORD_HEAD - LEN_BYTES + slot.len)?;
            }
            if due.is_empty() {
                Ok(())
            } else {
                file.sync_data()
            }
        };
        match erased() {
            Ok(()) => Ok(due.len()),
            Err(e) => {
                // Tried again next time (no compaction ran meanwhile: this holds it off).
                if let Ok(mut state) = self.state.write() {
                    state.erase.extend(due);
                }
                Err(e)
            }
        }
    }

    /// The blobs packed here.
    pub fn ids(&self) -> Vec<BlobId> {
        self.state
            .read()
            .map_or_else(|_| Vec::new(), |s| s.index.keys().copied().collect())
    }

    /// (count, bytes) of the blobs packed here.
    pub fn stats(&self) -> (u64, u64) {
        self.state.read().map_or((0, 0), |state| {
            (
                state.index.len() as u64,
                state.index.values().map(|e| e.slot.len).sum::<u64>(),
            )
        })
    }

    /// (live, dead): bytes of the records found here, and of those in the file but
    /// not found (what a compaction gives back), heads included.
    pub fn garbage(&self) -> (u64, u64) {
        self.state.read().map_or((0, 0), |state| {
            let live = state.index.values().map(|e| RECORD_HEAD + e.slot.len);
            (live.sum(), state.dead_bytes)
        })
    }

    /// Copies the records still found here into a new file and puts it in the
    /// pack's place, giving back the space of the dead ones.
    ///
    /// Appends and reads go on while the records are copied; only the last step
    /// holds appends back: the records appended meanwhile are copied too, the new
    /// file synced and renamed over the old, and file and index swapped together.
    /// A crash before the rename leaves the old pack as it was (the new file is
    /// removed at the next opening); after it, the new one holds every record that
    /// was found and every append acknowledged meanwhile, synced. Each record is
    /// checked against its id as it is copied: one whose bytes no longer match is
    /// left out (and reported).
    pub fn compact(&self) -> io::Result<Compacted> {
        let _one = self.compacting.lock().map_err(|_| poisoned())?;
        // Every record before `from` was written: they are copied first, without
        // holding anything; those after, appended meanwhile, in the last step.
        let (old, from, dead) = {
            let tail = self.tail.lock().map_err(|_| poisoned())?;
            let state = self.state.read().map_err(|_| poisoned())?;
            let Some(old) = state.file.clone() else {
                return Ok(Compacted::default());
            };
            (old, tail.end, state.dead.clone())
        };
        let before = old.metadata()?.len();
        let tmp = compact_path(&self.path);
        let mut copy = Copy {
            old: &old,
            path: &self.path,
            new: OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&tmp)?,
            end: HEADER,
            moved: HashMap::new(),
            dropped: 0,
            batch: MAGIC.to_vec(),
            batch_at: 0,
        };
        // Without holding anything: the records there were at the start, then
        // those appended meanwhile (a few rounds, while they are many), then zeros
        // ahead, and a sync: the last step then writes and syncs little.
        let copied = (|| -> io::Result<(u64, u64)> {
            copy.records(HEADER, from, &dead)?;
            let mut from = from;
            for _ in 0..4 {
                let to = self.tail.lock().map_err(|_| poisoned())?.end;
                if to - from < CATCH_UP {
                    break;
                }
                copy.records(from, to, &HashSet::new())?;
                from = to;
            }
            let zeroed = copy.zeros_ahead()?;
            Ok((from, zeroed))
        })();
        let mut tail = self.tail.lock().map_err(|_| poisoned())?;
        let finished = copied.and_then(|(from, zeroed)| {
            copy.records(from, tail.end, &HashSet::new())?;
            copy.finish(zeroed)
        });
        let zeroed = match finished {
            Ok(zeroed) => zeroed,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        };
        let Copy {
            new,
            end,
            moved,
            dropped,
            ..
        } = copy;
        let kept = {
            let mut state = self.state.write().map_err(|_| poisoned())?;
            if let Err(e) = std::fs::rename(&tmp, &self.path) {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
            state.swap(Arc::new(new), moved, end);
            state.index.len() as u64
        };
        *tail = Tail {
            end,
            zeros: ZerosAhead::new(zeroed, self.path.display().to_string()),
        };
        drop(tail);
        if let Some(dir) = self.path.parent() {
            File::open(dir)?.sync_all()?;
        }
        let retiring = std::thread::Builder::new()
            .name("gpumesh-pack-retire".into())
            .spawn(move || retire(old));
        if let Err(e) = retiring {
            // Freed as it is closed, all at once.
            tracing::debug!(error = %e, "cannot start a thread to give the old pack back");
        }
        Ok(Compacted {
            before,
            after: zeroed,
            kept,
            dropped,
        })
    }

    /// Makes the file, with its header, on the first append (under the tail's
    /// lock); returns it and its generation.
    fn ensure_file(&self, tail: &mut Tail) -> io::Result<(Arc<File>, u64)> {
        {
            let state = self.state.read().map_err(|_| poisoned())?;
            if let Some(file) = &state.file {
                return Ok((file.clone(), state.generation));
            }
        }
        let mut state = self.state.write().map_err(|_| poisoned())?;
        if let Some(file) = &state.file {
            return Ok((file.clone(), state.generation));
        }
        let create = || {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&self.path)
        };
        let made = match create() {
            // Left by a try whose header found no room (a full disk): no blob is in it.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let left = OpenOptions::new().read(true).open(&self.path)?;
                if !never_written(&left)? {
                    return Err(e);
                }
                std::fs::remove_file(&self.path)?;
                create()?
            }
            made => made?,
        };
        let mut head = MAGIC.to_vec();
        head.resize(FIRST_ZEROS as usize, 0);
        let begun = made
            .write_all_at(&head, 0)
            .and_then(|()| made.sync_all())
            .and_then(|()| match self.path.parent() {
                Some(dir) => File::open(dir)?.sync_all(),
                None => Ok(()),
            });
        if let Err(e) = begun {
            // Gone, so the next blob makes it afresh once there is room.
            drop(made);
            let _ = std::fs::remove_file(&self.path);
            return Err(e);
        }
        *tail = Tail {
            end: HEADER,
            zeros: ZerosAhead::new(FIRST_ZEROS, self.path.display().to_string()),
        };
        let made = Arc::new(made);
        state.file = Some(made.clone());
        Ok((made, state.generation))
    }
}

impl State {
    /// Finds blob `id` at `slot`; a record of it found before is dead.
    fn find(&mut self, id: BlobId, slot: Slot) {
        if let Some(before) = self.index.insert(id, Entry::new(slot)) {
            self.bury(before.slot);
        }
    }

    /// Counts the record at `slot` dead: left out by the next compaction, and its
    /// bytes erased before then ([`Pack::erase_dead`]).
    fn bury(&mut self, slot: Slot) {
        self.bury_erased(slot);
        self.erase.push((slot, Instant::now()));
    }

    /// Counts the record at `slot` dead, its bytes erased already.
    fn bury_erased(&mut self, slot: Slot) {
        self.dead.insert(slot.at);
        self.dead_bytes += RECORD_HEAD + slot.len;
    }

    fn remove(&mut self, id: &BlobId) {
        if let Some(entry) = self.index.remove(id) {
            self.bury(entry.slot);
        }
    }

    /// Puts the compacted file `file` (records up to `end`) in place of the old:
    /// `moved` maps where each record copied was in the old file to its id and
    /// where it is in the new one.
    fn swap(&mut self, file: Arc<File>, mut moved: HashMap<u64, (BlobId, Slot)>, end: u64) {
        let mut index = HashMap::with_capacity(self.index.len());
        for (id, entry) in self.index.drain() {
            // Every record found was copied: each was written before the last
            // step began, and none of them is dead.
            if let Some((_, slot)) = moved.remove(&entry.slot.at) {
                index.insert(
                    id,
                    Entry {
                        slot,
                        used: entry.used,
                    },
                );
            }
        }
        let mut dead = HashSet::new();
        let mut dead_bytes = 0;
        let mut moved_dead = Vec::new();
        for (old_at, (id, slot)) in moved {
            if self.dead.contains(&old_at) || index.contains_key(&id) {
                // Removed while it was copied, or a second record of a blob found.
                dead.insert(slot.at);
                dead_bytes += RECORD_HEAD + slot.len;
                moved_dead.push(slot);
            } else {
                // Appended and synced here, its writer not yet back to find it (it
                // sees the new generation and leaves that to this).
                index.insert(id, Entry::new(slot));
            }
        }
        debug_assert_eq!(
            index
                .values()
                .map(|e| RECORD_HEAD + e.slot.len)
                .sum::<u64>()
                + dead_bytes,
            end - HEADER
        );
        // The old file's dead records were not copied; those copied and dead
        // here are erased in this one.
        let now = Instant::now();
        self.erase = moved_dead.into_iter().map(|slot| (slot, now)).collect();
        self.file = Some(file);
        self.generation += 1;
        self.index = index;
        self.dead = dead;
        self.dead_bytes = dead_bytes;
    }
}

/// A compaction's copy of the live records into the next file.
struct Copy<'a> {
    old: &'a File,
    path: &'a Path,
    new: File,
    /// Where the next record goes in the new file.
    end: u64,
    /// Each record copied: where it was, its id, where it is now.
    moved: HashMap<u64, (BlobId, Slot)>,
    dropped: u64,
    /// Records not yet written, and where they go.
    batch: Vec<u8>,
    batch_at: u64,
}

impl Copy<'_> {
    /// Copies the records in `from..to` of the old file, leaving out those at
    /// `dead` and any whose bytes do not match its id.
    fn records(&mut self, from: u64, to: u64, dead: &HashSet<u64>) -> io::Result<()> {
        let mut at = from;
        let mut head = [0u8; RECORD_HEAD as usize];
        while at < to {
            self.old.read_exact_at(&mut head, at)?;
            let len = u64::from_le_bytes(head[..8].try_into().unwrap_or_default());
            let id = BlobId(head[8..].try_into().unwrap_or_default());
            let next = at + RECORD_HEAD + len;
            if len > PACK_MAX || next > to {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{}: a record head at {at} that cannot be one, before the \
                         pack's end ({to}); not compacted",
                        self.path.display()
                    ),
                ));
            }
            let body = at + RECORD_HEAD;
            if dead.contains(&body) || id.0 == [0; 32] {
                self.dropped += 1;
                at = next;
                continue;
            }
            let start = self.batch.len();
            self.batch.extend_from_slice(&head);
            self.batch.resize(start + (RECORD_HEAD + len) as usize, 0);
            self.old
                .read_exact_at(&mut self.batch[start + RECORD_HEAD as usize..], body)?;
            if !id.matches(&self.batch[start + RECORD_HEAD as usize..]) {
                tracing::warn!(
                    path = %self.path.display(),
                    at,
                    blob = %id,
                    "a blob in the pack no longer matches its id (damaged on disk); \
                     it is left out as the pack is compacted"
                );
                self.batch.truncate(start);
                self.dropped += 1;
                at = next;
                continue;
            }
            self.moved.insert(
                body,
                (
                    id,
                    Slot {
                        at: self.end + RECORD_HEAD,
                        len,
                    },
                ),
            );
            self.end += RECORD_HEAD + len;
            if self.batch.len() >= COPY_BATCH {
                self.flush()?;
            }
            at = next;
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        write_paced(&self.new, self.batch_at, &self.batch)?;
        self.batch_at += self.batch.len() as u64;
        self.batch.clear();
        Ok(())
    }

    /// Writes what is copied so far and zeros after it (room for what is appended
    /// before the last step), and syncs all of it; returns how far the new file is
    /// zeroed.
    fn zeros_ahead(&mut self) -> io::Result<u64> {
        let zeroed = (self.end + CATCH_UP).div_ceil(FIRST_ZEROS) * FIRST_ZEROS + FIRST_ZEROS;
        self.batch
            .resize(self.batch.len() + (zeroed - self.end) as usize, 0);
        let records = self.end - self.batch_at;
        write_paced(&self.new, self.batch_at, &self.batch)?;
        self.batch_at += records;
        self.batch.clear();
        self.new.sync_all()?;
        Ok(zeroed)
    }

    /// Writes the records copied since [`Self::zeros_ahead`] and makes them
    /// durable: into the zeros already synced (one `fdatasync`), or with zeros of
    /// their own past them if there were more; returns how far the file is zeroed.
    fn finish(&mut self, zeroed: u64) -> io::Result<u64> {
        if self.end <= zeroed {
            self.flush()?;
            self.new.sync_data()?;
            return Ok(zeroed);
        }
        let zeroed = self.end.div_ceil(FIRST_ZEROS) * FIRST_ZEROS + FIRST_ZEROS;
        self.batch
            .resize(self.batch.len() + (zeroed - self.end) as usize, 0);
        self.flush()?;
        self.new.sync_all()?;
        Ok(zeroed)
    }
}

/// Gives the space of a file a compaction replaced back to the disk a few
/// megabytes at a time, each step synced, once nothing reads it any more.
///
/// Freed all at once (the file closed), its blocks are released in one journal
/// commit, which on a disk mounted with `discard` also trims them all: the appends
/// synced meanwhile wait for that commit (a 132 MiB pack: 17-21 ms here, against
/// at most 2.2 ms freed in steps; `gpumesh bench blobs`). Every reader of the pack
/// holds the file it reads (an `Arc`, taken with the slot under the state's lock),
/// so when this holds the last one nothing can read it again; if readers hold it
/// for long (10 s), it is left to be freed as the last of them closes it.
fn retire(old: Arc<File>) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while Arc::strong_count(&old) > 1 {
        if std::time::Instant::now() > deadline {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let Ok(mut len) = old.metadata().map(|m| m.len()) else {
        return;
    };
    while len > 0 {
        len = len.saturating_sub(RETIRE_STEP);
        if old.set_len(len).and_then(|()| old.sync_all()).is_err() {
            return;
        }
    }
}

/// Whether a pack file has not even its header (a crash while it was being made).
fn never_written(file: &File) -> io::Result<bool> {
    let size = file.metadata()?.len();
    let mut magic = [0u8; MAGIC.len()];
    Ok(size < HEADER || (file.read_exact_at(&mut magic, 0).is_ok() && magic == [0; 16]))
}

/// Reads every record of `file` into `state` (the found and the dead); returns
/// where the next one goes and how far the file is zeroed. A record whose bytes do
/// not check is dead; a head that cannot be one ends the pack, and everything from
/// it on is zeroed.
fn read_records(file: &File, path: &Path, state: &mut State) -> io::Result<(u64, u64)> {
    let size = file.metadata()?.len();
    let mut magic = [0u8; MAGIC.len()];
    if file.read_exact_at(&mut magic, 0).is_err() || &magic != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is not a blob pack", path.display()),
        ));
    }
    let mut at = HEADER;
    let mut head = [0u8; RECORD_HEAD as usize];
    let cut = loop {
        if at + RECORD_HEAD > size || file.read_exact_at(&mut head, at).is_err() {
            break None;
        }
        let len = u64::from_le_bytes(head[..8].try_into().unwrap_or_default());
        let id = BlobId(head[8..].try_into().unwrap_or_default());
        if len == 0 && id.0 == [0; 32] {
            break None;
        }
        let fits = len <= PACK_MAX && at + RECORD_HEAD + len <= size;
        if fits && id.0 == [0; 32] {
            // Erased once dead (see `Pack::erase_dead`).
            state.bury_erased(Slot {
                at: at + RECORD_HEAD,
                len,
            });
            at += RECORD_HEAD + len;
            continue;
        }
        let mut bytes = vec![0u8; if fits { len as usize } else { 0 }];
        if !fits || file.read_exact_at(&mut bytes, at + RECORD_HEAD).is_err() {
            break Some(at);
        }
        let slot = Slot {
            at: at + RECORD_HEAD,
            len,
        };
        if id.matches(&bytes) {
            // A blob written twice is found at its last record.
            state.find(id, slot);
        } else {
            tracing::warn!(
                path = %path.display(),
                at,
                blob = %id,
                "a blob in the pack does not match its id (a write cut short by a crash, \
                 before it was acknowledged, or damage since); it is not served"
            );
            state.bury(slot);
        }
        at += RECORD_HEAD + len;
    };
    if let Some(cut) = cut {
        tracing::warn!(
            path = %path.display(),
            at = cut,
            "the blob pack ends in a record head that cannot be one (a crash while it \
             was written, before it was acknowledged); dropping it"
        );
        file.write_all_at(&vec![0u8; (size - cut) as usize], cut)?;
        file.sync_data()?;
    }
    Ok((at, size))
}

/// Makes `len` bytes of `file` from `at` read as zeros: a hole punched in the file
/// where the file system can (its whole blocks given back to the disk, no data
/// written: a removed actor state of megabytes costs no second write), else zeros
/// written.
fn erase(file: &File, at: u64, len: u64) -> io::Result<()> {
    if punch_hole(file, at, len) {
        return Ok(());
    }
    write_zeros(file, at, len)
}

fn write_zeros(file: &File, at: u64, len: u64) -> io::Result<()> {
    let zeros = vec![0u8; len.min(ERASE_STEP) as usize];
    let (mut at, end) = (at, at + len);
    while at < end {
        let n = (end - at).min(zeros.len() as u64);
        file.write_all_at(&zeros[..n as usize], at)?;
        at += n;
    }
    Ok(())
}

/// `fallocate(PUNCH_HOLE | KEEP_SIZE)`; whether it was done.
#[cfg(target_os = "linux")]
fn punch_hole(file: &File, at: u64, len: u64) -> bool {
    use std::os::fd::AsRawFd;
    let (Ok(at), Ok(len)) = (libc::off_t::try_from(at), libc::off_t::try_from(len)) else {
        return false;
    };
    // SAFETY: the descriptor is `file`'s, open for the whole call, and the other
    // arguments are integers. The call reads and writes no memory of ours.
    #[allow(unsafe_code)]
    let done = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            at,
            len,
        )
    };
    done == 0
}

#[cfg(not(target_os = "linux"))]
fn punch_hole(_: &File, _: u64, _: u64) -> bool {
    false
}

fn poisoned() -> io::Error {
    io::Error::other("the blob pack's lock was poisoned")
}

/// What [`bench_compaction`] measured.
#[derive(Clone, Debug)]
pub struct CompactionReport {
    pub blob_bytes: u64,
    pub live_bytes: u64,
    pub dead_bytes: u64,
    /// The file's length before and after.
    pub before: u64,
    pub after: u64,
    pub compact: std::time::Duration,
    /// Synced appends of [`BENCH_APPEND`] bytes, one after another: alone, and
    /// while the compaction ran and [`BENCH_AFTER`] after.
    pub appends_alone: Vec<std::time::Duration>,
    pub appends_compacting: Vec<std::time::Duration>,
}

/// The appends [`bench_compaction`] times beside the compaction.
pub const BENCH_APPEND: usize = 4 << 10;
/// ... and for this long after it (the old file is given back meanwhile).
pub const BENCH_AFTER: std::time::Duration = std::time::Duration::from_millis(300);

/// Fills a pack in `dir` with blobs of `blob_bytes`, `live` bytes of them kept and
/// `dead` bytes removed, then compacts it while appending, and times both.
pub fn bench_compaction(
    dir: &Path,
    blob_bytes: usize,
    live: u64,
    dead: u64,
) -> io::Result<CompactionReport> {
    use std::time::{Duration, Instant};
    const AFTER: Duration = BENCH_AFTER;
    let path = dir.join("small.pack");
    let pack = Pack::open(path.clone())?;
    let blob = |i: u64, len: usize| -> Vec<u8> {
        let seed = blake3::hash(&i.to_le_bytes());
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            out.extend_from_slice(seed.as_bytes());
        }
        out.truncate(len);
        out[..8].copy_from_slice(&i.to_le_bytes());
        out
    };
    let total = (live + dead) / blob_bytes.max(1) as u64;
    // Every this many blobs, one is removed.
    let every = (live + dead).checked_div(dead);
    let mut gone = Vec::new();
    for i in 0..total {
        let b = blob(i, blob_bytes);
        pack.append_unsynced(BlobId::of(&b), &b)?;
        if every.is_some_and(|e| i % e == 0) {
            gone.push(BlobId::of(&b));
        }
    }
    pack.sync()?;
    let ahead = SystemTime::now() + Duration::from_secs(3600);
    for id in &gone {
        pack.remove_unused(id, ahead);
    }
    let (live_bytes, dead_bytes) = pack.garbage();
    let mut n = total;
    let mut append = |pack: &Pack| -> io::Result<Duration> {
        n += 1;
        let b = blob(n, BENCH_APPEND);
        let at = Instant::now();
        pack.append(BlobId::of(&b), &b)?;
        Ok(at.elapsed())
    };
    let mut appends_alone = Vec::new();
    for _ in 0..200 {
        appends_alone.push(append(&pack)?);
    }
    let before = std::fs::metadata(&path)?.len();
    let done = std::sync::atomic::AtomicBool::new(false);
    let ((compact, after), appends_compacting) = std::thread::scope(|s| {
        let compaction = s.spawn(|| {
            let at = Instant::now();
            let out = pack.compact();
            done.store(true, Ordering::Relaxed);
            out.map(|c| (at.elapsed(), c.after))
        });
        let mut during = Vec::new();
        // Through the compaction and the old file's return to the disk after it.
        let mut after: Option<Instant> = None;
        while after.is_none_or(|t| t.elapsed() < AFTER) {
            if after.is_none() && done.load(Ordering::Relaxed) {
                after = Some(Instant::now());
            }
            match append(&pack) {
                Ok(took) => during.push(took),
                Err(e) => return Err(e),
            }
        }
        let compact = compaction
            .join()
            .map_err(|_| io::Error::other("the compaction panicked"))??;
        Ok((compact, during))
    })?;
    Ok(CompactionReport {
        blob_bytes: blob_bytes as u64,
        live_bytes,
        dead_bytes,
        before,
        after,
        compact,
        appends_alone,
        appends_compacting,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn blob(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
    }

    /// Blob `b`'s bytes as the pack reads them (it must have them).
    fn bytes_of(pack: &Pack, b: &[u8]) -> Vec<u8> {
        let (len, bytes) = pack.read(&BlobId::of(b), 0, u64::MAX).unwrap().unwrap();
        assert_eq!(len, b.len() as u64);
        bytes
    }

    #[test]
    fn packed_blobs_are_found_again_after_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.pack");
        let pack = Pack::open(path.clone()).unwrap();
        assert!(!path.exists(), "no file before the first blob");
        // Enough to cross several stretches of zeros.
        let blobs: Vec<Vec<u8>> = (0..40).map(|i| blob(6_000 * i + 1, i as u8)).collect();
        for b in &blobs {
            pack.append(BlobId::of(b), b).unwrap();
        }
        let again = Pack::open(path).unwrap();
        for b in &blobs {
            assert_eq!(&bytes_of(&again, b), b);
        }
        assert_eq!(again.stats(), pack.stats());
        // Appends go on after the last record.
        let more = blob(3_000, 99);
        again.append(BlobId::of(&more), &more).unwrap();
        let third = Pack::open(again.path().to_path_buf()).unwrap();
        assert_eq!(third.stats().0, 41);
        let over = blob(PACK_MAX as usize + 1, 5);
        assert!(third.append(BlobId::of(&over), &over).is_err());
    }

    #[test]
    fn an_unsynced_append_is_found_at_once_and_kept_with_the_records_around_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.pack");
        let pack = Pack::open(path.clone()).unwrap();
        // Syncing a pack that has no file yet does nothing.
        pack.sync().unwrap();
        let (a, b, c) = (blob(5_000, 1), blob(20_000, 2), blob(700, 3));
        pack.append(BlobId::of(&a), &a).unwrap();
        pack.append_unsynced(BlobId::of(&b), &b).unwrap();
        assert_eq!(bytes_of(&pack, &b), b, "found before any sync");
        // Kept once: a second write of it changes nothing.
        pack.append_unsynced(BlobId::of(&b), &b).unwrap();
        pack.append(BlobId::of(&c), &c).unwrap();
        pack.sync().unwrap();
        assert_eq!(pack.stats().0, 3);
        let again = Pack::open(path).unwrap();
        for x in [&a, &b, &c] {
            assert_eq!(&bytes_of(&again, x), x);
        }
        assert_eq!(again.stats(), pack.stats());
    }

    #[test]
    fn a_record_cut_short_or_damaged_is_skipped_and_the_rest_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.pack");
        let pack = Pack::open(path.clone()).unwrap();
        let (a, b) = (blob(5_000, 1), blob(6_000, 2));
        pack.append(BlobId::of(&a), &a).unwrap();
        pack.append(BlobId::of(&b), &b).unwrap();
        let slot = pack.get(&BlobId::of(&b)).unwrap();
        drop(pack);
        // A crash halfway through b's bytes: the rest of them never reached the disk.
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&vec![0u8; 3_000], slot.at + 3_000)
            .unwrap();
        let pack = Pack::open(path.clone()).unwrap();
        assert!(pack.get(&BlobId::of(&a)).is_some());
        assert!(pack.get(&BlobId::of(&b)).is_none());
        let c = blob(100, 3);
        pack.append(BlobId::of(&c), &c).unwrap();
        let pack = Pack::open(path.clone()).unwrap();
        assert_eq!(pack.stats(), (2, 5_100));
        assert_eq!(bytes_of(&pack, &c), c);
        // A byte of a, the first record, flipped since: a alone is lost.
        let slot = pack.get(&BlobId::of(&a)).unwrap();
        drop(pack);
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&[!a[10]], slot.at + 10).unwrap();
        let pack = Pack::open(path.clone()).unwrap();
        assert!(pack.get(&BlobId::of(&a)).is_none());
        assert_eq!(pack.stats(), (1, 100));
        // A head that cannot be one (a length past the end): the pack ends there.
        let d = blob(200, 4);
        pack.append(BlobId::of(&d), &d).unwrap();
        let slot = pack.get(&BlobId::of(&d)).unwrap();
        drop(pack);
        file.write_all_at(&u64::MAX.to_le_bytes(), slot.at - RECORD_HEAD)
            .unwrap();
        let pack = Pack::open(path.clone()).unwrap();
        assert_eq!(pack.stats(), (1, 100));
        pack.append(BlobId::of(&d), &d).unwrap();
        assert_eq!(Pack::open(path).unwrap().stats(), (2, 300));
    }

    #[test]
    fn a_file_that_is_not_a_pack_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.pack");
        std::fs::write(&path, b"something else entirely").unwrap();
        let err = Pack::open(path.clone()).unwrap_err();
        assert!(err.to_string().contains("not a blob pack"), "{err}");
        // Made but never written (a crash before its header): a fresh pack.
        std::fs::write(&path, b"").unwrap();
        let pack = Pack::open(path.clone()).unwrap();
        let b = blob(10, 0);
        pack.append(BlobId::of(&b), &b).unwrap();
        assert_eq!(Pack::open(path).unwrap().stats(), (1, 10));
    }

    #[test]
    fn appends_from_many_threads_are_all_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.pack");
        let pack = Pack::open(path.clone()).unwrap();
        let blobs: Vec<Vec<u8>> = (0..64).map(|i| blob(1_000 + 997 * i, i as u8)).collect();
        std::thread::scope(|s| {
            for chunk in blobs.chunks(8) {
                let pack = &pack;
                s.spawn(move || {
                    for b in chunk {
                        pack.append(BlobId::of(b), b).unwrap();
                    }
                });
            }
        });
        let again = Pack::open(path).unwrap();
        for b in &blobs {
            assert_eq!(&bytes_of(&again, b), b);
        }
    }

    /// Removes blob `b` now, whenever it was last used.
    fn remove(pack: &Pack, b: &[u8]) -> Removed {
        let ahead = SystemTime::now() + std::time::Duration::from_secs(3600);
        pack.remove_unused(&BlobId::of(b), ahead)
    }

    #[test]
    fn erasing_zeros_the_range_and_nothing_else_by_hole_or_by_writing() {
        let dir = tempfile::tempdir().unwrap();
        let len = 3 * ERASE_STEP as usize + 12_345;
        let bytes = blob(len, 9);
        for punch in [true, false] {
            let path = dir.path().join(format!("f{punch}"));
            std::fs::write(&path, &bytes).unwrap();
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap();
            let (at, n) = (1_000u64, 2 * ERASE_STEP + 7_777);
            if punch {
                erase(&file, at, n).unwrap();
            } else {
                write_zeros(&file, at, n).unwrap();
            }
            let after = std::fs::read(&path).unwrap();
            assert_eq!(after.len(), len);
            let (a, b) = (at as usize, (at + n) as usize);
            assert_eq!(after[..a], bytes[..a]);
            assert!(after[a..b].iter().all(|&x| x == 0));
            assert_eq!(after[b..], bytes[b..]);
        }
    }

    /// Whether `needle` appears anywhere in the file at `path`.
    fn file_holds(path: &Path, needle: &[u8]) -> bool {
        std::fs::read(path)
            .unwrap()
            .windows(needle.len())
            .any(|w| w == needle)
    }

    #[test]
    fn a_removed_blob_is_erased_from_the_file_and_not_found_again_on_opening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.pack");
        let pack = Pack::open(path.clone()).unwrap();
        let blobs: Vec<Vec<u8>> = (0..6)
            .map(|i| blob(5_000 + 700 * i, 40 + i as u8))
            .collect();
        for b in &blobs {
            pack.append(BlobId::of(b), b).unwrap();
        }
        let (gone, kept) = (&blobs[1..3], [&blobs[0], &blobs[3], &blobs[4], &blobs[5]]);
        for b in gone {
            assert_eq!(remove(&pack, b), Removed::Yes(b.len() as u64));
        }
        // Within the grace, the bytes stay (a read that found them may be under way),
        // and a node started again then finds them again.
        assert_eq!(
            pack.erase_dead(std::time::Duration::from_secs(60)).unwrap(),
            0
        );
        assert!(file_holds(&path, &gone[0]));
        assert!(Pack::open(path.clone())
            .unwrap()
            .get(&BlobId::of(&gone[0]))
            .is_some());
        // After it, gone from the file, id and bytes; not found again on opening.
        assert_eq!(pack.erase_dead(std::time::Duration::ZERO).unwrap(), 2);
        assert_eq!(pack.erase_dead(std::time::Duration::ZERO).unwrap(), 0);
        for b in gone {
            assert!(
                !file_holds(&path, b),
                "a removed blob's bytes are still in the file"
            );
            assert!(!file_holds(&path, &BlobId::of(b).0));
        }
        let again = Pack::open(path.clone()).unwrap();
        assert_eq!(again.stats(), pack.stats());
        assert_eq!(again.garbage(), pack.garbage());
        for b in gone {
            assert!(again.get(&BlobId::of(b)).is_none());
        }
        for b in kept {
            assert_eq!(&bytes_of(&again, b), b);
        }
        // Erased records are left out by a compaction, and the rest kept.
        let done = again.compact().unwrap();
        assert_eq!((done.kept, done.dropped), (4, 2));
        for b in kept {
            assert_eq!(&bytes_of(&again, b), b);
        }
        // In the compacted file too.
        remove(&again, &blobs[0]);
        assert_eq!(again.erase_dead(std::time::Duration::ZERO).unwrap(), 1);
        assert!(!file_holds(&path, &blobs[0]));
        assert_eq!(&bytes_of(&Pack::open(path).unwrap(), &blobs[5]), &blobs[5]);
    }

    #[test]
    fn a_compaction_keeps_the_records_found_and_gives_back_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.pack");
        let pack = Pack::open(path.clone()).unwrap();
        assert_eq!(pack.compact().unwrap(), Compacted::default(), "no file yet");
        let blobs: Vec<Vec<u8>> = (0..60).map(|i| blob(10_000 + 37 * i, i as u8)).collect();
        for b in &blobs {
            pack.append(BlobId::of(b), b).unwrap();
        }
        // Used a moment ago: kept by a cutoff before that.
        let past = SystemTime::now() - std::time::Duration::from_secs(60);
        assert_eq!(
            pack.remove_unused(&BlobId::of(&blobs[0]), past),
            Removed::InUse
        );
        let (gone, kept) = blobs.split_at(40);
        for b in gone {
            assert_eq!(remove(&pack, b), Removed::Yes(b.len() as u64));
            assert_eq!(remove(&pack, b), Removed::Absent);
        }
        let size = |p: &Path| std::fs::metadata(p).unwrap().len();
        let (live, dead) = pack.garbage();
        assert_eq!(
            live,
            kept.iter()
                .map(|b| RECORD_HEAD + b.len() as u64)
                .sum::<u64>()
        );
        assert_eq!(
            dead,
            gone.iter()
                .map(|b| RECORD_HEAD + b.len() as u64)
                .sum::<u64>()
        );
        let before = size(&path);
        let done = pack.compact().unwrap();
        assert_eq!((done.kept, done.dropped), (20, 40));
        assert_eq!(done.before, before);
        assert_eq!(done.after, size(&path));
        assert!(
            done.after < HEADER + live + CATCH_UP + 2 * FIRST_ZEROS,
            "{done:?}"
        );
        assert_eq!(pack.garbage(), (live, 0));
        for b in kept {
            assert_eq!(&bytes_of(&pack, b), b);
        }
        for b in gone {
            assert!(pack.read(&BlobId::of(b), 0, 1).unwrap().is_none());
        }
        // Appends go on in the new file, and all of it is found again on opening.
        let more = blob(3_000, 99);
        pack.append(BlobId::of(&more), &more).unwrap();
        let again = Pack::open(path.clone()).unwrap();
        assert_eq!(again.stats(), pack.stats());
        for b in kept.iter().chain([&more]) {
            assert_eq!(&bytes_of(&again, b), b);
        }
        assert!(again.get(&BlobId::of(&gone[0])).is_none());
    }

    #[test]
    fn a_record_damaged_on_disk_is_left_out_by_a_compaction() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.pack");
        let pack = Pack::open(path.clone()).unwrap();
        let (a, b) = (blob(4_000, 1), blob(4_000, 2));
        pack.append(BlobId::of(&a), &a).unwrap();
        pack.append(BlobId::of(&b), &b).unwrap();
        let slot = pack.get(&BlobId::of(&a)).unwrap();
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&[!a[7]], slot.at + 7).unwrap();
        let done = pack.compact().unwrap();
        assert_eq!((done.kept, done.dropped), (1, 1));
        assert!(pack.get(&BlobId::of(&a)).is_none());
        assert_eq!(bytes_of(&pack, &b), b);
        assert_eq!(Pack::open(path).unwrap().stats(), (1, 4_000));
    }

    #[test]
    fn a_compaction_cut_short_leaves_the_pack_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.pack");
        let pack = Pack::open(path.clone()).unwrap();
        let blobs: Vec<Vec<u8>> = (0..10).map(|i| blob(5_000, i)).collect();
        for b in &blobs {
            pack.append(BlobId::of(b), b).unwrap();
        }
        drop(pack);
        // A crash while the next file was written: half of it there.
        let whole = std::fs::read(&path).unwrap();
        std::fs::write(compact_path(&path), &whole[..whole.len() / 2]).unwrap();
        let pack = Pack::open(path.clone()).unwrap();
        assert!(
            !compact_path(&path).exists(),
            "the unfinished file is removed"
        );
        for b in &blobs {
            assert_eq!(&bytes_of(&pack, b), b);
        }
    }

    #[test]
    fn appends_reads_and_removals_during_compactions_lose_nothing_found() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.pack");
        let pack = Pack::open(path.clone()).unwrap();
        let blobs: Vec<Vec<u8>> = (0..600)
            .map(|i| blob(1 + (i * 7_919) % 30_000, (i % 251) as u8))
            .map(|mut b| {
                b.push(0xA5);
                b
            })
            .collect();
        // Every third blob is removed once written (its writer's choice).
        let removed = |i: usize| i.is_multiple_of(3);
        let done = std::sync::atomic::AtomicBool::new(false);
        let compactions = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            s.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    if pack.compact().unwrap().kept > 0 {
                        compactions.fetch_add(1, Ordering::Relaxed);
                    }
                    // Dead records erased between compactions, at once (nothing
                    // here reads a blob once it is removed): in whichever file
                    // holds them, never a live one.
                    pack.erase_dead(std::time::Duration::ZERO).unwrap();
                }
            });
            // Stops the compactions however the writers end (a failed assertion too).
            struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
            impl Drop for Stop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Relaxed);
                }
            }
            let _stop = Stop(&done);
            let writers: Vec<_> = (0..4)
                .map(|w| {
                    let (pack, blobs, compactions) = (&pack, &blobs, &compactions);
                    s.spawn(move || {
                        for i in (w..blobs.len()).step_by(4) {
                            if (i / 4) % 40 == 39 {
                                // Every 40 blobs, until another compaction is
                                // done (a few seconds at most): appends always
                                // meet several, however the threads are run.
                                let seen = compactions.load(Ordering::Relaxed);
                                let until =
                                    std::time::Instant::now() + std::time::Duration::from_secs(5);
                                while compactions.load(Ordering::Relaxed) == seen
                                    && std::time::Instant::now() < until
                                {
                                    std::thread::yield_now();
                                }
                            }
                            let b = &blobs[i];
                            if i % 2 == 0 {
                                pack.append(BlobId::of(b), b).unwrap();
                            } else {
                                pack.append_unsynced(BlobId::of(b), b).unwrap();
                            }
                            // Found at once, and right, whatever a compaction does.
                            assert_eq!(&bytes_of(pack, b), b, "blob {i}");
                            if removed(i) {
                                assert_eq!(remove(pack, b), Removed::Yes(b.len() as u64));
                            }
                            // An earlier one of this writer's, read again.
                            let j = i.saturating_sub(40) / 4 * 4 + w;
                            if j < i && !removed(j) {
                                assert_eq!(&bytes_of(pack, &blobs[j]), &blobs[j], "blob {j}");
                            }
                        }
                    })
                })
                .collect();
            for w in writers {
                w.join().unwrap();
            }
        });
        assert!(
            compactions.load(Ordering::Relaxed) > 2,
            "compactions ran alongside"
        );
        pack.compact().unwrap();
        let kept = |p: &Pack| {
            for (i, b) in blobs.iter().enumerate() {
                let found = p.read(&BlobId::of(b), 0, u64::MAX).unwrap();
                if removed(i) {
                    assert!(found.is_none(), "blob {i} was removed");
                } else {
                    assert_eq!(found.map(|f| f.1).as_ref(), Some(b), "blob {i}");
                }
            }
        };
        kept(&pack);
        assert_eq!(pack.garbage().1, 0);
        let file_len = std::fs::metadata(&path).unwrap().len();
        let (live, _) = pack.garbage();
        assert!(
            file_len <= HEADER + live + CATCH_UP + 2 * FIRST_ZEROS,
            "{file_len} for {live}"
        );
        drop(pack);
        kept(&Pack::open(path).unwrap());
    }

    #[test]
    fn a_record_written_before_a_compaction_and_found_after_it_is_found_in_the_new_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.pack");
        let pack = Pack::open(path.clone()).unwrap();
        let (gone, a, b) = (blob(9_000, 1), blob(3_000, 2), blob(4_000, 3));
        pack.append(BlobId::of(&gone), &gone).unwrap();
        remove(&pack, &gone);
        // Written (its writer now syncing) as a compaction runs from start to end:
        // the compaction copies it and finds it; its writer, back, finds the
        // next file in place and leaves it.
        let written = pack.write_record(BlobId::of(&a), &a).unwrap();
        let done = pack.compact().unwrap();
        assert_eq!((done.kept, done.dropped), (1, 1));
        assert_eq!(bytes_of(&pack, &a), a);
        written.file.sync_data().unwrap();
        pack.found(written).unwrap();
        assert_eq!(bytes_of(&pack, &a), a);
        // And one found before a compaction's end: moved with the rest.
        let written = pack.write_record(BlobId::of(&b), &b).unwrap();
        pack.found(written).unwrap();
        pack.compact().unwrap();
        assert_eq!(bytes_of(&pack, &b), b);
        assert_eq!(pack.garbage().1, 0);
        let again = Pack::open(path).unwrap();
        assert_eq!(again.stats(), (2, 7_000));
    }

    /// Blob `i` of the crash test below.
    fn crash_blob(i: u64) -> Vec<u8> {
        let mut b = blob(1 + (i as usize * 4_999) % 40_000, i as u8);
        b.extend_from_slice(&i.to_le_bytes());
        b
    }

    /// The process [`killed_mid_compaction_the_pack_keeps_every_acknowledged_blob`]
    /// kills: appends blobs and says which it has kept (and which it removed after)
    /// while another thread compacts the pack over and over.
    #[test]
    #[ignore = "started (and killed) by killed_mid_compaction_the_pack_keeps_every_acknowledged_blob"]
    fn pack_writer_to_kill() {
        let (Ok(path), Ok(from)) = (
            std::env::var("GPUMESH_PACK_TO_KILL"),
            std::env::var("GPUMESH_PACK_FROM"),
        ) else {
            return;
        };
        let pack = Pack::open(PathBuf::from(path)).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| loop {
                if pack.compact().unwrap().kept > 0 {
                    println!("compacted");
                }
            });
            for i in from.parse::<u64>().unwrap().. {
                let b = crash_blob(i);
                if i % 2 == 0 {
                    pack.append(BlobId::of(&b), &b).unwrap();
                } else {
                    pack.append_unsynced(BlobId::of(&b), &b).unwrap();
                    pack.sync().unwrap();
                }
                println!("kept {i}");
                if i % 3 == 0 {
                    assert_eq!(remove(&pack, &b), Removed::Yes(b.len() as u64));
                    println!("removed {i}");
                }
            }
        });
    }

    #[test]
    fn killed_mid_compaction_the_pack_keeps_every_acknowledged_blob() {
        use std::io::BufRead as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.pack");
        let (mut next, mut compactions) = (0u64, 0);
        let mut kept = Vec::new();
        for round in 0..6u64 {
            let mut writer = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "blobs::pack::tests::pack_writer_to_kill"])
                .args(["--include-ignored", "--nocapture", "--test-threads=1"])
                .env("GPUMESH_PACK_TO_KILL", &path)
                .env("GPUMESH_PACK_FROM", next.to_string())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            let lines = std::io::BufReader::new(writer.stdout.take().unwrap()).lines();
            let mut this_round = 0;
            for line in lines {
                let line = line.unwrap();
                if line == "compacted" {
                    compactions += 1;
                } else if let Some(i) = line.strip_prefix("kept ") {
                    kept.push(i.parse::<u64>().unwrap());
                    this_round += 1;
                } else if let Some(i) = line.strip_prefix("removed ") {
                    let i: u64 = i.parse().unwrap();
                    kept.retain(|k| *k != i);
                }
                if this_round == 40 + 23 * round {
                    break;
                }
            }
            // SIGKILL, mid-append or mid-compaction.
            writer.kill().unwrap();
            writer.wait().unwrap();
            next = kept.iter().max().map_or(next, |m| m + 1).max(next + 200);
            let pack = Pack::open(path.clone()).unwrap();
            for i in &kept {
                let b = crash_blob(*i);
                let found = pack.read(&BlobId::of(&b), 0, u64::MAX).unwrap();
                assert_eq!(found.map(|f| f.1), Some(b), "blob {i}, round {round}");
            }
        }
        assert!(compactions > 6, "the pack was compacted as it was written");
    }
}
