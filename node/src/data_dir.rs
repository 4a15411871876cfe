//! The data directory's format stamp: which data format wrote what a directory
//! holds, so a build of another format refuses it by name instead of misreading
//! its Raft log, snapshots or blobs.
//!
//! A directory is stamped (`data-format`) when a node first starts on it. One that
//! holds a mesh's state (its cluster id, Raft storage or blobs) but no stamp was
//! written by a build from before formats were numbered, and is refused as well.
//! Key files (`node.key`, `cluster.key`, `api.token`) are plain text and read by
//! every build: a directory holding only those is stamped and used.

use std::io::Write;
use std::path::Path;

use gpumesh_protocol::FORMAT;

use crate::admission::CLUSTER_FILE;
use crate::error::{NodeError, Result};

/// The stamp's file name in the data directory.
pub const FORMAT_FILE: &str = "data-format";

/// What a build of this format may not read unless the directory is stamped.
const STATE: [&str; 3] = [CLUSTER_FILE, "raft.redb", "blobs"];

/// Checks that `dir` was written by this data format, stamping it if it holds no
/// mesh state yet; an error names the format found and what to do.
pub fn check_or_stamp(dir: &Path) -> Result<()> {
    let path = dir.join(FORMAT_FILE);
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
         {FORMAT} only. Start this node on an empty --data-dir (it joins the mesh afresh: \
         every node of a mesh must run one data format), or run the build that wrote it",
        dir.display()
    ))
}

fn parse(text: &str) -> Option<u16> {
    text.trim()
        .strip_prefix("gpumesh data format ")?
        .parse()
        .ok()
}

/// Writes the stamp durably: the file, then the directory entry.
fn stamp(dir: &Path) -> Result<()> {
    let path = dir.join(FORMAT_FILE);
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::File::create(&path)?;
        writeln!(file, "gpumesh data format {FORMAT}")?;
        file.sync_all()?;
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
        check_or_stamp(dir.path()).unwrap();
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
    }
}
