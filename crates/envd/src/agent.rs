//! The agent's shared state: what `/init` configured, and the live processes and watchers.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use crate::connect::{Code, ConnectError};
use crate::filesystem::watch::Watchers;
use crate::process::running::Table;
use crate::user::{self, User};

/// Where processes find self-keepalive (`keepalive.rs`; `VMON_KEEPALIVE_URL` in their
/// environment).
pub const KEEPALIVE_URL: &str = "http://127.0.0.1:49983/keepalive";
/// The latest self-keepalive ask (`keepalive.rs`): when it came (the guest's monotonic
/// clock) and for how long.
#[derive(Debug, Default)]
pub struct KeepaliveAsks {
    latest: Mutex<Option<(Instant, u64)>>,
}

impl KeepaliveAsks {
    pub fn set(&self, timeout_secs: u64) {
        *self.latest.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((Instant::now(), timeout_secs));
    }

    /// Forgets the ask (a new start: the create or resume set the timeout anew).
    pub fn clear(&self) {
        *self.latest.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// How long ago the latest ask came, and its timeout.
    pub fn latest(&self) -> Option<(u128, u64)> {
        let l = *self.latest.lock().unwrap_or_else(|p| p.into_inner());
        l.map(|(at, t)| (at.elapsed().as_millis(), t))
    }
}

/// Settings `/init` may change after start.
#[derive(Debug, Clone, Default)]
pub struct Defaults {
    pub user: String,
    pub workdir: Option<String>,
    pub env_vars: BTreeMap<String, String>,
}

pub struct Agent {
    pub token: RwLock<Option<String>>,
    pub defaults: RwLock<Defaults>,
    /// Newest `/init` timestamp applied, in Unix nanoseconds.
    pub last_init_nanos: Mutex<Option<i128>>,
    pub processes: Table,
    pub watchers: Watchers,
    pub cpu_sample: Mutex<Option<crate::metrics::CpuSample>>,
    /// Rewritten after every `/init` ([`crate::control::mark_init`]), if set.
    pub init_marker: Option<PathBuf>,
    /// How many `/init`s this agent applied (part of the marker's text).
    pub inits: AtomicU64,
    /// The guest's latest self-keepalive ask.
    pub keepalive: KeepaliveAsks,
}

fn read<T: Clone>(l: &RwLock<T>) -> T {
    l.read().unwrap_or_else(|p| p.into_inner()).clone()
}

impl Agent {
    pub fn new(
        default_user: String,
        token: Option<String>,
        init_marker: Option<PathBuf>,
    ) -> Arc<Self> {
        Arc::new(Agent {
            token: RwLock::new(token),
            defaults: RwLock::new(Defaults {
                user: default_user,
                env_vars: BTreeMap::from([(
                    "VMON_KEEPALIVE_URL".to_string(),
                    KEEPALIVE_URL.to_string(),
                )]),
                ..Defaults::default()
            }),
            last_init_nanos: Mutex::new(None),
            processes: Table::default(),
            watchers: Watchers::default(),
            cpu_sample: Mutex::new(None),
            init_marker,
            inits: AtomicU64::new(0),
            keepalive: Default::default(),
        })
    }

    pub fn token(&self) -> Option<String> {
        read(&self.token)
    }

    pub fn set_token(&self, t: Option<String>) {
        *self.token.write().unwrap_or_else(|p| p.into_inner()) = t;
    }

    pub fn defaults(&self) -> Defaults {
        read(&self.defaults)
    }

    pub fn update_defaults(&self, f: impl FnOnce(&mut Defaults)) {
        f(&mut self.defaults.write().unwrap_or_else(|p| p.into_inner()))
    }

    /// The user a request acts as: the one named in Basic auth, else the default user.
    pub async fn request_user(&self, headers: &http::HeaderMap) -> Result<User, ConnectError> {
        let name = match user::basic_auth_user(headers)? {
            Some(n) => n,
            None => self.defaults().user,
        };
        self.user_named(name).await
    }

    pub async fn user_named(&self, name: String) -> Result<User, ConnectError> {
        tokio::task::spawn_blocking(move || User::lookup(&name))
            .await
            .map_err(|e| ConnectError::new(Code::Internal, format!("user lookup failed: {e}")))?
    }

    /// The working directory a process starts in when the client gives none.
    pub fn default_cwd(&self, user: &User) -> PathBuf {
        match self.defaults().workdir {
            Some(w) if !w.is_empty() => PathBuf::from(w),
            _ => user.home.clone(),
        }
    }
}
