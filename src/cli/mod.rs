//! The command line: `gpumesh adapters`, `gpumesh run`, `gpumesh bench`, `gpumesh
//! keygen`, `gpumesh completions`, and the mesh commands.
//!
//! - [`settings`]: `gpumesh node`'s flags, config file and environment, merged;
//! - [`console`]: log lines and the progress line on stderr;
//! - [`mesh`]: the node and the commands that talk to one through its API.

mod actor;
mod adapters;
pub mod console;
mod keygen;
pub mod mesh;
pub mod run;
pub mod settings;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{ArgMatches, CommandFactory, Parser, Subcommand};
use gpumesh_protocol::{Grid, MergeRule};
use gpumesh_shaders::BackendChoice;

use console::LogFormat;

#[derive(Parser, Debug)]
#[command(
    name = "gpumesh",
    version = concat!(
        env!("CARGO_PKG_VERSION"),
        " (data format ",
        gpumesh_protocol::format_number!(),
        ")"
    ),
    about = "A peer-to-peer GPU compute mesh: WGSL on any adapter."
)]
pub struct Cli {
    /// How log lines on stderr look: text, or one JSON object per line. RUST_LOG
    /// picks what is logged (default: warnings).
    #[arg(
        long,
        global = true,
        env = "GPUMESH_LOG_FORMAT",
        value_enum,
        default_value_t = LogFormat::Text
    )]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// List the GPU adapters on this machine and measure their speed.
    Adapters {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Skip the short calibration kernels.
        #[arg(long)]
        no_calibrate: bool,
    },
    /// Run a WGSL kernel (or a built-in one) here, once, without a mesh.
    Run(RunArgs),
    /// Make a cluster key: the shared secret without which no node can connect to a
    /// mesh started with `--cluster-key`.
    Keygen(keygen::KeygenArgs),
    /// Print a join ticket (last line) for the mesh of the node whose data dir is
    /// given: the cluster key and the members' addresses, for `node --join`.
    Ticket(crate::cli::mesh::TicketArgs),
    /// Run a mesh node until Ctrl-C or SIGTERM (it stays a member: started again on
    /// its data dir it comes back) or until it leaves the mesh (`gpumesh leave`).
    ///
    /// Each setting comes from its flag, else its GPUMESH_* variable, else the
    /// --config file, else the default shown.
    ///
    /// Exit status: 0 once stopped (Ctrl-C, SIGTERM) or gone from the mesh (`gpumesh
    /// leave`); 75 when its Raft storage could not be written (a full disk): start it
    /// again once there is room; 1 when it could not start or was removed from its
    /// mesh (starting it again on that data dir will not help).
    Node(Box<settings::NodeArgs>),
    /// Submit a task to the mesh through a node's API.
    Submit(crate::cli::mesh::SubmitArgs),
    /// Fetch a finished task's outputs from any node into DIR/<binding>.bin.
    Result(crate::cli::mesh::ResultArgs),
    /// The mesh: leader, term, and every member.
    Status {
        #[command(flatten)]
        api: ApiArgs,
        #[arg(long)]
        json: bool,
    },
    /// Every task the mesh knows.
    Tasks {
        #[command(flatten)]
        api: ApiArgs,
        #[arg(long)]
        json: bool,
    },
    /// One task: its shards (state, node, epoch, attempts), replicas, mismatches
    /// and history.
    Task {
        /// The task id (as `gpumesh tasks` shows it, e.g. t12 or 12).
        task: String,
        #[command(flatten)]
        api: ApiArgs,
        #[arg(long)]
        json: bool,
    },
    /// Cancel a task that has not finished: no shard of it starts after that, a
    /// shard already on a GPU runs to its end with its result dropped, and its
    /// outputs are never served.
    Cancel {
        /// The task id (as `gpumesh tasks` shows it, e.g. t12 or 12).
        task: String,
        /// Why, for the task's history (default: "cancelled by a user").
        #[arg(long)]
        reason: Option<String>,
        #[command(flatten)]
        api: ApiArgs,
        #[arg(long)]
        json: bool,
    },
    /// Forget a finished task: it leaves the record, and every node removes its
    /// results soon after (a blob another task names stays).
    Forget {
        /// The task id (as `gpumesh tasks` shows it, e.g. t12 or 12).
        task: String,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Take a node out of the mesh for good: other members keep the results and
    /// actor states it holds, the mesh removes it, and it stops. (Ctrl-C only stops
    /// a node; it stays a member.)
    Leave {
        #[command(flatten)]
        api: ApiArgs,
        #[arg(long)]
        json: bool,
    },
    /// Remove a member that is gone for good (its machine lost) so the mesh's
    /// quorum no longer counts on it; refused for a member that runs (`gpumesh
    /// leave` on it hands its data off first). Never start a removed node on its old
    /// data dir again: start it with a new one.
    Remove {
        /// Its raft id, in hex as `gpumesh status` shows it.
        node: String,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// GPU actors: named state on a node's GPU, called from any node, surviving it.
    Actor {
        #[command(subcommand)]
        command: actor::ActorCommand,
    },
    /// Print a shell completion script.
    ///
    /// For example `gpumesh completions bash >
    /// ~/.local/share/bash-completion/completions/gpumesh`.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Measure gpumesh and print a table.
    Bench {
        #[command(subcommand)]
        which: BenchCommand,
    },
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// The executor: matmul vs CPU sgemm, overhead vs direct wgpu, 1 vs n shards.
    Executor(crate::bench::ExecutorBenchArgs),
    /// Raft: committed proposals/s (batched and one at a time), commit latency, and
    /// the disk's raw fsync'd append rate, on a 3-node cluster in one process.
    Consensus(crate::bench::ConsensusBenchArgs),
    /// The mesh: task latency and throughput, mesh vs direct, blob transfer vs TCP.
    Mesh(crate::bench::MeshBenchArgs),
    /// Failover: leader and worker loss on a 3-node mesh with default timeouts, and
    /// throughput with replicas=2 against replicas=1.
    Faults(crate::bench::FaultsBenchArgs),
    /// GPU actors: call latency one at a time, calls/s with many in flight from
    /// every node, and the time to the next acknowledged call after the host dies.
    Actors(crate::bench::ActorsBenchArgs),
    /// Blob transfer: one blob pulled between two nodes (and fetched into the blob
    /// store, hashed and fsync'd) beside raw loopback TCP.
    Blobs(crate::bench::BlobsBenchArgs),
}

/// What to run: the flags `gpumesh run` and `gpumesh submit` share.
#[derive(clap::Args, Debug)]
pub struct TaskArgs {
    /// A WGSL file holding the kernel (or use --builtin).
    #[arg(required_unless_present = "builtin", conflicts_with = "builtin")]
    pub kernel: Option<PathBuf>,
    /// A built-in kernel: vector_add, matmul, mandelbrot, montecarlo_pi, histogram,
    /// linreg_grad, jacobi, blur.
    #[arg(long)]
    pub builtin: Option<String>,
    /// Problem size of a built-in kernel (its meaning depends on the kernel).
    #[arg(long, requires = "builtin")]
    pub size: Option<u32>,
    /// Entry point of the kernel (default: its one compute entry point, or `main`
    /// among several).
    #[arg(long)]
    pub entry: Option<String>,
    /// An input: the bytes of FILE bound at @group(0) @binding(BINDING), a
    /// var<storage, read> or var<uniform> binding.
    #[arg(long = "input", value_name = "BINDING=FILE", value_parser = parse_input)]
    pub inputs: Vec<(u32, PathBuf)>,
    /// An output of BYTES bytes at @group(0) @binding(BINDING), starting as zeros.
    #[arg(long = "output", value_name = "BINDING:BYTES", value_parser = parse_output)]
    pub outputs: Vec<(u32, u64)>,
    /// A var<storage, read_write> buffer at @group(0) @binding(BINDING) that starts
    /// as the bytes of FILE; its final contents are the output BINDING.bin.
    #[arg(long = "inout", value_name = "BINDING=FILE", value_parser = parse_input)]
    pub inouts: Vec<(u32, PathBuf)>,
    /// Workgroups along x, y and z.
    #[arg(long, value_name = "X[,Y[,Z]]", value_parser = parse_grid)]
    pub grid: Option<Grid>,
    /// Split the grid into this many shards and merge their outputs.
    #[arg(long, default_value_t = 1)]
    pub shards: u32,
    /// How shard results merge: changes (the default: each shard's changed words,
    /// a conflict if two shards change one word differently), or a reduction of
    /// partials, sum|min|max-u32|i32|f32 or or|and|xor-u32|i32 (bits set with
    /// atomicOr, ...). RULE sets every writable binding's rule; BINDING=RULE
    /// (repeatable) sets one binding's.
    #[arg(long = "merge", value_name = "[BINDING=]RULE", value_parser = parse_merge)]
    pub merges: Vec<(Option<u32>, MergeRule)>,
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub task: TaskArgs,
    /// Write each output to DIR/<binding>.bin.
    #[arg(long, value_name = "DIR")]
    pub out_dir: Option<PathBuf>,
    /// Backend: vulkan, gl, metal, dx12 (default: the best adapter available).
    #[arg(long, default_value = "auto", value_parser = <BackendChoice as std::str::FromStr>::from_str)]
    pub backend: BackendChoice,
    /// Compare with the CPU reference (built-in kernels); exit non-zero on mismatch.
    #[arg(long)]
    pub verify: bool,
    /// Run the task this many times and report the median time (the first run,
    /// which builds the pipeline, is not counted when repeating).
    #[arg(long, default_value_t = 1)]
    pub repeat: u32,
    /// Fail the task if it runs longer than this many seconds.
    #[arg(long, value_name = "SECONDS")]
    pub deadline: Option<f64>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Where the mesh's API is.
#[derive(clap::Args, Debug, Clone)]
pub struct ApiArgs {
    /// A node's API address (HOST:PORT), or several, comma-separated
    /// (HOST:PORT,HOST:PORT): a request that one does not answer goes on at the next.
    #[arg(long, env = "GPUMESH_API", default_value = gpumesh::DEFAULT_API)]
    pub api: String,
    /// While the mesh cannot answer (a leader change under way), retry for this many
    /// seconds, saying on stderr what is awaited; 0: fail at once.
    #[arg(
        long,
        env = "GPUMESH_RETRY_FOR",
        value_name = "SECONDS",
        default_value_t = 30.0
    )]
    pub retry_for: f64,
    /// The node's API token, needed when its API is off loopback (else read from
    /// DATA_DIR/api.token).
    #[arg(
        long,
        env = "GPUMESH_TOKEN",
        value_name = "TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// The data dir of the node at --api, to read its API token from.
    #[arg(long, env = "GPUMESH_DATA_DIR", default_value = "gpumesh-data")]
    pub data_dir: PathBuf,
}

