//! vmon-store: the durable records of the control plane (DESIGN §6): teams, API keys (hashed),
//! templates and builds with their names, sandbox records (running and paused) with execution
//! ids, snapshots, lifecycle events (30-day retention), webhooks (secrets encrypted at rest),
//! webhook deliveries and the webhook outbox, and named volumes (their rows; the files are
//! the api's), and team secrets (values sealed like webhook secrets).
//!
//! It must never coordinate: locks, admission counters, routes, idempotency and leader
//! election are `vmon-kv`'s. What it guarantees is atomicity: a state change, the event that
//! reports it and the outbox rows that will deliver it commit together or not at all
//! ([`Store::begin`] → [`StoreTx`] → [`StoreTx::commit`]).
//!
//! # Backends
//! SQLite (the default, one file in the data dir; one writer connection plus readers, WAL,
//! `synchronous=FULL`) and PostgreSQL 15+. Both run the same SQL except where they cannot
//! (the outbox claim uses `FOR UPDATE SKIP LOCKED` on PostgreSQL; SQLite's single writer makes
//! the same statement exclusive). Migrations live in `migrations/{sqlite,postgres}`, are
//! embedded in the binary and applied by [`Store::open`] with sqlx's migrator
//! (`_sqlx_migrations`); databases of the earlier runner (`vmon_migrations`) are adopted.
//!
//! # The API in one screen
//! ```text
//! let store = Store::open(&StoreConfig::sqlite(data_dir.join("vmon.db"), secret_key)).await?;
//! // teams and keys
//! store.create_team(&NewTeam{..}) -> Team;  store.team(id) / team_by_slug(slug)
//! store.create_api_key(team_id, name, raw_key) -> ApiKey;  store.api_key_by_raw(raw_key) -> Option<ApiKey>
//! store.api_keys(team_id);  store.revoke_api_key(team_id, key_id) -> bool
//! // templates, builds, names (`alias`, `namespace/alias`, with `:tag`)
//! store.create_template(&NewTemplate) ; store.create_build(&NewBuild) ; store.set_tag(t, tag, build)
//! store.add_alias(t, alias) ; store.resolve_template(reference) -> Option<ResolvedTemplate>
//! store.template_by_alias(alias) ; store.tagged_builds(t) -> Vec<(tag, Build)> ; store.remove_tag(t, tag)
//! store.snapshots(&SnapshotQuery) -> Page<Snapshot>
//! // sandboxes and events, atomically
//! let mut tx = store.begin().await?;
//! tx.update_sandbox(&record, &expected_execution_id, fence) -> bool   // false: stale operation
//! tx.append_event(&NewEvent{..}) -> Event                             // + outbox rows per webhook
//! tx.commit().await?;
//! store.sandbox(id) ; store.sandboxes(&SandboxQuery) -> Page<SandboxRecord> ; store.count_sandboxes(team, state)
//! store.events(&EventQuery) -> Vec<Event> ; store.delete_events_before(t) ; store.run_retention(now)
//! // volumes (names unique per team)
//! store.create_volume(&NewVolume) -> Volume (Err(Conflict) on a taken name) ; store.volume(team, id)
//! store.volumes(team) ; store.delete_volume(team, id) -> bool ; store.volume_by_id(id)
//! // secrets (values sealed, never returned; by id or lower-cased name)
//! store.create_secret(&NewSecret) ; store.secret(team, id_or_name) ; store.secrets(team, limit, after)
//! store.update_secret(team, id_or_name, value, metadata) ; store.delete_secret(team, id_or_name)
//! // webhooks
//! store.create_webhook(&NewWebhook) -> Webhook (never the secret) ; store.webhook_secret(id)
//! store.record_delivery(&DeliveryAttempt) ; store.deliveries(webhook_id, limit, offset) ; store.webhook_stats(id)
//! store.claim_outbox(dispatcher, leader_epoch, limit, visibility) -> Vec<OutboxItem>   // Err(Fenced) if stale
//! store.complete_outbox(leader_epoch, seq) -> bool
//! ```
//!
//! Do not call [`Store`] methods while holding a [`StoreTx`] on SQLite: there is one writer
//! connection, so a second write would wait for the transaction that waits for it. Use the
//! transaction's own methods.

