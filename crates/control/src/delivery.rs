//! Webhook delivery, run by the KV leader: claims the store's outbox with the leader epoch and
//! hands each row to its webhook's queue, so one slow receiver never holds up another. Per
//! webhook, events go out one at a time in outbox order: up to three attempts (500 ms, then
//! 1 s apart), each cut after 10 s, every attempt recorded; after the last, on to the next.
//!
//! `http://` and `https://` (rustls; the system's CA certificates plus `webhook_ca_file`). The
//! connector resolves names itself and connects only to addresses `targets.rs` allows, so a
//! webhook never reaches this host or the networks behind it unless the operator opened them.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::Request;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use time::OffsetDateTime;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::targets::{VettedResolver, WebhookTargets};
use super::{rfc3339, Control};
use crate::platform::{platform, WebhookOutcome};
use crate::records::{DeliveryAttempt, Event, OutboxItem};

/// How each event is delivered to each webhook.
#[derive(Debug, Clone)]
pub struct DeliveryPolicy {
    pub attempts: u32,
    /// The wait before the second, third, ... attempt (the last entry repeats).
    pub backoff: Vec<Duration>,
    /// One attempt, from connecting to the end of the response body.
    pub timeout: Duration,
}

impl Default for DeliveryPolicy {
    fn default() -> Self {
        Self {
            attempts: 3,
            backoff: vec![Duration::from_millis(500), Duration::from_secs(1)],
            timeout: Duration::from_secs(10),
        }
    }
}

/// Events are kept this long; receivers learn it from `events_ttl_days`.
const EVENTS_TTL_DAYS: i64 = 30;
/// Outbox rows claimed per round.
const CLAIM_LIMIT: i64 = 100;
/// A claim not completed in this time may be taken again (the dispatcher died).
const CLAIM_VISIBILITY: Duration = Duration::from_secs(3600);
/// How often the outbox is polled when no local commit wakes the dispatcher (events written
/// by other api replicas).
const POLL: Duration = Duration::from_secs(1);
/// Response bodies are read (so the connection can be reused) up to this size.
const MAX_RESPONSE_BODY: usize = 64 * 1024;

/// The body of a webhook request: snake_case, exactly the fields of the spec.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WebhookPayload {
    pub id: String,
    pub version: String,
    #[serde(rename = "type")]
    pub event_type: String,
    pub timestamp: String,
    pub event_category: String,
    pub event_label: String,
    pub event_data: Option<serde_json::Value>,
    pub sandbox_id: String,
    pub sandbox_execution_id: String,
    pub sandbox_template_id: String,
    pub sandbox_build_id: String,
    pub sandbox_team_id: String,
    pub events_ttl_days: i64,
}

impl WebhookPayload {
    pub fn of(event: &Event) -> WebhookPayload {
        // `sandbox.lifecycle.created` → category `lifecycle`, label `created`.
        let mut parts = event.event_type.rsplitn(3, '.');
        let label = parts.next().unwrap_or_default().to_string();
        let category = parts.next().unwrap_or_default().to_string();
        WebhookPayload {
            id: event.id.to_string(),
            version: "v1".to_string(),
            event_type: event.event_type.clone(),
            timestamp: rfc3339(event.timestamp),
            event_category: category,
            event_label: label,
            event_data: event.event_data.clone(),
            sandbox_id: event.sandbox_id.clone(),
            sandbox_execution_id: event.execution_id.clone(),
            sandbox_template_id: event.template_id.clone(),
            sandbox_build_id: event.build_id.clone(),
            sandbox_team_id: event.team_id.clone(),
            events_ttl_days: EVENTS_TTL_DAYS,
        }
    }
}

/// `e2b-signature`: unpadded standard base64 of SHA-256(secret ‖ body).
pub fn signature(secret: &str, body: &[u8]) -> String {
    let mut hash = Sha256::new();
    hash.update(secret.as_bytes());
    hash.update(body);
    base64::engine::general_purpose::STANDARD_NO_PAD.encode(hash.finalize())
}

type HttpClient = Client<hyper_rustls::HttpsConnector<HttpConnector<VettedResolver>>, Full<Bytes>>;

/// The TLS settings of deliveries: the system's roots, plus the configured CA file's.
fn tls_config(ca_file: Option<&std::path::Path>) -> anyhow::Result<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for c in native.certs {
        let _ = roots.add(c);
    }
    if let Some(path) = ca_file {
        let certs = CertificateDer::pem_file_iter(path)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
        for c in certs {
            let c = c.map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            roots
                .add(c)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// The delivery client: vetted addresses, TLS when the URL says so, 10 s to connect. An
/// unusable CA file is logged and the system's CAs are trusted alone.
fn client(
    targets: Arc<WebhookTargets>,
    ca_file: Option<&std::path::Path>,
) -> anyhow::Result<HttpClient> {
    let tls = match tls_config(ca_file) {
        Ok(t) => t,
        Err(e) => {
            tracing::error!(error = %e, "webhook CA file unusable; trusting the system's CAs only");
            tls_config(None)?
        }
    };
    let mut http = HttpConnector::new_with_resolver(VettedResolver { targets });
    http.enforce_http(false);
    http.set_connect_timeout(Some(Duration::from_secs(10)));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new()).build(https))
}

