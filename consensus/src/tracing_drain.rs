//! raft-rs logs through `slog`; gpumesh logs through `tracing`. This drain forwards
//! every slog record to a `tracing` event with the same level, so one subscriber sees
//! both (target `raft`, the raft-rs module path as a field).

use std::fmt::{self, Write as _};

use slog::{Drain, Key, OwnedKVList, Record, Serializer, KV};

/// A slog drain that emits each record as a `tracing` event.
pub struct TracingDrain;

impl Drain for TracingDrain {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, record: &Record<'_>, values: &OwnedKVList) -> Result<(), slog::Never> {
        // Only pay for formatting when a subscriber wants this level.
        let enabled = match record.level() {
            slog::Level::Critical | slog::Level::Error => tracing::enabled!(tracing::Level::ERROR),
            slog::Level::Warning => tracing::enabled!(tracing::Level::WARN),
            slog::Level::Info => tracing::enabled!(tracing::Level::INFO),
            slog::Level::Debug => tracing::enabled!(tracing::Level::DEBUG),
            slog::Level::Trace => tracing::enabled!(tracing::Level::TRACE),
        };
        if !enabled {
            return Ok(());
        }
        let mut kv = KvText(String::new());
        // Formatting into a String cannot fail; a failing KV impl just loses its fields.
        let _ = record.kv().serialize(record, &mut kv);
        let _ = values.serialize(record, &mut kv);
        let message = record.msg();
        let module = record.module();
        let fields = kv.0;
        match record.level() {
            slog::Level::Critical | slog::Level::Error => {
                tracing::error!(target: "raft", module, "{message}{fields}")
            }
            slog::Level::Warning => tracing::warn!(target: "raft", module, "{message}{fields}"),
            slog::Level::Info => tracing::info!(target: "raft", module, "{message}{fields}"),
            slog::Level::Debug => tracing::debug!(target: "raft", module, "{message}{fields}"),
            slog::Level::Trace => tracing::trace!(target: "raft", module, "{message}{fields}"),
        }
        Ok(())
    }
}

/// Collects slog key-values as ` key=value` text.
struct KvText(String);

impl Serializer for KvText {
    fn emit_arguments(&mut self, key: Key, val: &fmt::Arguments<'_>) -> slog::Result {
        let _ = write!(self.0, " {key}={val}");
        Ok(())
    }
}

/// A slog logger for raft-rs that writes into `tracing`, tagged with the raft id.
pub fn raft_logger(raft_id: u64) -> slog::Logger {
    slog::Logger::root(TracingDrain, slog::o!("raft_id" => raft_id))
}
