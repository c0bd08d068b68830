//! The proxy's view of sandboxes ([`vmon_proxy::Routes`]), served from the route table
//! [`Control::commit`] keeps, and auto-resume on traffic.

use std::net::IpAddr;
use std::sync::Arc;

use vmon_proxy::{ResumeError, Routes, SandboxRoute};

use super::Control;
use crate::records::SandboxState;

/// Traffic-triggered resumes run at least this long.
const TRAFFIC_RESUME_MIN_SECS: u64 = 300;

/// [`Routes`] over a [`Control`].
pub struct ProxyRoutes(pub Arc<Control>);

#[async_trait::async_trait]
impl Routes for ProxyRoutes {
    async fn lookup(&self, sandbox_id: &str) -> Option<SandboxRoute> {
        self.0.route(sandbox_id).await
    }

    async fn find_signer(&self, signed: &vmon_proxy::signed::SignedFiles) -> Option<String> {
        // A lookup hashes with every token this api knows (`signers.rs`): a few at a time, so
        // requests with made-up signatures cost the host a bounded share of its CPU.
        static LOOKUPS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(4);
        let _turn = LOOKUPS.acquire().await.ok()?;
        self.0.find_signer(signed).await
    }

    async fn resume_for_traffic(&self, sandbox_id: &str) -> Result<IpAddr, ResumeError> {
        let control = self.0.clone();
        let id = sandbox_id.to_string();
        // Detached: a client that gives up does not abandon a half-done resume.
        tokio::spawn(async move { control.resume_for_traffic(&id).await })
            .await
            .map_err(|e| ResumeError::Failed(format!("resume task failed: {e}")))?
    }
}

impl Control {
    async fn resume_for_traffic(&self, id: &str) -> Result<IpAddr, ResumeError> {
        let not_found = || ResumeError::NotFound(id.to_string());
        let guard = self
            .lock(id)
            .await
            .map_err(|e| ResumeError::Failed(e.to_string()))?;
        let result = async {
            let rec = self
                .records
                .sandbox(id)
                .await
                .map_err(|e| ResumeError::Failed(e.to_string()))?
                .ok_or_else(not_found)?;
            if rec.state == SandboxState::Running {
                return rec.guest_ip.ok_or_else(not_found);
            }
            if !super::idle::resumes_on_traffic(&rec) {
                return Err(ResumeError::Refused(format!(
                    "The sandbox {id} is paused and does not resume on traffic; connect to it to resume it"
                )));
            }
            if !rec.build.has_memory {
                return Err(ResumeError::Refused(format!(
                    "The sandbox {id} was paused without memory and does not resume on traffic; connect to it to resume it"
                )));
            }
            let team = self
                .records
                .team(&rec.team_id)
                .await
                .map_err(|e| ResumeError::Failed(e.to_string()))?
                .ok_or_else(not_found)?;
            let timeout = rec
                .timeout_secs
                .max(TRAFFIC_RESUME_MIN_SECS)
                .min(team.limits.max_lifetime_secs);
            let rec = self
                .resume_locked(
                    &team,
                    rec,
                    timeout,
                    false,
                    guard.fence().token(),
                    super::why::ResumeTrigger::Traffic,
                )
                .await
                .map_err(|e| ResumeError::Failed(e.to_string()))?;
            rec.guest_ip.ok_or_else(not_found)
        }
        .await;
        let _ = guard.unlock().await;
        result
    }
}
