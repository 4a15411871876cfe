//! Admission: which key a node's transport holds, the join ticket that hands that key
//! and the members' addresses to a new node, and the bearer token of the HTTP API.
//!
//! A mesh is closed by default. The node that forms it (`--init`) makes the cluster
//! key in its data dir (`cluster.key`, readable by its owner only); `gpumesh ticket`
//! prints a join ticket from that file and the members' addresses the node keeps in
//! `mesh-addrs`; `gpumesh node --join TICKET` stores the key in the new node's data
//! dir and dials the addresses. Every later start reads the key from the data dir.
//! A mesh without a key exists only when asked for with `--open`.
//!
//! Files only; talks to nobody.

use std::path::Path;
use std::str::FromStr;

use libp2p::Multiaddr;

use crate::cluster_key::{write_private, ClusterKey};
use crate::error::{NodeError, Result};

/// The cluster key in a node's data dir.
pub const KEY_FILE: &str = "cluster.key";
/// The bearer token of the node's HTTP API.
pub const TOKEN_FILE: &str = "api.token";
/// Where every member listens (`…/p2p/<peer id>`, one per line), as this node last
/// saw the membership: what `gpumesh ticket` hands out.
pub const ADDRS_FILE: &str = "mesh-addrs";
/// The mesh a node formed or joined: it is a member (restarting, not joining).
pub const CLUSTER_FILE: &str = "cluster-id";

/// How a node comes into a mesh the first time it starts with an empty data dir.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Formation {
    /// Form a new one-node mesh.
    Init,
    /// Wait until this many nodes (this one included) see each other, then form a
    /// mesh of all of them as voters.
    BootstrapExpect(usize),
    /// Join an existing mesh through any member reached.
    Join,
}

/// The key this node's transport holds: `given` (a `--cluster-key` file or a join
/// ticket's), else the one in the data dir, else — for a node forming a new mesh —
/// a new one written there. `None` only with `open`. Refuses, saying what to do, a
/// data dir holding another key than the one given, `open` with a key, and a node
/// with no key at all that was not told `open`.
pub fn settle_key(
    dir: &Path,
    given: Option<ClusterKey>,
    open: bool,
    formation: Formation,
) -> Result<Option<ClusterKey>> {
    let path = dir.join(KEY_FILE);
    let stored = if path.exists() {
        Some(ClusterKey::load(&path)?)
    } else {
        None
    };
    let in_a_mesh = dir.join(CLUSTER_FILE).exists();
    match (given, stored) {
        (Some(_), _) | (None, Some(_)) if open => Err(NodeError::Config(format!(
            "--open asks for a mesh without a cluster key, but {} this node one; drop \
             --open (a closed mesh is the default)",
            if given.is_some() {
                "--cluster-key or --join gives"
            } else {
                "the data dir holds"
            }
        ))),
        (Some(key), Some(stored)) if key != stored => Err(NodeError::Config(format!(
            "{} holds another cluster key (fingerprint {}) than the one given (fingerprint \
             {}): a data dir belongs to one mesh; use a fresh --data-dir to join the other",
            path.display(),
            stored.fingerprint(),
            key.fingerprint()
        ))),
        (Some(key), stored) => {
            if stored.is_none() {
                if in_a_mesh {
                    return Err(NodeError::Config(format!(
                        "the data dir {} belongs to a mesh started without a cluster key; \
                         start this node with --open, or join the closed mesh with a fresh \
                         --data-dir",
                        dir.display()
                    )));
                }
                write_private(&path, key.to_key_file().as_bytes())
                    .map_err(|e| NodeError::io(&path, e))?;
            }
            Ok(Some(key))
        }
        (None, Some(stored)) => Ok(Some(stored)),
        (None, None) if open => {
            tracing::warn!(
                "OPEN MESH: no cluster key; anyone who reaches this node's listen addresses \
                 can join the mesh and run code on its GPU"
            );
            Ok(None)
        }
        (None, None) if in_a_mesh => Err(NodeError::Config(format!(
            "the data dir {} belongs to a mesh started without a cluster key; start this \
             node with --open to rejoin it",
            dir.display()
        ))),
        (None, None) => match formation {
            Formation::Init => {
                let key = ClusterKey::generate();
                write_private(&path, key.to_key_file().as_bytes())
                    .map_err(|e| NodeError::io(&path, e))?;
                tracing::info!(
                    file = %path.display(),
                    fingerprint = %key.fingerprint(),
                    "made the mesh's cluster key; `gpumesh ticket` prints a join ticket"
                );
                Ok(Some(key))
            }
            Formation::BootstrapExpect(n) => Err(NodeError::Config(format!(
                "--bootstrap-expect {n}: the nodes forming the mesh need one cluster key: \
                 make it with `gpumesh keygen --out FILE` and start each with --cluster-key \
                 FILE (or start them with --open for a mesh anyone can join)"
            ))),
            Formation::Join => Err(NodeError::Config(
                "meshes are closed by default and this node has no cluster key: join with \
                 --join TICKET (run `gpumesh ticket --data-dir DIR` on a member to get one) \
                 or --cluster-key FILE; --open joins a mesh started with --open"
                    .into(),
            )),
        },
    }
}

