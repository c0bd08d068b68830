//! Databases migrated by the runner before sqlx's (versions in `vmon_migrations`) open under
//! sqlx's migrator on both backends: the versions they have are adopted, only newer
//! migrations run, a second open applies nothing, and an applied migration that changed is
//! refused.

#![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

mod support;

use std::collections::BTreeMap;

use sqlx::{Connection, Row};
use vmon_store::*;

const SQLITE: &[(i64, &str)] = &[
    (1, include_str!("../migrations/sqlite/0001_init.sql")),
    (
        2,
        include_str!("../migrations/sqlite/0002_build_memory.sql"),
    ),
    (
        3,
        include_str!("../migrations/sqlite/0003_template_builds.sql"),
    ),
    (4, include_str!("../migrations/sqlite/0004_volumes.sql")),
];
const POSTGRES: &[(i64, &str)] = &[
    (1, include_str!("../migrations/postgres/0001_init.sql")),
    (
        2,
        include_str!("../migrations/postgres/0002_build_memory.sql"),
    ),
    (
        3,
        include_str!("../migrations/postgres/0003_template_builds.sql"),
    ),
    (4, include_str!("../migrations/postgres/0004_volumes.sql")),
];

async fn connect(url: &str) -> sqlx::AnyConnection {
    sqlx::any::install_default_drivers();
    sqlx::AnyConnection::connect(url).await.unwrap()
}

/// What the runner before sqlx's did: each file in a transaction, its version recorded in
/// `vmon_migrations`.
async fn migrate_the_old_way(url: &str, files: &[(i64, &str)]) {
    let mut conn = connect(url).await;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS vmon_migrations (version BIGINT PRIMARY KEY, \
         description TEXT NOT NULL, applied_at BIGINT NOT NULL)",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    for (version, sql) in files {
        let mut tx = conn.begin().await.unwrap();
        sqlx::raw_sql(sql).execute(&mut *tx).await.unwrap();
        sqlx::query(
            "INSERT INTO vmon_migrations (version, description, applied_at) VALUES ($1, $2, $3)",
        )
        .bind(*version)
        .bind("old")
        .bind(0i64)
        .execute(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    conn.close().await.unwrap();
}

async fn sqlx_versions(url: &str) -> Vec<(i64, bool)> {
    let mut conn = connect(url).await;
    let rows = sqlx::query(
        "SELECT version, CAST(success AS INTEGER) FROM _sqlx_migrations ORDER BY version",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    rows.iter()
        .map(|r| (r.get::<i64, _>(0), r.get::<i32, _>(1) == 1))
        .collect()
}

async fn the_old_runners_databases_open(config: StoreConfig, url: &str, files: &[(i64, &str)]) {
    migrate_the_old_way(url, files).await;
    // Re-running 0001..0004 would fail (their tables exist): only 0005 (secrets) may run.
    let store = Store::open(&config).await.unwrap();
    store
        .create_team(&NewTeam {
            id: "t1".into(),
            name: "T".into(),
            slug: "t".into(),
            limits: TeamLimits {
                max_concurrent_sandboxes: 1,
                max_vcpus: 1,
                max_memory_mb: 512,
                max_disk_mb: 1024,
                max_lifetime_secs: 60,
            },
        })
        .await
        .unwrap();
    store
        .create_secret(&NewSecret {
            id: "sec_1".into(),
            team_id: "t1".into(),
            name: "k".into(),
            value: "v".into(),
            metadata: BTreeMap::new(),
        })
        .await
        .unwrap();
    store.close().await;
    let all: Vec<(i64, bool)> = (1..=5).map(|v| (v, true)).collect();
    assert_eq!(sqlx_versions(url).await, all);

    // Opening again applies and adopts nothing; the data is there.
    let store = Store::open(&config).await.unwrap();
    assert_eq!(
        store.secret_value("t1", "sec_1").await.unwrap().as_deref(),
        Some("v")
    );
    store.close().await;
    assert_eq!(sqlx_versions(url).await, all);

    // An applied migration whose file changed is refused, not silently skipped.
    let mut conn = connect(url).await;
    sqlx::query("UPDATE _sqlx_migrations SET checksum = $1 WHERE version = 1")
        .bind(vec![0u8; 48])
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    match Store::open(&config).await {
        Err(StoreError::Migrate(_)) => {}
        other => panic!("a changed migration must be refused: {other:?}"),
    }
}

#[tokio::test]
async fn sqlite_databases_of_the_old_runner_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vmon.db");
    let config = StoreConfig::sqlite(path.clone(), support::KEY);
    let url = format!("sqlite://{}?mode=rwc", path.display());
    the_old_runners_databases_open(config, &url, SQLITE).await;
}

#[tokio::test]
async fn postgres_databases_of_the_old_runner_open() {
    let pg = support::Postgres::start(false).await;
    let config = StoreConfig::postgres(pg.url(), support::KEY);
    the_old_runners_databases_open(config, &pg.url(), POSTGRES).await;
}
