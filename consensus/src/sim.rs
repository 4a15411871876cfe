//! An in-process network for tests and benchmarks: a [`Transport`] per replica that
//! delivers frames straight into the other replicas' inboxes, and can drop, delay,
//! duplicate, reorder (random delays), cut links, isolate nodes and partition the
//! group. All randomness comes from one seed, so a failing run can be replayed.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::replica::ConsensusHandle;
use crate::transport::{Transport, Unreachable};

/// Probabilistic faults applied to every frame.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Faults {
    /// Chance a frame is lost.
    pub drop: f64,
    /// Chance a frame is delivered twice.
    pub duplicate: f64,
    /// Each delivery is delayed uniformly in this range (ms); 0..0 is immediate.
    /// Different delays reorder frames.
    pub delay_ms: (u64, u64),
}

/// Counters of what the network did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    pub sent: u64,
    pub delivered: u64,
    pub dropped: u64,
    pub duplicated: u64,
}

/// A small seeded generator (SplitMix64): enough for fault injection, no dependency.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [lo, hi] (inclusive; `lo` if the range is empty).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }

    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.next_f64() < p
    }
}

struct Net {
    nodes: HashMap<u64, ConsensusHandle>,
    rng: SplitMix64,
    faults: Faults,
    /// Directed links that lose everything.
    cut: HashSet<(u64, u64)>,
    stats: SimStats,
}

/// The simulated network shared by a group of in-process replicas.
#[derive(Clone)]
pub struct SimNetwork {
    net: Arc<Mutex<Net>>,
}

impl SimNetwork {
    pub fn new(seed: u64) -> Self {
        Self {
            net: Arc::new(Mutex::new(Net {
                nodes: HashMap::new(),
                rng: SplitMix64::new(seed),
                faults: Faults::default(),
                cut: HashSet::new(),
                stats: SimStats::default(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Net> {
        // A panic elsewhere while holding the lock leaves plain data: keep going.
        self.net.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The transport replica `id` sends through.
    pub fn transport(&self, id: u64) -> Arc<dyn Transport> {
        Arc::new(SimTransport {
            from: id,
            net: self.clone(),
        })
    }

    /// Connects a started replica so frames addressed to it arrive.
    pub fn register(&self, handle: ConsensusHandle) {
        self.lock().nodes.insert(handle.id(), handle);
    }

    /// Disconnects a replica (crashed or stopped): frames to it are lost.
    pub fn unregister(&self, id: u64) {
        self.lock().nodes.remove(&id);
    }

    pub fn set_faults(&self, faults: Faults) {
        self.lock().faults = faults;
    }

    /// Cuts the link between `a` and `b` in both directions.
    pub fn cut(&self, a: u64, b: u64) {
        let mut net = self.lock();
        net.cut.insert((a, b));
        net.cut.insert((b, a));
    }

    /// Cuts every link of `id`.
    pub fn isolate(&self, id: u64, all: &[u64]) {
        for &other in all {
            if other != id {
                self.cut(id, other);
            }
        }
    }

    /// Cuts every link between different groups.
    pub fn partition(&self, groups: &[Vec<u64>]) {
        for (i, a) in groups.iter().enumerate() {
            for b in groups.iter().skip(i + 1) {
                for &x in a {
                    for &y in b {
                        self.cut(x, y);
                    }
                }
            }
        }
    }

    /// Restores every link (faults stay as set).
    pub fn heal(&self) {
        self.lock().cut.clear();
    }

    pub fn stats(&self) -> SimStats {
        self.lock().stats
    }

    /// Delivers raw bytes as if `from` had sent them (for malformed-input tests).
    pub fn inject(&self, from: u64, to: u64, bytes: Vec<u8>) -> bool {
        let target = self.lock().nodes.get(&to).cloned();
        target.is_some_and(|h| h.try_receive(from, bytes))
    }

    fn send(&self, from: u64, to: u64, frame: Vec<u8>) {
        let mut net = self.lock();
        net.stats.sent += 1;
        if net.cut.contains(&(from, to)) || !net.nodes.contains_key(&to) {
            net.stats.dropped += 1;
            return;
        }
        let faults = net.faults;
        if net.rng.chance(faults.drop) {
            net.stats.dropped += 1;
            return;
        }
        let copies = if net.rng.chance(faults.duplicate) {
            net.stats.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let delay = net.rng.range(faults.delay_ms.0, faults.delay_ms.1);
            if delay == 0 {
                let ok = net
                    .nodes
                    .get(&to)
                    .is_some_and(|h| h.try_receive(from, frame.clone()));
                if ok {
                    net.stats.delivered += 1;
                } else {
                    net.stats.dropped += 1;
                }
            } else {
                let this = self.clone();
                let frame = frame.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                    this.deliver_late(from, to, frame);
                });
            }
        }
    }

    /// A delayed frame arrives only if the link is still up when it lands.
    fn deliver_late(&self, from: u64, to: u64, frame: Vec<u8>) {
        let mut net = self.lock();
        let handle = if net.cut.contains(&(from, to)) {
            None
        } else {
            net.nodes.get(&to).cloned()
        };
        match handle {
            Some(h) if h.try_receive(from, frame) => net.stats.delivered += 1,
            _ => net.stats.dropped += 1,
        }
    }
}

struct SimTransport {
    from: u64,
    net: SimNetwork,
}

impl Transport for SimTransport {
    fn send(&self, to: u64, frame: Vec<u8>) -> Result<(), Unreachable> {
        // Loss is silent, as on a real network: Raft's own timers recover.
        self.net.send(self.from, to, frame);
        Ok(())
    }
}
