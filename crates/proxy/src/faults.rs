//! Fault points: named places in a transition (the api's) or in a request's way (the proxy's)
//! where a test can hold the work until it lets go, so races between a transition and a
//! request or another call are tested in a chosen order instead of by timing.
//!
//! Test-only. It is on only when the process was started with `VMON_FAULT_DIR` (an
//! environment variable of the api/proxy process, never a setting a request, a tenant or the
//! config file can reach) or a test gave it a directory; otherwise every point is one branch
//! on `None`.
//!
//! The protocol is files in that directory. A test *arms* point `P` by creating the file `P`
//! (e.g. `pause:commit`). A process reaching an armed point appends the sandbox id and a
//! newline to `P.reached` and then, unless `P` holds the word `pass`, waits until `P` is
//! removed (checked every 20 ms), which *releases* it. An armed file holding a sandbox id
//! (one line) holds only that sandbox. Points are listed where they are placed.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where fault points are armed; `None`: off.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    dir: Option<PathBuf>,
}

/// How often a held point looks whether it was released.
const POLL: Duration = Duration::from_millis(20);

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

    /// The point `point` for `sandbox_id`: records the visit and waits for the release when
    /// armed; returns at once otherwise.
    pub async fn point(&self, point: &str, sandbox_id: &str) {
        let Some(dir) = &self.dir else {
            return;
        };
        let arm = dir.join(point);
        let Ok(armed) = tokio::fs::read_to_string(&arm).await else {
            return;
        };
        let armed = armed.trim();
        if !armed.is_empty() && armed != "pass" && armed != sandbox_id {
            return;
        }
        tracing::warn!(point, sandbox_id, "fault point reached");
        if let Err(e) = append_line(&dir.join(format!("{point}.reached")), sandbox_id).await {
            tracing::warn!(point, error = %e, "recording a fault point failed");
        }
        if armed == "pass" {
            return;
        }
        while tokio::fs::try_exists(&arm).await.unwrap_or(false) {
            tokio::time::sleep(POLL).await;
        }
        tracing::warn!(point, sandbox_id, "fault point released");
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
