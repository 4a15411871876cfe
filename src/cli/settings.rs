//! The settings of `gpumesh node`, from four places, each overriding the one before:
//! built-in defaults, a TOML file (`--config FILE`, or `GPUMESH_CONFIG`), `GPUMESH_*`
//! environment variables, and flags.
//!
//! Each setting is declared once, as a field of [`NodeArgs`]: its flag, variable,
//! default and help are clap's; its key in the file is the field's name, read and
//! written through serde. A setting has one name in all three: key `max_grid`,
//! variable `GPUMESH_MAX_GRID`, flag `--max-grid`; the lists are `peers` /
//! `GPUMESH_PEERS=A,B` / `--peer A --peer B` and `allow_peers` / `GPUMESH_ALLOW_PEERS`
//! / `--allow-peer`. clap reads the flags and the variables (a flag wins) and holds
//! the defaults; the file slots in between: what clap took from a flag or a variable
//! wins over the file, what clap only defaulted loses to it. Relative paths in a file
//! are relative to the file's directory. `--print-config` writes every key with its
//! help as a comment, in the order the fields are declared.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, CommandFactory};
use gpumesh::node::admission::Ticket;
use gpumesh::node::scheduler::SchedulerConfig;
use gpumesh::node::{ClusterKey, ConnectionCaps, Formation, Limits, Multiaddr, NodeConfig, PeerId};
use gpumesh_shaders::BackendChoice;
use serde::{Deserialize, Serialize};

use super::console::LogFormat;

