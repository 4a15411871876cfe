//! The mesh commands: `gpumesh node`, `submit`, `result`, `status`, `tasks`, `task`.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use gpumesh::node::api::TaskView;
use gpumesh::node::{admission, MeshNode};

use super::console::Progress;
use super::settings::NodeArgs;
use super::{ApiArgs, TaskArgs};

/// A node stopped because its Raft log or record could not be written (a full disk,
/// a failing one): `gpumesh node` then exits with [`StorageStopped::STATUS`], not 1,
/// so that a supervisor can tell a node worth starting again, once the disk is
/// mended, from one that cannot start (a bad setting, a removed member's data dir).
#[derive(Debug)]
pub struct StorageStopped(String);

impl StorageStopped {
    /// `EX_TEMPFAIL` (sysexits.h): a temporary failure; trying again later may work.
    pub const STATUS: u8 = 75;
}

impl std::fmt::Display for StorageStopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StorageStopped {}

pub fn node(settings: NodeArgs) -> anyhow::Result<ExitCode> {
    // Before anything starts: a bad key file or ticket stops the node, named.
    let config = settings.node_config(settings.given_key()?)?;
    let data_dir = config.data_dir.clone();
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let node = MeshNode::start(config).await?;
        println!(
            "gpumesh node {} (raft id {:x}, data format {})",
            node.peer_id,
            node.raft_id,
            gpumesh_protocol::FORMAT
        );
        for a in &node.listen_addrs {
            println!("  listening on {a}/p2p/{}", node.peer_id);
        }
        match &node.cluster_key {
            Some(key) => {
                println!(
                    "  cluster key: fingerprint {} ({})",
                    key.fingerprint(),
                    data_dir.join(admission::KEY_FILE).display()
                );
                println!(
                    "  join ticket: gpumesh ticket --data-dir {}",
                    data_dir.display()
                );
            }
            None => {
                let warning = "OPEN MESH (--open): no cluster key; anyone who reaches the \
                               listen address can join and run code on this GPU";
                println!("  {warning}");
                eprintln!("gpumesh: WARNING: {warning}");
            }
        }
        if !node.api_addr.ip().is_loopback() {
            println!(
                "  API token required off loopback: {}",
                data_dir.join(admission::TOKEN_FILE).display()
            );
        }
        match &node.capability {
            Some(c) => println!(
                "  adapter: {} ({}), {:.1} GFLOP/s, {:.1} GB/s, {} MiB kept between runs",
                c.adapter_name,
                c.backend.name(),
                c.gflops,
                c.gbps,
                c.memory >> 20
            ),
            None => println!("  adapter: none (this node joins the mesh but runs no shards)"),
        }
        println!("  dashboard: http://{}/", node.api_addr);
        println!(
            "  API on http://{}  (Ctrl-C stops this node, which stays a member; `gpumesh leave` \
             takes it out of the mesh)",
            node.api_addr
        );
        let _ = std::io::stdout().flush();
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let left = node.left();
        let consensus = node.consensus.clone();
        tokio::select! {
            got = tokio::signal::ctrl_c() => got?,
            _ = term.recv() => {}
            why = consensus.failed() => {
                // Its Raft log or record cannot be written: the node stops, as a
                // crash would, rather than run on as a member that records nothing.
                node.stop().await;
                let hint = if why.contains("No space left") {
                    format!("free disk space on the file system of {} (files other than \
                             the node's; once it runs again, `gpumesh forget` finished tasks \
                             keeps its disk from filling), then ", data_dir.display())
                } else {
                    String::new()
                };
                return Err(anyhow::Error::new(StorageStopped(format!(
                    "this node's Raft storage failed, so it stopped: {why}. Nothing it \
                     acknowledged is lost; {hint}start it again with --data-dir {} to come \
                     back as the member it was",
                    data_dir.display()
                ))));
            }
            () = left.cancelled() => {
                if let Some(why) = node.removed() {
                    node.stop().await;
                    bail!(
                        "this node is no longer a member of its mesh: {why}. Its data dir is \
                         marked as one that left; to be a member again, start it with a new \
                         --data-dir and --join TICKET (or --peer ADDRESS of a member)"
                    );
                }
                println!("left the mesh (gpumesh leave); stopping");
                node.stop().await;
                return anyhow::Ok(());
            }
        }
        println!(
            "stopping; this node stays a member: start it again with --data-dir {} to come back \
             (Ctrl-C again: stop at once, as a crash would; nothing acknowledged is lost)",
            data_dir.display()
        );
        let _ = std::io::stdout().flush();
        tokio::spawn(async {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("gpumesh: stopped at once (second Ctrl-C)");
                std::process::exit(130);
            }
        });
        node.shutdown().await;
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

