//! RedbStorage: what it persists survives reopening; corrupt or foreign data is refused.

mod common;

use common::CLUSTER;
use gpumesh_consensus::storage::SEGMENT;
use gpumesh_consensus::{ClusterId, ClusterSettings, ConsensusError, RedbStorage};
use protobuf::Message as _;
use raft::eraftpb::{Entry, HardState, Snapshot};
use raft::{GetEntriesContext, Storage};
use redb::TableHandle as _;

fn entry(index: u64, term: u64) -> Entry {
    Entry {
        index,
        term,
        data: format!("entry {index}").into_bytes().into(),
        ..Default::default()
    }
}

fn settings() -> ClusterSettings {
    ClusterSettings { max_voters: 5 }
}

fn initialized(path: &std::path::Path) -> RedbStorage {
    let mut s = RedbStorage::open(path, CLUSTER).expect("open");
    s.initialize(
        &[(1, "p1".into()), (2, "p2".into()), (3, "p3".into())],
        settings(),
    )
    .expect("init");
    s
}

#[test]
fn entries_hard_state_and_snapshot_survive_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("raft.redb");
    {
        let mut s = initialized(&path);
        assert_eq!((s.first(), s.last()), (2, 1));
        let ents: Vec<Entry> = (2..=10).map(|i| entry(i, 2)).collect();
        let hs = HardState {
            term: 2,
            vote: 1,
            commit: 5,
            ..Default::default()
        };
        s.persist(None, &ents, Some(&hs)).expect("persist");
        // A conflicting suffix from a new leader replaces entries 8..=10.
        s.persist(None, &[entry(8, 3), entry(9, 3)], None)
            .expect("overwrite");
        assert_eq!(s.last(), 9);
    }
    let s = RedbStorage::open(&path, CLUSTER).expect("reopen");
    assert_eq!((s.first(), s.last()), (2, 9));
    assert_eq!(s.term(7).expect("term"), 2);
    assert_eq!(s.term(8).expect("term"), 3);
    assert_eq!(s.term(1).expect("snapshot term"), 1);
    let got = s
        .entries(2, 10, None, GetEntriesContext::empty(false))
        .expect("entries");
    assert_eq!(got.len(), 8);
    assert_eq!(got[6], entry(8, 3));
    let st = s.initial_state().expect("state");
    assert_eq!(
        (st.hard_state.term, st.hard_state.vote, st.hard_state.commit),
        (2, 1, 5)
    );
    assert_eq!(st.conf_state.voters, vec![1, 2, 3]);
    assert_eq!(s.snapshot_state().expect("sm").members().len(), 3);
}

#[test]
fn compaction_keeps_the_tail_and_snapshots_replace_the_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("raft.redb");
    let mut s = initialized(&path);
    let ents: Vec<Entry> = (2..=20).map(|i| entry(i, 2)).collect();
    s.persist(None, &ents, None).expect("persist");
    let state = s.snapshot_state().expect("sm");
    let mut snap = Snapshot {
        data: state.to_bytes().expect("bytes").into(),
        ..Default::default()
    };
    snap.mut_metadata().index = 15;
    snap.mut_metadata().term = 2;
    snap.mut_metadata().mut_conf_state().voters = vec![1, 2, 3];
    s.compact(snap, 12).expect("compact");
    assert_eq!((s.first(), s.last()), (12, 20));
    assert!(matches!(
        s.entries(5, 8, None, GetEntriesContext::empty(false)),
        Err(raft::Error::Store(raft::StorageError::Compacted))
    ));
    assert_eq!(s.term(11).expect("term of the truncation point"), 2);
    assert_eq!(s.snapshot(0, 1).expect("snapshot").get_metadata().index, 15);
    // A snapshot without the receiver in its conf state is not handed out.
    assert!(s.snapshot(0, 9).is_err());
    assert!(s.take_snapshot_request());
    drop(s);

    let mut s = RedbStorage::open(&path, CLUSTER).expect("reopen");
    assert_eq!((s.first(), s.last()), (12, 20));
    assert!(
        s.hard_state().commit >= 15,
        "a snapshot's index is committed"
    );
    // A snapshot from the leader replaces the whole log.
    let mut snap = Snapshot {
        data: s
            .snapshot_state()
            .expect("sm")
            .to_bytes()
            .expect("bytes")
            .into(),
        ..Default::default()
    };
    snap.mut_metadata().index = 40;
    snap.mut_metadata().term = 4;
    snap.mut_metadata().mut_conf_state().voters = vec![1, 2, 3];
    s.persist(Some(&snap), &[entry(41, 4)], None)
        .expect("install");
    drop(s);
    let s = RedbStorage::open(&path, CLUSTER).expect("reopen");
    assert_eq!((s.first(), s.last()), (41, 41));
    assert_eq!(s.term(40).expect("term"), 4);
    assert_eq!(s.hard_state().commit, 40);
}

