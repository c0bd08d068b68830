//! The etcd backend (etcd 3.4+ through `etcd-client`). Every key carries the configured prefix.
//! Transient failures (a member down, a leader change) are retried for `retry_for`; a retried
//! transaction may already have applied, which the recipes tolerate: their comparisons fail and
//! they re-read.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, Error as EtcdError, GetOptions,
    Identity, KeyValue, PutOptions, TlsOptions, Txn, TxnOp, WatchOptions,
};
use tokio::time::Instant;

use crate::engine::{Cmp, Engine, Op, TxnOutcome};
use crate::{Entry, EtcdConfig, EtcdTls, KvError, LeaseId, Revision};

pub(crate) struct EtcdEngine {
    client: Client,
    prefix: String,
    retry_for: Duration,
}

fn transient(error: &EtcdError) -> bool {
    use tonic::Code;
    match error {
        EtcdError::TransportError(_) | EtcdError::IoError(_) => true,
        EtcdError::GRpcStatus(status) => matches!(
            status.code(),
            Code::Unavailable
                | Code::DeadlineExceeded
                | Code::Unknown
                | Code::Aborted
                | Code::Cancelled
                | Code::Internal
        ),
        EtcdError::LeaseKeepAliveError(msg) | EtcdError::WatchError(msg) => {
            !msg.contains("lease not found")
        }
        _ => false,
    }
}

fn lease_not_found(error: &EtcdError) -> bool {
    match error {
        EtcdError::GRpcStatus(status) => status.message().contains("lease not found"),
        EtcdError::LeaseKeepAliveError(msg) => msg.contains("lease not found"),
        _ => false,
    }
}

/// The CA (the only roots trusted) and client identity of an etcd TLS configuration.
fn tls_options(tls: &EtcdTls) -> Result<TlsOptions, KvError> {
    let read = |p: &std::path::Path| {
        std::fs::read(p).map_err(|e| {
            KvError::InvalidArgument(format!("etcd TLS: reading {}: {e}", p.display()))
        })
    };
    Ok(TlsOptions::new()
        .ca_certificate(Certificate::from_pem(read(&tls.ca_file)?))
        .identity(Identity::from_pem(
            read(&tls.cert_file)?,
            read(&tls.key_file)?,
        )))
}

impl EtcdEngine {
    /// After a failed watch, waits a little (never past `deadline`) so a caller that re-reads
    /// and watches again does not spin while etcd is unreachable.
    async fn pause_before_retry(deadline: Instant) {
        tokio::time::sleep_until(deadline.min(Instant::now() + Duration::from_millis(100))).await;
    }

