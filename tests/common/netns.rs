//! Network namespaces for the tests that cut links for real: one per node, behind
//! a veth pair on a bridge the test makes (and removes), a cut being a blackhole
//! route each way, so packets vanish as on a broken network. Needs root and `ip`.

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use super::procs::Proc;

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Network namespaces, one per node, on a bridge: made by the test, removed on drop.
pub struct Namespaces {
    tag: u32,
    nodes: usize,
    cuts: BTreeSet<(usize, usize)>,
}

impl Namespaces {
    /// Makes them, or says why it cannot (and leaves nothing behind).
    pub fn make(nodes: usize) -> Result<Namespaces, String> {
        // Unique to this instance: tests of one binary run at once, each with its
        // own namespaces (and, from the tag, its own subnet).
        static MADE: AtomicU32 = AtomicU32::new(0);
        let tag = std::process::id() % 10_000 * 10 + MADE.fetch_add(1, Ordering::Relaxed) % 10;
        let ns = Namespaces {
            tag,
            nodes,
            cuts: BTreeSet::new(),
        };
        let bridge = ns.bridge();
        let gateway = format!("{}/24", ns.addr(253));
        let steps: Vec<Vec<String>> = [
            vec!["link", "add", &bridge, "type", "bridge"]
                .into_iter()
                .map(String::from)
                .collect(),
            vec![
                "addr".into(),
                "add".into(),
                gateway,
                "dev".into(),
                bridge.clone(),
            ],
            vec!["link".into(), "set".into(), bridge.clone(), "up".into()],
        ]
        .into_iter()
        .chain((0..nodes).flat_map(|i| {
            let (name, veth, addr) = (ns.name(i), ns.veth(i), format!("{}/24", ns.addr(i)));
            vec![
                vec!["netns".into(), "add".into(), name.clone()],
                vec![
                    "link".into(),
                    "add".into(),
                    veth.clone(),
                    "type".into(),
                    "veth".into(),
                    "peer".into(),
                    "name".into(),
                    "eth0".into(),
                    "netns".into(),
                    name.clone(),
                ],
                vec![
                    "link".into(),
                    "set".into(),
                    veth,
                    "master".into(),
                    bridge.clone(),
                    "up".into(),
                ],
                vec![
                    "-n".into(),
                    name.clone(),
                    "addr".into(),
                    "add".into(),
                    addr,
                    "dev".into(),
                    "eth0".into(),
                ],
                vec![
                    "-n".into(),
                    name.clone(),
                    "link".into(),
                    "set".into(),
                    "eth0".into(),
                    "up".into(),
                ],
                vec![
                    "-n".into(),
                    name,
                    "link".into(),
                    "set".into(),
                    "lo".into(),
                    "up".into(),
                ],
            ]
        }))
        .collect();
        for step in &steps {
            let args: Vec<&str> = step.iter().map(String::as_str).collect();
            if !ip(&args) {
                return Err(format!("`ip {}` failed", args.join(" ")));
            }
        }
        Ok(ns)
    }

    fn bridge(&self) -> String {
        format!("gmb{}", self.tag)
    }

    pub fn name(&self, i: usize) -> String {
        format!("gpumesh-chaos-{}-{i}", self.tag)
    }

    fn veth(&self, i: usize) -> String {
        format!("gmv{}n{i}", self.tag)
    }

    /// Node i's address; 253 is the bridge's (the test's own side).
    pub fn addr(&self, i: usize) -> String {
        format!("10.213.{}.{}", self.tag % 250, i + 1)
    }

    fn route(&self, verb: &str, from: usize, to: usize) -> bool {
        ip(&[
            "-n",
            &self.name(from),
            "route",
            verb,
            "blackhole",
            &format!("{}/32", self.addr(to)),
        ])
    }

    /// Packets between i and j vanish, both ways; connections stay open, unanswered.
    pub fn cut(&mut self, i: usize, j: usize) {
        let key = (i.min(j), i.max(j));
        if self.cuts.insert(key) {
            assert!(
                self.route("add", i, j) && self.route("add", j, i),
                "cut {i}-{j}"
            );
        }
    }

    pub fn mend_all(&mut self) {
        for (i, j) in std::mem::take(&mut self.cuts) {
            self.route("del", i, j);
            self.route("del", j, i);
        }
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for i in 0..self.nodes {
            ip(&["netns", "del", &self.name(i)]);
            ip(&["link", "del", &self.veth(i)]);
        }
        ip(&["link", "del", &self.bridge()]);
    }
}

/// Where the test starts its nodes.
pub fn nodes(root: &std::path::Path, n: usize, ns: Option<&Namespaces>) -> Vec<Proc> {
    (0..n)
        .map(|i| {
            let mut p = super::procs::node(root, &format!("n{i}"));
            p.log_filter = "info,wgpu_hal=error,wgpu_core=error,naga=error,raft=warn".into();
            if let Some(ns) = ns {
                p.prefix = vec!["ip".into(), "netns".into(), "exec".into(), ns.name(i)];
                p.host = ns.addr(i);
                // Off loopback: every request of the test carries the node's token.
                p.api_host = ns.addr(i);
                p.p2p = 4070;
                p.api = 7070;
            }
            p
        })
        .collect()
}
