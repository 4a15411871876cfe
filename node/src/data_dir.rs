//! The data directory's format stamp: which data format wrote what a directory
//! holds, so a build of another format refuses it by name instead of misreading
//! its Raft log, snapshots or blobs.
//!
//! A directory is stamped (`data-format`) when a node first starts on it. One that
//! holds a mesh's state (its cluster id, Raft storage or blobs) but no stamp was
//! written by a build from before formats were numbered, and is refused as well.
//! Key files (`node.key`, `cluster.key`, `api.token`) are plain text and read by
//! every build: a directory holding only those is stamped and used.
//!
//! A directory of an older format whose every file this build reads as it is
//! ([`READS_AS_IS`]) is stamped with this format when a node opens it: the whole
//! mesh moves to the new build without starting afresh. It is one way: the older
//! build refuses the directory from then on (its pack may hold blobs it would
//! misread).

use std::io::Write;
use std::path::Path;

use gpumesh_protocol::FORMAT;

use crate::admission::CLUSTER_FILE;
use crate::error::{NodeError, Result};

/// The stamp's file name in the data directory.
pub const FORMAT_FILE: &str = "data-format";

/// What a build of this format may not read unless the directory is stamped.
const STATE: [&str; 3] = [CLUSTER_FILE, "raft.redb", "blobs"];

/// Older formats whose directories this build reads as they are, stamped with
/// [`FORMAT`] on opening: 9 differs from 10 only on the wire (a new state sent
/// whole), 8 from 9 only in merge rules added (every record of 8 reads the same in
/// 9), 7 from 8 only on the wire (a node request added), and 6 from 7 only in the
/// largest blob its pack takes (256 KiB, then 4 MiB), so a directory of any of
/// them is one of 10.
const READS_AS_IS: [u16; 4] = [6, 7, 8, 9];

/// A running node's hold on its data dir (an exclusive `flock` of the directory
/// itself, so nothing is written for it): a second node started on the same
/// directory is refused before it reads or writes anything there. It goes when
/// dropped, or with the process, however that ends.
#[derive(Debug)]
pub struct DirLock(#[allow(dead_code)] std::fs::File);

/// Takes `dir`'s [`DirLock`], or says that another node holds it. Where the file
/// system takes no locks, a warning, and no lock.
pub fn lock(dir: &Path) -> Result<DirLock> {
    let handle = std::fs::File::open(dir).map_err(|e| NodeError::io(dir, e))?;
    match handle.try_lock() {
        Ok(()) => Ok(DirLock(handle)),
        Err(std::fs::TryLockError::WouldBlock) => Err(NodeError::Config(format!(
            "the data dir {} is in use by another gpumesh node; stop that node first, or start \
             this one with another --data-dir",
            dir.display()
        ))),
        // A file system without locks (some network ones): the node starts, as it
        // did before there was a lock, and says so.
        Err(std::fs::TryLockError::Error(e)) => {
            tracing::warn!(
                dir = %dir.display(),
                error = %e,
                "could not lock the data dir; starting without the lock: make sure no other \
                 gpumesh node uses it"
            );
            Ok(DirLock(handle))
        }
    }
}

/// Checks that `dir` was written by this data format, stamping it if it holds no
/// mesh state yet; an error names the format found and what to do.
pub fn check_or_stamp(dir: &Path) -> Result<()> {
    let path = dir.join(FORMAT_FILE);
    // A stamp cut short by a crash before its rename: the stamp is whole either way.
    let _ = std::fs::remove_file(dir.join(format!("{FORMAT_FILE}.tmp")));
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let found = parse(&text).ok_or_else(|| {
                NodeError::Config(format!(
                    "{} is corrupt ({:?}); it should say which gpumesh data format wrote the \
                     directory",
                    path.display(),
                    text.trim()
                ))
            })?;
            if found == FORMAT {
                return Ok(());
            }
            if READS_AS_IS.contains(&found) {
                tracing::info!(
                    dir = %dir.display(),
                    from = found,
                    to = FORMAT,
                    "the data directory was written by an older data format that this build \
                     reads as it is; stamped with this one (builds of the older format now \
                     refuse it)"
                );
                return stamp(dir);
            }
            Err(refused(dir, &format!("gpumesh data format {found}")))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if STATE.iter().any(|name| dir.join(name).exists()) {
                return Err(refused(
                    dir,
                    "a gpumesh build from before data formats were numbered",
                ));
            }
            stamp(dir)
        }
        Err(e) => Err(NodeError::io(&path, e)),
    }
}