/// The settings of `gpumesh node`: each a flag, a `GPUMESH_*` variable and a key of
/// the config file. After [`NodeArgs::resolve`], the settings in effect.
#[derive(clap::Args, Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeArgs {
    /// A TOML file of settings, keyed by the flags' names with `_` (`max_grid =
    /// 4096`); GPUMESH_* variables and flags override it. `--print-config` writes one.
    #[arg(long, env = "GPUMESH_CONFIG", value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Print the settings in effect, as a TOML file for --config, and exit.
    #[arg(long)]
    #[serde(skip)]
    pub print_config: bool,
    /// Where this node keeps its identity, Raft log and blobs.
    #[arg(long, env = "GPUMESH_DATA_DIR", default_value = "gpumesh-data")]
    pub data_dir: PathBuf,
    /// libp2p listen address.
    #[arg(long, env = "GPUMESH_LISTEN", default_value = "/ip4/0.0.0.0/tcp/4070")]
    #[serde(with = "text")]
    pub listen: Multiaddr,
    /// Local API address (HTTP+JSON) for the CLI and clients.
    #[arg(long, env = "GPUMESH_API", default_value = gpumesh::DEFAULT_API)]
    pub api: SocketAddr,
    /// Form a new mesh with this node as its first member.
    #[arg(long, env = "GPUMESH_INIT", value_parser = clap::builder::BoolishValueParser::new())]
    pub init: bool,
    /// Form a new mesh once this many nodes (this one included) see each other.
    #[arg(long, env = "GPUMESH_BOOTSTRAP_EXPECT", value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootstrap_expect: Option<usize>,
    /// A peer to reach (multiaddr; `/p2p/<peer id>` optional). Repeatable; the
    /// variable takes a comma-separated list.
    #[arg(
        long = "peer",
        env = "GPUMESH_PEERS",
        value_name = "MULTIADDR",
        value_delimiter = ','
    )]
    #[serde(with = "text_list")]
    pub peers: Vec<Multiaddr>,
    /// Backend: vulkan, gl, metal, dx12, or auto (the best adapter available).
    #[arg(long, env = "GPUMESH_BACKEND", default_value = "auto", value_parser = <BackendChoice as std::str::FromStr>::from_str)]
    #[serde(with = "text")]
    pub backend: BackendChoice,
    /// Discover peers on the LAN with mDNS.
    #[arg(
        long,
        env = "GPUMESH_MDNS",
        value_name = "BOOL",
        default_value_t = true,
        action = clap::ArgAction::Set,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub mdns: bool,
    /// Do not discover peers with mDNS (the same as `--mdns false`).
    #[arg(long)]
    #[serde(skip)]
    pub no_mdns: bool,
    /// Seconds to wait for a mesh to join or form.
    #[arg(
        long,
        env = "GPUMESH_JOIN_TIMEOUT",
        value_name = "SECONDS",
        default_value_t = 30.0
    )]
    pub join_timeout: f64,
    /// The mesh's cluster key file (`gpumesh keygen --out FILE`): only nodes holding
    /// the same key can connect. Without it the key in the data dir is used (made
    /// there by --init, stored there by --join).
    #[arg(long, env = "GPUMESH_CLUSTER_KEY", value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster_key: Option<PathBuf>,
    /// Join the mesh of this ticket (`gpumesh ticket` on a member prints one): it
    /// holds the cluster key, stored into the data dir, and the members' addresses.
    #[arg(long, env = "GPUMESH_JOIN", value_name = "TICKET")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub join: Option<String>,
    /// A mesh without a cluster key: anyone who reaches --listen can join and run
    /// code on this node's GPU. Meshes are closed unless every node is started so.
    #[arg(long, env = "GPUMESH_OPEN", value_parser = clap::builder::BoolishValueParser::new())]
    pub open: bool,
    /// Admit only this peer id (repeatable; the node's own id is printed at start).
    /// Without any, every peer holding the cluster key is admitted.
    #[arg(
        long = "allow-peer",
        env = "GPUMESH_ALLOW_PEERS",
        value_name = "PEER_ID",
        value_delimiter = ','
    )]
    #[serde(with = "text_list")]
    pub allow_peers: Vec<PeerId>,
    /// Most connections one peer may hold open with this node.
    #[arg(long, env = "GPUMESH_MAX_CONNECTIONS_PER_PEER", value_name = "N",
          default_value_t = ConnectionCaps::default().per_peer)]
    pub max_connections_per_peer: u32,
    /// Most connections open with all peers together.
    #[arg(long, env = "GPUMESH_MAX_CONNECTIONS", value_name = "N",
          default_value_t = ConnectionCaps::default().total)]
    pub max_connections: u32,
    /// Most incoming connections still in their handshakes at once.
    #[arg(long, env = "GPUMESH_MAX_PENDING_INCOMING", value_name = "N",
          default_value_t = ConnectionCaps::default().pending_incoming)]
    pub max_pending_incoming: u32,
    /// Largest WGSL source of one task, in bytes.
    #[arg(long, env = "GPUMESH_MAX_SHADER_BYTES", value_name = "BYTES",
          default_value_t = Limits::default().max_shader_bytes)]
    pub max_shader_bytes: u64,
    /// Largest blob, in bytes: an upload, a blob from a peer, a task's outputs together.
    #[arg(long, env = "GPUMESH_MAX_BLOB_BYTES", value_name = "BYTES",
          default_value_t = Limits::default().max_blob_bytes)]
    pub max_blob_bytes: u64,
    /// Most workgroups (x·y·z) in one task's grid.
    #[arg(long, env = "GPUMESH_MAX_GRID", value_name = "N",
          default_value_t = Limits::default().max_grid)]
    pub max_grid: u64,
    /// Most tasks submitted through this node that may be pending or running at once.
    #[arg(long, env = "GPUMESH_MAX_QUEUED_PER_SUBMITTER", value_name = "N",
          default_value_t = Limits::default().max_queued_per_submitter)]
    pub max_queued_per_submitter: usize,
    /// Largest API request body in bytes, blob uploads excepted (--max-blob-bytes).
    #[arg(long, env = "GPUMESH_MAX_REQUEST_BYTES", value_name = "BYTES",
          default_value_t = Limits::default().max_request_bytes)]
    pub max_request_bytes: u64,
    /// Bytes of GPU memory kept in use between runs: actors' state and inputs reused
    /// by later tasks. The leader places actors where their state fits in what is
    /// left of it.
    #[arg(long, env = "GPUMESH_GPU_MEMORY", value_name = "BYTES",
          default_value_t = Limits::default().gpu_memory)]
    pub gpu_memory: u64,
    /// Loop turns one invocation of a kernel may run in all, on a GPU that runs loops
    /// as written (Mesa's software adapters stop them at 65,535 themselves): past it
    /// every loop of the invocation is stopped and the task refused, so a loop that
    /// never ends frees the GPU. A loop whose turns are known as it starts (a `for`
    /// over a fixed range) counts them then, at no cost a turn; any other counts and
    /// tests each turn.
    #[arg(long, env = "GPUMESH_MAX_LOOP_TURNS", value_name = "N",
          default_value_t = Limits::default().max_loop_turns)]
    pub max_loop_turns: u32,
    /// Bytes kept free on the data dir's disk: a new blob (an upload, an input or
    /// result copied here, a shard's output, an actor's state) that would leave less
    /// is refused (507 in the API), so that the Raft log can still be written once
    /// users' data has filled the rest; 0 refuses none for it.
    #[arg(long, env = "GPUMESH_DISK_RESERVE", value_name = "BYTES",
          default_value_t = Limits::default().disk_reserve)]
    pub disk_reserve: u64,
    /// Seconds a member may go without an entry of its own being applied before it
    /// counts as down: the leader moves its unfinished shards elsewhere and status
    /// shows it silent.
    #[arg(long, env = "GPUMESH_DOWN_AFTER", value_name = "SECONDS",
          default_value_t = gpumesh::node::liveness::DEFAULT_DOWN_AFTER.as_secs_f64())]
    pub down_after: f64,
    /// A running shard is a straggler, and gets a speculative copy on another node,
    /// once it has run this many times as long as its task's finished shards…
    #[arg(long, env = "GPUMESH_STRAGGLER_FACTOR", value_name = "X",
          default_value_t = SchedulerConfig::default().straggler_factor)]
    pub straggler_factor: f64,
    /// …and at least this many seconds.
    #[arg(long, env = "GPUMESH_STRAGGLER_MIN", value_name = "SECONDS",
          default_value_t = SchedulerConfig::default().straggler_min.as_secs_f64())]
    pub straggler_min: f64,
    /// Seconds a shard may run on this node's GPU when its task sets no deadline.
    #[arg(long, env = "GPUMESH_DEFAULT_DEADLINE", value_name = "SECONDS",
          default_value_t = NodeConfig::new("").default_deadline.as_secs_f64())]
    pub default_deadline: f64,
    /// Seconds a blob stored here is kept once the record no longer names it and no
    /// one has used it (a forgotten task's result, an upload never submitted);
    /// an actor's replaced states go within a minute of their replacement.
    #[arg(long, env = "GPUMESH_KEEP_UNUSED_BLOBS", value_name = "SECONDS",
          default_value_t = NodeConfig::new("").blob_sweep.keep_unused.as_secs_f64())]
    pub keep_unused_blobs: f64,
    /// Seconds a member may be down before the others make the copies of results
    /// and actor states it held again on running members (a member removed with
    /// `gpumesh remove`: at once).
    #[arg(long, env = "GPUMESH_REPAIR_AFTER", value_name = "SECONDS",
          default_value_t = NodeConfig::new("").repair_after.as_secs_f64())]
    pub repair_after: f64,
    /// `gpumesh run` tasks (one shard, one replica) run on this node's GPU at once,
    /// recorded with their result in one commit, while fewer than this many are
    /// under way here; beyond, and with 0, the mesh places them.
    #[arg(long, env = "GPUMESH_RUN_HERE_SLOTS", value_name = "N",
          default_value_t = NodeConfig::new("").run_here_slots)]
    pub run_here_slots: usize,
    /// Log lines on stderr: text or json (the global --log-format; a key of the file
    /// too, under the flag and its variable).
    #[arg(skip)]
    pub log_format: LogFormat,
}

