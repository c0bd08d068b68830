//! One conformance suite, run against both backends: SQLite (a file in a temp dir) and
//! PostgreSQL 15 (a cluster the test starts). Every test gets a fresh database.

#![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde_json::json;
use time::OffsetDateTime;
use vmon_store::*;

pub fn team(id: &str) -> NewTeam {
    NewTeam {
        id: id.to_owned(),
        name: format!("Team {id}"),
        slug: format!("{id}-slug"),
        limits: TeamLimits {
            max_concurrent_sandboxes: 20,
            max_vcpus: 8,
            max_memory_mb: 8192,
            max_disk_mb: 20480,
            max_lifetime_secs: 86400,
        },
    }
}

pub fn sandbox(id: &str, team: &str, started_at: OffsetDateTime) -> SandboxRecord {
    SandboxRecord {
        sandbox_id: id.to_owned(),
        team_id: team.to_owned(),
        execution_id: format!("{id}-e1"),
        template_id: "base".to_owned(),
        build_id: "b1".to_owned(),
        paused_build_id: None,
        alias: Some("base".to_owned()),
        state: SandboxState::Running,
        node_id: Some("node-a".to_owned()),
        pause_mode: None,
        vcpus: 2,
        memory_mb: 512,
        disk_mb: 2048,
        envd_version: "0.2.0".to_owned(),
        metadata: BTreeMap::new(),
        env_vars: BTreeMap::from([("FOO".to_owned(), "bar".to_owned())]),
        network: Some(json!({"allowPublicTraffic": true, "allowOut": ["1.1.1.1"]})),
        auto_pause: true,
        auto_pause_memory: true,
        auto_resume: false,
        timeout_secs: 300,
        started_at,
        end_at: started_at + time::Duration::seconds(300),
        envd_access_token: Some("tok".to_owned()),
        traffic_access_token: None,
        extra: json!({"volumeMounts": []}),
        fence: 0,
    }
}

pub fn event(kind: &str, s: &SandboxRecord, at: OffsetDateTime) -> NewEvent {
    NewEvent {
        event_type: kind.to_owned(),
        event_data: Some(json!({"sandbox_metadata": s.metadata})),
        sandbox_id: s.sandbox_id.clone(),
        execution_id: s.execution_id.clone(),
        build_id: s.build_id.clone(),
        team_id: s.team_id.clone(),
        template_id: s.template_id.clone(),
        timestamp: at,
    }
}

fn now() -> OffsetDateTime {
    // Millisecond precision, as stored.
    let t = OffsetDateTime::now_utc();
    OffsetDateTime::from_unix_timestamp_nanos(t.unix_timestamp_nanos() / 1_000_000 * 1_000_000)
        .unwrap()
}

pub async fn teams_and_keys(b: &support::Backend) {
    let store = &b.store;
    let t = store.create_team(&team("t1")).await.unwrap();
    assert_eq!(store.team("t1").await.unwrap().unwrap(), t);
    assert_eq!(
        store.team_by_slug("t1-slug").await.unwrap().unwrap().id,
        "t1"
    );
    let mut dup = team("t2");
    dup.slug = "t1-slug".to_owned();
    assert!(matches!(
        store.create_team(&dup).await,
        Err(StoreError::Conflict(_))
    ));

    let raw = "e2b_0123456789abcdef0123456789abcdef";
    let key = store.create_api_key("t1", "ci", raw).await.unwrap();
    assert!(
        !key.mask.contains("0123456789abcdef0123"),
        "the mask must not reveal the key"
    );
    assert_eq!(store.api_key_by_raw(raw).await.unwrap().unwrap().id, key.id);
    assert_eq!(
        store
            .api_key_by_hash(&hash_api_key(raw))
            .await
            .unwrap()
            .unwrap()
            .team_id,
        "t1"
    );
    assert_eq!(store.api_key_by_raw("e2b_wrong").await.unwrap(), None);
    assert_eq!(store.api_keys("t1").await.unwrap().len(), 1);
    assert!(store.revoke_api_key("t1", &key.id).await.unwrap());
    assert!(!store.revoke_api_key("t1", &key.id).await.unwrap());
    assert_eq!(store.api_key_by_raw(raw).await.unwrap(), None);
    assert!(store.api_keys("t1").await.unwrap()[0].revoked_at.is_some());

    let mut limits = t.limits.clone();
    limits.max_concurrent_sandboxes = 3;
    assert!(store.set_team_limits("t1", &limits).await.unwrap());
    assert_eq!(
        store
            .team("t1")
            .await
            .unwrap()
            .unwrap()
            .limits
            .max_concurrent_sandboxes,
        3
    );
}

fn build(id: &str, template: &str, vcpus: i64) -> NewBuild {
    NewBuild {
        id: id.to_owned(),
        template_id: template.to_owned(),
        status: BuildStatus::Ready,
        vcpus,
        memory_mb: 512,
        disk_mb: 2048,
        envd_version: "0.2.0".to_owned(),
        node_id: Some("node-a".to_owned()),
        has_memory: true,
        parent_build_id: None,
    }
}