impl ApiArgs {
    /// A client of the node at `--api`, retrying as `--retry-for` says and telling
    /// stderr what it waits for.
    pub fn client(&self) -> anyhow::Result<gpumesh::Client> {
        anyhow::ensure!(
            self.retry_for.is_finite() && self.retry_for >= 0.0,
            "--retry-for must be a number of seconds, 0 or more (got {})",
            self.retry_for
        );
        let token = self
            .token
            .clone()
            .or_else(|| gpumesh::node::admission::read_api_token(&self.data_dir));
        let mut client = gpumesh::Client::new(self.api.clone());
        if let Some(token) = token {
            client = client.with_token(&token)?;
        }
        Ok(client
            .retry_for(std::time::Duration::from_secs_f64(self.retry_for))
            .on_wait(|line| eprintln!("gpumesh: {line}")))
    }
}

fn parse_input(s: &str) -> Result<(u32, PathBuf), String> {
    let (binding, file) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not BINDING=FILE (e.g. --input 0=a.bin)"))?;
    let binding = binding
        .parse()
        .map_err(|_| format!("{binding:?} in {s:?} is not a binding number"))?;
    Ok((binding, PathBuf::from(file)))
}

fn parse_output(s: &str) -> Result<(u32, u64), String> {
    let (binding, bytes) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?} is not BINDING:BYTES (e.g. --output 2:4096)"))?;
    let binding = binding
        .parse()
        .map_err(|_| format!("{binding:?} in {s:?} is not a binding number"))?;
    let bytes = bytes
        .parse()
        .map_err(|_| format!("{bytes:?} in {s:?} is not a byte count"))?;
    Ok((binding, bytes))
}