/// Fields of [`NodeArgs`] that are not settings: they say where the settings come
/// from and what to do with them.
const NOT_KEYS: [&str; 3] = ["config", "print_config", "no_mdns"];

/// The key of the global `--log-format` flag, which the file may set too.
const LOG_FORMAT: &str = "log_format";

/// A config file as written: each key with where its value is (for errors).
struct NodeFile {
    path: PathBuf,
    text: String,
    keys: BTreeMap<String, toml::Spanned<toml::Value>>,
}

impl NodeFile {
    fn load(path: &Path) -> anyhow::Result<NodeFile> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "cannot read the config file {} (given by --config or GPUMESH_CONFIG)",
                path.display()
            )
        })?;
        let mut keys: BTreeMap<String, toml::Spanned<toml::Value>> = toml::from_str(&text)
            .map_err(|e| anyhow!("in the config file {}: {e}", path.display()))?;
        // Relative to the file, so that the file means the same from any directory.
        let dir = path.parent().unwrap_or(Path::new(""));
        for key in ["data_dir", "cluster_key"] {
            if let Some(value) = keys.get_mut(key) {
                if let toml::Value::String(p) = value.get_mut() {
                    *p = dir.join(&*p).to_string_lossy().into_owned();
                }
            }
        }
        Ok(NodeFile {
            path: path.to_path_buf(),
            text,
            keys,
        })
    }

    fn get(&self, key: &str) -> Option<&toml::Value> {
        self.keys.get(key).map(|v| v.get_ref())
    }

    /// An error about `key`'s value, with its line and column in the file.
    fn at(&self, key: &str, what: impl Display) -> anyhow::Error {
        let offset = self.keys.get(key).map_or(0, |v| v.span().start);
        let before = &self.text[..offset.min(self.text.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
        anyhow!(
            "in the config file {}: line {line}, column {column}: {key}: {what}",
            self.path.display()
        )
    }
}

/// Where clap found each argument of `gpumesh node`.
struct Given<'a>(Option<&'a ArgMatches>);

