//! stderr, shared by log lines and the one progress line of `submit --wait`.
//!
//! Logs always go to stderr (stdout is for results, tables and JSON), as text or as
//! one JSON object a line (`--log-format`). A progress line is drawn only when stderr
//! is a terminal; while one is drawn, each log line first erases it and then draws it
//! again below itself, so the two never end up on one line.

use std::io::{IsTerminal, Write};
use std::sync::{Mutex, MutexGuard, OnceLock};

use serde::{Deserialize, Serialize};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One human-readable line per event, with its spans (`shard{task=t3 shard=1}`).
    #[default]
    Text,
    /// One JSON object per line: level, target, fields, the current span and the
    /// spans it is in.
    Json,
}

/// What `RUST_LOG` falls back to: warnings, without the GPU stack's chatter.
const DEFAULT_FILTER: &str = "warn,wgpu_hal=error,wgpu_core=error,naga=error";

/// The format logging was set up with, for [`report_error`].
static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// The progress line now drawn on stderr, if any.
static PROGRESS: Mutex<Option<String>> = Mutex::new(None);

fn progress_line() -> MutexGuard<'static, Option<String>> {
    // A panic while drawing leaves nothing half-done that matters: take the line.
    PROGRESS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sets up logging to stderr, filtered by `RUST_LOG`. Call once.
pub fn init_logs(format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(StderrLines);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().init(),
    }
    let _ = FORMAT.set(format);
}

/// Writes the error that ends the command to stderr: `error: …`, or with JSON logs a
/// JSON line like the log lines, so that every line on stderr parses. Written
/// directly, not as an event, so that no `RUST_LOG` filter can hide it.
pub fn report_error(e: &anyhow::Error, before_logs: LogFormat) {
    let message = format!("{e:#}");
    let mut err = StderrLines.make_writer();
    let _ = match FORMAT.get().copied().unwrap_or(before_logs) {
        LogFormat::Text => writeln!(err, "error: {message}"),
        LogFormat::Json => writeln!(
            err,
            "{}",
            serde_json::json!({
                "level": "ERROR",
                "fields": { "message": message },
                "target": "gpumesh",
            })
        ),
    };
}

/// stderr for the log subscriber: one event at a time, around the progress line.
struct StderrLines;

impl<'a> MakeWriter<'a> for StderrLines {
    type Writer = LogLine;

    fn make_writer(&'a self) -> LogLine {
        LogLine(Vec::with_capacity(256))
    }
}

/// One event, written out whole when dropped.
struct LogLine(Vec<u8>);

impl Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        let drawn = progress_line();
        let mut err = std::io::stderr().lock();
        let _ = match drawn.as_deref() {
            Some(line) => err
                .write_all(ERASE_LINE.as_bytes())
                .and_then(|()| err.write_all(&self.0))
                .and_then(|()| err.write_all(line.as_bytes())),
            None => err.write_all(&self.0),
        };
        let _ = err.flush();
    }
}

/// Back to the line's start, and clear it.
const ERASE_LINE: &str = "\r\x1b[2K";

/// A progress line on stderr, when stderr is a terminal; otherwise nothing at all, so
/// that a pipe or a CI log gets no carriage returns.
pub struct Progress {
    on_terminal: bool,
}

impl Progress {
    pub fn on_stderr() -> Self {
        Progress {
            on_terminal: std::io::stderr().is_terminal(),
        }
    }

    /// Replaces the line with `text`.
    pub fn show(&self, text: String) {
        if !self.on_terminal {
            return;
        }
        let mut drawn = progress_line();
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "{ERASE_LINE}{text}");
        let _ = err.flush();
        *drawn = Some(text);
    }
}

impl Drop for Progress {
    /// Leaves the last state on its own line; what follows starts on a fresh one.
    fn drop(&mut self) {
        let mut drawn = progress_line();
        if drawn.take().is_some() {
            let mut err = std::io::stderr().lock();
            let _ = writeln!(err);
        }
    }
}
