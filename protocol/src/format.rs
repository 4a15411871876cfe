//! The format number: one number for every encoding gpumesh writes to disk or sends
//! to a peer (Raft entries and snapshots, node requests, blob and call lanes, the
//! envelope).
//!
//! Nodes of different formats never exchange a byte of their encodings: the format
//! is in every stream protocol's name ([`lane!`](crate::lane)) and in every
//! envelope, so a peer of another format is refused by name rather than misread;
//! a data directory is stamped with the format that wrote it and another build
//! refuses to open it. Bump [`FORMAT`] (and [`format_number!`](crate::format_number))
//! with any change to a type that is encoded: the node crate's `format_schema` test
//! fails while the shapes it records in `node/format-schema.json` are not the code's
//! under this number.

/// The format number as a literal, for protocol names built with `concat!`.
#[macro_export]
macro_rules! format_number {
    () => {
        "10"
    };
}

/// The name of a stream protocol of this format: `lane!("raft")` is
/// `/gpumesh/5/raft`.
#[macro_export]
macro_rules! lane {
    ($name:literal) => {
        concat!("/gpumesh/", $crate::format_number!(), "/", $name)
    };
}

/// This build's format. 10: an actor's second copy can be asked to pull the new
/// state whole (`Changes::Whole`), on the wire only, so a directory of format 9 is
/// read as it is and stamped 10. 9: bitwise merge rules (`MergeRule::Or`, `And`, `Xor`),
/// new variants only, so a directory of format 8 is read as it is and stamped 9.
/// 8: a node request that asks a peer whether the asker is a
/// member (`NodeRequest::Membership`); nothing written to disk changed, so a
/// directory of format 7 is read as it is and stamped 8. 7: a blob store packs
/// blobs of up to 4 MiB (6: 256 KiB), so a directory of format 6 is read as it is
/// too (see the node's `data_dir`).
pub const FORMAT: u16 = 10;

/// How a node names its build to peers (libp2p identify's agent version):
/// `gpumesh/<version> format/<FORMAT>`.
pub fn agent() -> String {
    format!("gpumesh/{} format/{FORMAT}", env!("CARGO_PKG_VERSION"))
}

/// What an agent version says of the peer's format: `Ok(())` if it is this build's,
/// else why not, in words (another format, a build from before formats were
/// numbered, no gpumesh node).
pub fn check_agent(agent: &str) -> Result<(), String> {
    let Some(rest) = agent.strip_prefix("gpumesh/") else {
        return Err(format!(
            "it is not a gpumesh node (it calls itself {agent:?})"
        ));
    };
    match rest.split_once(" format/") {
        Some((_, format_number!())) => Ok(()),
        Some((version, theirs)) => Err(format!(
            "it runs gpumesh {version} with data format {theirs}, this node format {FORMAT}"
        )),
        None => Err(format!(
            "it runs gpumesh {rest} from before data formats were numbered, this node format \
             {FORMAT}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_literal_is_the_number() {
        assert_eq!(format_number!(), FORMAT.to_string());
        assert_eq!(lane!("raft"), format!("/gpumesh/{FORMAT}/raft"));
    }

    #[test]
    fn agents_say_their_format() {
        assert_eq!(check_agent(&agent()), Ok(()));
        let other = check_agent("gpumesh/0.1.0 format/4").unwrap_err();
        assert!(other.contains("data format 4") && other.contains(&format!("format {FORMAT}")));
        let older = check_agent("gpumesh/0.1.0").unwrap_err();
        assert!(
            older.contains("before data formats were numbered"),
            "{older}"
        );
        let stranger = check_agent("rust-libp2p/0.56").unwrap_err();
        assert!(stranger.contains("not a gpumesh node"), "{stranger}");
    }
}