pub mod bench;
mod events;
mod model;
mod sandboxes;
mod secrets;
mod sql;
mod teams;
pub use events::EVENT_RETENTION;
pub use teams::hash_api_key;
pub use templates::split_reference;
mod template_builds;
pub use template_builds::TemplateBuildDoc;
mod templates;
mod tx;
mod volumes;
mod webhooks;

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::{AnyPool, ConnectOptions, Executor};

pub use model::*;
pub use tx::StoreTx;

/// The result type of this crate.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// What can go wrong.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database failed (connection lost, constraint, syntax).
    #[error("the database request failed")]
    Database(#[source] sqlx::Error),
    /// The database cannot be reached now (no connection within [`ACQUIRE_TIMEOUT`], or the
    /// connection broke): nothing was written by this call; it may be retried later.
    #[error("the database is unreachable")]
    Unavailable(#[source] sqlx::Error),
    /// A call got no answer from the database within its deadline (the link drops packets,
    /// the server stalls): what it wrote may or may not have been committed.
    #[error("the database did not answer within {} s", .0.as_secs())]
    TimedOut(Duration),
    /// A unique name or id is already taken.
    #[error("{0} already exists")]
    Conflict(String),
    /// A newer leader epoch (or lock fence) has been recorded: this caller is stale.
    #[error("a newer leader epoch holds the fence")]
    Fenced,
    /// The argument cannot be stored.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A stored value does not decode.
    #[error("the stored value {0} is malformed")]
    Malformed(String),
    /// Encrypting or decrypting a webhook secret failed (wrong key?).
    #[error("the webhook secret could not be decrypted with the configured key")]
    Crypto,
    /// The schema could not be brought up to date (or an applied migration changed).
    #[error("the store's migrations failed")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> StoreError {
        if let sqlx::Error::Database(db) = &error {
            if db.kind() == sqlx::error::ErrorKind::UniqueViolation {
                return StoreError::Conflict(db.message().to_owned());
            }
        }
        match error {
            sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::WorkerCrashed => StoreError::Unavailable(error),
            error => StoreError::Database(error),
        }
    }
}

/// How long a call waits for a PostgreSQL connection (including the check that an idle one
/// still answers) before it fails as [`StoreError::Unavailable`]: a replica cut off from
/// the database answers within seconds instead of holding its callers. A pool of 10 serving
/// queries of milliseconds never makes a caller wait this long.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// Which database is behind a [`Store`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// How to open the store.
#[derive(Clone)]
pub struct StoreConfig {
    /// `sqlite://<path>` or `postgres://user@host:port/db`.
    pub url: String,
    /// The key webhook secrets are encrypted with (ChaCha20-Poly1305). Losing it makes stored
    /// secrets unreadable; changing it needs a re-encryption.
    pub secret_key: [u8; 32],
    /// Pool size (PostgreSQL; SQLite readers).
    pub max_connections: u32,
}

impl std::fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreConfig")
            .field("url", &self.url)
            .field("max_connections", &self.max_connections)
            .finish()
    }
}

impl StoreConfig {
    /// A SQLite file, created if missing.
    pub fn sqlite(path: impl Into<PathBuf>, secret_key: [u8; 32]) -> StoreConfig {
        let path: PathBuf = path.into();
        StoreConfig {
            url: format!("sqlite://{}", path.display()),
            secret_key,
            max_connections: 4,
        }
    }

    /// A PostgreSQL URL.
    pub fn postgres(url: impl Into<String>, secret_key: [u8; 32]) -> StoreConfig {
        StoreConfig {
            url: url.into(),
            secret_key,
            max_connections: 10,
        }
    }
}

/// The records store. Cheap to clone; share one per process.
#[derive(Clone)]
pub struct Store {
    backend: Backend,
    /// Writes (and transactions). On SQLite a single connection: the single writer.
    writer: AnyPool,
    /// Reads. On PostgreSQL the same pool as `writer`.
    reader: AnyPool,
    cipher: webhooks::SecretBox,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("backend", &self.backend)
            .finish()
    }
}