impl Given<'_> {
    fn source(&self, id: &str) -> Option<ValueSource> {
        self.0.and_then(|m| m.value_source(id))
    }

    /// Set by a flag or a variable, so over the file.
    fn set(&self, id: &str) -> bool {
        matches!(
            self.source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        )
    }
}

/// A key of the file: its name (the field's), its flag's help and value name.
struct Key {
    name: String,
    help: String,
    value: String,
}

/// Every key of the file, in the order `--print-config` writes them.
fn keys() -> Vec<Key> {
    let key = |a: &clap::Arg| Key {
        name: a.get_id().to_string(),
        help: a.get_help().map(|h| h.to_string()).unwrap_or_default(),
        value: a
            .get_value_names()
            .and_then(|v| v.first())
            .map(|v| v.to_string())
            .unwrap_or_default(),
    };
    let node = NodeArgs::augment_args(clap::Command::new("node"));
    let mut keys: Vec<Key> = node
        .get_arguments()
        .map(key)
        .filter(|k| !NOT_KEYS.contains(&k.name.as_str()))
        .collect();
    keys.extend(
        super::Cli::command()
            .get_arguments()
            .filter(|a| a.get_id() == LOG_FORMAT)
            .map(key),
    );
    keys
}

/// `text` as comment lines of at most about 88 columns.
fn comment(text: &str) -> String {
    let mut out = String::new();
    let mut line = String::from("#");
    for word in text.split_whitespace() {
        if line.len() + 1 + word.len() > 88 && line.len() > 1 {
            out.push_str(&line);
            out.push('\n');
            line = String::from("#");
        }
        line.push(' ');
        line.push_str(word);
    }
    out.push_str(&line);
    out.push('\n');
    out
}

impl NodeArgs {
    /// The settings in effect: the file (if any) applied under the flags and
    /// variables in `self`; `matches` says which of those clap found and which it
    /// defaulted. `log_format` is the global flag's value, also found in `matches`.
    pub fn resolve(
        &self,
        matches: Option<&ArgMatches>,
        log_format: LogFormat,
    ) -> anyhow::Result<NodeArgs> {
        let given = Given(matches);
        let mut settings = self.clone();
        settings.log_format = log_format;
        if let Some(path) = &self.config {
            let file = NodeFile::load(path)?;
            let known = keys();
            for key in file.keys.keys() {
                if !known.iter().any(|k| &k.name == key) {
                    let names: Vec<&str> = known.iter().map(|k| k.name.as_str()).collect();
                    return Err(file.at(
                        key,
                        format!("no such setting; the keys are {}", names.join(", ")),
                    ));
                }
            }
            // Each of the file's values on its own over what clap has, so that a bad
            // one is named with its place in the file.
            let mut merged = toml::Table::try_from(&settings)?;
            for (key, value) in &file.keys {
                // The global --log-format is found in the node's matches too.
                let over = !given.set(key);
                let mut trial = merged.clone();
                trial.insert(key.clone(), value.get_ref().clone());
                trial
                    .clone()
                    .try_into::<NodeArgs>()
                    .map_err(|e| file.at(key, e.message()))?;
                if over {
                    merged = trial;
                }
            }
            let (init, bootstrap_expect) = formation(&given, self, Some(&file))?;
            settings = merged.try_into()?;
            settings.init = init;
            settings.bootstrap_expect = bootstrap_expect;
        } else {
            let (init, bootstrap_expect) = formation(&given, self, None)?;
            settings.init = init;
            settings.bootstrap_expect = bootstrap_expect;
        }
        settings.mdns &= !self.no_mdns;
        settings.config = self.config.clone();
        settings.print_config = self.print_config;
        settings.check()?;
        Ok(settings)
    }

