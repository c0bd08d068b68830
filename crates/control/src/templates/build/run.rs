//! A RUN step of a template build: started detached in the build sandbox (its output into one
//! file, its exit code into another) and polled through envd, each poll's new output going
//! into the build log as lines, so a long `apt-get` or `pip install` shows progress while it
//! runs instead of all at once at its end.

use std::time::Duration;

use super::guest::BuildVm;
use super::log::{cut, Log};
use super::{MAX_STEP_LINES, STEP_TIMEOUT};
use crate::ids;
use crate::templates::steps::{self, StepState};

/// Most output bytes one poll of a running step reads.
const POLL_CHUNK: usize = 256 << 10;

impl BuildVm {
    /// Runs a RUN step detached in the guest (stdout and stderr into one file, the exit code
    /// into another) and streams its output into the build log while it runs, so a long
    /// `apt-get` or `pip install` shows progress. Returns the exit code.
    pub(super) async fn run_streamed(
        &self,
        cmd: &str,
        user: &str,
        state: &StepState,
        log: &Log,
        step: &str,
    ) -> Result<i32, String> {
        let tag = ids::random_lower(12);
        let (out_file, rc_file) = (
            format!("/tmp/.vmon-step-{tag}.log"),
            format!("/tmp/.vmon-step-{tag}.rc"),
        );
        let inner = format!(
            "bash -l -c {} > {out} 2>&1 < /dev/null; echo $? > {rc}.tmp; mv {rc}.tmp {rc}",
            steps::quote(cmd),
            out = out_file,
            rc = rc_file
        );
        // A background job of the launching shell, which exits at once: no `setsid -f`, which
        // an image's busybox may lack.
        let launch = format!(
            "bash -c {} > /dev/null 2>&1 < /dev/null &",
            steps::quote(&inner)
        );
        let started = self
            .exec(launch, user, state, Duration::from_secs(60))
            .await?;
        if started.exit_code != 0 {
            return Err(format!(
                "the step could not start: {}",
                cut(started.stderr.trim())
            ));
        }
        let t0 = tokio::time::Instant::now();
        let mut offset: u64 = 0;
        let mut pending: Vec<u8> = Vec::new();
        let mut lines = 0usize;
        let mut left_out = 0usize;
        let mut wait = Duration::from_millis(50);
        let b64 = base64::engine::general_purpose::STANDARD;
        loop {
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(1));
            let poll = format!(
                "cat {rc_file} >&2 2>/dev/null; tail -c +{} {out_file} 2>/dev/null | head -c {POLL_CHUNK} | base64 -w0",
                offset + 1
            );
            let out = self
                .exec(poll, "root", state, Duration::from_secs(60))
                .await?;
            let chunk = base64::Engine::decode(&b64, out.stdout.trim())
                .map_err(|e| format!("reading the step's output: {e}"))?;
            offset += chunk.len() as u64;
            pending.extend_from_slice(&chunk);
            let mut complete = Vec::new();
            while let Some(i) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=i).collect();
                complete.push(String::from_utf8_lossy(&line[..line.len() - 1]).into_owned());
            }
            let exit = out.stderr.trim().parse::<i32>().ok();
            let drained = chunk.len() < POLL_CHUNK;
            if exit.is_some() && drained && !pending.is_empty() {
                complete.push(String::from_utf8_lossy(&pending).into_owned());
                pending.clear();
            }
            for l in complete {
                if lines < MAX_STEP_LINES {
                    lines += 1;
                    log.info(Some(step), l).await;
                } else {
                    left_out += 1;
                }
            }
            if let (Some(code), true) = (exit, drained) {
                if left_out > 0 {
                    log.info(Some(step), format!("[{left_out} more lines left out]"))
                        .await;
                }
                let _ = self
                    .exec(
                        format!("rm -f {out_file} {rc_file}"),
                        "root",
                        state,
                        Duration::from_secs(30),
                    )
                    .await;
                return Ok(code);
            }
            if !chunk.is_empty() {
                wait = Duration::from_millis(50);
            }
            if t0.elapsed() > STEP_TIMEOUT {
                return Err(format!("it ran longer than {} s", STEP_TIMEOUT.as_secs()));
            }
        }
    }
}