/// The migrations of one backend, embedded in the binary, for sqlx's migrator (which keeps
/// them in `_sqlx_migrations` with their checksums and refuses an applied one that changed).
/// `sqlx::migrate!` would embed the same files through a proc macro that builds sqlx's
/// drivers, bundled SQLite included, a second time for the host; this is its one-screen
/// equivalent.
#[derive(Debug)]
struct Embedded(&'static [(i64, &'static str, &'static str)]);

impl sqlx::migrate::MigrationSource<'static> for Embedded {
    fn resolve(
        self,
    ) -> futures::future::BoxFuture<
        'static,
        std::result::Result<Vec<sqlx::migrate::Migration>, sqlx::error::BoxDynError>,
    > {
        Box::pin(async move {
            Ok(self
                .0
                .iter()
                .map(|&(version, description, sql)| {
                    sqlx::migrate::Migration::new(
                        version,
                        description.into(),
                        sqlx::migrate::MigrationType::Simple,
                        sql.into(),
                        false,
                    )
                })
                .collect())
        })
    }
}

macro_rules! migrations {
    ($dir:literal: $($version:literal $name:literal $description:literal),* $(,)?) => {
        &[$((
            $version,
            $description,
            include_str!(concat!("../migrations/", $dir, "/", $name, ".sql")),
        )),*]
    };
}

const SQLITE_MIGRATIONS: Embedded = Embedded(migrations!("sqlite":
    1 "0001_init" "init",
    2 "0002_build_memory" "build memory and parent",
    3 "0003_template_builds" "template builds, their logs, the layer cache",
    4 "0004_volumes" "volumes",
    5 "0005_secrets" "secrets",
));
const POSTGRES_MIGRATIONS: Embedded = Embedded(migrations!("postgres":
    1 "0001_init" "init",
    2 "0002_build_memory" "build memory and parent",
    3 "0003_template_builds" "template builds, their logs, the layer cache",
    4 "0004_volumes" "volumes",
    5 "0005_secrets" "secrets",
));

/// Serializes concurrent migrations of several `vmon api` replicas on PostgreSQL.
const MIGRATION_LOCK: i64 = 0x766d_6f6e_0001;

impl Store {
    /// Connects and applies pending migrations.
    pub async fn open(config: &StoreConfig) -> Result<Store> {
        sqlx::any::install_default_drivers();
        let backend = if config.url.starts_with("sqlite:") {
            Backend::Sqlite
        } else if config.url.starts_with("postgres:") || config.url.starts_with("postgresql:") {
            Backend::Postgres
        } else {
            return Err(StoreError::InvalidArgument(format!(
                "unsupported store URL {:?}",
                config.url
            )));
        };
        let (writer, reader) = match backend {
            Backend::Sqlite => {
                let url = if config.url.contains('?') {
                    config.url.clone()
                } else {
                    format!("{}?mode=rwc", config.url)
                };
                let options = AnyConnectOptions::from_str(&url)?.disable_statement_logging();
                let pool = |max: u32| {
                    AnyPoolOptions::new()
                        .max_connections(max)
                        .acquire_timeout(Duration::from_secs(30))
                        .after_connect(|conn, _| {
                            Box::pin(async move {
                                conn.execute(
                                    "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; \
                                     PRAGMA busy_timeout=10000; PRAGMA foreign_keys=ON;",
                                )
                                .await?;
                                Ok(())
                            })
                        })
                };
                let writer = pool(1).connect_with(options.clone()).await?;
                // Create the file and schema with the writer before readers open it.
                migrate(&writer, backend).await?;
                let reader = pool(config.max_connections.max(1))
                    .connect_with(options)
                    .await?;
                (writer, reader)
            }
            Backend::Postgres => {
                let options = AnyConnectOptions::from_str(&config.url)?.disable_statement_logging();
                let pool = AnyPoolOptions::new()
                    .max_connections(config.max_connections.max(2))
                    .acquire_timeout(ACQUIRE_TIMEOUT)
                    .test_before_acquire(true)
                    .connect_with(options)
                    .await?;
                migrate(&pool, backend).await?;
                (pool.clone(), pool)
            }
        };
        Ok(Store {
            backend,
            writer,
            reader,
            cipher: webhooks::SecretBox::new(&config.secret_key),
        })
    }