    /// Refuses values no node could run with, naming the setting.
    fn check(&self) -> anyhow::Result<()> {
        let keys = [self.cluster_key.is_some(), self.join.is_some(), self.open];
        if keys.iter().filter(|k| **k).count() > 1 {
            bail!(
                "give one of --cluster-key FILE, --join TICKET and --open: a mesh has one \
                 key (a ticket carries it), or none when it is open"
            );
        }
        if self.join.is_some() && (self.init || self.bootstrap_expect.is_some()) {
            bail!("--join joins an existing mesh; --init and --bootstrap-expect form a new one");
        }
        if self.bootstrap_expect == Some(0) {
            bail!("{} must be at least 1", names("bootstrap_expect"));
        }
        for (key, secs) in [
            ("join_timeout", self.join_timeout),
            ("down_after", self.down_after),
            ("straggler_min", self.straggler_min),
            ("default_deadline", self.default_deadline),
            ("keep_unused_blobs", self.keep_unused_blobs),
            ("repair_after", self.repair_after),
        ] {
            seconds(key, secs)?;
        }
        if !(self.straggler_factor.is_finite() && self.straggler_factor >= 1.0) {
            bail!(
                "{} must be a number of at least 1 (got {}): a shard is a straggler only \
                 once it runs longer than its siblings",
                names("straggler_factor"),
                self.straggler_factor
            );
        }
        let heartbeat = NodeConfig::new("").heartbeat_interval;
        if seconds("down_after", self.down_after)? <= heartbeat {
            bail!(
                "{} must be more than the {} s between a node's heartbeats (got {}): \
                 otherwise healthy nodes are declared down",
                names("down_after"),
                heartbeat.as_secs_f64(),
                self.down_after
            );
        }
        for (key, value) in [
            (
                "max_connections_per_peer",
                u64::from(self.max_connections_per_peer),
            ),
            ("max_connections", u64::from(self.max_connections)),
            ("max_pending_incoming", u64::from(self.max_pending_incoming)),
            ("max_shader_bytes", self.max_shader_bytes),
            ("max_blob_bytes", self.max_blob_bytes),
            ("max_grid", self.max_grid),
            (
                "max_queued_per_submitter",
                self.max_queued_per_submitter as u64,
            ),
            ("max_request_bytes", self.max_request_bytes),
            ("gpu_memory", self.gpu_memory),
            ("max_loop_turns", u64::from(self.max_loop_turns)),
        ] {
            if value == 0 {
                bail!(
                    "{} must be at least 1: a node with a zero limit could serve nothing",
                    names(key)
                );
            }
        }
        self.limits().check()?;
        Ok(())
    }

    fn limits(&self) -> Limits {
        Limits {
            max_shader_bytes: self.max_shader_bytes,
            max_blob_bytes: self.max_blob_bytes,
            max_grid: self.max_grid,
            max_queued_per_submitter: self.max_queued_per_submitter,
            max_request_bytes: self.max_request_bytes,
            gpu_memory: self.gpu_memory,
            max_loop_turns: self.max_loop_turns,
            disk_reserve: self.disk_reserve,
        }
    }