/// What the api needs to rebuild its template records: memory flag and parent on builds,
/// tags with their builds, lookup by alias, removal of one tag, keys by id.
pub async fn builds_tags_and_aliases(b: &support::Backend) {
    let store = &b.store;
    store.create_team(&team("t1")).await.unwrap();
    store
        .create_template(&NewTemplate {
            id: "tpl-snap".to_owned(),
            team_id: Some("t1".to_owned()),
            kind: TemplateKind::Snapshot,
            source_sandbox_id: Some("isbx1".to_owned()),
            public: false,
        })
        .await
        .unwrap();
    store.add_alias("tpl-snap", "t1-slug/snap").await.unwrap();
    let mut disk_only = build("b-disk", "tpl-snap", 2);
    disk_only.has_memory = false;
    disk_only.parent_build_id = Some("b-parent".to_owned());
    let mut tx = store.begin().await.unwrap();
    let created = tx.create_build(&disk_only).await.unwrap();
    assert!(!created.has_memory);
    tx.create_build(&build("b-mem", "tpl-snap", 2))
        .await
        .unwrap();
    tx.set_tag("tpl-snap", "v1", "b-disk").await.unwrap();
    tx.set_tag("tpl-snap", "v2", "b-mem").await.unwrap();
    assert_eq!(
        tx.build("b-disk")
            .await
            .unwrap()
            .unwrap()
            .parent_build_id
            .as_deref(),
        Some("b-parent")
    );
    assert_eq!(
        tx.template("tpl-snap").await.unwrap().unwrap().aliases,
        ["t1-slug/snap"]
    );
    assert_eq!(tx.tagged_builds("tpl-snap").await.unwrap().len(), 2);
    tx.commit().await.unwrap();

    let b_disk = store.build("b-disk").await.unwrap().unwrap();
    assert_eq!(
        (b_disk.has_memory, b_disk.parent_build_id.as_deref()),
        (false, Some("b-parent"))
    );
    assert!(store.build("b-mem").await.unwrap().unwrap().has_memory);
    let tags: Vec<(String, String, bool)> = store
        .tagged_builds("tpl-snap")
        .await
        .unwrap()
        .into_iter()
        .map(|(t, b)| (t, b.id, b.has_memory))
        .collect();
    assert_eq!(
        tags,
        [
            ("v1".to_owned(), "b-disk".to_owned(), false),
            ("v2".to_owned(), "b-mem".to_owned(), true)
        ]
    );
    assert_eq!(
        store
            .template_by_alias("t1-slug/snap")
            .await
            .unwrap()
            .unwrap()
            .id,
        "tpl-snap"
    );
    assert_eq!(store.template_by_alias("snap").await.unwrap(), None);
    assert!(store.remove_tag("tpl-snap", "v1").await.unwrap());
    assert!(!store.remove_tag("tpl-snap", "v1").await.unwrap());
    assert_eq!(store.tagged_builds("tpl-snap").await.unwrap().len(), 1);
    assert!(store.delete_template("tpl-snap").await.unwrap());
    assert_eq!(store.template_by_alias("t1-slug/snap").await.unwrap(), None);

    let key = store
        .create_api_key("t1", "ci", "e2b_0123456789abcdef")
        .await
        .unwrap();
    assert_eq!(store.api_key(&key.id).await.unwrap().unwrap().team_id, "t1");
    assert_eq!(store.api_key("nope").await.unwrap(), None);
}

