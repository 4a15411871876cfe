//! `gpumesh node` as a child process: started, killed with SIGKILL and started again
//! on the same data dir and ports. What the multi-process tests and `gpumesh bench
//! faults` run meshes of, the way a user runs one from a shell.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::Client;

/// How long a node may take to print "API on" (it calibrates its adapter first).
const START_LIMIT: Duration = Duration::from_secs(90);

/// A port free on loopback now, for the caller to bind soon after (and again when
/// it restarts a node). It is drawn below the OS's ephemeral range where there is
/// room: a port from that range can be handed to any outgoing connection or port-0
/// listener between now and the bind ("Address already in use").
pub fn free_port() -> std::io::Result<u16> {
    const FLOOR: u16 = 10_000;
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    if low > FLOOR + 1_000 {
        use std::hash::{BuildHasher, Hasher};
        for _ in 0..64 {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            let port = FLOOR + (h.finish() % u64::from(low - FLOOR)) as u16;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// One `gpumesh node` process and what it needs to be started again.
#[derive(Debug)]
pub struct NodeProcess {
    /// The `gpumesh` binary.
    pub bin: PathBuf,
    pub name: String,
    pub dir: PathBuf,
    /// The IPv4 address it listens on for peers.
    pub host: String,
    pub p2p: u16,
    /// The address its API binds; off loopback the node requires its token.
    pub api_host: String,
    pub api: u16,
    /// A command the node runs under (`ip netns exec NS`), if any.
    pub prefix: Vec<String>,
    /// Given to the node's RUST_LOG.
    pub log_filter: String,
    child: Option<Child>,
    /// Read from its first line once started.
    pub raft_id: u64,
    /// `/ip4/…/tcp/…/p2p/…`, as printed once started.
    pub seed: String,
}

impl NodeProcess {
    /// A node named `name` keeping its data in `root/name` (and its log in
    /// `root/name.log`), on free loopback ports.
    pub fn new(bin: impl Into<PathBuf>, root: &Path, name: &str) -> std::io::Result<Self> {
        Ok(NodeProcess {
            bin: bin.into(),
            name: name.into(),
            dir: root.join(name),
            host: "127.0.0.1".into(),
            p2p: free_port()?,
            api_host: "127.0.0.1".into(),
            api: free_port()?,
            prefix: Vec::new(),
            log_filter: "info,wgpu_hal=error,wgpu_core=error,naga=error".into(),
            child: None,
            raft_id: 0,
            seed: String::new(),
        })
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.with_extension("log")
    }

    /// Starts `gpumesh node` with `extra` flags and waits until it serves its API,
    /// reading its raft id and address from what it prints.
    pub fn start(&mut self, extra: &[&str]) -> std::io::Result<()> {
        let listen = format!("/ip4/{}/tcp/{}", self.host, self.p2p);
        let api = format!("{}:{}", self.api_host, self.api);
        if let Some(parent) = self.dir.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let log = std::fs::File::create(self.log_path())?;
        let mut cmd = match self.prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&self.bin);
                c
            }
            None => Command::new(&self.bin),
        };
        let mut child = cmd
            .arg("node")
            .arg("--data-dir")
            .arg(&self.dir)
            .args(["--listen", &listen, "--api", &api, "--no-mdns"])
            .args(extra)
            .env("RUST_LOG", &self.log_filter)
            .env("XDG_RUNTIME_DIR", std::env::temp_dir())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()?;
        let (tx, lines) = mpsc::channel();
        let Some(out) = child.stdout.take() else {
            return Err(std::io::Error::other("no stdout from the node"));
        };
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + START_LIMIT;
        let mut seen = String::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(line) = lines.recv_timeout(left) else {
                let _ = child.kill();
                let _ = child.wait();
                return Err(std::io::Error::other(format!(
                    "node {} did not start: {seen}\n{}",
                    self.name,
                    std::fs::read_to_string(self.log_path()).unwrap_or_default()
                )));
            };
            if let Some(rest) = line.strip_prefix("gpumesh node ") {
                // `… (raft id 353c9eab506d4d90, data format 6)`
                if let Some(rest) = rest.split("raft id ").nth(1) {
                    let hex = rest.split([',', ')']).next().unwrap_or_default();
                    self.raft_id = u64::from_str_radix(hex, 16).map_err(std::io::Error::other)?;
                }
            }
            if let Some(addr) = line.trim().strip_prefix("listening on ") {
                self.seed = addr.to_string();
            }
            seen.push_str(&line);
            seen.push('\n');
            if line.contains("API on") {
                break;
            }
        }
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL: no goodbye, no flush, no leadership hand-over.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends it `signal` (`INT` as Ctrl-C does, `TERM` as a service manager stops it)
    /// and waits up to `limit` for it to exit; its exit status, if it did.
    pub fn stop_with(
        &mut self,
        signal: &str,
        limit: Duration,
    ) -> std::io::Result<Option<std::process::ExitStatus>> {
        let Some(child) = self.child.as_mut() else {
            return Ok(None);
        };
        Command::new("kill")
            .args(["-s", signal, &child.id().to_string()])
            .status()?;
        self.wait_exit(limit)
    }

    /// Waits up to `limit` for it to exit by itself; its exit status, if it did (it
    /// is then no longer started).
    pub fn wait_exit(
        &mut self,
        limit: Duration,
    ) -> std::io::Result<Option<std::process::ExitStatus>> {
        let Some(child) = self.child.as_mut() else {
            return Ok(None);
        };
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                return Ok(Some(status));
            }
            if Instant::now() > deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether it was started and has not exited.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// Whether it was started and not killed (it may have exited by itself).
    pub fn started(&self) -> bool {
        self.child.is_some()
    }

    /// The API's address as a client reaches it.
    pub fn api_addr(&self) -> String {
        let host = if self.api_host == "0.0.0.0" {
            "127.0.0.1"
        } else {
            &self.api_host
        };
        format!("{host}:{}", self.api)
    }

    /// A client of its API, holding its token when the API is off loopback.
    pub fn client(&self) -> crate::ClientResult<Client> {
        let client = Client::new(self.api_addr());
        let loopback = self
            .api_host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
        match gpumesh_node::admission::read_api_token(&self.dir) {
            Some(token) if !loopback => client.with_token(&token),
            _ => Ok(client),
        }
    }

    /// The join ticket of its mesh: the last line `gpumesh ticket` prints.
    pub fn ticket(&self) -> std::io::Result<String> {
        let out = Command::new(&self.bin)
            .arg("ticket")
            .arg("--data-dir")
            .arg(&self.dir)
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        match text.lines().last() {
            Some(last) if out.status.success() => Ok(last.trim().to_string()),
            _ => Err(std::io::Error::other(format!(
                "gpumesh ticket failed: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            ))),
        }
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}
