//! Which sandbox signed a `/files` URL that names none (an SDK's `download_url()` opened by a
//! browser): an index of every sandbox's envd access token, kept in memory beside the proxy's
//! routes, so an unauthenticated request never reads the store.
//!
//! The signature is SHA-256 over the path, operation, user, token and expiry, computed by the
//! SDK; nothing in the URL names the token, so the index cannot be keyed by it. A lookup
//! hashes the URL with each token in memory (bounded by the sandboxes this api knows, a few
//! at a time: `routes.rs`), after a table of recent signatures (the same URL fetched again
//! costs one hash). The proxy limits, per client, lookups that find nothing.
//!
//! One api process sees every change in [`Control::commit`]. In a cluster other replicas
//! commit too: the index is loaded from the store at start, and a lookup that finds nothing
//! reloads it when the last load is older than [`RELOAD_EVERY`] (one at a time), so the store
//! is read at most that often whatever the traffic.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use vmon_proxy::signed::SignedFiles;

use super::Control;

/// In a cluster, the shortest time between two loads of the index from the store.
pub const RELOAD_EVERY: Duration = Duration::from_secs(5);
/// Recent signatures remembered; the table is emptied when it fills.
const RECENT: usize = 1024;

/// The index (see the module's docs).
#[derive(Default)]
pub(crate) struct Signers {
    /// Sandbox id to its envd access token.
    tokens: RwLock<HashMap<String, Arc<str>>>,
    /// Signature to the sandbox that made it, for URLs fetched again.
    recent: Mutex<HashMap<String, String>>,
    /// When the index was last loaded from the store (cluster only).
    loaded: tokio::sync::Mutex<Option<Instant>>,
}

impl Signers {
    /// Sandbox `id` has envd access token `token` (none when empty).
    pub(crate) fn set(&self, id: &str, token: &str) {
        let mut tokens = self.tokens.write().unwrap_or_else(|p| p.into_inner());
        if token.is_empty() {
            tokens.remove(id);
        } else if tokens.get(id).map(|t| &**t) != Some(token) {
            tokens.insert(id.to_string(), Arc::from(token));
        }
    }

    pub(crate) fn remove(&self, id: &str) {
        self.tokens
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }

    /// Replaces the whole index with these (sandbox id, token) pairs.
    fn load<'a>(&self, pairs: impl Iterator<Item = (&'a str, &'a str)>) {
        let fresh: HashMap<String, Arc<str>> = pairs
            .filter(|(_, token)| !token.is_empty())
            .map(|(id, token)| (id.to_string(), Arc::from(token)))
            .collect();
        *self.tokens.write().unwrap_or_else(|p| p.into_inner()) = fresh;
    }

    /// The sandbox whose token made `signed`, from memory only.
    pub(crate) fn find(&self, signed: &SignedFiles) -> Option<String> {
        let remembered = self
            .recent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(signed.signature())
            .cloned();
        if let Some(id) = remembered {
            let token = self.token(&id);
            if token.is_some_and(|t| signed.signed_with(&t)) {
                return Some(id);
            }
        }
        // Tokens are copied out first: no lock is held while hashing.
        let all: Vec<(String, Arc<str>)> = self
            .tokens
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(id, t)| (id.clone(), t.clone()))
            .collect();
        let id = all
            .into_iter()
            .find(|(_, token)| signed.signed_with(token))
            .map(|(id, _)| id)?;
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if recent.len() >= RECENT {
            recent.clear();
        }
        recent.insert(signed.signature().to_string(), id.clone());
        Some(id)
    }

    fn token(&self, id: &str) -> Option<Arc<str>> {
        self.tokens
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.tokens.read().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Control {
    /// The sandbox whose envd access token made `signed`, if this api knows it.
    pub(crate) async fn find_signer(&self, signed: &SignedFiles) -> Option<String> {
        if let Some(id) = self.signers.find(signed) {
            return Some(id);
        }
        // In a cluster another replica may have created it since the last load.
        self.cluster.as_ref()?;
        self.reload_signers(false).await;
        self.signers.find(signed)
    }

    /// Loads the index from the store; unless `now`, only when the last load is older than
    /// [`RELOAD_EVERY`]. Callers that arrive during a load wait for it.
    pub(crate) async fn reload_signers(&self, now: bool) {
        let mut loaded = self.signers.loaded.lock().await;
        if !now && loaded.is_some_and(|t| t.elapsed() < RELOAD_EVERY) {
            return;
        }
        match self.records.sandboxes(None).await {
            Ok(records) => {
                self.signers.load(
                    records
                        .iter()
                        .map(|r| (r.id.as_str(), r.envd_access_token.as_str())),
                );
                *loaded = Some(Instant::now());
            }
            Err(e) => {
                // Tried again no sooner than a successful load would be.
                *loaded = Some(Instant::now());
                tracing::warn!(error = %e, "loading the signed-URL index from the store failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;
    use sha2::{Digest, Sha256};

    fn signed(path: &str, token: &str) -> SignedFiles {
        let raw = format!("{path}:read:user:{token}");
        let sig = format!(
            "v1_{}",
            base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(raw.as_bytes()))
        );
        let q = sig.replace('+', "%2B").replace('/', "%2F");
        let uri: http::Uri = format!("/files?path={path}&username=user&signature={q}")
            .parse()
            .unwrap_or_else(|e| panic!("{e}"));
        SignedFiles::parse(&http::Method::GET, &uri).unwrap_or_else(|| panic!("signed"))
    }

    #[test]
    fn finds_the_signer_and_forgets_removed_sandboxes() {
        let s = Signers::default();
        s.set("ione", "token-one");
        s.set("itwo", "token-two");
        s.set("inone", "");
        assert_eq!(s.len(), 2);
        let url = signed("/a", "token-two");
        assert_eq!(s.find(&url).as_deref(), Some("itwo"));
        // Again, from the recent table.
        assert_eq!(s.find(&url).as_deref(), Some("itwo"));
        assert_eq!(s.find(&signed("/a", "token-three")), None);
        s.remove("itwo");
        assert_eq!(s.find(&url), None, "a killed sandbox's URLs find nothing");
        s.load([("ithree", "token-three"), ("iempty", "")].into_iter());
        assert_eq!(s.len(), 1);
        assert_eq!(s.find(&signed("/a", "token-one")), None);
        assert_eq!(
            s.find(&signed("/a", "token-three")).as_deref(),
            Some("ithree")
        );
    }
}