#[test]
fn the_entries_kept_behind_a_snapshot_are_bounded_in_bytes_and_held_entries_reach_the_index() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut s = initialized(&dir.path().join("raft.redb"));
    // Entries 2..=11 of 100 bytes each.
    let ents: Vec<Entry> = (2..=11)
        .map(|i| Entry {
            index: i,
            term: 2,
            data: vec![i as u8; 100].into(),
            ..Default::default()
        })
        .collect();
    s.persist(None, &ents, None).expect("persist");
    let first = s.first();
    // Room for everything from `from` on: `from` itself.
    assert_eq!(s.keep_from(first, 11, 10_000), first);
    // 350 bytes hold the last three entries, 300 bytes too; 99 not even one.
    assert_eq!(s.keep_from(first, 11, 350), 9);
    assert_eq!(s.keep_from(first, 11, 300), 9);
    assert_eq!(s.keep_from(first, 11, 99), 12);
    // Never before `from`, and up to `upto` only.
    assert_eq!(s.keep_from(10, 11, 10_000), 10);
    assert_eq!(s.keep_from(first, 8, 200), 7);
    let held: Vec<u64> = s.held_entries(5).map(|e| e.index).collect();
    assert_eq!(held, (first..=5).collect::<Vec<_>>());
    assert_eq!(s.held_entries(100).count() as u64, 11 - first + 1);
}

#[test]
fn storage_of_another_cluster_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("raft.redb");
    drop(initialized(&path));
    let err = RedbStorage::open(&path, ClusterId(7)).expect_err("must refuse");
    assert!(
        matches!(err, ConsensusError::ClusterMismatch { .. }),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains(&CLUSTER.to_string()) && text.contains("refusing"),
        "{text}"
    );
    // The refusal changed nothing: the right cluster still opens.
    RedbStorage::open(&path, CLUSTER).expect("still ours");
}

#[test]
fn a_garbage_file_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("raft.redb");
    let mut rng = gpumesh_consensus::sim::SplitMix64::new(99);
    let junk: Vec<u8> = (0..65536).map(|_| rng.next_u64() as u8).collect();
    std::fs::write(&path, &junk).expect("write");
    let err = RedbStorage::open(&path, CLUSTER).expect_err("must refuse");
    assert!(
        err.to_string().contains("raft.redb"),
        "names the file: {err}"
    );
}

#[test]
fn a_damaged_database_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("raft.redb");
    {
        let mut s = initialized(&path);
        s.persist(None, &[entry(2, 1), entry(3, 1)], None)
            .expect("persist");
    }
    // Flip bytes in the middle of the file, where redb keeps pages.
    let mut bytes = std::fs::read(&path).expect("read");
    let len = bytes.len();
    for b in &mut bytes[len / 3..len / 3 + 4096] {
        *b ^= 0x5a;
    }
    std::fs::write(&path, &bytes).expect("write");
    match RedbStorage::open(&path, CLUSTER) {
        Err(e) => assert!(e.to_string().contains("raft.redb"), "{e}"),
        // Damage may land in free pages; then the data must still be intact.
        Ok(s) => assert_eq!(s.last(), 3),
    }
}

