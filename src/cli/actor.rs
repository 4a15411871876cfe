//! `gpumesh actor …`: GPU actors through any node's API — create, call, get, list,
//! delete.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Subcommand;
use gpumesh::node::api::{ActorView, StateInit};
use gpumesh::protocol::{ActorCall, BindingRole, BindingSpec, BlobId, Grid, ShaderSource};

use super::console::Progress;
use super::{parse_grid, parse_input, parse_output, ApiArgs};

#[derive(Subcommand, Debug)]
pub enum ActorCommand {
    /// Create a GPU actor: named state buffers that live on one node's GPU between
    /// calls and survive that node.
    Create {
        /// A name unique in the mesh (letters, digits, '-', '_', '.').
        name: String,
        /// A state buffer at @group(0) @binding(BINDING): BYTES bytes of zeros, or the
        /// bytes of FILE. Repeatable.
        #[arg(long = "state", required = true, value_name = "BINDING:BYTES|BINDING=FILE", value_parser = parse_state)]
        state: Vec<StateArg>,
        /// Host it on a node of this backend: vulkan, gl, metal, dx12 (default: any).
        #[arg(long)]
        backend: Option<String>,
        #[command(flatten)]
        api: ApiArgs,
        #[arg(long)]
        json: bool,
    },
    /// Call an actor: run KERNEL with the actor's state bound at its bindings
    /// (read_write, in place) beside the call's own buffers. Prints the call's
    /// sequence number and the state version it made.
    Call(CallArgs),
    /// Write a state buffer of an actor, as of its last acknowledged call, to FILE.
    Get {
        name: String,
        binding: u32,
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Every actor: its host, epoch, version (calls applied) and bytes of state.
    List {
        #[command(flatten)]
        api: ApiArgs,
        #[arg(long)]
        json: bool,
    },
    /// Delete an actor; its calls not yet run fail.
    Delete {
        name: String,
        #[command(flatten)]
        api: ApiArgs,
    },
}

#[derive(clap::Args, Debug)]
pub struct CallArgs {
    /// The actor.
    pub name: String,
    /// A WGSL file holding the kernel.
    pub kernel: PathBuf,
    /// Entry point of the kernel (default: its one compute entry point, or `main`
    /// among several).
    #[arg(long)]
    pub entry: Option<String>,
    /// A read-only input: the bytes of FILE at @group(0) @binding(BINDING).
    #[arg(long = "input", value_name = "BINDING=FILE", value_parser = parse_input)]
    pub inputs: Vec<(u32, PathBuf)>,
    /// An output of BYTES bytes, starting as zeros.
    #[arg(long = "output", value_name = "BINDING:BYTES", value_parser = parse_output)]
    pub outputs: Vec<(u32, u64)>,
    /// A read_write buffer of the call (not of the actor) starting as FILE's bytes.
    #[arg(long = "inout", value_name = "BINDING=FILE", value_parser = parse_input)]
    pub inouts: Vec<(u32, PathBuf)>,
    /// Workgroups along x, y and z.
    #[arg(long, required = true, value_name = "X[,Y[,Z]]", value_parser = parse_grid)]
    pub grid: Grid,
    /// Stop the call if it runs longer than this many seconds on the GPU (default:
    /// the host's --default-deadline); the state then stays as it was.
    #[arg(long, value_name = "SECONDS")]
    pub deadline: Option<f64>,
    /// Write the call's outputs to DIR/<binding>.bin.
    #[arg(long, value_name = "DIR")]
    pub out_dir: Option<PathBuf>,
    #[command(flatten)]
    pub api: ApiArgs,
    #[arg(long)]
    pub json: bool,
}

/// A state buffer as given on the command line.
#[derive(Clone, Debug)]
pub enum StateArg {
    Zeros(u32, u64),
    File(u32, PathBuf),
}

fn parse_state(s: &str) -> Result<StateArg, String> {
    if s.contains('=') {
        parse_input(s).map(|(b, f)| StateArg::File(b, f))
    } else {
        parse_output(s).map(|(b, n)| StateArg::Zeros(b, n))
    }
}

fn read(path: &PathBuf) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))
}

