//! The guard on [`gpumesh_protocol::FORMAT`]: the shape of every type gpumesh
//! encodes with serde (Raft entries and frames, the replicated record and its
//! snapshots, mesh and node requests), traced from the types themselves and
//! recorded in `node/format-schema.json` with the format it belongs to. A type whose
//! shape changes while the format number stays fails here, naming the types; so does
//! a new number with the old record. The byte formats written by hand (shard changes,
//! the blob, call and direct lanes' headers) have tests of their own bytes.
//!
//! After bumping the format: `GPUMESH_RECORD_FORMAT=1 cargo test -p gpumesh-node --lib
//! format_schema` records the new shapes (it refuses to overwrite the record of the
//! same number).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::Path;

use gpumesh_protocol::FORMAT;
use serde_json::{json, Value};
use serde_reflection::{Tracer, TracerConfig};

/// Traces every encoded type; each enum on its own, so every variant is seen.
fn traced() -> BTreeMap<String, Value> {
    let mut tracer = Tracer::new(TracerConfig::default());
    macro_rules! trace {
        ($($t:ty),* $(,)?) => {
            $(
                tracer
                    .trace_simple_type::<$t>()
                    .unwrap_or_else(|e| panic!("tracing {}: {e}", stringify!($t)));
            )*
        };
    }
    trace!(
        gpumesh_consensus::LogEntry,
        gpumesh_consensus::Command,
        gpumesh_consensus::Frame,
        gpumesh_consensus::FrameBody,
        gpumesh_consensus::StateMachine,
        gpumesh_protocol::MeshRequest,
        gpumesh_protocol::MeshResponse,
        crate::wire::NodeRequest,
        crate::wire::NodeReply,
        crate::wire::CallAnswer,
        crate::wire::Changes,
        gpumesh_consensus::CallRan,
        gpumesh_consensus::CallResult,
        gpumesh_consensus::Outcome,
        gpumesh_consensus::Ran,
        gpumesh_consensus::Role,
        gpumesh_consensus::ShardState,
        gpumesh_consensus::TaskStatus,
        gpumesh_protocol::BackendKind,
        gpumesh_protocol::BindingRole,
        gpumesh_protocol::DeviceKind,
        gpumesh_protocol::ElemType,
        gpumesh_protocol::MergeRule,
        gpumesh_protocol::ShaderSource,
    );
    let registry = tracer.registry().unwrap_or_else(|e| {
        panic!("the trace is incomplete ({e}): trace the enum it names on its own above")
    });
    let Value::Object(types) = serde_json::to_value(&registry).unwrap() else {
        panic!("a registry is a map");
    };
    types.into_iter().collect()
}

#[test]
fn every_encoded_type_has_the_shape_its_format_recorded() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("format-schema.json");
    let now = traced();
    let recorded: Value = std::fs::read_to_string(&path)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or(Value::Null);
    let recorded_format = recorded["format"].as_u64();
    let recorded_types: BTreeMap<String, Value> = match &recorded["types"] {
        Value::Object(types) => types.clone().into_iter().collect(),
        _ => BTreeMap::new(),
    };
    if recorded_format == Some(u64::from(FORMAT)) && recorded_types == now {
        return;
    }
    let changed: Vec<&String> = now
        .keys()
        .chain(recorded_types.keys())
        .filter(|name| now.get(*name) != recorded_types.get(*name))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_ne!(
        recorded_format,
        Some(u64::from(FORMAT)),
        "the encoding of {changed:?} changed but the data format is still {FORMAT}: a node \
         of this build would misread what an older one wrote or sent. Bump FORMAT and \
         format_number! in protocol/src/format.rs, then record the shapes with \
         GPUMESH_RECORD_FORMAT=1 cargo test -p gpumesh-node --lib format_schema"
    );
    if std::env::var_os("GPUMESH_RECORD_FORMAT").is_some() {
        let record = json!({ "format": FORMAT, "types": now });
        let text = serde_json::to_string_pretty(&record).unwrap() + "\n";
        std::fs::write(&path, text).unwrap();
        return;
    }
    panic!(
        "the data format is {FORMAT} but {} records format {recorded_format:?} (changed: \
         {changed:?}): record this format's shapes with GPUMESH_RECORD_FORMAT=1 cargo test \
         -p gpumesh-node --lib format_schema",
        path.display()
    );
}