#[test]
fn an_undecodable_hard_state_is_refused() {
    const META: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("raft.redb");
    {
        let mut s = initialized(&path);
        s.persist(None, &[entry(2, 1)], None).expect("persist");
    }
    {
        let db = redb::Database::create(&path).expect("raw open");
        let txn = db.begin_write().expect("txn");
        txn.open_table(META)
            .expect("meta")
            .insert("hard_state", [0xffu8; 7].as_slice())
            .expect("insert");
        txn.commit().expect("commit");
    }
    let err = RedbStorage::open(&path, CLUSTER).expect_err("must refuse");
    assert!(
        matches!(err, ConsensusError::CorruptStorage { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("hard state"), "{err}");
}

#[test]
fn a_foreign_redb_database_is_refused() {
    const OTHER: redb::TableDefinition<u64, u64> = redb::TableDefinition::new("accounts");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("other.redb");
    {
        let db = redb::Database::create(&path).expect("create");
        let txn = db.begin_write().expect("txn");
        txn.open_table(OTHER)
            .expect("table")
            .insert(1, 2)
            .expect("insert");
        txn.commit().expect("commit");
    }
    let err = RedbStorage::open(&path, CLUSTER).expect_err("must refuse");
    assert!(
        matches!(err, ConsensusError::CorruptStorage { .. }),
        "{err}"
    );
}

#[test]
fn a_commit_index_alone_is_not_written_until_the_next_append() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("raft.redb");
    {
        let mut s = initialized(&path);
        let ents: Vec<Entry> = (2..=6).map(|i| entry(i, 2)).collect();
        let hs = |commit| HardState {
            term: 2,
            vote: 1,
            commit,
            ..Default::default()
        };
        s.persist(None, &ents, Some(&hs(3))).expect("persist");
        // Only the commit index moved: kept in memory, no fsync of its own.
        s.persist(None, &[], Some(&hs(5))).expect("commit");
        assert_eq!(s.initial_state().expect("state").hard_state.commit, 5);
    }
    {
        // Lost in the "crash": the durable commit index is the last written one,
        // which Raft may trail safely (the leader tells it again).
        let mut s = RedbStorage::open(&path, CLUSTER).expect("reopen");
        assert_eq!(s.initial_state().expect("state").hard_state.commit, 3);
        assert_eq!(s.last(), 6);
        // It reaches the disk with the next append.
        let hs = HardState {
            term: 2,
            vote: 1,
            commit: 6,
            ..Default::default()
        };
        s.persist(None, &[entry(7, 2)], Some(&hs)).expect("append");
    }
    let s = RedbStorage::open(&path, CLUSTER).expect("reopen");
    assert_eq!(s.initial_state().expect("state").hard_state.commit, 6);
    // A new term or vote is written at once, like entries.
    drop(s);
    let mut s = RedbStorage::open(&path, CLUSTER).expect("reopen");
    let voted = HardState {
        term: 3,
        vote: 2,
        commit: 6,
        ..Default::default()
    };
    s.persist(None, &[], Some(&voted)).expect("vote");
    drop(s);
    let s = RedbStorage::open(&path, CLUSTER).expect("reopen");
    let st = s.initial_state().expect("state").hard_state;
    assert_eq!((st.term, st.vote), (3, 2));
}

/// The snapshot the store at `path` names in a file of its own (read with redb
/// closed).
fn snapshot_in_file(path: &std::path::Path) -> Snapshot {
    const META: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");
    let generation = {
        let db = redb::Database::create(path).expect("raw open");
        let txn = db.begin_read().expect("txn");
        let meta = txn.open_table(META).expect("meta");
        let bytes = meta
            .get("snapshot_file")
            .expect("get")
            .expect("a snapshot file");
        u64::from_le_bytes(bytes.value().try_into().expect("8 bytes"))
    };
    gpumesh_consensus::snapfile::read(path, generation, CLUSTER).expect("the snapshot file")
}

/// The snapshot files of the store in `dir`, by name.
fn snapshot_files(dir: &std::path::Path) -> Vec<String> {
    files_named(dir, ".snap-")
}

/// The files of the store's log in `dir`, by name.
fn log_files(dir: &std::path::Path) -> Vec<String> {
    files_named(dir, ".log-")
}

/// The files in `dir` whose names hold `infix`, sorted.
fn files_named(dir: &std::path::Path, infix: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(infix))
        .collect();
    names.sort();
    names
}

