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

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use gpumesh_consensus::ZerosAhead;
use gpumesh_protocol::BlobId;

const MAGIC: &[u8; 16] = b"gpumesh-blobpak1";
const HEADER: u64 = MAGIC.len() as u64;
/// Length and id in front of each record's bytes.
const RECORD_HEAD: u64 = 8 + 32;
/// Blobs of at most this many bytes are packed; larger ones get a file each.
pub const PACK_MAX: u64 = 256 << 10;
/// The largest stretch of zeros written ahead at once; the first ones are smaller
/// (each the size of the pack so far), so a store holding a few blobs stays small.
const ZERO_AHEAD: u64 = 4 << 20;
const FIRST_ZEROS: u64 = 64 << 10;

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
    /// `None` until the first append makes the file.
    file: RwLock<Option<Arc<File>>>,
    /// Where the next record goes, and how far the file is zeroed; held while a
    /// record is written, so records are written one at a time and in order.
    tail: Mutex<Tail>,
    index: RwLock<HashMap<BlobId, Slot>>,
}

#[derive(Debug)]
struct Tail {
    end: u64,
    zeros: ZerosAhead,
}

impl Pack {
    /// Opens the pack at `path` if there is one (reading every record and checking
    /// it against its id); else one is made at the first append.
    pub fn open(path: PathBuf) -> io::Result<Pack> {
        let mut index = HashMap::new();
        let (file, end, zeroed) = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(file) if never_written(&file)? => {
                // Made, but a crash came before its header was synced: no blob was
                // kept in it.
                drop(file);
                std::fs::remove_file(&path)?;
                (None, HEADER, 0)
            }
            Ok(file) => {
                let (end, zeroed) = read_records(&file, &path, &mut index)?;
                (Some(file), end, zeroed)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => (None, HEADER, 0),
            Err(e) => return Err(e),
        };
        let zeros = ZerosAhead::new(zeroed, path.display().to_string());
        Ok(Pack {
            path,
            file: RwLock::new(file.map(Arc::new)),
            tail: Mutex::new(Tail { end, zeros }),
            index: RwLock::new(index),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where blob `id` is, if it is packed here.
    pub fn get(&self, id: &BlobId) -> Option<Slot> {
        self.index.read().ok()?.get(id).copied()
    }

    /// `len` bytes of a packed blob from `offset` within it (cut at its end).
    pub fn read(&self, slot: Slot, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let start = offset.min(slot.len);
        let len = len.min(slot.len - start);
        let mut buf = vec![0u8; len as usize];
        self.with_file(|f| f.read_exact_at(&mut buf, slot.at + start))?;
        Ok(buf)
    }

    /// The pack's file, opened anew for reading (for a reader that seeks).
    pub fn reopen(&self) -> io::Result<File> {
        File::open(&self.path)
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
        if self.file.read().map_err(|_| poisoned())?.is_none() {
            return Ok(());
        }
        self.with_file(|f| f.sync_data())
    }

    fn write(&self, id: BlobId, bytes: &[u8], sync: bool) -> io::Result<()> {
        if self.get(&id).is_some() {
            return Ok(());
        }
        let len = bytes.len() as u64;
        if len > PACK_MAX {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a blob of {len} bytes is not packed (at most {PACK_MAX})"),
            ));
        }
        let slot = {
            let mut tail = self.tail.lock().map_err(|_| poisoned())?;
            self.ensure_file(&mut tail)?;
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
            let file = self.with_file(|f| f.write_all_at(&record, at).map(|()| f.clone()))?;
            tail.end = after;
            tail.zeros.wrote(&file, after, zeroed, stretch);
            Slot {
                at: at + RECORD_HEAD,
                len,
            }
        };
        if sync {
            self.with_file(|f| f.sync_data())?;
        }
        self.index.write().map_err(|_| poisoned())?.insert(id, slot);
        Ok(())
    }

    /// Stops finding blob `id` here (its bytes did not check when read).
    pub fn forget(&self, id: &BlobId) {
        if let Ok(mut index) = self.index.write() {
            index.remove(id);
        }
    }

    /// (count, bytes) of the blobs packed here.
    pub fn stats(&self) -> (u64, u64) {
        self.index.read().map_or((0, 0), |index| {
            (
                index.len() as u64,
                index.values().map(|s| s.len).sum::<u64>(),
            )
        })
    }

    fn with_file<R>(&self, f: impl FnOnce(&Arc<File>) -> io::Result<R>) -> io::Result<R> {
        let file = self.file.read().map_err(|_| poisoned())?;
        match file.as_ref() {
            Some(file) => f(file),
            None => Err(io::Error::new(
                io::ErrorKind::NotFound,
                "the store has no packed blobs yet",
            )),
        }
    }

    /// Makes the file, with its header, on the first append (under the tail's lock).
    fn ensure_file(&self, tail: &mut Tail) -> io::Result<()> {
        let mut file = self.file.write().map_err(|_| poisoned())?;
        if file.is_some() {
            return Ok(());
        }
        let made = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&self.path)?;
        let mut head = MAGIC.to_vec();
        head.resize(FIRST_ZEROS as usize, 0);
        made.write_all_at(&head, 0)?;
        made.sync_all()?;
        if let Some(dir) = self.path.parent() {
            File::open(dir)?.sync_all()?;
        }
        *tail = Tail {
            end: HEADER,
            zeros: ZerosAhead::new(FIRST_ZEROS, self.path.display().to_string()),
        };
        *file = Some(Arc::new(made));
        Ok(())
    }
}

