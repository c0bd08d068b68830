//! Showing the first build's [`Progress`]: a bar on a terminal, plain log lines (step, percent,
//! elapsed) otherwise. Log lines written while the bar is up go through [`LogWriter`], which
//! lifts the bar for the write so the two never garble each other.

use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use vmon_proto::progress::{Phase, Progress, Snapshot};

/// The bar being drawn, if any.
static BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

fn bar_slot() -> std::sync::MutexGuard<'static, Option<ProgressBar>> {
    BAR.lock().unwrap_or_else(|p| p.into_inner())
}

/// The log's writer: stderr, with the bar (when one is drawn) lifted around each write.
pub struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let bar = bar_slot().clone();
        match bar {
            Some(b) => b
                .suspend(|| std::io::stderr().write_all(buf))
                .map(|()| buf.len()),
            None => std::io::stderr().write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// Shows `progress` until it is ready: a bar when stderr is a terminal, log lines otherwise.
pub fn show(progress: Progress) {
    let tty = std::io::stderr().is_terminal();
    tokio::spawn(async move {
        // A warm start is ready within moments: no bar, no lines for it.
        for _ in 0..10 {
            if progress.is_ready() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if tty {
            bar(progress).await
        } else {
            lines(progress).await
        }
    });
}

async fn bar(progress: Progress) {
    let bar = ProgressBar::new(100);
    // A bar where the step has a percent, a spinner where it has none.
    let with_percent = ProgressStyle::with_template(
        "{spinner} building {prefix} [{elapsed_precise}] [{bar:30}] {pos:>3}% {wide_msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    let without =
        ProgressStyle::with_template("{spinner} building {prefix} [{elapsed_precise}] {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner());
    bar.set_style(without.clone());
    bar.enable_steady_tick(Duration::from_millis(120));
    *bar_slot() = Some(bar.clone());
    let mut seen = u64::MAX;
    loop {
        let s = progress.snapshot();
        if s.version != seen {
            seen = s.version;
            bar.set_prefix(s.step.clone());
            match s.percent {
                Some(p) => {
                    bar.set_style(with_percent.clone());
                    bar.set_position(u64::from(p));
                }
                None => bar.set_style(without.clone()),
            }
            bar.set_message(match s.phase {
                Phase::Failed => format!(
                    "failed: {} (retrying)",
                    s.error.as_deref().unwrap_or("unknown error")
                ),
                _ => s.detail.clone(),
            });
        }
        if s.phase == Phase::Ready {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bar.finish_and_clear();
    *bar_slot() = None;
    tracing::info!("{}; creates are admitted", progress.snapshot().message());
}

async fn lines(progress: Progress) {
    let mut last: Option<(Snapshot, Instant)> = None;
    loop {
        let s = progress.snapshot();
        if s.phase == Phase::Ready {
            break;
        }
        if worth_a_line(last.as_ref(), &s) {
            log(&s);
            last = Some((s, Instant::now()));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tracing::info!("{}; creates are admitted", progress.snapshot().message());
}

/// A new step or phase, 5 points more, or a change after 30 s: not a line per package.
fn worth_a_line(last: Option<&(Snapshot, Instant)>, s: &Snapshot) -> bool {
    let Some((prev, at)) = last else { return true };
    if prev.step != s.step || prev.phase != s.phase {
        return true;
    }
    let (a, b) = (prev.percent.unwrap_or(0), s.percent.unwrap_or(0));
    b >= a.saturating_add(5)
        || (prev.version != s.version && at.elapsed() >= Duration::from_secs(30))
}

fn log(s: &Snapshot) {
    let elapsed_secs = s.elapsed.as_secs();
    match s.phase {
        Phase::Failed => tracing::warn!(
            step = %s.step,
            elapsed_secs,
            error = s.error.as_deref().unwrap_or(""),
            "first build failed (retrying)"
        ),
        _ => match s.percent {
            Some(percent) => tracing::info!(
                step = %s.step,
                percent,
                elapsed_secs,
                "building {}: {}",
                s.what,
                s.detail
            ),
            None => tracing::info!(
                step = %s.step,
                elapsed_secs,
                "building {}: {}",
                s.what,
                s.detail
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_not_one_per_update() {
        let p = Progress::new("the base template");
        p.step("guest image");
        p.update("retrieving", Some(10));
        let first = (p.snapshot(), Instant::now());
        p.update("retrieving more", Some(12));
        assert!(!worth_a_line(Some(&first), &p.snapshot()));
        p.update("retrieving more", Some(15));
        assert!(worth_a_line(Some(&first), &p.snapshot()));
        p.step("template");
        assert!(worth_a_line(Some(&first), &p.snapshot()));
        assert!(worth_a_line(None, &p.snapshot()));
    }
}