#[test]
fn stores_from_before_the_log_file_move_their_log_into_one() {
    const META: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");
    const SNAPSHOT: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("snapshot");
    let last = SEGMENT + 10;
    let want: Vec<Entry> = (2..=last).map(|i| entry(i, 1)).collect();
    // The first layout: the snapshot in `meta`, the log one table; the second: the
    // log in segments of SEGMENT entries. Neither had a log file.
    for layout in ["one table", "segments"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("raft.redb");
        drop(initialized(&path));
        // The snapshot, which has a file of its own now, goes back into redb.
        let snapshot = snapshot_in_file(&path).write_to_bytes().expect("snapshot");
        for f in log_files(dir.path())
            .into_iter()
            .chain(snapshot_files(dir.path()))
        {
            std::fs::remove_file(dir.path().join(f)).expect("remove");
        }
        {
            let db = redb::Database::create(&path).expect("raw open");
            let txn = db.begin_write().expect("txn");
            {
                let mut meta = txn.open_table(META).expect("meta");
                meta.remove("log_generation").expect("remove");
                meta.remove("snapshot_file").expect("remove");
                let hs = HardState {
                    term: 1,
                    vote: 2,
                    commit: 4,
                    ..Default::default()
                };
                meta.insert("hard_state", hs.write_to_bytes().expect("hs").as_slice())
                    .expect("insert");
                if layout == "one table" {
                    meta.insert("snapshot", snapshot.as_slice())
                        .expect("insert");
                } else {
                    txn.open_table(SNAPSHOT)
                        .expect("snapshot")
                        .insert("snapshot", snapshot.as_slice())
                        .expect("insert");
                }
            }
            if layout == "one table" {
                txn.delete_table(SNAPSHOT).expect("delete");
            }
            for e in &want {
                let table = match layout {
                    "one table" => "log".to_string(),
                    _ => format!("log.{:012}", e.index / SEGMENT),
                };
                txn.open_table(redb::TableDefinition::<u64, &[u8]>::new(&table))
                    .expect("log table")
                    .insert(e.index, e.write_to_bytes().expect("entry").as_slice())
                    .expect("insert");
            }
            txn.commit().expect("commit");
        }
        for reopen in 0..2 {
            let s = RedbStorage::open(&path, CLUSTER).expect("open the old layout");
            assert_eq!((s.first(), s.last()), (2, last), "{layout}, open {reopen}");
            let got = s
                .entries(2, last + 1, None, GetEntriesContext::empty(false))
                .expect("entries");
            assert_eq!(got, want, "{layout}");
            let hs = s.initial_state().expect("state").hard_state;
            assert_eq!((hs.term, hs.vote, hs.commit), (1, 2, 4), "{layout}");
            assert_eq!(s.snapshot_metadata().index, 1);
            assert_eq!(s.snapshot_state().expect("sm").members().len(), 3);
        }
        assert_eq!(log_files(dir.path()).len(), 1, "{layout}: one log file");
        let db = redb::Database::create(&path).expect("raw open");
        let txn = db.begin_read().expect("txn");
        let meta = txn.open_table(META).expect("meta");
        assert!(
            meta.get("snapshot").expect("get").is_none(),
            "moved out of meta"
        );
        let snapshots = txn.open_table(SNAPSHOT).expect("snapshot");
        assert!(snapshots.get("snapshot").expect("get").is_some());
        let tables: Vec<String> = txn
            .list_tables()
            .expect("tables")
            .map(|t| t.name().to_owned())
            .collect();
        assert!(
            tables.iter().all(|t| !t.starts_with("log")),
            "{layout}: the log tables are gone: {tables:?}"
        );
    }
}

#[test]
fn the_log_survives_compaction_overwrites_and_reopening() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("raft.redb");
    let last = 3 * SEGMENT + 5;
    {
        let mut s = initialized(&path);
        let ents: Vec<Entry> = (2..=last).map(|i| entry(i, 2)).collect();
        s.persist(None, &ents, None).expect("persist");
        // A new leader's suffix from inside the second segment on.
        let from = SEGMENT + 100;
        let ents: Vec<Entry> = (from..=from + 3).map(|i| entry(i, 3)).collect();
        s.persist(None, &ents, None).expect("overwrite");
        assert_eq!(s.last(), from + 3);
    }
    let mut s = RedbStorage::open(&path, CLUSTER).expect("reopen");
    let last = SEGMENT + 103;
    assert_eq!((s.first(), s.last()), (2, last));
    assert_eq!(s.term(SEGMENT + 99).expect("term"), 2);
    assert_eq!(s.term(SEGMENT + 100).expect("term"), 3);
    // Appends go on after the overwritten suffix, into the segments it cut.
    let ents: Vec<Entry> = (last + 1..=2 * SEGMENT + 50).map(|i| entry(i, 3)).collect();
    s.persist(None, &ents, None).expect("append");
    // Compaction to the middle of the second segment drops the first whole.
    let state = s.snapshot_state().expect("sm");
    let mut snap = Snapshot {
        data: state.to_bytes().expect("bytes").into(),
        ..Default::default()
    };
    snap.mut_metadata().index = SEGMENT + 200;
    snap.mut_metadata().term = 3;
    snap.mut_metadata().mut_conf_state().voters = vec![1, 2, 3];
    s.compact(snap, SEGMENT + 150).expect("compact");
    let bytes: usize = (SEGMENT + 150..=2 * SEGMENT + 50)
        .map(|i| entry(i, 3).data.len())
        .sum();
    assert_eq!(
        s.log_bytes(),
        bytes as u64,
        "kept count, cut and compacted do not"
    );
    drop(s);
    let s = RedbStorage::open(&path, CLUSTER).expect("reopen");
    assert_eq!((s.first(), s.last()), (SEGMENT + 150, 2 * SEGMENT + 50));
    let got = s
        .entries(
            SEGMENT + 150,
            2 * SEGMENT + 51,
            None,
            GetEntriesContext::empty(false),
        )
        .expect("entries");
    let want: Vec<Entry> = (SEGMENT + 150..=2 * SEGMENT + 50)
        .map(|i| entry(i, if i < SEGMENT + 100 { 2 } else { 3 }))
        .collect();
    assert_eq!(got, want);
    let bytes: usize = want.iter().map(|e| e.data.len()).sum();
    assert_eq!(s.log_bytes(), bytes as u64, "the bytes of the log held");
    drop(s);
    // The compaction started the log file's next generation; the old file is gone.
    assert_eq!(log_files(dir.path()), ["raft.redb.log-0000000003"]);
}