/// Whether a pack file has not even its header (a crash while it was being made).
fn never_written(file: &File) -> io::Result<bool> {
    let size = file.metadata()?.len();
    let mut magic = [0u8; MAGIC.len()];
    Ok(size < HEADER || (file.read_exact_at(&mut magic, 0).is_ok() && magic == [0; 16]))
}

/// Reads every record of `file` into `index`; returns where the next one goes and
/// how far the file is zeroed. A record whose bytes do not check is skipped; a head
/// that cannot be one ends the pack, and everything from it on is zeroed.
fn read_records(
    file: &File,
    path: &Path,
    index: &mut HashMap<BlobId, Slot>,
) -> io::Result<(u64, u64)> {
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
        let mut bytes = vec![0u8; if fits { len as usize } else { 0 }];
        if !fits || file.read_exact_at(&mut bytes, at + RECORD_HEAD).is_err() {
            break Some(at);
        }
        if !id.matches(&bytes) {
            tracing::warn!(
                path = %path.display(),
                at,
                blob = %id,
                "a blob in the pack does not match its id (a write cut short by a crash, \
                 before it was acknowledged, or damage since); it is not served"
            );
            at += RECORD_HEAD + len;
            continue;
        }
        index.insert(
            id,
            Slot {
                at: at + RECORD_HEAD,
                len,
            },
        );
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

fn poisoned() -> io::Error {
    io::Error::other("the blob pack's lock was poisoned")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn blob(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
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
            let slot = again.get(&BlobId::of(b)).unwrap();
            assert_eq!(&again.read(slot, 0, u64::MAX).unwrap(), b);
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
        let slot = pack.get(&BlobId::of(&b)).expect("found before any sync");
        assert_eq!(pack.read(slot, 0, u64::MAX).unwrap(), b);
        // Kept once: a second write of it changes nothing.
        pack.append_unsynced(BlobId::of(&b), &b).unwrap();
        pack.append(BlobId::of(&c), &c).unwrap();
        pack.sync().unwrap();
        assert_eq!(pack.stats().0, 3);
        let again = Pack::open(path).unwrap();
        for x in [&a, &b, &c] {
            let slot = again.get(&BlobId::of(x)).unwrap();
            assert_eq!(&again.read(slot, 0, u64::MAX).unwrap(), x);
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
        let slot = pack.get(&BlobId::of(&c)).unwrap();
        assert_eq!(pack.read(slot, 0, 100).unwrap(), c);
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
            let slot = again.get(&BlobId::of(b)).unwrap();
            assert_eq!(&again.read(slot, 0, u64::MAX).unwrap(), b);
        }
    }
}
