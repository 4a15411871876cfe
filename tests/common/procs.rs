//! Real `gpumesh node` processes, for the tests that kill them with SIGKILL.

use std::path::Path;
use std::time::{Duration, Instant};

use gpumesh::node::api::StatusView;

#[allow(unused_imports)] // each test file uses its own subset
pub use gpumesh::process::{free_port, NodeProcess as Proc};

/// A node process of this build's `gpumesh` binary, data in `root/name`.
pub fn node(root: &Path, name: &str) -> Proc {
    Proc::new(env!("CARGO_BIN_EXE_gpumesh"), root, name).expect("free ports")
}

/// Three node processes, a, b and c, as the README starts them: a forms the mesh
/// (`--init`), b and c join it with a's ticket.
pub fn three(root: &Path) -> Vec<Proc> {
    three_and_ticket(root).0
}

/// [`three`], and the ticket b and c joined with (a's, made before they joined: it
/// names a alone).
pub fn three_and_ticket(root: &Path) -> (Vec<Proc>, String) {
    joined(root, &["a", "b", "c"])
}

/// A node process for each of `names`, started as the README starts them: the
/// first forms the mesh, the others join with its ticket (returned).
pub fn joined(root: &Path, names: &[&str]) -> (Vec<Proc>, String) {
    let mut procs: Vec<Proc> = names.iter().map(|n| node(root, n)).collect();
    procs[0].start(&["--init"]).unwrap();
    let ticket = procs[0].ticket().unwrap();
    for p in &mut procs[1..] {
        p.start(&["--join", &ticket]).unwrap();
    }
    (procs, ticket)
}

/// Waits until one leader counts three live voters with adapters; their status.
pub async fn three_voters(procs: &[Proc]) -> StatusView {
    voters(procs, 3).await
}

/// Waits until one leader counts `n` live voters with adapters; their status.
pub async fn voters(procs: &[Proc], n: usize) -> StatusView {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        for p in procs.iter().filter(|p| p.started()) {
            if let Ok(st) = p.client().unwrap().status().await {
                let voters = st.members.iter().filter(|m| m.role == "voter").count();
                if st.leader != 0
                    && voters == n
                    && st.members.iter().all(|m| m.adapter.is_some() && m.alive)
                {
                    return st;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "the mesh never had {n} live voters"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits, off the runtime's threads, for a command started by a test to exit (two
/// minutes at most, then it is killed); what it printed.
pub async fn exited(mut child: std::process::Child) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(120);
        while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap()
}
