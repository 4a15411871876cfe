//! Zeros written ahead of an append-only file's end, on a thread of their own: the
//! Raft log's ([`crate::wal`]) and the blob store's pack of small blobs.
//!
//! Both files append a record and `fdatasync` it for every write that must be
//! durable. Written into blocks the file already has (zeros written before), that
//! sync flushes the record's own pages and no file metadata; written past the
//! file's end, it also records new blocks and a new length. So the zeros go ahead
//! of the records. Written with the record that runs out of room (as both did), a
//! stretch of 4 MiB and its sync made that one append take 4.3-14.6 ms here, on
//! every replica at about the same entry. Now the next stretch is begun once less
//! than half of the last is left, on a thread of its own, a piece at a time, each
//! piece written to disk before the next ([`write_out`]), so an append's
//! `fdatasync`, which flushes every dirty page of the file, finds at most one piece
//! of them. A record that finds no room (one larger than what is left, or written
//! faster than the zeros) waits for the stretch in flight, whose zeros must not land
//! on it, and then has its zeros written with it, as before.
//!
//! The same pacing serves the files of megabytes written beside the log (a
//! snapshot's, the log's next generation): [`write_paced`].

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt as _;
use std::sync::Arc;
use std::thread::JoinHandle;

/// A stretch of zeros is written out this much at a time.
const PIECE: u64 = 256 << 10;

/// How far a file is zeroed, and the next stretch being written.
#[derive(Debug)]
pub struct ZerosAhead {
    /// The file's length: zeros from the last record's end up to here.
    zeroed: u64,
    /// The stretch being written: the file's length once it is done.
    ahead: Option<JoinHandle<io::Result<u64>>>,
    /// For log lines.
    path: String,
}

impl ZerosAhead {
    /// A file (at `path`, named in log lines) zeroed up to `zeroed`.
    pub fn new(zeroed: u64, path: String) -> Self {
        Self {
            zeroed,
            ahead: None,
            path,
        }
    }

    /// How far the file is zeroed, once the stretch in flight (if any) is counted
    /// when done.
    pub fn zeroed(&mut self) -> u64 {
        self.collect(false);
        self.zeroed
    }

    /// Before a record that ends at `after` is written: `None` when the file is
    /// zeroed that far, else how far zeros must be written with the record (to the
    /// next multiple of `stretch`), once the stretch in flight, if any, is done.
    /// [`Self::wrote`] must follow the record's write.
    pub fn room_for(&mut self, after: u64, stretch: u64) -> Option<u64> {
        if after <= self.zeroed() {
            return None;
        }
        self.collect(true);
        (after > self.zeroed).then(|| after.div_ceil(stretch) * stretch)
    }

    /// A record was written up to `end`, with zeros after it up to `zeroed` (what
    /// [`Self::room_for`] asked for, or `end` when it asked for none): begins the
    /// next `stretch` of zeros in `file` if less than half of one is left.
    pub fn wrote(&mut self, file: &Arc<File>, end: u64, zeroed: Option<u64>, stretch: u64) {
        if let Some(zeroed) = zeroed {
            self.zeroed = self.zeroed.max(zeroed);
        }
        if self.ahead.is_some() || self.zeroed.saturating_sub(end) >= stretch / 2 {
            return;
        }
        let (file, from) = (file.clone(), self.zeroed);
        let spawned = std::thread::Builder::new()
            .name("gpumesh-zeros".into())
            .spawn(move || zero(&file, from, stretch));
        match spawned {
            Ok(handle) => self.ahead = Some(handle),
            // The record that needs them writes them.
            Err(e) => {
                tracing::warn!(path = %self.path, error = %e, "cannot start a thread to zero ahead")
            }
        }
    }

    /// Takes the outcome of the stretch in flight if it is done (with `wait`, once
    /// it is). One that failed is only reported: the record that needs the room
    /// writes the zeros itself, and meets the failure there.
    fn collect(&mut self, wait: bool) {
        if !wait && !self.ahead.as_ref().is_some_and(|h| h.is_finished()) {
            return;
        }
        let Some(handle) = self.ahead.take() else {
            return;
        };
        match handle.join() {
            Ok(Ok(zeroed)) => self.zeroed = self.zeroed.max(zeroed),
            Ok(Err(e)) => {
                tracing::warn!(path = %self.path, error = %e, "could not zero ahead; appends will")
            }
            Err(_) => tracing::warn!(path = %self.path, "the thread zeroing ahead panicked"),
        }
    }
}

impl Drop for ZerosAhead {
    /// Waits for a stretch still being written (a few milliseconds at most): the
    /// file may be opened again at once, and appends there must not meet zeros
    /// landing late.
    fn drop(&mut self) {
        self.collect(true);
    }
}

/// Writes `len` zeros at `from` (the file's end) a piece at a time, each written out
/// before the next, and syncs them. Returns the file's new length.
fn zero(file: &File, from: u64, len: u64) -> io::Result<u64> {
    let zeros = vec![0u8; PIECE as usize];
    let mut at = from;
    while at < from + len {
        let n = PIECE.min(from + len - at);
        file.write_all_at(&zeros[..n as usize], at)?;
        write_out(file, at, n)?;
        at += n;
    }
    file.sync_data()?;
    Ok(from + len)
}

/// Writes `bytes` at `at` a piece at a time, each written to disk before the next
/// (no sync: the caller's follows), so a file of megabytes written beside the Raft
/// log (a snapshot, the log's next generation) never queues more than a piece ahead
/// of the log's own appends on the disk.
pub fn write_paced(file: &File, at: u64, bytes: &[u8]) -> io::Result<()> {
    for (i, piece) in bytes.chunks(PIECE as usize).enumerate() {
        let from = at + i as u64 * PIECE;
        file.write_all_at(piece, from)?;
        write_out(file, from, piece.len() as u64)?;
    }
    Ok(())
}

/// Writes bytes `at..at + len` of `file` to the disk and waits for them (Linux's
/// `sync_file_range`; no journal commit, no cache flush: the `fdatasync` after
/// does those). Elsewhere a no-op.
#[cfg(target_os = "linux")]
fn write_out(file: &File, at: u64, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let (Ok(at), Ok(len)) = (libc::off64_t::try_from(at), libc::off64_t::try_from(len)) else {
        return Ok(());
    };
    let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
        | libc::SYNC_FILE_RANGE_WRITE
        | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    // SAFETY: the descriptor is `file`'s, open for the whole call, and the other
    // arguments are integers. The call reads and writes no memory of ours.
    #[allow(unsafe_code)]
    let done = unsafe { libc::sync_file_range(file.as_raw_fd(), at, len, flags) };
    if done == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn write_out(_: &File, _: u64, _: u64) -> io::Result<()> {
    Ok(())
}