    /// The key given to this node: the `--cluster-key` file's, or the join
    /// ticket's. `None` leaves it to the data dir (see [`NodeConfig::cluster_key`]).
    pub fn given_key(&self) -> anyhow::Result<Option<ClusterKey>> {
        if let Some(path) = &self.cluster_key {
            return Ok(Some(ClusterKey::load(path)?));
        }
        Ok(self.ticket()?.map(|t| t.key))
    }

    fn ticket(&self) -> anyhow::Result<Option<Ticket>> {
        self.join
            .as_deref()
            .map(|t| t.parse::<Ticket>().map_err(|e| anyhow!("--join: {e}")))
            .transpose()
    }

    /// The node's configuration; `cluster_key` is [`NodeArgs::given_key`].
    pub fn node_config(&self, cluster_key: Option<ClusterKey>) -> anyhow::Result<NodeConfig> {
        let mut config = NodeConfig::new(&self.data_dir);
        config.listen = vec![self.listen.clone()];
        config.api = self.api;
        config.formation = match (self.init, self.bootstrap_expect) {
            (true, _) => Formation::Init,
            (false, Some(n)) => Formation::BootstrapExpect(n),
            (false, None) => Formation::Join,
        };
        config.peers = self.peers.clone();
        if let Some(ticket) = self.ticket()? {
            config.peers.extend(ticket.addrs);
        }
        config.open = self.open;
        config.backend = self.backend;
        config.mdns = self.mdns;
        config.join_timeout = seconds("join_timeout", self.join_timeout)?;
        config.cluster_key = cluster_key;
        config.allow_peers = self.allow_peers.clone();
        config.connections = ConnectionCaps {
            per_peer: self.max_connections_per_peer,
            total: self.max_connections,
            pending_incoming: self.max_pending_incoming,
        };
        config.limits = self.limits();
        config.down_after = seconds("down_after", self.down_after)?;
        config.scheduler.straggler_factor = self.straggler_factor;
        config.scheduler.straggler_min = seconds("straggler_min", self.straggler_min)?;
        config.default_deadline = seconds("default_deadline", self.default_deadline)?;
        config.blob_sweep.keep_unused = seconds("keep_unused_blobs", self.keep_unused_blobs)?;
        config.repair_after = seconds("repair_after", self.repair_after)?;
        config.run_here_slots = self.run_here_slots;
        Ok(config)
    }

    /// The settings as a TOML file for `--config`: every key, each under its help as
    /// a comment; keys without a value are commented out. Paths are made absolute,
    /// so that the file means the same wherever it is put.
    pub fn to_toml(&self) -> anyhow::Result<String> {
        let mut table = toml::Table::try_from(self)?;
        for key in ["data_dir", "cluster_key"] {
            if let Some(toml::Value::String(p)) = table.get_mut(key) {
                if let Ok(abs) = std::path::absolute(&*p) {
                    *p = abs.to_string_lossy().into_owned();
                }
            }
        }
        let mut out = String::from(
            "# gpumesh node settings, for `gpumesh node --config FILE`.\n\
             # GPUMESH_<KEY> variables and --<key> flags override what is set here.\n",
        );
        for key in keys() {
            out.push('\n');
            out.push_str(&comment(&key.help));
            match table.remove(&key.name) {
                Some(value) => out.push_str(&format!("{} = {value}\n", key.name)),
                None => out.push_str(&format!("# {} = <{}>\n", key.name, key.value)),
            }
        }
        if let Some(key) = table.keys().next() {
            bail!("setting {key} has no flag to document it");
        }
        Ok(out)
    }
}

