//! The settings of `gpumesh node`, from four places, each overriding the one before:
//! built-in defaults, a TOML file (`--config FILE`, or `GPUMESH_CONFIG`), `GPUMESH_*`
//! environment variables, and flags.
//!
//! A setting has one name in all three: key `max_grid`, variable `GPUMESH_MAX_GRID`,
//! flag `--max-grid`; the lists are `peers` / `GPUMESH_PEERS=A,B` / `--peer A --peer B`
//! and `allow_peers` / `GPUMESH_ALLOW_PEERS` / `--allow-peer`. clap reads the flags and
//! the variables (a flag wins) and holds the defaults; the file slots in between: what
//! clap took from a flag or a variable wins over the file, what clap only defaulted
//! loses to it. Relative paths in a file are relative to the file's directory.

use std::fmt::Display;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use clap::parser::ValueSource;
use clap::ArgMatches;
use gpumesh::node::admission::Ticket;
use gpumesh::node::scheduler::SchedulerConfig;
use gpumesh::node::{ClusterKey, ConnectionCaps, Formation, Limits, Multiaddr, NodeConfig, PeerId};
use gpumesh_shaders::BackendChoice;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::console::LogFormat;

/// The flags of `gpumesh node`, each also read from its `GPUMESH_*` variable.
#[derive(clap::Args, Debug)]
pub struct NodeArgs {
    /// A TOML file of settings, keyed by the flags' names with `_` (`max_grid =
    /// 4096`); GPUMESH_* variables and flags override it. `--print-config` writes one.
    #[arg(long, env = "GPUMESH_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the settings in effect, as a TOML file for --config, and exit.
    #[arg(long)]
    pub print_config: bool,
    /// Where this node keeps its identity, Raft log and blobs.
    #[arg(long, env = "GPUMESH_DATA_DIR", default_value = "gpumesh-data")]
    pub data_dir: PathBuf,
    /// libp2p listen address.
    #[arg(long, env = "GPUMESH_LISTEN", default_value = "/ip4/0.0.0.0/tcp/4070")]
    pub listen: Multiaddr,
    /// Local API address (HTTP+JSON) for the CLI and clients.
    #[arg(long, env = "GPUMESH_API", default_value = gpumesh::DEFAULT_API)]
    pub api: SocketAddr,
    /// Form a new mesh with this node as its first member.
    #[arg(long, env = "GPUMESH_INIT", value_parser = clap::builder::BoolishValueParser::new())]
    pub init: bool,
    /// Form a new mesh once this many nodes (this one included) see each other.
    #[arg(long, env = "GPUMESH_BOOTSTRAP_EXPECT", value_name = "N")]
    pub bootstrap_expect: Option<usize>,
    /// A peer to reach (multiaddr; `/p2p/<peer id>` optional). Repeatable; the
    /// variable takes a comma-separated list.
    #[arg(
        long = "peer",
        env = "GPUMESH_PEERS",
        value_name = "MULTIADDR",
        value_delimiter = ','
    )]
    pub peers: Vec<Multiaddr>,
    /// Backend: vulkan, gl, metal, dx12, or auto (the best adapter available).
    #[arg(long, env = "GPUMESH_BACKEND", default_value = "auto", value_parser = <BackendChoice as std::str::FromStr>::from_str)]
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
    pub cluster_key: Option<PathBuf>,
    /// Join the mesh of this ticket (`gpumesh ticket` on a member prints one): it
    /// holds the cluster key, stored into the data dir, and the members' addresses.
    #[arg(long, env = "GPUMESH_JOIN", value_name = "TICKET")]
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
}

