//! The collector of template-file uploads: an archive no waiting or running build names goes
//! once it is older than `template_files_grace_secs`.
//!
//! An upload comes before the build start that names it (the SDK probes, uploads, then
//! starts), so a fresh archive that nothing names yet is kept for the grace; a probe that
//! finds it and the start that names it make it new again (`files.rs`), and from the start
//! until the build ends its record names it. A finished build needs its archives no more (a
//! rebuild probes and uploads again). Every api collects its own directory: each keeps the
//! uploads it received. The first pass, when the api starts, also removes unfinished uploads
//! (`.upload-*`) however new: none is being written yet.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

use crate::records::BuildState;
use crate::Control;

/// The archives (team, hash) the records of unfinished builds name.
fn named_by(builds: &[crate::records::TemplateBuild]) -> HashSet<(String, String)> {
    let mut named = HashSet::new();
    for b in builds {
        let steps = b
            .start
            .as_ref()
            .and_then(|s| s.get("steps"))
            .and_then(|s| s.as_array());
        for step in steps.into_iter().flatten() {
            if let Some(h) = step.get("filesHash").and_then(|h| h.as_str()) {
                named.insert((b.team_id.clone(), h.to_ascii_lowercase()));
            }
        }
    }
    named
}

/// Removes what `dir` holds that `named` lacks and that is at least `grace` old (unfinished
/// uploads whatever their age with `at_start`). Blocking.
fn sweep(
    dir: &std::path::Path,
    named: &HashSet<(String, String)>,
    grace: Duration,
    at_start: bool,
) -> Vec<PathBuf> {
    let now = SystemTime::now();
    let mut removed = Vec::new();
    let Ok(teams) = std::fs::read_dir(dir) else {
        return removed;
    };
    for team in teams.flatten() {
        let team_name = team.file_name().to_string_lossy().into_owned();
        let Ok(files) = std::fs::read_dir(team.path()) else {
            continue;
        };
        for f in files.flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            let unfinished = name.starts_with(".upload-");
            if !unfinished && named.contains(&(team_name.clone(), name.clone())) {
                continue;
            }
            let age = f
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| now.duration_since(t).ok())
                .unwrap_or_default();
            if ((unfinished && at_start) || age >= grace) && std::fs::remove_file(f.path()).is_ok()
            {
                removed.push(f.path());
            }
        }
        // An empty team directory goes too (fails while anything is in it).
        let _ = std::fs::remove_dir(team.path());
    }
    removed
}

impl Control {
    /// One pass of the collector; returns what it removed. Fails rather than collect with an
    /// unknown set of named archives.
    pub async fn collect_template_files(&self, at_start: bool) -> anyhow::Result<Vec<PathBuf>> {
        let grace = Duration::from_secs(self.config().template_files_grace_secs);
        let dir = self.uploads().dir().to_path_buf();
        // The records first, the files' ages second: an archive a start names meanwhile was
        // made new by that start.
        let builds = self
            .records()
            .template_builds_in(&[BuildState::Waiting, BuildState::Building])
            .await?;
        let named = named_by(&builds);
        let removed =
            tokio::task::spawn_blocking(move || sweep(&dir, &named, grace, at_start)).await?;
        for p in &removed {
            tracing::info!(path = %p.display(), "template file no build names: deleted");
        }
        Ok(removed)
    }

    /// Collects at start and then every half grace (1 s to 5 min), until `cancel` fires.
    pub async fn run_template_files_collector(self: Arc<Self>, cancel: CancellationToken) {
        let grace = Duration::from_secs(self.config().template_files_grace_secs);
        let every = (grace / 2).clamp(Duration::from_secs(1), Duration::from_secs(300));
        let mut at_start = true;
        loop {
            if let Err(e) = self.collect_template_files(at_start).await {
                tracing::warn!(error = %e, "collecting template files failed");
            }
            at_start = false;
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_old_unnamed_archives_go() {
        let tmp = tempfile::tempdir().expect("tmp");
        let team = tmp.path().join("t1");
        std::fs::create_dir_all(&team).expect("team dir");
        for f in ["named", "fresh", "old", ".upload-x"] {
            std::fs::write(team.join(f), "x").expect("file");
        }
        let old = SystemTime::now() - Duration::from_secs(120);
        for f in ["named", "old"] {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(team.join(f))
                .expect("open");
            file.set_modified(old).expect("age");
        }
        let named: HashSet<_> = [("t1".to_string(), "named".to_string())].into();
        let gone = sweep(tmp.path(), &named, Duration::from_secs(60), false);
        assert_eq!(gone, vec![team.join("old")]);
        let gone = sweep(tmp.path(), &named, Duration::from_secs(60), true);
        assert_eq!(gone, vec![team.join(".upload-x")]);
        assert!(team.join("named").exists() && team.join("fresh").exists());
    }
}
