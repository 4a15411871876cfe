//! The cluster key: the pre-shared key that keeps strangers out of a mesh's
//! transport.
//!
//! Every node of a closed mesh holds the same 32-byte key in the standard text form
//! (`/key/swarm/psk/1.0.0/`, `/base16/`, 64 hex digits — the libp2p private-network
//! key file). The key is proven inside the Noise handshake (a prologue derived from
//! it, see `net::swarm`): a connection whose other end holds another key, or none,
//! fails its handshake, and every byte is encrypted once, by Noise. This module makes keys (`gpumesh keygen`), writes
//! them to files only their owner can read, and loads them (`gpumesh node
//! --cluster-key`). The key itself never appears in logs or `Debug` output: only its
//! fingerprint does, which is enough to tell two keys apart.
//!
//! Talks to nobody: the net actor takes the key through `NetConfig::psk`.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use libp2p::pnet::{KeyParseError, PreSharedKey};

use crate::error::{NodeError, Result};

/// A mesh's shared secret. `Debug` shows only the fingerprint.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ClusterKey(PreSharedKey);

impl ClusterKey {
    /// A new random key, from the operating system's randomness.
    pub fn generate() -> Self {
        ClusterKey(PreSharedKey::new(rand::random::<[u8; 32]>()))
    }

    /// The key's fingerprint (hex): safe to print and compare, useless to connect.
    pub fn fingerprint(&self) -> String {
        self.0.fingerprint().to_string()
    }

    /// The key in the standard key-file form (three lines). This is the secret.
    pub fn to_key_file(&self) -> String {
        self.0.to_string()
    }

    /// The key from its 32 bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        ClusterKey(PreSharedKey::new(bytes))
    }

    /// The key's 32 bytes. This is the secret.
    pub fn to_bytes(&self) -> [u8; 32] {
        let text = self.to_key_file();
        let hex = text.lines().nth(2).unwrap_or_default();
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = hex
                .get(2 * i..2 * i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .unwrap_or_default();
        }
        out
    }

    /// What the transport takes.
    pub fn psk(&self) -> PreSharedKey {
        self.0
    }

    /// Reads a key file written by `gpumesh keygen` (or any libp2p private-network
    /// key tool). Errors
    /// name the file and say how to make a good one.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            NodeError::Config(format!(
                "cannot read the cluster key file {}: {e}; make one with \
                 `gpumesh keygen --out FILE` and copy it to every node",
                path.display()
            ))
        })?;
        let key = text.parse().map_err(|why: String| {
            NodeError::Config(format!(
                "{} is not a cluster key: {why}; make one with `gpumesh keygen --out FILE`",
                path.display()
            ))
        })?;
        warn_if_readable_by_others(path);
        Ok(key)
    }

    /// Writes the key to a new file readable and writable only by its owner (0600 on
    /// Unix). Refuses to replace an existing file: nodes holding the old key would be
    /// locked out of the mesh.
    pub fn write_new(&self, path: &Path) -> Result<()> {
        write_private(path, self.to_key_file().as_bytes()).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                NodeError::Config(format!(
                    "{} already exists; not overwriting it (nodes holding that key would \
                     be shut out): remove it first or choose another --out",
                    path.display()
                ))
            } else {
                NodeError::io(path, e)
            }
        })
    }
}

impl FromStr for ClusterKey {
    type Err = String;

    /// Parses the key-file form; surrounding blank space is ignored.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        // Checked here before libp2p parses it: its parser slices the hex line by
        // bytes (a multi-byte character there would panic it) and lets a `+` pass
        // as a digit.
        if let Some(hex) = s.lines().nth(2) {
            let hex = hex.trim_end();
            if !hex.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err("the third line holds a character that is not a hex digit".into());
            }
        }
        s.parse().map(ClusterKey).map_err(|e| {
            match e {
                KeyParseError::InvalidKeyFile => {
                    "expected three lines: /key/swarm/psk/1.0.0/, /base16/, then 64 hex digits"
                }
                KeyParseError::InvalidKeyType => "the first line must be /key/swarm/psk/1.0.0/",
                KeyParseError::InvalidKeyEncoding => "the second line must be /base16/",
                KeyParseError::InvalidKeyLength => {
                    "the third line must be exactly 64 hex digits (32 bytes)"
                }
                KeyParseError::InvalidKeyChar(_) => {
                    "the third line holds a character that is not a hex digit"
                }
            }
            .to_string()
        })
    }
}

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClusterKey(fingerprint {})", self.fingerprint())
    }
}

#[cfg(unix)]
fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!(
                "the cluster key file {} can be read by other users (mode {mode:o}); \
                 `chmod 600` it",
                path.display()
            );
        }
    }
}

#[cfg(not(unix))]
fn warn_if_readable_by_others(_: &Path) {}

/// Writes `bytes` to a new file at `path` readable and writable only by its owner
/// (0600 on Unix); an existing file is an error, never replaced.
pub(crate) fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_written_key_loads_back_and_debug_hides_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mesh.key");
        let key = ClusterKey::generate();
        key.write_new(&path).unwrap();
        let back = ClusterKey::load(&path).unwrap();
        assert_eq!(back, key);
        let hex = key.to_key_file().lines().nth(2).unwrap().to_string();
        assert_eq!(hex.len(), 64);
        let debug = format!("{key:?}");
        assert!(!debug.contains(&hex), "{debug}");
        assert!(debug.contains(&key.fingerprint()), "{debug}");
        assert_ne!(ClusterKey::generate(), key, "keys are random");
        assert_eq!(ClusterKey::from_bytes(key.to_bytes()), key);
    }

    #[test]
    fn malformed_keys_are_explained() {
        let good = ClusterKey::generate().to_key_file();
        let hex = good.lines().nth(2).unwrap();
        for (text, expect) in [
            ("", "three lines"),
            ("/key/swarm/psk/2.0.0/\n/base16/\n00", "first line"),
            (
                &format!("/key/swarm/psk/1.0.0/\n/base64/\n{hex}"),
                "second line",
            ),
            ("/key/swarm/psk/1.0.0/\n/base16/\nabcd", "64 hex digits"),
            (
                &format!("/key/swarm/psk/1.0.0/\n/base16/\n{}zz", &hex[..62]),
                "not a hex digit",
            ),
            // 64 bytes whose multi-byte character straddles a digit pair: libp2p's
            // own parser would panic on it.
            (
                &format!(
                    "/key/swarm/psk/1.0.0/\n/base16/\n{}é{}",
                    &hex[..61],
                    &hex[..1]
                ),
                "not a hex digit",
            ),
            (
                &format!("/key/swarm/psk/1.0.0/\n/base16/\n+f{}", &hex[2..]),
                "not a hex digit",
            ),
        ] {
            let err = text.parse::<ClusterKey>().unwrap_err();
            assert!(err.contains(expect), "{text:?}: {err}");
        }
        assert!(format!("\n{good}\n\n").parse::<ClusterKey>().is_ok());
    }
}