#[test]
fn appends_after_a_large_snapshot_do_not_write_it_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("raft.redb");
    let mut s = initialized(&path);
    s.persist(None, &[entry(2, 1)], None).expect("persist");
    // Only its size matters here: the bytes are stored, not decoded, until a reopen.
    const SIZE: usize = 4 << 20;
    let mut snap = Snapshot {
        data: vec![7u8; SIZE].into(),
        ..Default::default()
    };
    snap.mut_metadata().index = 2;
    snap.mut_metadata().term = 1;
    snap.mut_metadata().mut_conf_state().voters = vec![1, 2, 3];
    s.compact(snap, 2).expect("compact");
    let size = || std::fs::metadata(&path).expect("size").len();
    let before = size();
    for i in 3..200u64 {
        let hs = HardState {
            term: 1,
            vote: 1,
            commit: i - 1,
            ..Default::default()
        };
        s.persist(None, &[entry(i, 1)], Some(&hs)).expect("persist");
    }
    // Had each append copied the snapshot, the file would hold two of it at least.
    let grew = size() - before;
    assert!(
        grew < SIZE as u64 / 2,
        "file grew {grew} bytes (from {before})"
    );
    assert_eq!(s.snapshot(0, 1).expect("snapshot").data.len(), SIZE);
}

/// Where the last append wrote in the log file: the bytes that differ between the
/// file before and after it.
fn written_by(before: &[u8], after: &[u8]) -> std::ops::Range<usize> {
    let start = (0..after.len())
        .find(|i| before.get(*i) != Some(&after[*i]))
        .expect("a change");
    let end = (0..after.len())
        .rev()
        .find(|i| before.get(*i) != Some(&after[*i]))
        .expect("a change");
    start..end + 1
}

fn the_log_file(dir: &std::path::Path) -> std::path::PathBuf {
    let files = log_files(dir);
    assert_eq!(files.len(), 1, "{files:?}");
    dir.join(&files[0])
}

#[test]
fn a_last_append_cut_short_by_a_crash_is_dropped_and_the_log_goes_on() {
    // Cut two ways: its end never written, or its head never written (the disk may
    // write a record's blocks in any order).
    for cut in ["end", "head"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("raft.redb");
        let hs = |commit| HardState {
            term: 1,
            vote: 1,
            commit,
            ..Default::default()
        };
        let log;
        let range;
        {
            let mut s = initialized(&path);
            for i in 2..=5 {
                s.persist(None, &[entry(i, 1)], Some(&hs(i - 1)))
                    .expect("persist");
            }
            log = the_log_file(dir.path());
            let before = std::fs::read(&log).expect("read");
            s.persist(None, &[entry(6, 1)], Some(&hs(5)))
                .expect("persist");
            range = written_by(&before, &std::fs::read(&log).expect("read"));
        }
        let mut bytes = std::fs::read(&log).expect("read");
        match cut {
            "end" => bytes[range.start + range.len() / 2..range.end].fill(0),
            _ => bytes[range.start..range.start + 8].fill(0),
        }
        std::fs::write(&log, &bytes).expect("write");
        {
            let mut s = RedbStorage::open(&path, CLUSTER).expect("reopen after the cut");
            assert_eq!(s.last(), 5, "cut {cut}: entry 6 was never acknowledged");
            assert_eq!(s.initial_state().expect("state").hard_state.commit, 4);
            // The log goes on from there, with a shorter entry than the cut one.
            let short = Entry {
                index: 6,
                term: 2,
                ..Default::default()
            };
            s.persist(None, std::slice::from_ref(&short), Some(&hs(5)))
                .expect("append");
            s.persist(None, &[entry(7, 2)], Some(&hs(6)))
                .expect("append");
        }
        let s = RedbStorage::open(&path, CLUSTER).expect("reopen");
        assert_eq!((s.first(), s.last()), (2, 7), "cut {cut}");
        let got = s
            .entries(5, 8, None, GetEntriesContext::empty(false))
            .expect("entries");
        assert_eq!(
            got.iter().map(|e| (e.index, e.term)).collect::<Vec<_>>(),
            [(5, 1), (6, 2), (7, 2)],
            "cut {cut}"
        );
        assert_eq!(s.initial_state().expect("state").hard_state.commit, 6);
    }
}