fn parse_grid(s: &str) -> Result<Grid, String> {
    s.parse()
        .map_err(|e: gpumesh_protocol::ProtocolError| e.to_string())
}

fn parse_merge(s: &str) -> Result<(Option<u32>, MergeRule), String> {
    let (binding, rule) = match s.split_once('=') {
        Some((b, rule)) => {
            let b = b
                .parse()
                .map_err(|_| format!("{b:?} in {s:?} is not a binding number"))?;
            (Some(b), rule)
        }
        None => (None, s),
    };
    let rule = rule
        .parse()
        .map_err(|e: gpumesh_protocol::ProtocolError| e.to_string())?;
    Ok((binding, rule))
}

/// A command whose output is piped into one that stops reading (`gpumesh tasks |
/// head`) ends there, quietly, as other command-line tools do, instead of
/// panicking at its next line ("failed printing to stdout: Broken pipe"). Not for
/// the commands that run nodes: their sockets report a closed peer as an error,
/// which they handle.
fn quiet_on_closed_stdout() {
    // SAFETY: puts SIGPIPE's disposition back to the default before this command
    // starts its work; no handler of ours is involved and no memory is touched.
    #[allow(unsafe_code)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Runs the command; `matches` are what `cli` was parsed from, for where each of
/// `gpumesh node`'s settings came from.
pub fn execute(cli: Cli, matches: &ArgMatches) -> anyhow::Result<ExitCode> {
    // A node's log format may come from its config file, read first.
    if !matches!(cli.command, Command::Node(_)) {
        console::init_logs(cli.log_format);
    }
    if !matches!(cli.command, Command::Node(_) | Command::Bench { .. }) {
        quiet_on_closed_stdout();
    }
    match cli.command {
        Command::Adapters { json, no_calibrate } => adapters::run(json, !no_calibrate),
        Command::Run(args) => run::run(args),
        Command::Keygen(args) => keygen::keygen(args),
        Command::Ticket(args) => crate::cli::mesh::ticket(args),
        Command::Node(args) => {
            let settings = args.resolve(matches.subcommand_matches("node"), cli.log_format)?;
            if args.print_config {
                print!("{}", settings.to_toml()?);
                return Ok(ExitCode::SUCCESS);
            }
            console::init_logs(settings.log_format);
            mesh::node(settings)
        }
        Command::Submit(args) => mesh::submit(args),
        Command::Result(args) => mesh::result(args),
        Command::Status { api, json } => mesh::status(api, json),
        Command::Tasks { api, json } => mesh::tasks(api, json),
        Command::Actor { command } => actor::run(command),
        Command::Task { task, api, json } => mesh::task(&task, api, json),
        Command::Cancel {
            task,
            reason,
            api,
            json,
        } => mesh::cancel(&task, reason.as_deref(), api, json),
        Command::Forget { task, api } => mesh::forget(&task, api),
        Command::Leave { api, json } => mesh::leave(api, json),
        Command::Remove { node, api } => mesh::remove(&node, api),
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "gpumesh",
                &mut std::io::stdout(),
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench { which } => match which {
            BenchCommand::Executor(args) => crate::bench::executor(args),
            BenchCommand::Consensus(args) => crate::bench::consensus(args),
            BenchCommand::Mesh(args) => crate::bench::mesh(args),
            BenchCommand::Faults(args) => crate::bench::faults(args),
            BenchCommand::Actors(args) => crate::bench::actors(args),
            BenchCommand::Blobs(args) => crate::bench::blobs(args),
        },
    }
}