/// A config file as written: every key optional, an unknown key an error.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeFile {
    data_dir: Option<PathBuf>,
    #[serde(default, deserialize_with = "parsed")]
    listen: Option<Multiaddr>,
    api: Option<SocketAddr>,
    init: Option<bool>,
    bootstrap_expect: Option<usize>,
    #[serde(default, deserialize_with = "parsed_list")]
    peers: Option<Vec<Multiaddr>>,
    #[serde(default, deserialize_with = "parsed")]
    backend: Option<BackendChoice>,
    mdns: Option<bool>,
    join_timeout: Option<f64>,
    cluster_key: Option<PathBuf>,
    join: Option<String>,
    open: Option<bool>,
    #[serde(default, deserialize_with = "parsed_list")]
    allow_peers: Option<Vec<PeerId>>,
    max_connections_per_peer: Option<u32>,
    max_connections: Option<u32>,
    max_pending_incoming: Option<u32>,
    max_shader_bytes: Option<u64>,
    max_blob_bytes: Option<u64>,
    max_grid: Option<u64>,
    max_queued_per_submitter: Option<usize>,
    max_request_bytes: Option<u64>,
    down_after: Option<f64>,
    straggler_factor: Option<f64>,
    straggler_min: Option<f64>,
    default_deadline: Option<f64>,
    log_format: Option<LogFormat>,
}

impl NodeFile {
    fn load(path: &Path) -> anyhow::Result<NodeFile> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "cannot read the config file {} (given by --config or GPUMESH_CONFIG)",
                path.display()
            )
        })?;
        let mut file: NodeFile = toml::from_str(&text)
            .map_err(|e| anyhow!("in the config file {}: {e}", path.display()))?;
        // Relative to the file, so that the file means the same from any directory.
        let dir = path.parent().unwrap_or(Path::new(""));
        file.data_dir = file.data_dir.map(|p| dir.join(p));
        file.cluster_key = file.cluster_key.map(|p| dir.join(p));
        Ok(file)
    }
}

/// The settings in effect, with every source applied.
#[derive(Debug, Serialize)]
pub struct NodeSettings {
    pub data_dir: PathBuf,
    #[serde(serialize_with = "displayed")]
    pub listen: Multiaddr,
    pub api: SocketAddr,
    pub init: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootstrap_expect: Option<usize>,
    #[serde(serialize_with = "displayed_list")]
    pub peers: Vec<Multiaddr>,
    #[serde(serialize_with = "displayed")]
    pub backend: BackendChoice,
    pub mdns: bool,
    pub join_timeout: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster_key: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub join: Option<String>,
    pub open: bool,
    #[serde(serialize_with = "displayed_list")]
    pub allow_peers: Vec<PeerId>,
    pub max_connections_per_peer: u32,
    pub max_connections: u32,
    pub max_pending_incoming: u32,
    pub max_shader_bytes: u64,
    pub max_blob_bytes: u64,
    pub max_grid: u64,
    pub max_queued_per_submitter: usize,
    pub max_request_bytes: u64,
    pub down_after: f64,
    pub straggler_factor: f64,
    pub straggler_min: f64,
    pub default_deadline: f64,
    pub log_format: LogFormat,
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

    /// clap's value where a flag or a variable set it, else the file's, else clap's
    /// default.
    fn pick<T>(&self, id: &str, clap: T, file: Option<T>) -> T {
        if self.set(id) {
            clap
        } else {
            file.unwrap_or(clap)
        }
    }
}