pub fn run(command: ActorCommand) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Runtime::new()?;
    match command {
        ActorCommand::Create {
            name,
            state,
            backend,
            api,
            json,
        } => {
            let client = api.client()?;
            runtime.block_on(async {
                let mut init = Vec::new();
                for s in state {
                    init.push(match s {
                        StateArg::Zeros(binding, size) => StateInit {
                            binding,
                            size,
                            blob: None,
                        },
                        StateArg::File(binding, path) => {
                            let bytes = read(&path)?;
                            let size = bytes.len() as u64;
                            StateInit {
                                binding,
                                size,
                                blob: Some(client.upload(bytes).await?),
                            }
                        }
                    });
                }
                let view = client.create_actor(&name, init, backend).await?;
                if json {
                    println!("{}", serde_json::to_string(&view)?);
                } else {
                    println!("actor {} created: {} bytes of state", view.name, view.bytes);
                }
                Ok(ExitCode::SUCCESS)
            })
        }
        ActorCommand::Call(args) => runtime.block_on(call(args)),
        ActorCommand::Get {
            name,
            binding,
            out,
            api,
        } => {
            let client = api.client()?;
            let bytes = runtime.block_on(client.actor_state(&name, binding))?;
            std::fs::write(&out, &bytes)
                .with_context(|| format!("cannot write {}", out.display()))?;
            println!(
                "{} bytes of actor {name}'s binding {binding} written to {}",
                bytes.len(),
                out.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        ActorCommand::List { api, json } => {
            let client = api.client()?;
            let actors = runtime.block_on(client.actors())?;
            if json {
                println!("{}", serde_json::to_string(&actors)?);
                return Ok(ExitCode::SUCCESS);
            }
            println!(
                "{:<20} {:<16} {:>6} {:>8} {:>10} {:>6} {:>8}",
                "actor", "host", "epoch", "version", "bytes", "moves", "waiting"
            );
            for a in &actors {
                println!(
                    "{:<20} {:<16} {:>6} {:>8} {:>10} {:>6} {:>8}",
                    a.name,
                    if a.host.is_empty() { "none" } else { &a.host },
                    a.epoch,
                    a.version,
                    a.bytes,
                    a.moves,
                    a.pending
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        ActorCommand::Delete { name, api } => {
            let client = api.client()?;
            runtime.block_on(client.delete_actor(&name))?;
            println!("actor {name} deleted");
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn call(args: CallArgs) -> anyhow::Result<ExitCode> {
    let client = args.api.client()?;
    let source = std::fs::read_to_string(&args.kernel)
        .with_context(|| format!("cannot read the kernel {}", args.kernel.display()))?;
    let entry_point = match &args.entry {
        Some(name) => name.clone(),
        None => gpumesh::shaders::Kernel::entry_point_of(&source)?,
    };
    let mut bindings = Vec::new();
    for (binding, path) in &args.inputs {
        let bytes = read(path)?;
        let size = bytes.len() as u64;
        let blob = client.upload(bytes).await?;
        bindings.push(BindingSpec {
            binding: *binding,
            role: BindingRole::Input { blob, size },
        });
    }
    for (binding, path) in &args.inouts {
        let bytes = read(path)?;
        let size = bytes.len() as u64;
        let blob = client.upload(bytes).await?;
        bindings.push(BindingSpec {
            binding: *binding,
            role: BindingRole::InOut { blob, size },
        });
    }
    for (binding, size) in &args.outputs {
        bindings.push(BindingSpec {
            binding: *binding,
            role: BindingRole::Output { size: *size },
        });
    }
    let deadline_ms = match args.deadline {
        None => None,
        Some(secs) if secs.is_finite() && secs > 0.0 => Some((secs * 1000.0).ceil() as u64),
        Some(_) => bail!("--deadline must be a positive number of seconds"),
    };
    let call = ActorCall {
        shader: ShaderSource::Wgsl(source),
        entry_point,
        bindings,
        grid: args.grid,
        deadline_ms,
    };
    let reply = {
        let answer = client.call_actor(&args.name, call, None);
        tokio::pin!(answer);
        let progress = Progress::on_stderr();
        tokio::select! {
            reply = &mut answer => reply.map_err(|e| match e {
                // The node stopped answering with the call sent: it may have run.
                gpumesh::ClientError::Lost { .. } => {
                    anyhow::anyhow!(
                        "call to actor {}: {e}. The call may have run before the node stopped \
                         answering: `gpumesh actor list --api HOST:PORT` through another node \
                         shows the actor's version, one more than before if it did",
                        args.name
                    )
                }
                e => e.into(),
            })?,
            () = show_waiting(&client, &args.name, &progress) => unreachable!("it never ends"),
        }
    };
    if let Some(dir) = &args.out_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        for o in &reply.outputs {
            let id: BlobId = o.blake3.parse()?;
            let bytes = client.outputs_of_blob(id).await?;
            let path = dir.join(format!("{}.bin", o.binding));
            std::fs::write(&path, bytes)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
    }
    if args.json {
        println!("{}", serde_json::to_string(&reply)?);
    } else {
        println!(
            "call {} to actor {}: state version {}",
            reply.seq, args.name, reply.version
        );
        for o in &reply.outputs {
            println!(
                "  output {}: {} bytes, blake3 {}",
                o.binding, o.size, o.blake3
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// How long a call waits before the progress line says what it waits for.
const QUIET: Duration = Duration::from_secs(1);

/// Redraws, on a terminal, what a call that takes a while waits for (its turn, a
/// host that stopped answering, the move to another node); never returns.
async fn show_waiting(client: &gpumesh::Client, name: &str, progress: &Progress) {
    let started = Instant::now();
    tokio::time::sleep(QUIET).await;
    loop {
        let actor = client.actor(name).await.ok();
        let host_alive = match (&actor, client.status().await) {
            (Some(a), Ok(st)) => st
                .members
                .iter()
                .find(|m| m.peer_id == a.node)
                .map(|m| m.alive),
            _ => None,
        };
        progress.show(waiting_line(
            started.elapsed(),
            name,
            actor.as_ref(),
            host_alive,
        ));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The progress line of a call to `name` waiting for `waited`.
fn waiting_line(
    waited: Duration,
    name: &str,
    actor: Option<&ActorView>,
    host_alive: Option<bool>,
) -> String {
    let secs = waited.as_secs();
    let Some(a) = actor else {
        return format!("waiting {secs} s for actor {name} (the node cannot read it now)");
    };
    let host: String = a
        .node
        .chars()
        .rev()
        .take(8)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    if a.node.is_empty() {
        format!("waiting {secs} s: actor {name} has no host yet; the leader places it")
    } else if host_alive == Some(false) {
        format!(
            "waiting {secs} s: actor {name}'s host …{host} is not answering; the leader moves \
             it to the node with its second copy (epoch {} now)",
            a.epoch
        )
    } else {
        format!(
            "waiting {secs} s: actor {name} on …{host} (epoch {}, moves {}), {} call(s) queued",
            a.epoch, a.moves, a.pending
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(node: &str, epoch: u32, pending: usize) -> ActorView {
        ActorView {
            name: "counter".into(),
            node: node.into(),
            host: String::new(),
            epoch,
            version: 3,
            bytes: 16,
            state: vec![],
            backend: None,
            moves: epoch.saturating_sub(1),
            pending,
            backup: None,
        }
    }

    #[test]
    fn the_waiting_line_says_what_the_call_waits_for() {
        let t = Duration::from_millis(4_200);
        let peer = "12D3KooWAbCdEfGh";
        let queued = waiting_line(t, "counter", Some(&view(peer, 1, 2)), Some(true));
        assert_eq!(
            queued,
            "waiting 4 s: actor counter on …AbCdEfGh (epoch 1, moves 0), 2 call(s) queued"
        );
        let moving = waiting_line(t, "counter", Some(&view(peer, 1, 2)), Some(false));
        assert!(moving.contains("…AbCdEfGh is not answering"), "{moving}");
        assert!(
            moving.contains("moves it to the node with its second copy"),
            "{moving}"
        );
        let unplaced = waiting_line(t, "counter", Some(&view("", 0, 1)), None);
        assert!(unplaced.contains("no host yet"), "{unplaced}");
        let unknown = waiting_line(t, "counter", None, None);
        assert!(unknown.contains("cannot read it now"), "{unknown}");
    }
}
