//! A build's log: entries written to the store as they come, each cut to [`MAX_LINE`], a
//! step's output to its last [`MAX_STEP_LINES`] lines.

use std::sync::Arc;

use time::OffsetDateTime;

use super::{MAX_LINE, MAX_STEP_LINES};
use crate::records::BuildLogEntry;
use crate::templates::steps;
use crate::Control;

/// The log of one build: entries are written to the store as they come.
pub(super) struct Log {
    pub(super) control: Arc<Control>,
    pub(super) build_id: String,
}

impl Log {
    pub(super) async fn write(&self, level: &str, step: Option<&str>, lines: &[String]) {
        let entries: Vec<BuildLogEntry> = lines
            .iter()
            .map(|m| BuildLogEntry {
                timestamp: OffsetDateTime::now_utc(),
                level: level.to_string(),
                message: cut(m),
                step: step.map(str::to_string),
            })
            .collect();
        if let Err(e) = self
            .control
            .records
            .append_build_logs(&self.build_id, &entries)
            .await
        {
            tracing::warn!(build = %self.build_id, error = %e, "writing build logs failed");
        }
    }

    pub(super) async fn info(&self, step: Option<&str>, line: impl Into<String>) {
        self.write("info", step, &[line.into()]).await;
    }

    /// A command's output, one entry per line.
    pub(super) async fn output(&self, step: Option<&str>, level: &str, text: &str) {
        let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
        if lines.len() > MAX_STEP_LINES {
            let dropped = lines.len() - MAX_STEP_LINES;
            lines.drain(..dropped);
            lines.insert(0, format!("[{dropped} earlier lines left out]"));
        }
        if !lines.is_empty() {
            self.write(level, step, &lines).await;
        }
    }

    /// The `CACHED` lines of the first `count` steps (of `start`'s `n`), found in the cache.
    pub(super) async fn cached_steps(&self, start: &[steps::Step], count: usize) {
        let n = start.len();
        for (i, step) in start.iter().enumerate().take(count) {
            self.info(
                Some(&(i + 1).to_string()),
                format!("CACHED [{}/{n}] {}", i + 1, describe(step)),
            )
            .await;
        }
    }
}

/// `s`, cut to [`MAX_LINE`] bytes (at a character's boundary) with an ellipsis.
pub(super) fn cut(s: &str) -> String {
    if s.len() <= MAX_LINE {
        return s.to_string();
    }
    let mut end = MAX_LINE;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// A step as its log line shows it.
pub(super) fn describe(s: &steps::Step) -> String {
    match s.kind.as_str() {
        "RUN" => format!("RUN {}", cut(s.args.first().map_or("", |a| a.as_str()))),
        "COPY" => format!(
            "COPY {} {}",
            s.args.first().map_or("", |a| a.as_str()),
            s.args.get(1).map_or("", |a| a.as_str())
        ),
        other => format!("{other} {}", cut(&s.args.join(" "))),
    }
}