    /// The database behind this store.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Starts a transaction: everything done through it commits together.
    pub async fn begin(&self) -> Result<StoreTx> {
        let tx = self.writer.begin().await?;
        Ok(StoreTx::new(tx, self.backend))
    }

    /// Closes every connection.
    pub async fn close(&self) {
        self.writer.close().await;
        self.reader.close().await;
    }
}

async fn migrate(pool: &AnyPool, backend: Backend) -> Result<()> {
    let mut conn = pool.acquire().await?;
    if backend == Backend::Postgres {
        sqlx::raw_sql(&format!(
            "DO $$ BEGIN PERFORM pg_advisory_lock({MIGRATION_LOCK}); END $$"
        ))
        .execute(&mut *conn)
        .await?;
    }
    let result = apply_migrations(&mut conn, backend).await;
    if backend == Backend::Postgres {
        sqlx::raw_sql(&format!(
            "DO $$ BEGIN PERFORM pg_advisory_unlock({MIGRATION_LOCK}); END $$"
        ))
        .execute(&mut *conn)
        .await?;
    }
    result
}

async fn apply_migrations(conn: &mut sqlx::AnyConnection, backend: Backend) -> Result<()> {
    let source = match backend {
        Backend::Sqlite => SQLITE_MIGRATIONS,
        Backend::Postgres => POSTGRES_MIGRATIONS,
    };
    let mut migrator = sqlx::migrate::Migrator::new(source).await?;
    // An older binary starts on a schema a newer one extended (a rolling upgrade), as before.
    migrator.set_ignore_missing(true);
    adopt_vmon_migrations(conn, backend, &migrator).await?;
    migrator.run_direct(&mut *conn).await?;
    Ok(())
}

/// Databases migrated before sqlx's runner recorded their versions in `vmon_migrations`
/// (version, description, applied_at): those versions are entered into `_sqlx_migrations`
/// with the checksums of the embedded files (the files are the ones that were applied), once,
/// so that the migrator applies only what is newer. `vmon_migrations` stays, unwritten, so
/// an older binary still starts during a rolling upgrade.
async fn adopt_vmon_migrations(
    conn: &mut sqlx::AnyConnection,
    backend: Backend,
    migrator: &sqlx::migrate::Migrator,
) -> Result<()> {
    use sqlx::migrate::Migrate;
    use sqlx::{Connection, Row};
    let exists = match backend {
        Backend::Sqlite => {
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'vmon_migrations'"
        }
        Backend::Postgres => {
            "SELECT count(*) FROM information_schema.tables \
             WHERE table_schema = current_schema() AND table_name = 'vmon_migrations'"
        }
    };
    let n: i64 = sqlx::query(exists)
        .fetch_one(&mut *conn)
        .await?
        .try_get(0)?;
    if n == 0 {
        return Ok(());
    }
    conn.ensure_migrations_table().await?;
    let known: Vec<i64> = conn
        .list_applied_migrations()
        .await?
        .iter()
        .map(|m| m.version)
        .collect();
    let old: Vec<i64> = sqlx::query("SELECT version FROM vmon_migrations")
        .fetch_all(&mut *conn)
        .await?
        .iter()
        .map(|row| row.try_get::<i64, _>(0))
        .collect::<Result<_, _>>()?;
    let mut tx = conn.begin().await?;
    for m in migrator.iter().filter(|m| old.contains(&m.version)) {
        if known.contains(&m.version) {
            continue;
        }
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES ($1, $2, TRUE, $3, 0)",
        )
        .bind(m.version)
        .bind(m.description.to_string())
        .bind(m.checksum.to_vec())
        .execute(&mut *tx)
        .await?;
        tracing::info!(
            version = m.version,
            "store migration adopted from vmon_migrations"
        );
    }
    tx.commit().await?;
    Ok(())
}