    pub(crate) async fn connect(config: &EtcdConfig) -> Result<Arc<dyn Engine>, KvError> {
        if config.endpoints.is_empty() {
            return Err(KvError::InvalidArgument("no etcd endpoints".to_owned()));
        }
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(3))
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2));
        if let Some(tls) = &config.tls {
            if let Some(plain) = config.endpoints.iter().find(|e| !e.starts_with("https://")) {
                return Err(KvError::InvalidArgument(format!(
                    "etcd endpoint {plain:?} is not https://, but etcd TLS is configured"
                )));
            }
            options = options.with_tls(tls_options(tls)?);
        }
        let client = Client::connect(&config.endpoints, Some(options))
            .await
            .map_err(|e| KvError::Etcd(Box::new(e)))?;
        Ok(Arc::new(EtcdEngine {
            client,
            prefix: config.prefix.clone(),
            retry_for: config.retry_for,
        }))
    }

    async fn retry<T, F, Fut>(&self, mut call: F) -> Result<T, KvError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, EtcdError>>,
    {
        let deadline = Instant::now() + self.retry_for;
        let mut backoff = Duration::from_millis(50);
        loop {
            match call(self.client.clone()).await {
                Ok(value) => return Ok(value),
                Err(error) if transient(&error) && Instant::now() < deadline => {
                    tracing::debug!(%error, "etcd request failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
                Err(error) if lease_not_found(&error) => return Err(KvError::LeaseLost),
                Err(error) => return Err(KvError::Etcd(Box::new(error))),
            }
        }
    }

    fn full(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn entry(&self, kv: &KeyValue) -> Entry {
        let key = String::from_utf8_lossy(kv.key());
        Entry {
            key: key.get(self.prefix.len()..).unwrap_or_default().to_owned(),
            value: kv.value().to_vec(),
            create_revision: kv.create_revision(),
            mod_revision: kv.mod_revision(),
            lease: (kv.lease() != 0).then_some(kv.lease()),
        }
    }
}

#[async_trait]
impl Engine for EtcdEngine {
    async fn get(&self, key: &str) -> Result<Option<Entry>, KvError> {
        let key = self.full(key);
        let response = self
            .retry(|mut c| {
                let key = key.clone();
                async move { c.get(key, None).await }
            })
            .await?;
        Ok(response.kvs().first().map(|kv| self.entry(kv)))
    }

    async fn range(&self, prefix: &str) -> Result<(Vec<Entry>, Revision), KvError> {
        let prefix = self.full(prefix);
        let response = self
            .retry(|mut c| {
                let prefix = prefix.clone();
                async move { c.get(prefix, Some(GetOptions::new().with_prefix())).await }
            })
            .await?;
        let revision = response.header().map_or(0, |h| h.revision());
        Ok((
            response.kvs().iter().map(|kv| self.entry(kv)).collect(),
            revision,
        ))
    }

    async fn txn(&self, cmps: Vec<Cmp>, ops: Vec<Op>) -> Result<TxnOutcome, KvError> {
        let compares: Vec<Compare> = cmps
            .iter()
            .map(|cmp| match cmp {
                Cmp::CreateRevision(k, r) => {
                    Compare::create_revision(self.full(k), CompareOp::Equal, *r)
                }
                Cmp::ModRevision(k, r) => Compare::mod_revision(self.full(k), CompareOp::Equal, *r),
            })
            .collect();
        let operations: Vec<TxnOp> = ops
            .iter()
            .map(|op| match op {
                Op::Put { key, value, lease } => {
                    let options = lease.map(|l| PutOptions::new().with_lease(l));
                    TxnOp::put(self.full(key), value.clone(), options)
                }
                Op::Delete { key } => TxnOp::delete(self.full(key), None),
            })
            .collect();
        let response = self
            .retry(|mut c| {
                let txn = Txn::new()
                    .when(compares.clone())
                    .and_then(operations.clone());
                async move { c.txn(txn).await }
            })
            .await?;
        Ok(TxnOutcome {
            succeeded: response.succeeded(),
            revision: response.header().map_or(0, |h| h.revision()),
        })
    }

    async fn grant(&self, ttl: Duration) -> Result<LeaseId, KvError> {
        let seconds = ttl.as_millis().div_ceil(1000).max(1) as i64;
        let response = self
            .retry(|mut c| async move { c.lease_grant(seconds, None).await })
            .await?;
        Ok(response.id())
    }

    async fn keep_alive_once(&self, lease: LeaseId) -> Result<bool, KvError> {
        // One request per refresh keeps no stream state to repair after a member dies.
        match self
            .retry(|mut c| async move { c.lease_keep_alive(lease).await.map(|_| ()) })
            .await
        {
            Ok(()) => Ok(true),
            Err(KvError::LeaseLost) => Ok(false),
            Err(error) => Err(error),
        }
    }

    async fn revoke(&self, lease: LeaseId) -> Result<(), KvError> {
        match self
            .retry(|mut c| async move { c.lease_revoke(lease).await.map(|_| ()) })
            .await
        {
            Ok(()) | Err(KvError::LeaseLost) => Ok(()),
            Err(error) => Err(error),
        }
    }

    async fn wait_change(
        &self,
        prefix: &str,
        after: Revision,
        timeout: Duration,
    ) -> Result<(), KvError> {
        let prefix = self.full(prefix);
        let mut client = self.client.clone();
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(after + 1);
        let deadline = Instant::now() + timeout;
        let watch = tokio::time::timeout_at(deadline, client.watch(prefix, Some(options))).await;
        let mut stream = match watch {
            Ok(Ok(stream)) => stream,
            // A failed or slow watch is a spurious wake-up: the caller re-reads.
            Ok(Err(error)) => {
                tracing::debug!(%error, "etcd watch failed");
                Self::pause_before_retry(deadline).await;
                return Ok(());
            }
            Err(_) => return Ok(()),
        };
        // The first response confirms the watch and names it; events come after.
        let mut watch_id = None;
        let ended = tokio::time::timeout_at(deadline, async {
            loop {
                match stream.message().await {
                    Ok(Some(message)) => {
                        if message.created() {
                            watch_id = Some(message.watch_id());
                        }
                        if !message.events().is_empty() || message.canceled() {
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(error) => {
                        tracing::debug!(%error, "etcd watch failed");
                        break;
                    }
                }
            }
        })
        .await;
        match watch_id {
            Some(id) => {
                let _ = stream.cancel(id).await;
            }
            // The stream ended before etcd confirmed the watch: a failed watch, as above.
            None if ended.is_ok() => Self::pause_before_retry(deadline).await,
            None => {}
        }
        Ok(())
    }
}
