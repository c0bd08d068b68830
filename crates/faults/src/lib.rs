//! Fault points: named places in the api's transitions, the proxy's request path and the
//! node's pauses, checkpoints and migrations where a test can hold the work until it lets go,
//! make the step fail, or end the process as a crash would. Races between a transition and a
//! request are tested in a chosen order instead of by timing, and crashes at a chosen point.
//! This is vmon's one way to inject a fault.
//!
//! Test-only. It is on only when the process was started with `VMON_FAULT_DIR` (an
//! environment variable of the api, proxy or node process, never a setting a request, a
//! tenant or the config file can reach) or a test gave it a directory; otherwise every point
//! is one branch on `None`. It must never be armed by anything but a file in that directory.
//!
//! The protocol is files in that directory. A test *arms* point `P` by creating the file `P`
//! (e.g. `pause:commit`). A process reaching an armed point appends the sandbox id and a
//! newline to `P.reached`, then acts on the file's first line:
//! - empty: waits until `P` is removed (checked every 20 ms), which *releases* it;
//! - a sandbox id: the same, for that sandbox only (others pass without a trace);
//! - `pass`: goes on at once (the visit is recorded);
//! - `abort`: aborts the process there, as a crash (`kill -9`, a power loss) would;
//! - `fail`: the step fails with [`Injected`] at a point that can fail ([`Faults::fallible`]),
//!   and passes at one that cannot.
//!
//! Points are listed where they are placed (`grep -rn 'point("' crates`).

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where fault points are armed; `None`: off.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    dir: Option<PathBuf>,
}

/// The failure an armed `fail` point injects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Injected {
    pub point: String,
}

impl std::fmt::Display for Injected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "injected failure at {}", self.point)
    }
}

impl std::error::Error for Injected {}

/// How often a held point looks whether it was released.
const POLL: Duration = Duration::from_millis(20);

/// What an armed point was told to do.
#[derive(Debug, PartialEq, Eq)]
enum Action {
    Hold,
    Pass,
    Abort,
    Fail,
}

impl Faults {
    /// Off.
    pub fn off() -> Faults {
        Faults { dir: None }
    }

    /// Points armed in `dir`.
    pub fn in_dir(dir: impl Into<PathBuf>) -> Faults {
        Faults {
            dir: Some(dir.into()),
        }
    }

    /// `VMON_FAULT_DIR` when set and not empty, else off.
    pub fn from_env() -> Faults {
        match std::env::var_os("VMON_FAULT_DIR") {
            Some(d) if !d.is_empty() => Faults::in_dir(d),
            _ => Faults::off(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.dir.is_some()
    }

    /// The point `point` for `sandbox_id`: records the visit and holds, passes or aborts as
    /// armed; returns at once when it is not armed.
    pub async fn point(&self, point: &str, sandbox_id: &str) {
        // A point that cannot fail passes a `fail`.
        let _ = self.fallible(point, sandbox_id).await;
    }

    /// [`Faults::point`] at a step that can fail: an armed `fail` returns [`Injected`].
    pub async fn fallible(&self, point: &str, sandbox_id: &str) -> Result<(), Injected> {
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        let arm = dir.join(point);
        let Ok(armed) = tokio::fs::read_to_string(&arm).await else {
            return Ok(());
        };
        let action = match armed.lines().next().unwrap_or("").trim() {
            "" => Action::Hold,
            "pass" => Action::Pass,
            "abort" => Action::Abort,
            "fail" => Action::Fail,
            only if only == sandbox_id => Action::Hold,
            _ => return Ok(()),
        };
        tracing::warn!(point, sandbox_id, ?action, "fault point reached");
        if let Err(e) = append_line(&dir.join(format!("{point}.reached")), sandbox_id).await {
            tracing::warn!(point, error = %e, "recording a fault point failed");
        }
        match action {
            Action::Pass => Ok(()),
            Action::Abort => {
                tracing::error!(point, "fault point: aborting");
                std::process::abort()
            }
            Action::Fail => Err(Injected {
                point: point.to_string(),
            }),
            Action::Hold => {
                while tokio::fs::try_exists(&arm).await.unwrap_or(false) {
                    tokio::time::sleep(POLL).await;
                }
                tracing::warn!(point, sandbox_id, "fault point released");
                Ok(())
            }
        }
    }
}

async fn append_line(path: &Path, line: &str) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt;
    let mut f = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .await?;
    f.write_all(format!("{line}\n").as_bytes()).await?;
    f.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reached(dir: &Path, point: &str) -> String {
        std::fs::read_to_string(dir.join(format!("{point}.reached"))).unwrap_or_default()
    }

    #[tokio::test]
    async fn off_and_unarmed_points_pass_without_a_trace() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(Faults::off().fallible("p", "s1").await, Ok(()));
        let faults = Faults::in_dir(dir.path());
        assert_eq!(faults.fallible("p", "s1").await, Ok(()));
        assert!(!dir.path().join("p.reached").exists());
    }

    #[tokio::test]
    async fn fail_fails_only_where_a_step_can_fail() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("p"), "fail\n").expect("arm");
        let faults = Faults::in_dir(dir.path());
        let e = faults.fallible("p", "s1").await.expect_err("armed to fail");
        assert_eq!(e.to_string(), "injected failure at p");
        faults.point("p", "s2").await;
        assert_eq!(reached(dir.path(), "p"), "s1\ns2\n");
    }

    #[tokio::test]
    async fn a_point_armed_for_one_sandbox_holds_it_until_released() {
        let dir = tempfile::tempdir().expect("tempdir");
        let arm = dir.path().join("p");
        std::fs::write(&arm, "s1").expect("arm");
        let faults = Faults::in_dir(dir.path());
        // Another sandbox passes without a trace.
        faults.point("p", "s2").await;
        assert_eq!(reached(dir.path(), "p"), "");
        let held = tokio::spawn({
            let faults = faults.clone();
            async move { faults.point("p", "s1").await }
        });
        while reached(dir.path(), "p").is_empty() {
            tokio::time::sleep(POLL).await;
        }
        tokio::time::sleep(POLL * 3).await;
        assert!(!held.is_finished(), "held while armed");
        std::fs::remove_file(&arm).expect("release");
        held.await.expect("released");
    }
}