#[test]
fn damage_inside_the_log_file_is_refused() {
    // A flipped bit in entry 3's record, or its length made to run past the file's
    // end, with whole records after it: not a write a crash cut short, so nothing is
    // dropped silently.
    for damage in ["payload", "length"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("raft.redb");
        let range;
        {
            let mut s = initialized(&path);
            s.persist(None, &[entry(2, 1)], None).expect("persist");
            let before = std::fs::read(the_log_file(dir.path())).expect("read");
            s.persist(None, &[entry(3, 1)], None).expect("persist");
            range = written_by(
                &before,
                &std::fs::read(the_log_file(dir.path())).expect("read"),
            );
            s.persist(None, &[entry(4, 1), entry(5, 1)], None)
                .expect("persist");
        }
        let log = the_log_file(dir.path());
        let mut bytes = std::fs::read(&log).expect("read");
        let original = bytes.clone();
        match damage {
            "payload" => bytes[range.start + 20] ^= 0x04,
            _ => bytes[range.start..range.start + 4].copy_from_slice(&u32::MAX.to_le_bytes()),
        }
        std::fs::write(&log, &bytes).expect("write");
        let err = RedbStorage::open(&path, CLUSTER).expect_err("must refuse");
        assert!(
            matches!(err, ConsensusError::CorruptStorage { .. }),
            "{damage}: {err}"
        );
        assert!(
            err.to_string().contains(".log-"),
            "names the log file: {err}"
        );
        // The refusal changed nothing: undamaged, the log opens whole.
        std::fs::write(&log, &original).expect("write");
        let s = RedbStorage::open(&path, CLUSTER).expect("reopen");
        assert_eq!(s.last(), 5, "{damage}");
        drop(s);
        // A log file of another store is refused too, as is a missing one.
        let mut bytes = original;
        bytes[16] ^= 0x01;
        std::fs::write(&log, &bytes).expect("write");
        let err = RedbStorage::open(&path, CLUSTER).expect_err("must refuse");
        assert!(err.to_string().contains("generation or cluster"), "{err}");
        std::fs::remove_file(&log).expect("remove");
        let err = RedbStorage::open(&path, CLUSTER).expect_err("must refuse");
        assert!(err.to_string().contains("missing"), "{err}");
    }
}

#[test]
fn a_new_generation_left_half_made_by_a_crash_is_ignored_and_removed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("raft.redb");
    {
        let mut s = initialized(&path);
        let ents: Vec<Entry> = (2..=9).map(|i| entry(i, 1)).collect();
        s.persist(None, &ents, None).expect("persist");
    }
    let named = the_log_file(dir.path());
    // A compaction wrote the next generation (whole or not) but crashed before the
    // store named it.
    let name = named
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let (stem, generation) = name.rsplit_once('-').expect("generation");
    let next = format!(
        "{stem}-{:010}",
        generation.parse::<u64>().expect("number") + 1
    );
    std::fs::write(dir.path().join(&next), b"half written").expect("write");
    std::fs::write(dir.path().join(format!("{next}.new")), b"half").expect("write");
    let s = RedbStorage::open(&path, CLUSTER).expect("reopen");
    assert_eq!((s.first(), s.last()), (2, 9));
    assert_eq!(log_files(dir.path()), [name]);
}