#[derive(clap::Args, Debug)]
pub struct SubmitArgs {
    #[command(flatten)]
    pub task: TaskArgs,
    #[command(flatten)]
    pub api: ApiArgs,
    /// Wait for the task, showing shard progress, then print its output hashes.
    #[arg(long)]
    pub wait: bool,
    /// Run each shard on this many nodes (different adapters or backends first) and
    /// accept a result only when two agree; a disagreement brings in a third node.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub replicas: u32,
    /// Compare replica outputs as f32 values within this relative tolerance instead
    /// of bit for bit (default: bit for bit, or 1e-5 for a float merge rule).
    #[arg(long, value_name = "R")]
    pub tolerance: Option<f32>,
    /// Stop a shard that runs longer than this many seconds on a GPU and fail the
    /// task (default: the node's --default-deadline, 60 s unless set).
    #[arg(long, value_name = "SECONDS")]
    pub deadline: Option<f64>,
    /// With --wait: also fetch the outputs into DIR/<binding>.bin.
    #[arg(long, value_name = "DIR", requires = "wait")]
    pub out_dir: Option<PathBuf>,
    /// With --wait and --builtin: check the result against the CPU reference.
    #[arg(long, requires = "wait")]
    pub verify: bool,
    #[arg(long)]
    pub json: bool,
}

pub fn submit(args: SubmitArgs) -> anyhow::Result<ExitCode> {
    if args.verify && args.task.builtin.is_none() {
        bail!("--verify needs a CPU reference, which only built-in kernels have (use --builtin)");
    }
    // Validated here first, with the same messages as `gpumesh run`.
    let mut prepared = super::run::prepare(&args.task)?;
    // Float sums and extremes from different hardware differ in the last bits.
    let spec = &prepared.spec;
    let float = std::iter::once(&spec.merge)
        .chain(spec.merges.values())
        .any(|m| m.elem() == Some(gpumesh::protocol::ElemType::F32));
    let options = &mut prepared.spec.options;
    options.replicas = args.replicas;
    options.tolerance = args
        .tolerance
        .or_else(|| (args.replicas > 1 && float).then_some(1e-5));
    if let Some(secs) = args.deadline {
        if !(secs.is_finite() && secs > 0.0) {
            bail!("--deadline must be a positive number of seconds");
        }
        options.deadline_ms = Some((secs * 1000.0).ceil() as u64);
    }
    prepared.spec.check_shape()?;
    let client = args.api.client()?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        for (id, bytes) in &prepared.blobs {
            let stored = client.upload(bytes.to_vec()).await?;
            anyhow::ensure!(stored == *id, "the node stored input {id} as {stored}");
        }
        let task = client.submit(prepared.spec, None).await.map_err(|e| match e {
            // The node stopped answering with the submit sent: it may have been taken.
            gpumesh::ClientError::Lost { .. } => anyhow::anyhow!(
                "{e}. The task may have been submitted before the node stopped answering: \
                 `gpumesh tasks --api HOST:PORT` through another node shows the mesh's tasks"
            ),
            e => e.into(),
        })?;
        if !args.wait {
            if args.json {
                println!("{}", serde_json::json!({ "task": task }));
            } else {
                println!("submitted t{task} ({})", prepared.label);
            }
            return Ok(ExitCode::SUCCESS);
        }
        // From here the task is in the record and runs on whatever becomes of
        // this command or this node: a failure to follow it says how to find it.
        let api = client.addr().to_string();
        let elsewhere = move |e: gpumesh::ClientError| -> anyhow::Error {
            match e {
                gpumesh::ClientError::Refused(_) => e.into(),
                e => anyhow::anyhow!(
                    "t{task} was submitted and runs on in the mesh, but following it through \
                     {api} failed: {e}. Through any other node: `gpumesh task t{task} --api \
                     HOST:PORT` shows it, `gpumesh result t{task} --out-dir DIR --api HOST:PORT` \
                     fetches its outputs"
                ),
            }
        };
        let started = std::time::Instant::now();
        let view = {
            // Drawn only on a terminal, and only for people: not with --json.
            let progress = (!args.json).then(Progress::on_stderr);
            client
                .wait(task, |done, total| {
                    if let Some(p) = &progress {
                        let filled = done * 20 / total.max(1);
                        p.show(format!(
                            "  t{task} [{}{}] {done}/{total} shards",
                            "#".repeat(filled),
                            " ".repeat(20 - filled)
                        ));
                    }
                })
                .await
                .map_err(&elsewhere)?
        };
        let outputs = client.outputs(task).await.map_err(&elsewhere)?;
        let mut verdict = None;
        if args.out_dir.is_some() || args.verify {
            let results = client.results(task).await.map_err(&elsewhere)?;
            if let Some(dir) = &args.out_dir {
                std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
                for (binding, bytes) in &results {
                    std::fs::write(dir.join(format!("{binding}.bin")), bytes)?;
                }
            }
            if let Some(p) = &prepared.problem {
                verdict = Some(p.verify(&results).map(|a| a.to_string()).map_err(|m| m.to_string()));
            }
        }
        if args.json {
            println!(
                "{}",
                serde_json::json!({
                    "task": task,
                    "status": view.status,
                    "elapsed_ms": started.elapsed().as_secs_f64() * 1e3,
                    "outputs": outputs,
                    "verify": verdict.as_ref().map(|v| serde_json::json!({"ok": v.is_ok(), "detail": match v { Ok(s) | Err(s) => s }})),
                })
            );
        } else {
            println!("t{task} {} in {:.1} ms", view.status, started.elapsed().as_secs_f64() * 1e3);
            for o in &outputs {
                println!("  output {}: {} bytes, blake3 {}", o.binding, o.size, o.blake3);
            }
            if let Some(v) = &verdict {
                match v {
                    Ok(s) => println!("  verify: OK — {s}"),
                    Err(s) => println!("  verify: MISMATCH — {s}"),
                }
            }
        }
        Ok(match verdict {
            Some(Err(_)) => ExitCode::from(3),
            _ => ExitCode::SUCCESS,
        })
    })
}