/// Why an attempt got no status.
enum Attempt {
    TimedOut(String),
    Failed(String),
}

/// Outbox rows handed to a queue and not yet completed (a row whose claim expired while it
/// waits in a slow webhook's queue is claimed again; it must not be queued twice).
type InFlight = Arc<Mutex<HashSet<i64>>>;

impl Control {
    /// Delivers webhook events as leader `epoch` until `stop` fires or a newer leader claims
    /// the outbox.
    pub(crate) async fn run_dispatcher(self: Arc<Self>, epoch: i64, stop: CancellationToken) {
        let client = match client(
            self.webhook_targets.clone(),
            self.config.webhook_ca_file.as_deref(),
        ) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "no webhook client; deliveries wait for a restart");
                return;
            }
        };
        let in_flight: InFlight = Arc::default();
        let mut queues: HashMap<String, mpsc::UnboundedSender<OutboxItem>> = HashMap::new();
        let mut workers = tokio::task::JoinSet::new();
        loop {
            match self
                .records
                .claim_outbox(&self.config.client_id, epoch, CLAIM_LIMIT, CLAIM_VISIBILITY)
                .await
            {
                Ok(None) => {
                    tracing::warn!(
                        epoch,
                        "a newer leader holds the webhook outbox; not delivering"
                    );
                    break;
                }
                Err(e) => tracing::warn!(error = %e, "claiming webhook deliveries failed"),
                Ok(Some(items)) => {
                    for item in items {
                        if !lock(&in_flight).insert(item.seq) {
                            continue;
                        }
                        let queue = queues.entry(item.webhook_id.clone()).or_insert_with(|| {
                            let (tx, rx) = mpsc::unbounded_channel();
                            workers.spawn(self.clone().deliver_queue(
                                rx,
                                client.clone(),
                                epoch,
                                in_flight.clone(),
                                stop.clone(),
                            ));
                            tx
                        });
                        let _ = queue.send(item);
                    }
                }
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = self.deliveries_due.notified() => {}
                _ = tokio::time::sleep(POLL) => {}
            }
        }
        drop(queues);
        while workers.join_next().await.is_some() {}
    }

    /// One webhook's deliveries, in order.
    async fn deliver_queue(
        self: Arc<Self>,
        mut queue: mpsc::UnboundedReceiver<OutboxItem>,
        client: HttpClient,
        epoch: i64,
        in_flight: InFlight,
        stop: CancellationToken,
    ) {
        loop {
            let item = tokio::select! {
                _ = stop.cancelled() => return,
                item = queue.recv() => match item {
                    Some(item) => item,
                    None => return,
                },
            };
            // Leadership lost mid-delivery: the next leader takes the row over at once.
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = self.deliver(&client, &item) => {}
            }
            if let Err(e) = self.records.complete_outbox(epoch, item.seq).await {
                tracing::warn!(seq = item.seq, error = %e, "completing a webhook delivery failed");
            }
            lock(&in_flight).remove(&item.seq);
        }
    }

    /// All attempts of one event to one webhook.
    async fn deliver(&self, client: &HttpClient, item: &OutboxItem) {
        let event = &item.event;
        let hook = match self.records.webhook(&event.team_id, &item.webhook_id).await {
            Ok(Some(hook)) if hook.enabled => hook,
            // Deleted or disabled since the event was queued.
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(webhook_id = %item.webhook_id, error = %e, "reading a webhook failed");
                return;
            }
        };
        let secret = match self.records.webhook_secret(&hook.id).await {
            Ok(Some(secret)) => secret,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(webhook_id = %hook.id, error = %e, "the webhook secret is unreadable; skipping the event");
                return;
            }
        };
        let body = match serde_json::to_vec(&WebhookPayload::of(event)) {
            Ok(b) => Bytes::from(b),
            Err(e) => {
                tracing::warn!(error = %e, "encoding a webhook body failed");
                return;
            }
        };
        let signed = signature(&secret, &body);
        let policy = &self.delivery_policy;
        for attempt in 1..=policy.attempts.max(1) {
            if attempt > 1 {
                let i = (attempt as usize - 2).min(policy.backoff.len().saturating_sub(1));
                tokio::time::sleep(policy.backoff.get(i).copied().unwrap_or_default()).await;
            }
            let started = Instant::now();
            let request = Request::post(hook.url.as_str())
                .header("content-type", "application/json")
                .header("user-agent", "vmon-webhooks/1")
                .header("e2b-webhook-id", hook.id.as_str())
                .header("e2b-delivery-id", item.delivery_id.as_str())
                .header("e2b-signature-version", "v1")
                .header("e2b-signature", signed.as_str())
                .body(Full::new(body.clone()));
            let outcome = match request {
                Err(e) => Err(Attempt::Failed(format!("invalid request: {e}"))),
                Ok(request) => {
                    let targets = &self.webhook_targets;
                    match tokio::time::timeout(policy.timeout, post(client, targets, request)).await
                    {
                        Ok(result) => result.map_err(Attempt::Failed),
                        Err(_) => Err(Attempt::TimedOut(format!(
                            "no answer within {} ms",
                            policy.timeout.as_millis()
                        ))),
                    }
                }
            };
            let duration_ms = i64::try_from(started.elapsed().as_millis()).unwrap_or(i64::MAX);
            let (status_code, error, counted) = match outcome {
                Ok(code) if (200..300).contains(&code) => {
                    (Some(i64::from(code)), None, WebhookOutcome::Delivered)
                }
                Ok(code) => (
                    Some(i64::from(code)),
                    Some(format!("the receiver answered {code}")),
                    WebhookOutcome::Rejected,
                ),
                Err(Attempt::TimedOut(e)) => (None, Some(e), WebhookOutcome::TimedOut),
                Err(Attempt::Failed(e)) => (None, Some(e), WebhookOutcome::Failed),
            };
            platform().webhook_delivery(counted);
            let success = error.is_none();
            let record = DeliveryAttempt {
                webhook_id: hook.id.clone(),
                event_id: event.id,
                delivery_id: item.delivery_id.clone(),
                attempt: i64::from(attempt),
                status_code,
                success,
                duration_ms,
                error: error.clone(),
                at: OffsetDateTime::now_utc(),
            };
            if let Err(e) = self.records.record_delivery(&record).await {
                tracing::warn!(webhook_id = %hook.id, error = %e, "recording a delivery attempt failed");
            }
            if success {
                tracing::debug!(webhook_id = %hook.id, event_id = %event.id, attempt, "webhook delivered");
                return;
            }
            tracing::info!(webhook_id = %hook.id, event_id = %event.id, attempt, error = ?error, "webhook attempt failed");
        }
        tracing::warn!(webhook_id = %hook.id, event_id = %event.id, "webhook delivery given up; moving on");
    }
}