#[test]
fn appends_across_many_stretches_of_zeros_written_ahead_survive_reopening_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("raft.redb");
    let big = |index: u64| Entry {
        index,
        term: 2,
        data: vec![index as u8; 48 << 10].into(),
        ..Default::default()
    };
    let mut next = 2;
    for round in 0..3 {
        let mut s = if round == 0 {
            initialized(&path)
        } else {
            RedbStorage::open(&path, CLUSTER).expect("reopen")
        };
        assert_eq!(s.last(), next - 1, "round {round}");
        // 6 MiB a round, an append at a time: the zeros ahead of the log are begun
        // on their own thread and taken over again and again.
        for _ in 0..128 {
            s.persist(None, &[big(next)], None).expect("append");
            next += 1;
        }
        // Reopened at once: zeros still being written must not land on appends.
    }
    let s = RedbStorage::open(&path, CLUSTER).expect("reopen");
    assert_eq!((s.first(), s.last()), (2, next - 1));
    let got = s
        .entries(2, next, None, GetEntriesContext::empty(false))
        .expect("entries");
    let want: Vec<Entry> = (2..next).map(big).collect();
    assert!(got == want, "the entries read back differ");
    // The file: the records, then zeros to its end, a whole number of stretches.
    let len = std::fs::metadata(the_log_file(dir.path()))
        .expect("log")
        .len();
    assert_eq!(len % (4 << 20), 0, "{len}");
    assert!(len >= 18 << 20, "{len}");
}

#[test]
fn the_snapshot_has_a_file_of_its_own_checked_when_read_and_old_ones_go() {
    const META: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");
    const SNAPSHOT: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("snapshot");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("raft.redb");
    let compact_at = |s: &mut RedbStorage, index: u64| {
        let state = s.snapshot_state().expect("sm");
        let mut snap = Snapshot {
            data: state.to_bytes().expect("bytes").into(),
            ..Default::default()
        };
        snap.mut_metadata().index = index;
        snap.mut_metadata().term = 2;
        snap.mut_metadata().mut_conf_state().voters = vec![1, 2, 3];
        s.compact(snap, index).expect("compact");
    };
    {
        let mut s = initialized(&path);
        let ents: Vec<Entry> = (2..=300).map(|i| entry(i, 2)).collect();
        s.persist(None, &ents, None).expect("persist");
        compact_at(&mut s, 200);
    }
    // One file, the newest; read back on opening.
    let files = snapshot_files(dir.path());
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(snapshot_in_file(&path).get_metadata().index, 200);
    let s = RedbStorage::open(&path, CLUSTER).expect("reopen");
    assert_eq!(s.snapshot_metadata().index, 200);
    assert_eq!((s.first(), s.last()), (200, 300));
    drop(s);
    // A file of another generation (a crash before the store named it) goes.
    let stray = dir.path().join("raft.redb.snap-0000000099");
    std::fs::write(&stray, b"left by a crash").expect("stray");
    drop(RedbStorage::open(&path, CLUSTER).expect("reopen"));
    assert!(!stray.exists(), "the stray snapshot file is removed");
    // A damaged file is refused, not read as an empty snapshot.
    let named = dir.path().join(&files[0]);
    let good = std::fs::read(&named).expect("read");
    let mut bad = good.clone();
    let last = bad.len() - 1;
    bad[last] ^= 0x20;
    std::fs::write(&named, &bad).expect("damage");
    let err = RedbStorage::open(&path, CLUSTER).expect_err("damaged");
    assert!(
        matches!(err, ConsensusError::CorruptStorage { .. }),
        "{err}"
    );
    std::fs::remove_file(&named).expect("remove");
    let err = RedbStorage::open(&path, CLUSTER).expect_err("missing");
    assert!(
        matches!(err, ConsensusError::CorruptStorage { .. }),
        "{err}"
    );
    std::fs::write(&named, &good).expect("restore");
    // A store from before (its snapshot in redb) reads it there, and the next
    // compaction moves it to a file and out of redb.
    {
        let snapshot = snapshot_in_file(&path).write_to_bytes().expect("snapshot");
        let db = redb::Database::create(&path).expect("raw open");
        let txn = db.begin_write().expect("txn");
        {
            txn.open_table(META)
                .expect("meta")
                .remove("snapshot_file")
                .expect("remove");
            txn.open_table(SNAPSHOT)
                .expect("snapshot")
                .insert("snapshot", snapshot.as_slice())
                .expect("insert");
        }
        txn.commit().expect("commit");
    }
    std::fs::remove_file(&named).expect("remove");
    let mut s = RedbStorage::open(&path, CLUSTER).expect("the old layout");
    assert_eq!(s.snapshot_metadata().index, 200);
    compact_at(&mut s, 250);
    drop(s);
    assert_eq!(snapshot_in_file(&path).get_metadata().index, 250);
    assert_eq!(snapshot_files(dir.path()).len(), 1);
    let db = redb::Database::create(&path).expect("raw open");
    let txn = db.begin_read().expect("txn");
    let table = txn.open_table(SNAPSHOT).expect("snapshot");
    assert!(table.get("snapshot").expect("get").is_none(), "out of redb");
}