#[derive(clap::Args, Debug)]
pub struct ResultArgs {
    /// The task id (as `gpumesh tasks` shows it, e.g. t12 or 12).
    pub task: String,
    #[arg(long, value_name = "DIR")]
    pub out_dir: PathBuf,
    #[command(flatten)]
    pub api: ApiArgs,
    #[arg(long)]
    pub json: bool,
}

fn task_id(s: &str) -> anyhow::Result<u64> {
    s.trim_start_matches('t')
        .parse()
        .with_context(|| format!("{s:?} is not a task id (e.g. t12)"))
}

pub fn result(args: ResultArgs) -> anyhow::Result<ExitCode> {
    let task = task_id(&args.task)?;
    let client = args.api.client()?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let results = client.results(task).await?;
        std::fs::create_dir_all(&args.out_dir)
            .with_context(|| format!("cannot create {}", args.out_dir.display()))?;
        let mut written = Vec::new();
        for (binding, bytes) in &results {
            let path = args.out_dir.join(format!("{binding}.bin"));
            std::fs::write(&path, bytes)
                .with_context(|| format!("cannot write {}", path.display()))?;
            written.push(serde_json::json!({
                "binding": binding, "bytes": bytes.len(),
                "blake3": blake3::hash(bytes).to_hex().to_string(), "path": path,
            }));
            if !args.json {
                println!(
                    "output {binding}: {} bytes -> {}",
                    bytes.len(),
                    path.display()
                );
            }
        }
        if args.json {
            println!("{}", serde_json::Value::Array(written));
        }
        anyhow::Ok(ExitCode::SUCCESS)
    })
}