/// Keeps `addrs` as the mesh's member addresses in the data dir (replacing the file
/// whole, so a reader never sees half of it).
pub fn write_mesh_addrs(dir: &Path, addrs: &[Multiaddr]) -> Result<()> {
    let path = dir.join(ADDRS_FILE);
    let tmp = dir.join(format!("{ADDRS_FILE}.tmp"));
    let text: String = addrs.iter().map(|a| format!("{a}\n")).collect();
    std::fs::write(&tmp, text).map_err(|e| NodeError::io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| NodeError::io(&path, e))
}

/// The API token in the data dir, made at first start.
pub fn api_token(dir: &Path) -> Result<String> {
    if let Some(token) = read_api_token(dir) {
        return Ok(token);
    }
    let token: String = rand::random::<[u8; 32]>()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let path = dir.join(TOKEN_FILE);
    write_private(&path, format!("{token}\n").as_bytes()).map_err(|e| NodeError::io(&path, e))?;
    Ok(token)
}

/// The API token in `dir`, if there is one.
pub fn read_api_token(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join(TOKEN_FILE)).ok()?;
    let token = text.trim();
    (!token.is_empty()).then(|| token.to_string())
}

/// What a new node needs to join a closed mesh: its key and where members listen.
#[derive(Clone, PartialEq, Eq)]
pub struct Ticket {
    pub key: ClusterKey,
    /// Members' addresses, each ending in `/p2p/<peer id>`.
    pub addrs: Vec<Multiaddr>,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("key", &self.key)
            .field("addrs", &self.addrs)
            .finish()
    }
}

const TICKET_PREFIX: &str = "gpumesh1";
const TICKET_VERSION: u8 = 1;

impl Ticket {
    /// The ticket of the mesh whose member keeps its files in `dir`.
    pub fn from_data_dir(dir: &Path) -> Result<Ticket> {
        let key_path = dir.join(KEY_FILE);
        if !key_path.exists() {
            return Err(NodeError::Config(format!(
                "{} has no {KEY_FILE}: it is not the data dir of a node of a closed mesh \
                 (an --open mesh needs no ticket: join it with --open --peer ADDRESS)",
                dir.display()
            )));
        }
        let key = ClusterKey::load(&key_path)?;
        let addrs_path = dir.join(ADDRS_FILE);
        let text = std::fs::read_to_string(&addrs_path).map_err(|e| {
            NodeError::Config(format!(
                "cannot read {} ({e}): start the node once, so that it records where the \
                 members listen",
                addrs_path.display()
            ))
        })?;
        let addrs: Vec<Multiaddr> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        if addrs.is_empty() {
            return Err(NodeError::Config(format!(
                "{} lists no address yet: start the node and try again",
                addrs_path.display()
            )));
        }
        Ok(Ticket { key, addrs })
    }

    fn checksum(body: &[u8]) -> [u8; 4] {
        let hash = blake3::hash(body);
        let mut out = [0u8; 4];
        out.copy_from_slice(&hash.as_bytes()[..4]);
        out
    }
}

impl std::fmt::Display for Ticket {
    /// `gpumesh1` and then, in lower-case base32: a version byte, the key's 32
    /// bytes, each address as a 2-byte length and its bytes, and a 4-byte checksum.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut body = vec![TICKET_VERSION];
        body.extend_from_slice(&self.key.to_bytes());
        for a in &self.addrs {
            let bytes = a.to_vec();
            let len = u16::try_from(bytes.len()).unwrap_or(u16::MAX);
            body.extend_from_slice(&len.to_be_bytes());
            body.extend_from_slice(&bytes[..usize::from(len)]);
        }
        let sum = Ticket::checksum(&body);
        body.extend_from_slice(&sum);
        let text = data_encoding::BASE32_NOPAD
            .encode(&body)
            .to_ascii_lowercase();
        write!(f, "{TICKET_PREFIX}{text}")
    }
}