#[test]
fn a_snapshot_stored_while_the_log_goes_on_keeps_what_the_log_took_meanwhile() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("raft.redb");
    let snapshot_at = |s: &RedbStorage, index: u64, term: u64| {
        let state = s.snapshot_state().expect("sm");
        let mut snap = Snapshot {
            data: state.to_bytes().expect("bytes").into(),
            ..Default::default()
        };
        snap.mut_metadata().index = index;
        snap.mut_metadata().term = term;
        snap.mut_metadata().mut_conf_state().voters = vec![1, 2, 3];
        snap
    };
    // As a replica does: the state encoded on the writer's thread.
    let begin = |s: &mut RedbStorage, index: u64, term: u64, compact_to: u64| {
        let meta = snapshot_at(s, index, term).get_metadata().clone();
        let state = s.snapshot_state().expect("sm");
        s.begin_compaction(meta, move || state.to_bytes(), compact_to)
            .expect("begin")
            .expect("a store on disk writes the files on a thread")
    };
    let mut s = initialized(&path);
    let ents: Vec<Entry> = (2..=300).map(|i| entry(i, 2)).collect();
    s.persist(None, &ents, None).expect("persist");
    let wait = begin(&mut s, 200, 2, 150);
    assert!(s.compacting());
    // Meanwhile: appends, a new leader's suffix replacing some of them, a new term.
    let ents: Vec<Entry> = (301..=320).map(|i| entry(i, 2)).collect();
    s.persist(None, &ents, None).expect("append");
    let ents: Vec<Entry> = (310..=312).map(|i| entry(i, 3)).collect();
    let hs = HardState {
        term: 3,
        vote: 2,
        commit: 250,
        ..Default::default()
    };
    s.persist(None, &ents, Some(&hs)).expect("overwrite");
    // Nothing is compacted until the files are named.
    assert_eq!((s.first(), s.last()), (2, 312));
    assert_eq!(s.snapshot_metadata().index, 1);
    wait.blocking_recv().expect("the writer says it is done");
    s.finish_compaction().expect("finish");
    assert!(!s.compacting());
    let want: Vec<Entry> = (150..=312)
        .map(|i| entry(i, if i >= 310 { 3 } else { 2 }))
        .collect();
    let check = |s: &RedbStorage| {
        assert_eq!((s.first(), s.last()), (150, 312));
        assert_eq!(s.snapshot_metadata().index, 200);
        let got = s
            .entries(150, 313, None, GetEntriesContext::empty(false))
            .expect("entries");
        assert_eq!(got, want);
        assert_eq!((s.hard_state().term, s.hard_state().vote), (3, 2));
    };
    check(&s);
    drop(s);
    let mut s = RedbStorage::open(&path, CLUSTER).expect("reopen");
    check(&s);
    assert_eq!(log_files(dir.path()).len(), 1);
    assert_eq!(snapshot_files(dir.path()).len(), 1);

    // A snapshot from the leader arriving while ours is written replaces it.
    let _wait = begin(&mut s, 300, 3, 300);
    s.persist(Some(&snapshot_at(&s, 400, 4)), &[], None)
        .expect("the leader's snapshot");
    assert!(!s.compacting());
    s.finish_compaction().expect("nothing left to finish");
    assert_eq!((s.first(), s.last()), (401, 400));
    drop(s);
    let mut s = RedbStorage::open(&path, CLUSTER).expect("reopen");
    assert_eq!((s.snapshot_metadata().index, s.first()), (400, 401));
    assert_eq!(log_files(dir.path()).len(), 1);
    assert_eq!(snapshot_files(dir.path()).len(), 1);

    // A store closed with its files half named (a crash, in effect) opens with
    // the generation before, whole; the unnamed files go with the next one.
    let ents: Vec<Entry> = (401..=450).map(|i| entry(i, 4)).collect();
    s.persist(None, &ents, None).expect("append");
    let _wait = begin(&mut s, 420, 4, 420);
    drop(s);
    let mut s = RedbStorage::open(&path, CLUSTER).expect("reopen");
    assert_eq!(
        (s.snapshot_metadata().index, s.first(), s.last()),
        (400, 401, 450)
    );
    let snap = snapshot_at(&s, 430, 4);
    s.compact(snap, 430).expect("compact");
    drop(s);
    let s = RedbStorage::open(&path, CLUSTER).expect("reopen");
    assert_eq!(
        (s.snapshot_metadata().index, s.first(), s.last()),
        (430, 430, 450)
    );
    assert_eq!(log_files(dir.path()).len(), 1);
    assert_eq!(snapshot_files(dir.path()).len(), 1);
}