/// Init and bootstrap_expect are one choice, how the mesh forms: the first of
/// flags, variables and file that makes it (`init = true` or `bootstrap_expect =
/// N`) decides, and both in one place is an error. `init = false` only cancels an
/// `init = true` below it.
fn formation(
    given: &Given,
    args: &NodeArgs,
    file: Option<&NodeFile>,
) -> anyhow::Result<(bool, Option<usize>)> {
    let from = |source: ValueSource| {
        (
            (given.source("init") == Some(source)).then_some(args.init),
            args.bootstrap_expect
                .filter(|_| given.source("bootstrap_expect") == Some(source)),
        )
    };
    let in_file = (
        file.and_then(|f| f.get("init"))
            .and_then(toml::Value::as_bool),
        file.and_then(|f| f.get("bootstrap_expect"))
            .and_then(toml::Value::as_integer)
            .and_then(|n| usize::try_from(n).ok()),
    );
    let places = [
        ("the flags", from(ValueSource::CommandLine)),
        (
            "the environment (GPUMESH_INIT, GPUMESH_BOOTSTRAP_EXPECT)",
            from(ValueSource::EnvVariable),
        ),
        ("the config file", in_file),
    ];
    let (mut init, mut expect) = (None, None);
    for (place, (layer_init, layer_expect)) in places {
        if layer_init == Some(true) && layer_expect.is_some() {
            bail!(
                "{place} set both init and bootstrap_expect: a mesh forms either around \
                 one node (--init) or once N nodes see each other (--bootstrap-expect N)"
            );
        }
        init = init.or(layer_init);
        expect = expect.or(layer_expect);
        if init == Some(true) || expect.is_some() {
            break;
        }
    }
    let init = init.unwrap_or(false);
    Ok((init, expect.filter(|_| !init)))
}

/// A key's names as a user may have set it.
fn names(key: &str) -> String {
    format!(
        "{key} (--{}, GPUMESH_{})",
        key.replace('_', "-"),
        key.to_uppercase()
    )
}

fn seconds(key: &str, secs: f64) -> anyhow::Result<Duration> {
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => bail!(
            "{} must be a positive number of seconds (got {secs})",
            names(key)
        ),
    }
}

/// A value the file holds as a string, parsed as its type (a multiaddr, a peer id,
/// a backend) and written back as it displays.
mod text {
    use super::*;

    pub fn serialize<S: serde::Serializer, T: Display>(v: &T, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(v)
    }

    pub fn deserialize<'de, D, T>(d: D) -> Result<T, D::Error>
    where
        D: serde::Deserializer<'de>,
        T: FromStr,
        T::Err: Display,
    {
        let s = String::deserialize(d)?;
        s.parse()
            .map_err(|e| serde::de::Error::custom(format!("{s:?}: {e}")))
    }
}

/// A list of such values.
mod text_list {
    use super::*;

    pub fn serialize<S: serde::Serializer, T: Display>(v: &[T], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.iter().map(|x| x.to_string()))
    }

    pub fn deserialize<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
    where
        D: serde::Deserializer<'de>,
        T: FromStr,
        T::Err: Display,
    {
        Vec::<String>::deserialize(d)?
            .iter()
            .map(|s| {
                s.parse()
                    .map_err(|e| serde::de::Error::custom(format!("{s:?}: {e}")))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use clap::FromArgMatches;

    fn resolve(argv: &[&str]) -> anyhow::Result<NodeArgs> {
        let matches = super::super::Cli::command()
            .try_get_matches_from(std::iter::once("gpumesh").chain(argv.iter().copied()))?;
        let cli = super::super::Cli::from_arg_matches(&matches)?;
        let super::super::Command::Node(args) = cli.command else {
            panic!("not a node command")
        };
        args.resolve(matches.subcommand_matches("node"), cli.log_format)
    }

    #[test]
    fn print_config_writes_every_key_and_reads_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("mesh.key");
        let settings = resolve(&[
            "node",
            "--bootstrap-expect",
            "3",
            "--cluster-key",
            key.to_str().unwrap(),
            "--allow-peer",
            "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
            "--peer",
            "/ip4/10.0.0.1/tcp/4070",
        ])
        .unwrap();
        let text = settings.to_toml().unwrap();
        let path = dir.path().join("node.toml");
        std::fs::write(&path, &text).unwrap();
        let again = resolve(&["node", "--config", path.to_str().unwrap()]).unwrap();
        assert_eq!(again.to_toml().unwrap(), text);
        assert!(text.contains("\nbootstrap_expect = 3\n"), "{text}");
        assert!(text.contains("\ninit = false\n"), "{text}");
        // Every setting is written, each under its flag's help.
        for key in keys() {
            let name = &key.name;
            assert!(
                text.contains(&format!("\n{name} =")) || text.contains(&format!("# {name} =")),
                "{name} missing: {text}"
            );
            assert!(!key.help.is_empty(), "{name} has no help");
        }
    }
}