impl FromStr for Ticket {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        let body = s.strip_prefix(TICKET_PREFIX).ok_or_else(|| {
            format!(
                "not a join ticket (a ticket starts with {TICKET_PREFIX}; get one with \
                 `gpumesh ticket --data-dir DIR` on a member)"
            )
        })?;
        let bytes = data_encoding::BASE32_NOPAD
            .decode(body.to_ascii_uppercase().as_bytes())
            .map_err(|_| {
                "the join ticket is damaged (a character is not part of it): copy it again, \
                 whole"
                    .to_string()
            })?;
        let damaged =
            || "the join ticket is damaged or cut short: copy it again, whole".to_string();
        if bytes.len() < 1 + 32 + 4 {
            return Err(damaged());
        }
        let (body, sum) = bytes.split_at(bytes.len() - 4);
        if Ticket::checksum(body) != sum {
            return Err(damaged());
        }
        if body[0] != TICKET_VERSION {
            return Err(format!(
                "the join ticket is of version {}, this gpumesh reads version \
                 {TICKET_VERSION}: use the same gpumesh version on every node",
                body[0]
            ));
        }
        let mut key = [0u8; 32];
        key.copy_from_slice(&body[1..33]);
        let mut rest = &body[33..];
        let mut addrs = Vec::new();
        while !rest.is_empty() {
            if rest.len() < 2 {
                return Err(damaged());
            }
            let len = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
            let bytes = rest.get(2..2 + len).ok_or_else(damaged)?;
            addrs.push(Multiaddr::try_from(bytes.to_vec()).map_err(|_| damaged())?);
            rest = &rest[2 + len..];
        }
        if addrs.is_empty() {
            return Err("the join ticket names no member address".into());
        }
        Ok(Ticket {
            key: ClusterKey::from_bytes(key),
            addrs,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn ticket() -> Ticket {
        Ticket {
            key: ClusterKey::generate(),
            addrs: vec![
                "/ip4/127.0.0.1/tcp/4070/p2p/12D3KooWKzC7iKDDyBx8V4iyzdcRoTTgUTXrHXmLWznL8X17hZ59"
                    .parse()
                    .unwrap(),
                "/ip6/::1/tcp/4071".parse().unwrap(),
            ],
        }
    }

    #[test]
    fn a_ticket_reads_back_and_a_damaged_one_is_refused() {
        let t = ticket();
        let text = t.to_string();
        assert!(text.starts_with(TICKET_PREFIX), "{text}");
        assert!(text.chars().all(|c| c.is_ascii_alphanumeric()), "{text}");
        assert_eq!(text.parse::<Ticket>().unwrap(), t);
        assert_eq!(format!("  {text}\n").parse::<Ticket>().unwrap(), t);
        // Any one character changed, or the end cut off, is caught.
        for i in TICKET_PREFIX.len()..text.len() {
            let mut bad: Vec<char> = text.chars().collect();
            bad[i] = if bad[i] == 'a' { 'b' } else { 'a' };
            let bad: String = bad.into_iter().collect();
            assert!(bad.parse::<Ticket>().is_err(), "{i}");
        }
        let err = text[..text.len() - 3].parse::<Ticket>().unwrap_err();
        assert!(err.contains("damaged"), "{err}");
        let err = "hello".parse::<Ticket>().unwrap_err();
        assert!(err.contains("gpumesh ticket"), "{err}");
        assert!(!format!("{t:?}").contains(&t.key.to_key_file()));
    }

    #[test]
    fn keys_settle_closed_by_default() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // Joining without a key, or open with a key, is refused with what to do.
        let err = settle_key(d, None, false, Formation::Join).unwrap_err();
        assert!(err.to_string().contains("--join TICKET"), "{err}");
        let err = settle_key(d, None, false, Formation::BootstrapExpect(3)).unwrap_err();
        assert!(err.to_string().contains("--cluster-key"), "{err}");
        assert_eq!(settle_key(d, None, true, Formation::Join).unwrap(), None);
        // --init makes one, 0600, and every later start reads it.
        let made = settle_key(d, None, false, Formation::Init)
            .unwrap()
            .unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(d.join(KEY_FILE))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert_eq!(
            settle_key(d, None, false, Formation::Join).unwrap(),
            Some(made)
        );
        assert_eq!(
            settle_key(d, Some(made), false, Formation::Join).unwrap(),
            Some(made)
        );
        let err = settle_key(d, None, true, Formation::Join).unwrap_err();
        assert!(err.to_string().contains("drop --open"), "{err}");
        let other = ClusterKey::generate();
        let err = settle_key(d, Some(other), false, Formation::Join).unwrap_err();
        assert!(err.to_string().contains("another cluster key"), "{err}");
        // A given key is kept in a fresh data dir.
        let fresh = tempfile::tempdir().unwrap();
        settle_key(fresh.path(), Some(other), false, Formation::Join).unwrap();
        assert_eq!(
            ClusterKey::load(&fresh.path().join(KEY_FILE)).unwrap(),
            other
        );
    }

    #[test]
    fn the_api_token_is_made_once_and_private() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_api_token(dir.path()), None);
        let token = api_token(dir.path()).unwrap();
        assert_eq!(token.len(), 64);
        assert_eq!(api_token(dir.path()).unwrap(), token);
        assert_eq!(read_api_token(dir.path()), Some(token));
    }

    #[test]
    fn a_ticket_comes_from_a_data_dir() {
        let dir = tempfile::tempdir().unwrap();
        let err = Ticket::from_data_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains("--open"), "{err}");
        let key = settle_key(dir.path(), None, false, Formation::Init)
            .unwrap()
            .unwrap();
        assert!(Ticket::from_data_dir(dir.path()).is_err());
        let t = ticket();
        write_mesh_addrs(dir.path(), &t.addrs).unwrap();
        let got = Ticket::from_data_dir(dir.path()).unwrap();
        assert_eq!(got.key, key);
        assert_eq!(got.addrs, t.addrs);
    }
}