impl NodeSettings {
    /// Applies the file (if any) under the flags and variables in `args`; `matches`
    /// says which of those clap found and which it defaulted. `log_format` is the
    /// global flag's value, also found in `matches`.
    pub fn resolve(
        args: &NodeArgs,
        matches: Option<&ArgMatches>,
        log_format: LogFormat,
    ) -> anyhow::Result<NodeSettings> {
        let file = match &args.config {
            Some(path) => NodeFile::load(path)?,
            None => NodeFile::default(),
        };
        let given = Given(matches);
        let (init, bootstrap_expect) = formation(&given, args, &file)?;
        let mdns = !args.no_mdns && given.pick("mdns", args.mdns, file.mdns);
        let settings = NodeSettings {
            data_dir: given.pick("data_dir", args.data_dir.clone(), file.data_dir),
            listen: given.pick("listen", args.listen.clone(), file.listen),
            api: given.pick("api", args.api, file.api),
            init,
            bootstrap_expect,
            peers: given.pick("peers", args.peers.clone(), file.peers),
            backend: given.pick("backend", args.backend, file.backend),
            mdns,
            join_timeout: given.pick("join_timeout", args.join_timeout, file.join_timeout),
            cluster_key: if given.set("cluster_key") {
                args.cluster_key.clone()
            } else {
                file.cluster_key
            },
            join: if given.set("join") {
                args.join.clone()
            } else {
                file.join
            },
            open: given.pick("open", args.open, file.open),
            allow_peers: given.pick("allow_peers", args.allow_peers.clone(), file.allow_peers),
            max_connections_per_peer: given.pick(
                "max_connections_per_peer",
                args.max_connections_per_peer,
                file.max_connections_per_peer,
            ),
            max_connections: given.pick(
                "max_connections",
                args.max_connections,
                file.max_connections,
            ),
            max_pending_incoming: given.pick(
                "max_pending_incoming",
                args.max_pending_incoming,
                file.max_pending_incoming,
            ),
            max_shader_bytes: given.pick(
                "max_shader_bytes",
                args.max_shader_bytes,
                file.max_shader_bytes,
            ),
            max_blob_bytes: given.pick("max_blob_bytes", args.max_blob_bytes, file.max_blob_bytes),
            max_grid: given.pick("max_grid", args.max_grid, file.max_grid),
            max_queued_per_submitter: given.pick(
                "max_queued_per_submitter",
                args.max_queued_per_submitter,
                file.max_queued_per_submitter,
            ),
            max_request_bytes: given.pick(
                "max_request_bytes",
                args.max_request_bytes,
                file.max_request_bytes,
            ),
            down_after: given.pick("down_after", args.down_after, file.down_after),
            straggler_factor: given.pick(
                "straggler_factor",
                args.straggler_factor,
                file.straggler_factor,
            ),
            straggler_min: given.pick("straggler_min", args.straggler_min, file.straggler_min),
            default_deadline: given.pick(
                "default_deadline",
                args.default_deadline,
                file.default_deadline,
            ),
            log_format: given.pick("log_format", log_format, file.log_format),
        };
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

    /// The node's configuration; `cluster_key` is [`NodeSettings::given_key`].
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
        Ok(config)
    }

    /// The settings as a TOML file for `--config`: every key, each under a comment
    /// saying what it is; keys without a value are commented out. Paths are made
    /// absolute, so that the file means the same wherever it is put.
    pub fn to_toml(&self) -> anyhow::Result<String> {
        let mut absolute = toml::Table::try_from(self)?;
        for key in ["data_dir", "cluster_key"] {
            if let Some(toml::Value::String(p)) = absolute.get_mut(key) {
                if let Ok(abs) = std::path::absolute(&*p) {
                    *p = abs.to_string_lossy().into_owned();
                }
            }
        }
        let mut out = String::from(
            "# gpumesh node settings, for `gpumesh node --config FILE`.\n\
             # GPUMESH_<KEY> variables and --<key> flags override what is set here.\n",
        );
        for (key, doc, example) in KEYS {
            out.push_str(&format!("\n# {doc}\n"));
            match absolute.remove(*key) {
                Some(value) => out.push_str(&format!("{key} = {value}\n")),
                None => out.push_str(&format!("# {key} = {example}\n")),
            }
        }
        if let Some(key) = absolute.keys().next() {
            bail!("setting {key} has no entry in the config file's key list");
        }
        Ok(out)
    }
}