fn refused(dir: &Path, writer: &str) -> NodeError {
    NodeError::Config(format!(
        "the data directory {} was written by {writer}; this build reads data format \
         {FORMAT} (and opens {READS_AS_IS:?} as {FORMAT}) only. Start this node on an empty \
         --data-dir (it joins the mesh afresh: every node of a mesh must run one data \
         format), or run the build that wrote it",
        dir.display()
    ))
}

fn parse(text: &str) -> Option<u16> {
    text.trim()
        .strip_prefix("gpumesh data format ")?
        .parse()
        .ok()
}

/// Writes the stamp durably, whole or not at all (over an older one): a file
/// beside it, synced, renamed over it, then the directory entry synced.
fn stamp(dir: &Path) -> Result<()> {
    let path = dir.join(FORMAT_FILE);
    let write = || -> std::io::Result<()> {
        let next = dir.join(format!("{FORMAT_FILE}.tmp"));
        let mut file = std::fs::File::create(&next)?;
        writeln!(file, "gpumesh data format {FORMAT}")?;
        file.sync_all()?;
        std::fs::rename(&next, &path)?;
        std::fs::File::open(dir)?.sync_all()
    };
    write().map_err(|e| NodeError::io(&path, e))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_fresh_directory_is_stamped_and_reopened() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("node.key"),
            "a key file is read by any build",
        )
        .unwrap();
        check_or_stamp(dir.path()).unwrap();
        let text = std::fs::read_to_string(dir.path().join(FORMAT_FILE)).unwrap();
        assert_eq!(parse(&text), Some(FORMAT));
        std::fs::create_dir(dir.path().join("blobs")).unwrap();
        // A stamp cut short by a crash (written, not yet renamed) goes at the next
        // opening; the stamp stays.
        let cut = dir.path().join(format!("{FORMAT_FILE}.tmp"));
        std::fs::write(&cut, "gpumesh data fo").unwrap();
        check_or_stamp(dir.path()).unwrap();
        assert!(!cut.exists());
        let again = std::fs::read_to_string(dir.path().join(FORMAT_FILE)).unwrap();
        assert_eq!(again, text);
    }

    #[test]
    fn another_format_or_none_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FORMAT_FILE), "gpumesh data format 4\n").unwrap();
        let why = check_or_stamp(dir.path()).unwrap_err().to_string();
        assert!(why.contains("data format 4") && why.contains(&format!("format {FORMAT}")));
        assert!(why.contains("empty --data-dir"), "{why}");

        for state in STATE {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join(state), "").unwrap();
            let why = check_or_stamp(dir.path()).unwrap_err().to_string();
            assert!(
                why.contains("before data formats were numbered"),
                "{state}: {why}"
            );
            assert!(
                !dir.path().join(FORMAT_FILE).exists(),
                "{state}: stamped anyway"
            );
        }

        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FORMAT_FILE), "format five").unwrap();
        let why = check_or_stamp(dir.path()).unwrap_err().to_string();
        assert!(why.contains("corrupt"), "{why}");

        // A newer format than this build's: refused, the stamp left as it was.
        let dir = tempfile::tempdir().unwrap();
        let newer = format!("gpumesh data format {}\n", FORMAT + 1);
        std::fs::write(dir.path().join(FORMAT_FILE), &newer).unwrap();
        let why = check_or_stamp(dir.path()).unwrap_err().to_string();
        assert!(
            why.contains(&format!("data format {}", FORMAT + 1)),
            "{why}"
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join(FORMAT_FILE)).unwrap(),
            newer
        );
    }

    #[test]
    fn a_directory_of_a_format_read_as_it_is_is_stamped_with_this_one_and_opened() {
        for older in READS_AS_IS {
            let dir = tempfile::tempdir().unwrap();
            std::fs::create_dir(dir.path().join("blobs")).unwrap();
            std::fs::write(dir.path().join("blobs").join("small.pack"), b"kept").unwrap();
            std::fs::write(
                dir.path().join(FORMAT_FILE),
                format!("gpumesh data format {older}\n"),
            )
            .unwrap();
            check_or_stamp(dir.path()).unwrap();
            let text = std::fs::read_to_string(dir.path().join(FORMAT_FILE)).unwrap();
            assert_eq!(parse(&text), Some(FORMAT), "{older}: {text:?}");
            assert!(!dir.path().join(format!("{FORMAT_FILE}.tmp")).exists());
            // What it held is untouched, and it opens again as this format's.
            assert_eq!(
                std::fs::read(dir.path().join("blobs").join("small.pack")).unwrap(),
                b"kept"
            );
            check_or_stamp(dir.path()).unwrap();
        }
    }
}