pub async fn templates_and_snapshots(b: &support::Backend) {
    let store = &b.store;
    store.create_team(&team("t1")).await.unwrap();
    let base = NewTemplate {
        id: "tpl-base".to_owned(),
        team_id: None,
        kind: TemplateKind::Template,
        source_sandbox_id: None,
        public: true,
    };
    store.create_template(&base).await.unwrap();
    store.add_alias("tpl-base", "base").await.unwrap();
    store
        .create_build(&build("b-old", "tpl-base", 1))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    store
        .create_build(&build("b-new", "tpl-base", 2))
        .await
        .unwrap();
    let r = store.resolve_template("base").await.unwrap().unwrap();
    assert_eq!(
        (r.template.id.as_str(), r.build.id.as_str(), r.tag.as_str()),
        ("tpl-base", "b-new", "default")
    );
    assert_eq!(
        store
            .resolve_template("tpl-base")
            .await
            .unwrap()
            .unwrap()
            .build
            .id,
        "b-new"
    );
    assert_eq!(store.resolve_template("base:nope").await.unwrap(), None);
    assert_eq!(store.resolve_template("missing").await.unwrap(), None);
    assert!(matches!(
        store.add_alias("tpl-base", "base").await,
        Err(StoreError::Conflict(_))
    ));

    // A named snapshot: `slug/alias:tag`; a new build under an existing tag replaces it.
    let mut tx = store.begin().await.unwrap();
    tx.create_template(&NewTemplate {
        id: "tpl-snap".to_owned(),
        team_id: Some("t1".to_owned()),
        kind: TemplateKind::Snapshot,
        source_sandbox_id: Some("isbx1".to_owned()),
        public: false,
    })
    .await
    .unwrap();
    tx.add_alias("tpl-snap", "t1-slug/my-snap").await.unwrap();
    tx.create_build(&build("b-s1", "tpl-snap", 2))
        .await
        .unwrap();
    tx.set_tag("tpl-snap", "v1", "b-s1").await.unwrap();
    tx.commit().await.unwrap();
    store
        .create_build(&build("b-s2", "tpl-snap", 2))
        .await
        .unwrap();
    store.set_tag("tpl-snap", "v1", "b-s2").await.unwrap();
    let r = store
        .resolve_template("t1-slug/my-snap:v1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (r.template.kind, r.build.id.as_str()),
        (TemplateKind::Snapshot, "b-s2")
    );
    assert_eq!(
        store.template_names("tpl-snap").await.unwrap(),
        ["t1-slug/my-snap:v1"]
    );

    // An unnamed snapshot and a hidden fork template.
    for (id, kind) in [
        ("tpl-anon", TemplateKind::Snapshot),
        ("tpl-fork", TemplateKind::ForkHidden),
    ] {
        store
            .create_template(&NewTemplate {
                id: id.to_owned(),
                team_id: Some("t1".to_owned()),
                kind,
                source_sandbox_id: Some("isbx2".to_owned()),
                public: false,
            })
            .await
            .unwrap();
    }
    let all = store
        .snapshots(&SnapshotQuery {
            team_id: "t1".to_owned(),
            ..Default::default()
        })
        .await
        .unwrap();
    let ids: Vec<&str> = all.items.iter().map(|s| s.snapshot_id.as_str()).collect();
    assert_eq!(
        ids,
        ["tpl-anon:default", "t1-slug/my-snap:v1"],
        "newest first, forks hidden"
    );
    let by_sandbox = store
        .snapshots(&SnapshotQuery {
            team_id: "t1".to_owned(),
            sandbox_id: Some("isbx1".to_owned()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(by_sandbox.items.len(), 1);
    let by_name = store
        .snapshots(&SnapshotQuery {
            team_id: "t1".to_owned(),
            name: Some("t1-slug/my-snap:v1".to_owned()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(by_name.items[0].template_id, "tpl-snap");
    let first = store
        .snapshots(&SnapshotQuery {
            team_id: "t1".to_owned(),
            limit: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(first.items.len(), 1);
    let rest = store
        .snapshots(&SnapshotQuery {
            team_id: "t1".to_owned(),
            limit: 1,
            cursor: first.next_cursor,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        (rest.items[0].template_id.as_str(), rest.next_cursor),
        ("tpl-snap", None)
    );

    // Deleting frees the name at once; builds stay for their users.
    assert!(store.delete_template("tpl-snap").await.unwrap());
    assert_eq!(
        store.resolve_template("t1-slug/my-snap:v1").await.unwrap(),
        None
    );
    assert!(store.build("b-s2").await.unwrap().is_some());
    store
        .add_alias("tpl-anon", "t1-slug/my-snap")
        .await
        .unwrap();
    assert_eq!(
        store.templates("t1", true).await.unwrap().len(),
        1,
        "only kind=template is listed"
    );
}

pub async fn sandbox_records_and_listing(b: &support::Backend) {
    let store = &b.store;
    let t0 = now() - time::Duration::hours(1);
    for i in 0..25 {
        let mut s = sandbox(
            &format!("isbx{i:02}"),
            if i < 20 { "t1" } else { "t2" },
            t0 + time::Duration::seconds(i),
        );
        s.metadata.insert("job".to_owned(), (i % 3).to_string());
        s.metadata
            .insert("even".to_owned(), (i % 2 == 0).to_string());
        if i % 4 == 0 {
            s.state = SandboxState::Paused;
            s.pause_mode = Some(PauseMode::Filesystem);
            s.paused_build_id = Some(format!("pb{i}"));
        }
        if i == 7 {
            s.template_id = "other".to_owned();
        }
        store.insert_sandbox(&s).await.unwrap();
    }
    let s3 = store.sandbox("isbx03").await.unwrap().unwrap();
    let mut expected = sandbox("isbx03", "t1", t0 + time::Duration::seconds(3));
    expected.metadata =
        BTreeMap::from([("job".into(), "0".into()), ("even".into(), "false".into())]);
    assert_eq!(s3, expected, "a record reads back as written");
    assert!(matches!(
        store.insert_sandbox(&expected).await,
        Err(StoreError::Conflict(_))
    ));

    let q = |f: &dyn Fn(&mut SandboxQuery)| {
        let mut q = SandboxQuery {
            team_id: "t1".to_owned(),
            ..Default::default()
        };
        f(&mut q);
        q
    };
    let ids = |p: &Page<SandboxRecord>| {
        p.items
            .iter()
            .map(|s| s.sandbox_id.clone())
            .collect::<Vec<_>>()
    };
    let all = store.sandboxes(&q(&|_| {})).await.unwrap();
    assert_eq!(all.items.len(), 20);
    assert_eq!(all.items[0].sandbox_id, "isbx19", "newest first by default");
    let paused = store
        .sandboxes(&q(&|q| q.states = vec![SandboxState::Paused]))
        .await
        .unwrap();
    assert_eq!(
        ids(&paused),
        ["isbx16", "isbx12", "isbx08", "isbx04", "isbx00"]
    );
    let meta = store
        .sandboxes(&q(&|q| {
            q.metadata = vec![("job".into(), "1".into()), ("even".into(), "true".into())]
        }))
        .await
        .unwrap();
    assert_eq!(ids(&meta), ["isbx16", "isbx10", "isbx04"]);
    let tpl = store
        .sandboxes(&q(&|q| q.template_id = Some("other".into())))
        .await
        .unwrap();
    assert_eq!(ids(&tpl), ["isbx07"]);
    let after = store
        .sandboxes(&q(&|q| {
            q.started_after = Some(t0 + time::Duration::seconds(17))
        }))
        .await
        .unwrap();
    assert_eq!(ids(&after), ["isbx19", "isbx18"]);

    // Paging in both orders visits every record once.
    for order in [Order::Asc, Order::Desc] {
        let mut seen = Vec::new();
        let mut cursor = None;
        loop {
            let page = store
                .sandboxes(&q(&|q| {
                    q.order = order;
                    q.limit = 6;
                    q.cursor = cursor.clone();
                }))
                .await
                .unwrap();
            seen.extend(ids(&page));
            cursor = page.next_cursor;
            if cursor.is_none() {
                break;
            }
        }
        let mut expected: Vec<String> = (0..20).map(|i| format!("isbx{i:02}")).collect();
        if order == Order::Desc {
            expected.reverse();
        }
        assert_eq!(seen, expected, "{order:?}");
    }
    assert_eq!(
        store
            .count_sandboxes("t1", SandboxState::Running)
            .await
            .unwrap(),
        15
    );
    assert_eq!(
        store
            .count_sandboxes("t1", SandboxState::Paused)
            .await
            .unwrap(),
        5
    );
    let expired = store.expired_sandboxes(now(), 100).await.unwrap();
    assert!(expired.iter().all(|s| s.state == SandboxState::Running));
    assert_eq!(
        expired.len(),
        18,
        "started an hour ago with 300 s timeouts, all 18 running ones have ended"
    );
}

pub async fn transition_commits_with_event(b: &support::Backend) {
    let store = &b.store;
    let s = sandbox("isbx1", "t1", now());
    let mut tx = store.begin().await.unwrap();
    tx.insert_sandbox(&s).await.unwrap();
    tx.append_event(&event(event_types::CREATED, &s, now()))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // Pause: state change + event in one transaction, invisible until commit.
    let events_of = |store: &Store| {
        let store = store.clone();
        async move {
            store
                .events(&EventQuery {
                    team_id: "t1".into(),
                    sandbox_id: Some("isbx1".into()),
                    limit: 100,
                    ..Default::default()
                })
                .await
                .unwrap()
        }
    };
    let mut tx = store.begin().await.unwrap();
    assert!(tx
        .set_sandbox_state(
            "isbx1",
            "isbx1-e1",
            &[SandboxState::Running],
            SandboxState::Paused,
            5
        )
        .await
        .unwrap());
    tx.append_event(&event(event_types::PAUSED, &s, now()))
        .await
        .unwrap();
    assert_eq!(
        tx.sandbox("isbx1").await.unwrap().unwrap().state,
        SandboxState::Paused,
        "the tx sees itself"
    );
    if store.backend() == Backend::Postgres {
        // (SQLite readers would see the same; PostgreSQL is the one with concurrent writers.)
        assert_eq!(
            store.sandbox("isbx1").await.unwrap().unwrap().state,
            SandboxState::Running
        );
        assert_eq!(events_of(store).await.len(), 1);
    } else {
        assert_eq!(
            store.sandbox("isbx1").await.unwrap().unwrap().state,
            SandboxState::Running
        );
        assert_eq!(events_of(store).await.len(), 1);
    }
    tx.commit().await.unwrap();
    assert_eq!(
        store.sandbox("isbx1").await.unwrap().unwrap().state,
        SandboxState::Paused
    );
    let events = events_of(store).await;
    assert_eq!(
        events
            .iter()
            .map(|e| e.event_type.as_str())
            .collect::<Vec<_>>(),
        [event_types::PAUSED, event_types::CREATED]
    );

    // A failed operation rolls back both halves.
    let mut tx = store.begin().await.unwrap();
    assert!(tx
        .set_sandbox_state("isbx1", "isbx1-e1", &[], SandboxState::Resuming, 6)
        .await
        .unwrap());
    tx.append_event(&event(event_types::RESUMED, &s, now()))
        .await
        .unwrap();
    drop(tx);
    assert_eq!(
        store.sandbox("isbx1").await.unwrap().unwrap().state,
        SandboxState::Paused
    );
    assert_eq!(events_of(store).await.len(), 2);

    // Stale operations touch nothing: a wrong state, an old execution, an older fence.
    let mut tx = store.begin().await.unwrap();
    assert!(!tx
        .set_sandbox_state(
            "isbx1",
            "isbx1-e1",
            &[SandboxState::Running],
            SandboxState::Pausing,
            9
        )
        .await
        .unwrap());
    assert!(!tx
        .set_sandbox_state("isbx1", "old-exec", &[], SandboxState::Running, 9)
        .await
        .unwrap());
    assert!(!tx
        .set_sandbox_state("isbx1", "isbx1-e1", &[], SandboxState::Running, 4)
        .await
        .unwrap());
    // Resume: a new execution id, written under fence 7.
    let mut resumed = tx.sandbox("isbx1").await.unwrap().unwrap();
    resumed.execution_id = "isbx1-e2".into();
    resumed.state = SandboxState::Running;
    resumed.metadata.insert("k".into(), "v".into());
    assert!(tx.update_sandbox(&resumed, "isbx1-e1", 7).await.unwrap());
    assert!(
        !tx.update_sandbox(&resumed, "isbx1-e1", 8).await.unwrap(),
        "the old execution is gone"
    );
    tx.commit().await.unwrap();
    let now_record = store.sandbox("isbx1").await.unwrap().unwrap();
    assert_eq!(
        (now_record.execution_id.as_str(), now_record.fence),
        ("isbx1-e2", 7)
    );
    let with_k = store
        .sandboxes(&SandboxQuery {
            team_id: "t1".into(),
            metadata: vec![("k".into(), "v".into())],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(with_k.items.len(), 1);

    // Kill: the record goes, the events stay.
    let mut tx = store.begin().await.unwrap();
    assert!(tx.delete_sandbox("isbx1", "isbx1-e2", 8).await.unwrap());
    tx.append_event(&event(event_types::KILLED, &resumed, now()))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(store.sandbox("isbx1").await.unwrap(), None);
    assert_eq!(events_of(store).await.len(), 3);
}

pub async fn events_query_and_retention(b: &support::Backend) {
    let store = &b.store;
    let t = now();
    let s1 = sandbox("isbx1", "t1", t);
    let s2 = sandbox("isbx2", "t1", t);
    let other = sandbox("isbx3", "t2", t);
    let old = t - time::Duration::days(31);
    store
        .append_event(&event(event_types::CREATED, &s1, old))
        .await
        .unwrap();
    store
        .append_event(&event(
            event_types::CREATED,
            &s1,
            t - time::Duration::days(29),
        ))
        .await
        .unwrap();
    for i in 0..5 {
        let kind = if i % 2 == 0 {
            event_types::UPDATED
        } else {
            event_types::PAUSED
        };
        store
            .append_event(&event(kind, &s1, t + time::Duration::seconds(i)))
            .await
            .unwrap();
    }
    store
        .append_event(&event(event_types::CREATED, &s2, t))
        .await
        .unwrap();
    store
        .append_event(&event(event_types::CREATED, &other, t))
        .await
        .unwrap();
    let q = |f: &dyn Fn(&mut EventQuery)| {
        let mut q = EventQuery {
            team_id: "t1".into(),
            limit: 100,
            ..Default::default()
        };
        f(&mut q);
        q
    };
    assert_eq!(store.events(&q(&|_| {})).await.unwrap().len(), 8);
    let s1_events = store
        .events(&q(&|q| q.sandbox_id = Some("isbx1".into())))
        .await
        .unwrap();
    assert_eq!(s1_events.len(), 7);
    assert!(
        s1_events
            .windows(2)
            .all(|w| w[0].timestamp >= w[1].timestamp),
        "newest first"
    );
    let asc = store
        .events(&q(&|q| {
            q.sandbox_id = Some("isbx1".into());
            q.order_asc = true;
            q.offset = 1;
            q.limit = 2;
        }))
        .await
        .unwrap();
    assert_eq!(asc.len(), 2);
    assert_eq!(asc[0].timestamp, t - time::Duration::days(29));
    let typed = store
        .events(&q(&|q| q.types = vec![event_types::PAUSED.into()]))
        .await
        .unwrap();
    assert_eq!(typed.len(), 2);
    let first = &s1_events[0];
    assert_eq!(store.event(first.id).await.unwrap().unwrap(), *first);
    assert_eq!(first.event_data, Some(json!({"sandbox_metadata": {}})));

    assert_eq!(
        store.run_retention(now()).await.unwrap(),
        1,
        "only the 31-day-old event goes"
    );
    assert_eq!(store.events(&q(&|_| {})).await.unwrap().len(), 7);
}

pub async fn webhooks_and_deliveries(b: &support::Backend) {
    let store = &b.store;
    let hook = store
        .create_webhook(&NewWebhook {
            id: "wh1".into(),
            team_id: "t1".into(),
            name: "lifecycle".into(),
            url: "https://hooks.example.com/e2b".into(),
            enabled: true,
            events: vec![event_types::CREATED.into(), event_types::KILLED.into()],
            signature_secret: "s3cret-value-xyz".into(),
        })
        .await
        .unwrap();
    assert_eq!(store.webhook("t1", "wh1").await.unwrap().unwrap(), hook);
    assert_eq!(
        store.webhook("t2", "wh1").await.unwrap(),
        None,
        "scoped by team"
    );
    assert_eq!(
        store.webhooks("t1").await.unwrap(),
        std::slice::from_ref(&hook)
    );
    assert_eq!(
        store.webhook_secret("wh1").await.unwrap().unwrap(),
        "s3cret-value-xyz"
    );

    // A store with another key cannot read the secret.
    let mut wrong = b.config.clone();
    wrong.secret_key = [9; 32];
    let wrong = Store::open(&wrong).await.unwrap();
    assert!(matches!(
        wrong.webhook_secret("wh1").await,
        Err(StoreError::Crypto)
    ));
    wrong.close().await;

    let patched = store
        .update_webhook(
            "t1",
            "wh1",
            &WebhookPatch {
                enabled: Some(false),
                signature_secret: Some("rotated".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap()
        .unwrap();
    assert!(!patched.enabled);
    assert_eq!(patched.url, hook.url);
    assert_eq!(
        store.webhook_secret("wh1").await.unwrap().unwrap(),
        "rotated"
    );
    assert_eq!(
        store
            .update_webhook("t2", "wh1", &WebhookPatch::default())
            .await
            .unwrap(),
        None
    );

    let event_id = uuid::Uuid::new_v4();
    let t = now();
    for (attempt, ok) in [(1, false), (2, false), (3, true)] {
        store
            .record_delivery(&DeliveryAttempt {
                webhook_id: "wh1".into(),
                event_id,
                delivery_id: "d1".into(),
                attempt,
                status_code: Some(if ok { 200 } else { 502 }),
                success: ok,
                duration_ms: attempt * 10,
                error: (!ok).then(|| "bad gateway".to_owned()),
                at: t + time::Duration::milliseconds(attempt),
            })
            .await
            .unwrap();
    }
    let deliveries = store.deliveries("wh1", 10, 0).await.unwrap();
    assert_eq!(
        deliveries.iter().map(|d| d.attempt).collect::<Vec<_>>(),
        [3, 2, 1]
    );
    let stats = store.webhook_stats("wh1").await.unwrap();
    assert_eq!(
        (
            stats.attempts,
            stats.successes,
            stats.failures,
            stats.average_duration_ms
        ),
        (3, 1, 2, 20)
    );
    assert_eq!(
        stats.last_success_at,
        Some(t + time::Duration::milliseconds(3))
    );
    assert_eq!(
        stats.last_failure_at,
        Some(t + time::Duration::milliseconds(2))
    );
    assert_eq!(
        store.webhook_stats("none").await.unwrap(),
        WebhookStats::default()
    );

    assert!(store.delete_webhook("t1", "wh1").await.unwrap());
    assert!(!store.delete_webhook("t1", "wh1").await.unwrap());
    assert!(store.deliveries("wh1", 10, 0).await.unwrap().is_empty());
}

async fn subscribed_hook(store: &Store, id: &str, team: &str, events: &[&str]) {
    store
        .create_webhook(&NewWebhook {
            id: id.into(),
            team_id: team.into(),
            name: id.into(),
            url: "http://127.0.0.1:9/hook".into(),
            enabled: true,
            events: events.iter().map(|e| e.to_string()).collect(),
            signature_secret: "s".into(),
        })
        .await
        .unwrap();
}

pub async fn outbox_exactly_once(b: &support::Backend) {
    const EVENTS: usize = 120;
    let store = &b.store;
    subscribed_hook(store, "wh-created", "t1", &[event_types::CREATED]).await;
    subscribed_hook(store, "wh-all", "t1", &event_types::ALL).await;
    subscribed_hook(store, "wh-other-team", "t2", &event_types::ALL).await;
    let s = sandbox("isbx1", "t1", now());
    for i in 0..EVENTS {
        let kind = if i % 2 == 0 {
            event_types::CREATED
        } else {
            event_types::PAUSED
        };
        store.append_event(&event(kind, &s, now())).await.unwrap();
    }
    let expected = EVENTS + EVENTS / 2;
    assert_eq!(
        store.webhook_stats("wh-all").await.unwrap().pending,
        EVENTS as i64
    );
    assert_eq!(
        store.webhook_stats("wh-created").await.unwrap().pending,
        (EVENTS / 2) as i64
    );
    assert_eq!(
        store.webhook_stats("wh-other-team").await.unwrap().pending,
        0
    );

    // Two dispatchers, each its own Store (as two processes would be), same epoch.
    let second = b.open_another().await;
    let mut tasks = Vec::new();
    for (name, store) in [("d1", store.clone()), ("d2", second.clone())] {
        tasks.push(tokio::spawn(async move {
            let mut claimed = Vec::new();
            loop {
                let items = store
                    .claim_outbox(name, 1, 7, Duration::from_secs(300))
                    .await
                    .unwrap();
                if items.is_empty() {
                    return claimed;
                }
                for item in items {
                    assert!(store.complete_outbox(1, item.seq).await.unwrap());
                    claimed.push((item.seq, item.webhook_id, item.event.id));
                }
            }
        }));
    }
    let mut all = Vec::new();
    let mut per_dispatcher = Vec::new();
    for t in tasks {
        let claimed = t.await.unwrap();
        per_dispatcher.push(claimed.len());
        all.extend(claimed);
    }
    let mut seen = HashMap::new();
    for (seq, hook, event) in &all {
        assert!(
            seen.insert(*seq, (hook.clone(), *event)).is_none(),
            "outbox row {seq} was claimed twice"
        );
    }
    assert_eq!(seen.len(), expected, "every row claimed exactly once");
    println!("claims per dispatcher: {per_dispatcher:?}");

    // The epoch fences: a newer leader claims, the deposed one is refused and cannot complete.
    let s2 = sandbox("isbx2", "t1", now());
    store
        .append_event(&event(event_types::CREATED, &s2, now()))
        .await
        .unwrap();
    let old = store
        .claim_outbox("old-leader", 1, 10, Duration::from_secs(300))
        .await
        .unwrap();
    assert_eq!(old.len(), 2);
    let new = store
        .claim_outbox("new-leader", 2, 10, Duration::from_secs(300))
        .await
        .unwrap();
    assert_eq!(
        new.len(),
        2,
        "a newer epoch takes over unfinished claims at once"
    );
    assert!(matches!(
        store
            .claim_outbox("old-leader", 1, 10, Duration::from_secs(300))
            .await,
        Err(StoreError::Fenced)
    ));
    assert!(!store.complete_outbox(1, old[0].seq).await.unwrap());
    assert!(store.complete_outbox(2, new[0].seq).await.unwrap());
    assert!(store.complete_outbox(2, new[1].seq).await.unwrap());
    assert!(
        !store.complete_outbox(2, new[1].seq).await.unwrap(),
        "completed once"
    );
    // A claim not completed in time becomes claimable again (a dispatcher died).
    store
        .append_event(&event(event_types::PAUSED, &s2, now()))
        .await
        .unwrap();
    let lost = store
        .claim_outbox("new-leader", 2, 10, Duration::from_millis(50))
        .await
        .unwrap();
    assert_eq!(lost.len(), 1);
    assert!(store
        .claim_outbox("new-leader", 2, 10, Duration::from_secs(300))
        .await
        .unwrap()
        .is_empty());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let again = store
        .claim_outbox("new-leader", 2, 10, Duration::from_secs(300))
        .await
        .unwrap();
    assert_eq!(
        again.iter().map(|i| i.seq).collect::<Vec<_>>(),
        [lost[0].seq]
    );
    second.close().await;
}

pub async fn volumes_unique_per_team(b: &support::Backend) {
    let store = &b.store;
    let new = |id: &str, team: &str, name: &str| NewVolume {
        id: id.to_owned(),
        team_id: team.to_owned(),
        name: name.to_owned(),
    };
    let v = store.create_volume(&new("v1", "t1", "data")).await.unwrap();
    assert_eq!(
        (v.id.as_str(), v.team_id.as_str(), v.name.as_str()),
        ("v1", "t1", "data")
    );
    assert!(matches!(
        store.create_volume(&new("v2", "t1", "data")).await,
        Err(StoreError::Conflict(_))
    ));
    // The same name in another team is another volume.
    store.create_volume(&new("v3", "t2", "data")).await.unwrap();
    store.create_volume(&new("v4", "t1", "more")).await.unwrap();
    assert_eq!(store.volume("t1", "v1").await.unwrap(), Some(v.clone()));
    assert_eq!(store.volume("t2", "v1").await.unwrap(), None);
    assert_eq!(
        store.volume_by_id("v3").await.unwrap().unwrap().team_id,
        "t2"
    );
    assert_eq!(
        store
            .volume_by_name("t1", "more")
            .await
            .unwrap()
            .unwrap()
            .id,
        "v4"
    );
    assert_eq!(store.volume_by_name("t2", "more").await.unwrap(), None);
    let names: Vec<String> = store
        .volumes("t1")
        .await
        .unwrap()
        .into_iter()
        .map(|v| v.id)
        .collect();
    assert_eq!(names, ["v1", "v4"]);
    assert!(!store.delete_volume("t2", "v1").await.unwrap());
    assert!(store.delete_volume("t1", "v1").await.unwrap());
    assert!(!store.delete_volume("t1", "v1").await.unwrap());
    // The name is free again.
    store.create_volume(&new("v5", "t1", "data")).await.unwrap();
}

pub async fn secrets_sealed_versioned_paged(b: &support::Backend) {
    let store = &b.store;
    let new = |id: &str, team: &str, name: &str, value: &str| NewSecret {
        id: id.to_owned(),
        team_id: team.to_owned(),
        name: name.to_owned(),
        value: value.to_owned(),
        metadata: BTreeMap::from([("k".to_owned(), "v".to_owned())]),
    };
    let s1 = store
        .create_secret(&new("sec_1", "t1", "API-Key", "v1"))
        .await
        .unwrap();
    assert_eq!((s1.name.as_str(), s1.version), ("api-key", 1));
    assert!(matches!(
        store
            .create_secret(&new("sec_2", "t1", "api-key", "x"))
            .await,
        Err(StoreError::Conflict(_))
    ));
    store
        .create_secret(&new("sec_3", "t2", "api-key", "other team"))
        .await
        .unwrap();
    store
        .create_secret(&new("sec_4", "t1", "second", "v"))
        .await
        .unwrap();
    store
        .create_secret(&new("sec_5", "t1", "third", "v"))
        .await
        .unwrap();
    assert_eq!(
        store.secret("t1", "API-KEY").await.unwrap().unwrap().id,
        "sec_1"
    );
    assert_eq!(
        store.secret("t1", "sec_1").await.unwrap().unwrap().name,
        "api-key"
    );
    assert_eq!(store.secret("t2", "sec_1").await.unwrap(), None);
    assert_eq!(
        store.secret_value("t1", "sec_1").await.unwrap().as_deref(),
        Some("v1")
    );
    assert_eq!(store.secret_value("t2", "sec_1").await.unwrap(), None);
    assert_eq!(store.count_secrets("t1").await.unwrap(), 3);

    let page1 = store.secrets("t1", 2, None).await.unwrap();
    let page2 = store.secrets("t1", 2, Some(&page1[1].id)).await.unwrap();
    let ids: Vec<&str> = page1
        .iter()
        .chain(page2.iter())
        .map(|s| s.id.as_str())
        .collect();
    assert_eq!(ids, ["sec_1", "sec_4", "sec_5"]);

    let up = store
        .update_secret("t1", "api-key", "v2", None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((up.version, up.metadata.len()), (2, 1));
    let up = store
        .update_secret("t1", "sec_1", "v3", Some(&BTreeMap::new()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((up.version, up.metadata.len()), (3, 0));
    assert_eq!(
        store.secret_value("t1", "sec_1").await.unwrap().as_deref(),
        Some("v3")
    );
    assert_eq!(
        store.update_secret("t2", "sec_1", "x", None).await.unwrap(),
        None
    );
    assert!(!store.delete_secret("t2", "sec_1").await.unwrap());
    assert!(store.delete_secret("t1", "API-key").await.unwrap());
    assert_eq!(store.secret("t1", "sec_1").await.unwrap(), None);
}

macro_rules! conformance {
    ($backend:ident) => {
        mod $backend {
            macro_rules! case {
                ($name:ident) => {
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        let backend = crate::support::$backend().await;
                        crate::$name(&backend).await;
                        backend.store.close().await;
                    }
                };
            }
            case!(teams_and_keys);
            case!(templates_and_snapshots);
            case!(builds_tags_and_aliases);
            case!(sandbox_records_and_listing);
            case!(transition_commits_with_event);
            case!(events_query_and_retention);
            case!(webhooks_and_deliveries);
            case!(outbox_exactly_once);
            case!(volumes_unique_per_team);
            case!(secrets_sealed_versioned_paged);
        }
    };
}

conformance!(sqlite);
conformance!(postgres);

#[tokio::test]
async fn sqlite_secret_is_not_stored_in_plaintext() {
    let b = support::sqlite().await;
    subscribed_hook(&b.store, "wh1", "t1", &[event_types::CREATED]).await;
    b.store
        .update_webhook(
            "t1",
            "wh1",
            &WebhookPatch {
                signature_secret: Some("find-me-if-you-can".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    b.store.close().await;
    let dir = b.dir.as_ref().unwrap().path();
    for file in std::fs::read_dir(dir).unwrap() {
        let bytes = std::fs::read(file.unwrap().path()).unwrap();
        assert!(
            !bytes.windows(18).any(|w| w == b"find-me-if-you-can"),
            "the secret leaked to disk"
        );
    }
}