/// Every key of the file in the order `--print-config` writes them: its comment,
/// and an example value for a key that is unset.
const KEYS: &[(&str, &str, &str)] = &[
    (
        "data_dir",
        "Where this node keeps its identity, Raft log and blobs.",
        "",
    ),
    ("listen", "libp2p listen address.", ""),
    (
        "api",
        "Local API address (HTTP+JSON) for the CLI and clients.",
        "",
    ),
    (
        "init",
        "Form a new mesh with this node as its first member.",
        "",
    ),
    (
        "bootstrap_expect",
        "Form a new mesh once this many nodes see each other (instead of init).",
        "3",
    ),
    (
        "peers",
        "Peers to reach (multiaddrs; /p2p/<peer id> optional).",
        "",
    ),
    (
        "backend",
        "GPU backend: vulkan, gl, metal, dx12 or auto.",
        "",
    ),
    ("mdns", "Discover peers on the LAN with mDNS.", ""),
    (
        "join_timeout",
        "Seconds to wait for a mesh to join or form.",
        "",
    ),
    (
        "cluster_key",
        "The mesh's cluster key file (`gpumesh keygen --out FILE`); none: an open mesh.",
        "\"mesh.key\"",
    ),
    (
        "join",
        "A join ticket (`gpumesh ticket` on a member): the cluster key and members' addresses.",
        "\"gpumesh1...\"",
    ),
    (
        "open",
        "A mesh without a cluster key: anyone who reaches the listen address can join.",
        "",
    ),
    (
        "allow_peers",
        "Admit only these peer ids; empty: every peer holding the cluster key.",
        "",
    ),
    (
        "max_connections_per_peer",
        "Most connections one peer may hold open with this node.",
        "",
    ),
    (
        "max_connections",
        "Most connections open with all peers together.",
        "",
    ),
    (
        "max_pending_incoming",
        "Most incoming connections still in their handshakes at once.",
        "",
    ),
    (
        "max_shader_bytes",
        "Largest WGSL source of one task, in bytes.",
        "",
    ),
    (
        "max_blob_bytes",
        "Largest blob in bytes: an upload, a blob from a peer, a task's outputs together.",
        "",
    ),
    (
        "max_grid",
        "Most workgroups (x*y*z) in one task's grid.",
        "",
    ),
    (
        "max_queued_per_submitter",
        "Most tasks submitted through this node pending or running at once.",
        "",
    ),
    (
        "max_request_bytes",
        "Largest API request body in bytes, blob uploads excepted.",
        "",
    ),
    (
        "down_after",
        "Seconds without word from a member before the leader moves its shards elsewhere.",
        "",
    ),
    (
        "straggler_factor",
        "A shard running this many times as long as its finished siblings gets a copy elsewhere...",
        "",
    ),
    (
        "straggler_min",
        "...once it has also run at least this many seconds.",
        "",
    ),
    (
        "default_deadline",
        "Seconds a shard may run on this node's GPU when its task sets no deadline.",
        "",
    ),
    ("log_format", "Log lines on stderr: text or json.", ""),
];

/// Init and bootstrap_expect are one choice, how the mesh forms: the first of
/// flags, variables and file that makes it (`init = true` or `bootstrap_expect =
/// N`) decides, and both in one place is an error. `init = false` only cancels an
/// `init = true` below it.
fn formation(
    given: &Given,
    args: &NodeArgs,
    file: &NodeFile,
) -> anyhow::Result<(bool, Option<usize>)> {
    let from = |source: ValueSource| {
        (
            (given.source("init") == Some(source)).then_some(args.init),
            args.bootstrap_expect
                .filter(|_| given.source("bootstrap_expect") == Some(source)),
        )
    };
    let places = [
        ("the flags", from(ValueSource::CommandLine)),
        (
            "the environment (GPUMESH_INIT, GPUMESH_BOOTSTRAP_EXPECT)",
            from(ValueSource::EnvVariable),
        ),
        ("the config file", (file.init, file.bootstrap_expect)),
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

/// A value the file gives as a string, parsed as its type (a multiaddr, a peer id, a
/// backend); an error points at the value.
fn parsed<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: Display,
{
    let s = String::deserialize(d)?;
    s.parse()
        .map(Some)
        .map_err(|e| serde::de::Error::custom(format!("{s:?}: {e}")))
}

fn parsed_list<'de, D, T>(d: D) -> Result<Option<Vec<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: Display,
{
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|s| {
            s.parse()
                .map_err(|e| serde::de::Error::custom(format!("{s:?}: {e}")))
        })
        .collect::<Result<Vec<T>, D::Error>>()
        .map(Some)
}

fn displayed<S: Serializer, T: Display>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

fn displayed_list<S: Serializer, T: Display>(v: &[T], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(|x| x.to_string()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use clap::{CommandFactory, FromArgMatches};

    fn resolve(argv: &[&str]) -> anyhow::Result<NodeSettings> {
        let matches = super::super::Cli::command()
            .try_get_matches_from(std::iter::once("gpumesh").chain(argv.iter().copied()))?;
        let cli = super::super::Cli::from_arg_matches(&matches)?;
        let super::super::Command::Node(args) = cli.command else {
            panic!("not a node command")
        };
        NodeSettings::resolve(&args, matches.subcommand_matches("node"), cli.log_format)
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
    }
}
