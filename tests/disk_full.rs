//! A node whose disk fills up, on a real (small) file system of its own: a `gpumesh
//! node` process with its data dir on a tmpfs (root, to mount it; skipped loudly
//! elsewhere). With the disk full an upload is refused as such, a task fails with
//! the disk's own error, and the node still answers; once its Raft log cannot be written, the node stops with an
//! exit status and a message saying what to do, rather than run on as a member
//! that records nothing; given room and started again, it comes back with every
//! result it had, and runs new tasks. A leader at its disk reserve, among three
//! processes, still merges tasks, its outputs kept by the others.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::procs;
use common::{have_any, salted_expected, salted_spec};
use gpumesh::protocol::ShaderSource;

/// A tmpfs mounted for the test, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, mib: u32) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
        }
        Ok(Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A tmpfs of `mib` MiB mounted on `dir`; `None` (said loudly, and a failure where
/// GPUMESH_REQUIRE_TMPFS says one mounts) where none can be.
fn tmpfs_or_skip(dir: &Path, mib: u32) -> Option<Tmpfs> {
    match Tmpfs::mount(dir, mib) {
        Ok(disk) => Some(disk),
        Err(why) => {
            assert!(
                std::env::var("GPUMESH_REQUIRE_TMPFS").is_err(),
                "GPUMESH_REQUIRE_TMPFS is set but a tmpfs cannot be mounted: {why}"
            );
            common::skipped(&format!("NO TMPFS ({why}): a full-disk test did not run"));
            None
        }
    }
}

/// Writes zeros into `path` until the file system has no room left.
fn fill(path: &Path) {
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![0u8; 1 << 20];
    while f.write_all(&chunk).and_then(|()| f.sync_data()).is_ok() {}
}

/// A node, formed with `--init` and `--disk-reserve reserve`, whose data dir is a
/// tmpfs of `mib` MiB of its own (its log, beside it, is not on it), with a
/// client; `None` (said loudly) where there is no adapter or no tmpfs can be
/// mounted. Dropped in reverse, the tmpfs goes before the directory holding it.
fn node_on_tmpfs(
    mib: u32,
    reserve: u64,
) -> Option<(tempfile::TempDir, Tmpfs, procs::Proc, gpumesh::Client)> {
    if !have_any() {
        return None;
    }
    let root = tempfile::tempdir().unwrap();
    let disk = tmpfs_or_skip(&root.path().join("a"), mib)?;
    let mut node = procs::node(root.path(), "a");
    node.start(&["--init", "--disk-reserve", &reserve.to_string()])
        .unwrap();
    let client = node.client().unwrap().retry_for(Duration::from_secs(10));
    Some((root, disk, node, client))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_disk_fills_stops_when_its_log_cannot_be_written_and_comes_back_whole() {
    // No reserve: the disk fills to the last byte.
    let Some((_root, disk, mut node, client)) = node_on_tmpfs(24, 0) else {
        return;
    };
    let before = client.submit(salted_spec(4096, 1), None).await.unwrap();
    client.wait(before, |_, _| {}).await.unwrap();
    assert_eq!(
        client.results(before).await.unwrap()[&0],
        salted_expected(4096, 1)
    );

    // Full: an upload is refused at once as 507 (not retried as a 503 would be),
    // a task fails saying so, and the node still answers.
    fill(&disk.0.join("filler"));
    let e = client
        .upload(vec![7u8; 1 << 20])
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("disk is full") && !e.contains("retrying"), "{e}");
    let full = client.submit(salted_spec(65_536, 2), None).await.unwrap();
    let e = client.wait(full, |_, _| {}).await.unwrap_err().to_string();
    assert!(e.contains("No space left on device"), "{e}");
    assert!(node.running(), "the node stopped on a task's output");
    client.status().await.unwrap();

    // Submits whose specs (a long comment in the source) fill what the Raft log
    // had room for: the node stops, saying why and what to do.
    let quick = node.client().unwrap().retry_for(Duration::ZERO);
    let padding = format!("\n// {}\n", "x".repeat(200_000));
    let began = Instant::now();
    let mut submits = 0;
    while node.running() && submits < 200 {
        let mut spec = salted_spec(128, 3 + submits);
        if let ShaderSource::Wgsl(source) = &mut spec.shader {
            source.push_str(&padding);
        }
        if let Err(e) = quick.submit(spec, None).await {
            if submits < 3 {
                eprintln!("submit {submits}: {e}");
            }
        }
        submits += 1;
    }
    let status = node
        .wait_exit(Duration::from_secs(30))
        .unwrap()
        .expect("the node stops once its Raft log cannot be written");
    // EX_TEMPFAIL: a supervisor's cue to start it again, once there is room.
    assert_eq!(status.code(), Some(75), "{status:?}");
    let log = std::fs::read_to_string(node.log_path()).unwrap();
    assert!(
        log.contains("Raft storage failed") && log.contains("free disk space"),
        "{log}"
    );
    eprintln!(
        "stopped after {submits} large submits, {:?}: {}",
        began.elapsed(),
        log.lines()
            .rev()
            .find(|l| l.contains("Raft storage failed"))
            .unwrap_or_default()
    );

    // Room again: started on its data dir, it has every result and runs tasks.
    std::fs::remove_file(disk.0.join("filler")).unwrap();
    node.start(&["--disk-reserve", "0"]).unwrap();
    let client = node.client().unwrap().retry_for(Duration::from_secs(30));
    assert_eq!(
        client.results(before).await.unwrap()[&0],
        salted_expected(4096, 1)
    );
    let after = client.submit(salted_spec(4096, 9), None).await.unwrap();
    client.wait(after, |_, _| {}).await.unwrap();
    assert_eq!(
        client.results(after).await.unwrap()[&0],
        salted_expected(4096, 9)
    );
    node.kill9();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_full_before_the_first_small_blob_does_not_keep_small_blobs_out_once_freed() {
    let Some((_root, disk, mut node, client)) = node_on_tmpfs(16, 0) else {
        return;
    };
    // Full before this node kept any small blob (its pack is made with the first).
    fill(&disk.0.join("filler"));
    let e = client
        .upload(vec![1u8; 4096])
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("disk is full"), "{e}");
    // Room again, without a restart: small blobs are kept, and tasks run.
    std::fs::remove_file(disk.0.join("filler")).unwrap();
    let small = vec![2u8; 4096];
    let id = client.upload(small.clone()).await.unwrap();
    assert_eq!(id, gpumesh::protocol::BlobId::of(&small));
    let task = client.submit(salted_spec(4096, 5), None).await.unwrap();
    client.wait(task, |_, _| {}).await.unwrap();
    assert_eq!(
        client.results(task).await.unwrap()[&0],
        salted_expected(4096, 5)
    );
    node.kill9();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_at_its_disk_reserve_refuses_new_data_and_its_record_goes_on() {
    // 48 MiB with 32 kept free: some 10 MiB for data once the log's files are made.
    let Some((_root, disk, mut node, client)) = node_on_tmpfs(48, 32 << 20) else {
        return;
    };
    let before = client.submit(salted_spec(4096, 1), None).await.unwrap();
    client.wait(before, |_, _| {}).await.unwrap();
    // Uploads of 2 MiB each until one is refused, naming the reserve.
    let mut refused = None;
    for i in 0..20u8 {
        match client.upload(vec![i; 2 << 20]).await {
            Ok(_) => {}
            Err(e) => {
                refused = Some(e.to_string());
                break;
            }
        }
    }
    let e = refused.expect("uploads refused at the reserve");
    assert!(
        e.contains("disk reserve") && e.contains("--disk-reserve") && !e.contains("retrying"),
        "{e}"
    );
    // The record goes on: a task is recorded, and fails saying why, through the
    // reserve, not the disk; the result kept before is served.
    // (4 MiB a shard: more than the under 2 MiB the uploads left above the reserve.)
    let task = client.submit(salted_spec(2 << 20, 2), None).await.unwrap();
    let e = client.wait(task, |_, _| {}).await.unwrap_err().to_string();
    assert!(e.contains("disk reserve"), "{e}");
    assert_eq!(
        client.results(before).await.unwrap()[&0],
        salted_expected(4096, 1)
    );
    let free = {
        let out = Command::new("df").arg("-B1").arg(&disk.0).output().unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    eprintln!(
        "at the reserve: {}",
        free.lines().last().unwrap_or_default()
    );
    assert!(node.running());
    node.kill9();
}

/// A leader at its disk reserve, in a mesh of three processes as the README starts
/// them (its data dir alone on a small tmpfs): a task of two shards is merged all
/// the same, its outputs kept by the two other members, and fetched through any
/// node, the full leader included (from memory). Before, the
/// leader pulled the shards' results onto its own disk to merge them and stored
/// the merged output there, was refused each time by its reserve, and the task
/// stayed `merging` for as long as that node led.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_at_its_disk_reserve_still_merges_keeping_the_outputs_elsewhere() {
    if !have_any() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let Some(_disk) = tmpfs_or_skip(&root.path().join("a"), 48) else {
        return;
    };
    let mut procs: Vec<procs::Proc> = ["a", "b", "c"]
        .iter()
        .map(|n| procs::node(root.path(), n))
        .collect();
    procs[0]
        .start(&["--init", "--disk-reserve", &(32u64 << 20).to_string()])
        .unwrap();
    let ticket = procs[0].ticket().unwrap();
    for p in &mut procs[1..] {
        p.start(&["--join", &ticket]).unwrap();
    }
    let status = procs::three_voters(&procs).await;
    let clients: Vec<gpumesh::Client> = procs
        .iter()
        .map(|p| p.client().unwrap().retry_for(Duration::from_secs(10)))
        .collect();
    let a = clients[0].status().await.unwrap().node;
    assert_eq!(status.leader, a, "a formed the mesh and leads it");
    // Uploads to a until its reserve refuses one.
    let mut refused = None;
    for i in 0..20u8 {
        if let Err(e) = clients[0].upload(vec![i; 2 << 20]).await {
            refused = Some(e.to_string());
            break;
        }
    }
    let e = refused.expect("uploads refused at the reserve");
    assert!(e.contains("disk reserve"), "{e}");

    // 4 MiB merged from two shards: more than a has room for.
    let n = 1 << 20;
    let task = clients[1].submit(salted_spec(n, 5), None).await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), clients[1].wait(task, |_, _| {}))
        .await
        .expect("merged within a minute, the leader's disk full")
        .unwrap();
    assert_eq!(
        clients[0].status().await.unwrap().leader,
        a,
        "a still leads: it merged"
    );
    for c in &clients[1..] {
        assert_eq!(c.results(task).await.unwrap()[&0], salted_expected(n, 5));
    }
    // Through the full leader too: served from memory, as is a task of one shard.
    assert_eq!(
        clients[0].results(task).await.unwrap()[&0],
        salted_expected(n, 5)
    );
    let mut one = salted_spec(1 << 19, 6);
    one.shards = 1;
    let one = clients[2].submit(one, None).await.unwrap();
    clients[2].wait(one, |_, _| {}).await.unwrap();
    assert_eq!(
        clients[0].results(one).await.unwrap()[&0],
        salted_expected(1 << 19, 6)
    );
    for p in &mut procs {
        p.kill9();
    }
}