/// Sends one request and reads the (bounded) answer; the status on any answer.
async fn post(
    client: &HttpClient,
    targets: &WebhookTargets,
    request: Request<Full<Bytes>>,
) -> Result<u16, String> {
    // The connector vets what it resolves; a literal address it does not resolve is vetted here.
    let host = request.uri().host().unwrap_or_default();
    if let Ok(ip) = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
    {
        if !targets.allowed(ip) {
            return Err(format!(
                "{ip} is an address webhooks may not reach (this host or a private network)"
            ));
        }
    }
    let response = client.request(request).await.map_err(|e| chain(&e))?;
    let status = response.status().as_u16();
    let _ = Limited::new(response.into_body(), MAX_RESPONSE_BODY)
        .collect()
        .await;
    Ok(status)
}

/// An error with its sources, for the delivery record.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_is_unpadded_standard_base64_of_secret_then_body() {
        // python: base64.b64encode(hashlib.sha256(b"s3cret" + b"{}").digest()).decode().rstrip("=")
        let sig = signature("s3cret", b"{}");
        assert!(!sig.ends_with('='));
        assert_eq!(sig.len(), 43);
        let digest = Sha256::digest(b"s3cret{}");
        assert_eq!(
            sig,
            base64::engine::general_purpose::STANDARD
                .encode(digest)
                .trim_end_matches('=')
        );
    }

    #[test]
    fn payload_labels() {
        let e = Event {
            id: uuid::Uuid::new_v4(),
            seq: 1,
            event_type: "sandbox.lifecycle.killed".into(),
            event_data: Some(serde_json::json!({"kill_reason": "request"})),
            sandbox_id: "isbx".into(),
            execution_id: "e".into(),
            build_id: "b".into(),
            team_id: "t".into(),
            template_id: "tpl".into(),
            timestamp: OffsetDateTime::now_utc(),
        };
        let p = WebhookPayload::of(&e);
        assert_eq!(
            (p.event_category.as_str(), p.event_label.as_str()),
            ("lifecycle", "killed")
        );
        let v = serde_json::to_value(&p).expect("json");
        let mut keys: Vec<&str> = v
            .as_object()
            .expect("object")
            .keys()
            .map(|k| k.as_str())
            .collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "event_category",
                "event_data",
                "event_label",
                "events_ttl_days",
                "id",
                "sandbox_build_id",
                "sandbox_execution_id",
                "sandbox_id",
                "sandbox_team_id",
                "sandbox_template_id",
                "timestamp",
                "type",
                "version"
            ]
        );
    }
}