pub fn status(api: ApiArgs, json: bool) -> anyhow::Result<ExitCode> {
    let client = api.client()?;
    let st = tokio::runtime::Runtime::new()?.block_on(client.status())?;
    if json {
        println!("{}", serde_json::to_string_pretty(&st)?);
        return Ok(ExitCode::SUCCESS);
    }
    let leader = if st.leader == 0 {
        "none".to_string()
    } else {
        format!("{:x}", st.leader)
    };
    println!(
        "leader {leader}, term {}, commit {}, data format {}",
        st.term, st.commit_index, st.data_format
    );
    if st.leader == 0 {
        let voters: Vec<_> = st.members.iter().filter(|m| m.role == "voter").collect();
        // This node is running, whatever its own entries say.
        let running = voters
            .iter()
            .filter(|m| m.alive || m.raft_id == st.node)
            .count();
        let majority = voters.len() / 2 + 1;
        if running < majority {
            println!(
                "no quorum: {running} of the {} voters run as this node sees them, and {majority} \
                 must; start the others (a stopped node stays a member and comes back on its \
                 --data-dir)",
                voters.len()
            );
        } else {
            println!("an election is under way");
        }
    }
    println!(
        "{:<17} {:<54} {:<8} {:<16} {:<34} {:<7} {:>8} {:>6} {:>5}",
        "raft id", "peer id", "role", "alive", "adapter", "backend", "GFLOP/s", "GB/s", "queue"
    );
    for m in &st.members {
        let role = if m.raft_id == st.leader {
            "leader".to_string()
        } else {
            m.role.clone()
        };
        println!(
            "{:<17x} {:<54} {:<8} {:<16} {:<34} {:<7} {:>8.1} {:>6.1} {:>5}",
            m.raft_id,
            m.peer_id,
            role,
            if m.alive && m.unheard {
                // Just started here: not judged yet, and perhaps down.
                "not heard yet"
            } else if m.alive {
                "yes"
            } else if m.raft_id == st.node {
                // Nothing of its own applied lately (no quorum), but it answers.
                "yes (this node)"
            } else if m.unreachable {
                "NO (unreachable)"
            } else {
                "NO (silent)"
            },
            m.adapter.as_deref().unwrap_or("none"),
            m.backend.as_deref().unwrap_or("-"),
            m.gflops.unwrap_or(0.0),
            m.gbps.unwrap_or(0.0),
            m.queue
        );
    }
    let down: Vec<String> = st
        .members
        .iter()
        .filter(|m| !m.alive && m.raft_id != st.node)
        .map(|m| node_name(m.raft_id))
        .collect();
    if st.leader != 0 && !down.is_empty() {
        println!(
            "down: {} — a stopped node comes back when started on its --data-dir; one whose \
             machine is gone for good: `gpumesh remove RAFT_ID` (its copies are made again \
             elsewhere)",
            down.join(", ")
        );
    }
    if !st.actors.is_empty() {
        println!();
        println!(
            "{:<20} {:<17} {:>6} {:>8} {:>6} {:>8} {:>10}",
            "actor", "host", "epoch", "version", "moves", "waiting", "bytes"
        );
        for a in &st.actors {
            println!(
                "{:<20} {:<17} {:>6} {:>8} {:>6} {:>8} {:>10}",
                a.name,
                if a.host.is_empty() { "none" } else { &a.host },
                a.epoch,
                a.version,
                a.moves,
                a.pending,
                a.bytes
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn tasks(api: ApiArgs, json: bool) -> anyhow::Result<ExitCode> {
    let client = api.client()?;
    let tasks = tokio::runtime::Runtime::new()?.block_on(client.tasks())?;
    if let Some(note) = tasks.iter().find_map(|t| t.unconfirmed.as_ref()) {
        eprintln!("note: {note}");
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&tasks)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<8} {:<10} {:<18} {:<9} {:>7} {:>8} {:>10}  reason",
        "task", "status", "kernel", "merge", "shards", "replicas", "mismatches"
    );
    for t in &tasks {
        println!(
            "{:<8} {:<10} {:<18} {:<9} {:>3}/{:<3} {:>8} {:>10}  {}",
            format!("t{}", t.id),
            t.status,
            t.kernel,
            t.merge,
            t.shards_done,
            t.shards.len(),
            t.replicas,
            t.mismatches,
            t.reason.as_deref().unwrap_or("")
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub fn task(id: &str, api: ApiArgs, json: bool) -> anyhow::Result<ExitCode> {
    let id = task_id(id)?;
    let client = api.client()?;
    let t = tokio::runtime::Runtime::new()?.block_on(client.task(id))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&t)?);
    } else {
        print_task(&t);
    }
    Ok(ExitCode::SUCCESS)
}

pub fn cancel(
    id: &str,
    reason: Option<&str>,
    api: ApiArgs,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let id = task_id(id)?;
    let client = api.client()?;
    let t = tokio::runtime::Runtime::new()?.block_on(client.cancel(id, reason))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&t)?);
    } else {
        let running = t.shards.iter().filter(|s| s.state == "running").count();
        println!(
            "t{id} cancelled ({}/{} shards had finished{})",
            t.shards_done,
            t.shards.len(),
            if running > 0 {
                format!("; {running} on a GPU now run to their end, their results dropped")
            } else {
                String::new()
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub fn forget(id: &str, api: ApiArgs) -> anyhow::Result<ExitCode> {
    let id = task_id(id)?;
    let client = api.client()?;
    tokio::runtime::Runtime::new()?.block_on(client.forget(id))?;
    println!("t{id} forgotten; its results go from every node within a minute");
    Ok(ExitCode::SUCCESS)
}

pub fn leave(api: ApiArgs, json: bool) -> anyhow::Result<ExitCode> {
    let client = api.client()?;
    let left = tokio::runtime::Runtime::new()?.block_on(client.leave())?;
    if json {
        println!("{}", serde_json::to_string_pretty(&left)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "node {} left the mesh in {} ms and is stopping: {} blob(s), {} bytes, handed to {} \
         other member(s) each{}",
        node_name(left.node),
        left.took_ms,
        left.blobs_handed_off,
        left.bytes_handed_off,
        left.copies,
        left.leadership_to
            .map(|l| format!("; leadership handed to {}", node_name(l)))
            .unwrap_or_default()
    );
    Ok(ExitCode::SUCCESS)
}

pub fn remove(node: &str, api: ApiArgs) -> anyhow::Result<ExitCode> {
    let Ok(raft_id) = u64::from_str_radix(node.trim_start_matches("0x"), 16) else {
        bail!("{node:?} is not a raft id: give it in hex, as `gpumesh status` shows it");
    };
    let client = api.client()?;
    tokio::runtime::Runtime::new()?.block_on(client.remove_member(raft_id))?;
    println!(
        "member {} removed; start that machine again only with a new --data-dir (and --join)",
        node_name(raft_id)
    );
    Ok(ExitCode::SUCCESS)
}

/// A raft id as `gpumesh status` shows it.
fn node_name(id: u64) -> String {
    format!("{id:x}")
}

fn print_task(t: &TaskView) {
    if let Some(note) = &t.unconfirmed {
        eprintln!("note: {note}");
    }
    println!(
        "t{} {}: {}, grid {}, merge {}, {}/{} shards done, replicas {}, mismatches {}",
        t.id,
        t.status,
        t.kernel,
        t.grid,
        t.merge,
        t.shards_done,
        t.shards.len(),
        t.replicas,
        t.mismatches
    );
    println!("  submitted through {}", t.submitter);
    if let Some(reason) = &t.reason {
        println!("  reason: {reason}");
    }
    println!();
    println!(
        "{:<6} {:<10} {:<17} {:>5}  {:<36} {:<36} {:>8}  last error",
        "shard", "state", "node", "epoch", "running (node@epoch)", "reported by", "failures"
    );
    let list = |items: Vec<String>| {
        if items.is_empty() {
            "-".to_string()
        } else {
            items.join(" ")
        }
    };
    for sh in &t.shards {
        let running = sh
            .attempts
            .iter()
            .map(|(node, epoch)| format!("{}@{epoch}", node_name(*node)))
            .collect();
        let row = format!(
            "{:<6} {:<10} {:<17} {:>5}  {:<36} {:<36} {:>8}  {}",
            sh.index,
            sh.state,
            sh.node.map(node_name).unwrap_or_else(|| "-".into()),
            sh.epoch,
            list(running),
            list(sh.reported_by.iter().copied().map(node_name).collect()),
            sh.failures,
            sh.last_error.as_deref().unwrap_or("")
        );
        println!("{}", row.trim_end());
    }
    if !t.history.is_empty() {
        println!();
        println!("history (raft index, shard, what):");
        for h in &t.history {
            let shard = h.shard.map(|s| s.to_string()).unwrap_or_else(|| "-".into());
            println!("  {:>8}  {:>5}  {}", h.index, shard, h.what);
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct TicketArgs {
    /// The data dir of a node of the mesh (running or not).
    #[arg(long, env = "GPUMESH_DATA_DIR", default_value = "gpumesh-data")]
    pub data_dir: PathBuf,
}

/// Prints the join ticket of the mesh a node belongs to, as the last line.
pub fn ticket(args: TicketArgs) -> anyhow::Result<ExitCode> {
    let ticket = admission::Ticket::from_data_dir(&args.data_dir)?;
    println!(
        "join ticket of the mesh with cluster key {} ({} member address(es)); it holds \
         the key, so hand it over as you would a password:",
        ticket.key.fingerprint(),
        ticket.addrs.len()
    );
    println!("  gpumesh node --join TICKET   (on the new node)");
    println!("{ticket}");
    Ok(ExitCode::SUCCESS)
}
