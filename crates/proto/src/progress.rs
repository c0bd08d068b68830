//! How far a long first build (the guest image, then the `base` template) has come.
//!
//! One [`Progress`] handle is shared by whoever does the work (the image builder, the api's
//! template build) and whoever shows it (`vmon up`'s progress bar or log lines, the api's 503
//! answers and `GET /health`). Writers set the current step; readers take a [`Snapshot`].

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Where the whole build is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Building,
    Ready,
    /// The last attempt failed; the builder may try again.
    Failed,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Building => "building",
            Phase::Ready => "ready",
            Phase::Failed => "failed",
        }
    }
}

/// A copy of the state at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// What is being built, as a noun phrase ("the base template").
    pub what: String,
    pub phase: Phase,
    /// The current step ("guest image", "base template").
    pub step: String,
    /// What the step is doing now ("debootstrap: retrieving packages (120 of 298)").
    pub detail: String,
    /// How far the current step is, when that can be told.
    pub percent: Option<u8>,
    /// Since the build started.
    pub elapsed: Duration,
    /// Why the last attempt failed.
    pub error: Option<String>,
    /// Bumped on every change, so a reader can tell whether anything moved.
    pub version: u64,
}

impl Snapshot {
    /// One line for people: what is built, which step, how far, how long.
    pub fn message(&self) -> String {
        let secs = self.elapsed.as_secs();
        match self.phase {
            Phase::Ready => format!("{} is built ({secs} s)", self.what),
            Phase::Failed => format!(
                "building {} failed after {secs} s: {}; it is retried, see the vmon log",
                self.what,
                self.error.as_deref().unwrap_or("unknown error")
            ),
            Phase::Building => {
                let mut s = format!("{} is being built: {}", self.what, self.step);
                if let Some(p) = self.percent {
                    s.push_str(&format!(" {p}%"));
                }
                if !self.detail.is_empty() {
                    s.push_str(&format!(" ({})", self.detail));
                }
                s.push_str(&format!(", {secs} s elapsed"));
                s
            }
        }
    }
}

#[derive(Debug)]
struct State {
    what: String,
    phase: Phase,
    step: String,
    detail: String,
    percent: Option<u8>,
    started: Instant,
    finished: Option<Instant>,
    error: Option<String>,
    version: u64,
}

/// A shared, cheaply cloned progress handle.
#[derive(Debug, Clone)]
pub struct Progress(Arc<Mutex<State>>);

impl Progress {
    /// A build of `what` that has just started.
    pub fn new(what: impl Into<String>) -> Progress {
        Progress(Arc::new(Mutex::new(State {
            what: what.into(),
            phase: Phase::Building,
            step: "starting".to_string(),
            detail: String::new(),
            percent: None,
            started: Instant::now(),
            finished: None,
            error: None,
            version: 0,
        })))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies `f` unless the build is ready: readiness is final, so a late report (an image
    /// rebuilt after an upgrade, say) never makes a ready platform look busy again.
    fn change(&self, f: impl FnOnce(&mut State)) {
        let mut s = self.state();
        if s.phase == Phase::Ready {
            return;
        }
        f(&mut s);
        s.version += 1;
    }

    /// Enters `step` (its detail and percent cleared). A failed build that is retried is
    /// building again; a ready one stays ready.
    pub fn step(&self, step: impl Into<String>) {
        let step = step.into();
        self.change(|s| {
            if s.phase != Phase::Building {
                s.phase = Phase::Building;
                s.started = Instant::now();
                s.finished = None;
                s.error = None;
            }
            s.step = step;
            s.detail.clear();
            s.percent = None;
        });
    }

    /// How far the current step is; `percent` is capped at 100.
    pub fn update(&self, detail: impl Into<String>, percent: Option<u8>) {
        let detail = detail.into();
        self.change(|s| {
            s.detail = detail;
            s.percent = percent.map(|p| p.min(100));
        });
    }

    pub fn ready(&self) {
        self.change(|s| {
            s.phase = Phase::Ready;
            s.finished = Some(Instant::now());
            s.error = None;
        });
    }

    pub fn failed(&self, error: impl Into<String>) {
        let error = error.into();
        self.change(|s| {
            s.phase = Phase::Failed;
            s.finished = Some(Instant::now());
            s.error = Some(error);
        });
    }

    /// The current step's name (`"starting"` before any).
    pub fn current_step(&self) -> String {
        self.state().step.clone()
    }

    pub fn phase(&self) -> Phase {
        self.state().phase
    }

    pub fn is_ready(&self) -> bool {
        self.state().phase == Phase::Ready
    }

    pub fn snapshot(&self) -> Snapshot {
        let s = self.state();
        let end = s.finished.unwrap_or_else(Instant::now);
        Snapshot {
            what: s.what.clone(),
            phase: s.phase,
            step: s.step.clone(),
            detail: s.detail.clone(),
            percent: s.percent,
            elapsed: end.saturating_duration_since(s.started),
            error: s.error.clone(),
            version: s.version,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_then_ready() {
        let p = Progress::new("the base template");
        assert_eq!(p.snapshot().phase, Phase::Building);
        p.step("guest image");
        p.update("debootstrap", Some(140));
        let s = p.snapshot();
        assert_eq!(s.percent, Some(100));
        assert!(s
            .message()
            .starts_with("the base template is being built: guest image 100% (debootstrap), "));
        p.failed("no network");
        assert!(p.snapshot().message().contains("failed"));
        assert!(!p.is_ready());
        p.step("guest image");
        assert_eq!(p.snapshot().error, None);
        p.ready();
        assert!(p.is_ready());
        assert!(p.snapshot().version > s.version);
        p.step("guest image");
        p.failed("late");
        assert!(p.is_ready(), "ready is final");
    }
}
