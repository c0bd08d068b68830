//! One conformance suite, run against both backends: embedded (redb in a temp dir) and etcd (a
//! member started by the test). Every test gets a fresh backend.

#![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

mod support;

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;
use vmon_kv::{Expect, IdempotencyOutcome, Kv, KvError, Write, WriteOutcome};

use support::SESSION_TTL;

/// Enough for a lease of `SESSION_TTL` to be seen as expired by either backend.
const EXPIRY_SLACK: Duration = Duration::from_secs(4);

async fn eventually(what: &str, within: Duration, mut check: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub async fn plain_keys(kv: &Kv) {
    assert_eq!(kv.get("a").await.unwrap(), None);
    let r1 = kv.put("a", "1").await.unwrap();
    let a = kv.get("a").await.unwrap().unwrap();
    assert_eq!(
        (a.key.as_str(), a.value.as_slice(), a.mod_revision),
        ("a", &b"1"[..], r1)
    );
    kv.put("dir/x", "x").await.unwrap();
    kv.put("dir/y", "y").await.unwrap();
    kv.put("dirt", "no").await.unwrap();
    let listed: Vec<String> = kv
        .list("dir/")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.key)
        .collect();
    assert_eq!(listed, ["dir/x", "dir/y"]);

    // CAS on revision: the stale revision loses and sees the current value.
    let stale = kv
        .compare_and_swap("a", Expect::Revision(r1), Some(b"2".to_vec()))
        .await
        .unwrap();
    let WriteOutcome::Committed { revision: r2 } = stale else {
        panic!("first CAS must win: {stale:?}")
    };
    assert!(r2 > r1);
    match kv
        .compare_and_swap("a", Expect::Revision(r1), Some(b"3".to_vec()))
        .await
        .unwrap()
    {
        WriteOutcome::Conflict { current: Some(e) } => assert_eq!(e.value, b"2"),
        other => panic!("stale CAS must conflict: {other:?}"),
    }
    assert!(!kv
        .write(Write::put("a", "x").expect(Expect::Absent))
        .await
        .unwrap()
        .is_committed());
    assert!(kv
        .write(Write::put("b", "x").expect(Expect::Absent))
        .await
        .unwrap()
        .is_committed());
    assert!(kv.delete("a").await.unwrap());
    assert!(!kv.delete("a").await.unwrap());
    assert_eq!(kv.get("a").await.unwrap(), None);
    // A re-created key has a new create revision.
    kv.put("a", "again").await.unwrap();
    assert!(kv.get("a").await.unwrap().unwrap().create_revision > r2);
}

pub async fn cas_race(kv: &Kv) {
    const TASKS: usize = 16;
    const EACH: usize = 10;
    kv.put("race", "0").await.unwrap();
    let conflicts = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let kv = kv.clone();
        let conflicts = conflicts.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..EACH {
                loop {
                    let e = kv.get("race").await.unwrap().unwrap();
                    let n: u64 = std::str::from_utf8(&e.value).unwrap().parse().unwrap();
                    let next = (n + 1).to_string().into_bytes();
                    match kv
                        .compare_and_swap("race", Expect::Revision(e.mod_revision), Some(next))
                        .await
                        .unwrap()
                    {
                        WriteOutcome::Committed { .. } => break,
                        WriteOutcome::Conflict { .. } => conflicts.fetch_add(1, Ordering::Relaxed),
                        WriteOutcome::Fenced => panic!("no fence was given"),
                    };
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let e = kv.get("race").await.unwrap().unwrap();
    assert_eq!(
        e.value,
        (TASKS * EACH).to_string().into_bytes(),
        "a lost update"
    );
    // Not asserted (scheduling dependent) but printed: shows the race was real.
    println!(
        "CAS conflicts resolved: {}",
        conflicts.load(Ordering::Relaxed)
    );
}

pub async fn lease_expiry_and_keep_alive(kv: &Kv) {
    // Kept alive past several TTLs.
    let lease = kv.grant_lease(SESSION_TTL).await.unwrap();
    kv.write(Write::put("routes/s1", "node-a").lease(&lease))
        .await
        .unwrap();
    tokio::time::sleep(SESSION_TTL * 2 + Duration::from_millis(500)).await;
    assert!(!lease.is_lost());
    assert_eq!(
        kv.get("routes/s1").await.unwrap().unwrap().lease,
        Some(lease.id())
    );

    // A dead holder: its keys vanish after the TTL.
    lease.abandon();
    eventually(
        "leased key to expire",
        SESSION_TTL + EXPIRY_SLACK,
        async || kv.get("routes/s1").await.unwrap().is_none(),
    )
    .await;

    // Revoke removes keys at once.
    let lease = kv.grant_lease(SESSION_TTL).await.unwrap();
    kv.write(Write::put("routes/s2", "node-a").lease(&lease))
        .await
        .unwrap();
    let lost = lease.lost();
    lease.revoke().await.unwrap();
    assert!(lost.is_cancelled());
    assert_eq!(kv.get("routes/s2").await.unwrap(), None);

    // A write with a dead lease is refused.
    let lease = kv.grant_lease(SESSION_TTL).await.unwrap();
    kv.revoke_lease(lease.id()).await.unwrap();
    let refused = kv.write(Write::put("routes/s3", "x").lease(&lease)).await;
    assert!(matches!(refused, Err(KvError::LeaseLost)), "{refused:?}");
}

pub async fn keep_alive_loss(kv: &Kv) {
    let lease = kv.grant_lease(SESSION_TTL).await.unwrap();
    let lost = lease.lost();
    // Someone else removes the lease (an operator, or the server expiring it): the keep-alive
    // notices and the token fires within a TTL.
    kv.revoke_lease(lease.id()).await.unwrap();
    tokio::time::timeout(SESSION_TTL + Duration::from_secs(2), lost.cancelled())
        .await
        .expect("loss of the lease must fire the token");
}

pub async fn lock_exclusion_and_waiting(kv: &Kv) {
    // Many contenders, never two inside.
    let inside = Arc::new(AtomicUsize::new(0));
    let entered = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (kv, inside, entered) = (kv.clone(), inside.clone(), entered.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..3 {
                let guard = kv
                    .lock("sandbox/i1", Duration::from_secs(60))
                    .await
                    .unwrap();
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two holders at once"
                );
                entered.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                guard.unlock().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(entered.load(Ordering::SeqCst), 24);

    // A waiter gets the lock as soon as the holder unlocks.
    let held = kv.lock("sandbox/i2", Duration::from_secs(1)).await.unwrap();
    let waiter = {
        let kv = kv.clone();
        tokio::spawn(async move { kv.lock("sandbox/i2", Duration::from_secs(30)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    let first = held.fence().token();
    held.unlock().await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(second.fence().token() > first, "fencing tokens must grow");

    // A deadline passes while held.
    let timed_out = kv.lock("sandbox/i2", Duration::from_millis(300)).await;
    assert!(
        matches!(timed_out, Err(KvError::LockTimeout)),
        "{timed_out:?}"
    );
    second.unlock().await.unwrap();
    // Names with separators do not share queues.
    let a = kv.lock("x", Duration::from_secs(1)).await.unwrap();
    let b = kv.lock("x/y", Duration::from_secs(1)).await.unwrap();
    drop((a, b));
}

pub async fn lock_fencing(kv: &Kv) {
    let stale = kv.lock("sandbox/f", Duration::from_secs(5)).await.unwrap();
    let stale_fence = stale.fence();
    let w = kv
        .write(Write::put("sandbox-state/f", "pausing").fenced(&stale_fence))
        .await
        .unwrap();
    assert!(w.is_committed(), "the holder's write must apply: {w:?}");

    // The holder stalls (its process dies or hangs past the TTL); another takes over.
    stale.abandon();
    let fresh = kv
        .lock(
            "sandbox/f",
            SESSION_TTL + EXPIRY_SLACK + Duration::from_secs(2),
        )
        .await
        .unwrap();
    assert!(fresh.fence().token() > stale_fence.token());

    // The stale holder wakes up and writes: refused.
    let w = kv
        .write(Write::put("sandbox-state/f", "paused").fenced(&stale_fence))
        .await
        .unwrap();
    assert_eq!(w, WriteOutcome::Fenced);
    assert_eq!(
        kv.get("sandbox-state/f").await.unwrap().unwrap().value,
        b"pausing"
    );
    let w = kv
        .write(Write::put("sandbox-state/f", "running").fenced(&fresh.fence()))
        .await
        .unwrap();
    assert!(w.is_committed());
    fresh.unlock().await.unwrap();
    // After unlock the fence is stale too.
    let w = kv
        .write(Write::put("sandbox-state/f", "x").fenced(&stale_fence))
        .await
        .unwrap();
    assert_eq!(w, WriteOutcome::Fenced);
}

pub async fn counter_at_limit(kv: &Kv) {
    const LIMIT: u64 = 10;
    const ACQUIRERS: usize = 50;
    let mut tasks = Vec::new();
    for _ in 0..ACQUIRERS {
        let kv = kv.clone();
        tasks.push(tokio::spawn(async move {
            kv.acquire("team/t1/running", LIMIT).await.unwrap()
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += u64::from(t.await.unwrap());
    }
    assert_eq!(admitted, LIMIT, "exactly the limit is admitted");
    assert_eq!(kv.counter("team/t1/running").await.unwrap(), LIMIT);
    assert!(!kv.acquire("team/t1/running", LIMIT).await.unwrap());
    kv.release("team/t1/running").await.unwrap();
    assert!(kv.acquire("team/t1/running", LIMIT).await.unwrap());
    // Releases never go below zero.
    for _ in 0..LIMIT + 5 {
        kv.release("team/t1/running").await.unwrap();
    }
    assert_eq!(kv.counter("team/t1/running").await.unwrap(), 0);
    assert_eq!(kv.counter("team/unknown").await.unwrap(), 0);
    kv.set_counter("team/t1/running", 3).await.unwrap();
    assert_eq!(kv.counter("team/t1/running").await.unwrap(), 3);
}

pub async fn idempotency(kv: &Kv) {
    let day = SystemTime::now() + Duration::from_secs(24 * 3600);
    assert_eq!(
        kv.idempotency_put_if_absent("k1", b"sandbox-a", day)
            .await
            .unwrap(),
        IdempotencyOutcome::Inserted
    );
    match kv
        .idempotency_put_if_absent("k1", b"sandbox-b", day)
        .await
        .unwrap()
    {
        IdempotencyOutcome::Exists(r) => assert_eq!(r.value, b"sandbox-a"),
        other => panic!("reuse must return the first value: {other:?}"),
    }
    assert_eq!(
        kv.idempotency_get("k1").await.unwrap().unwrap().value,
        b"sandbox-a"
    );

    // A failed create deletes its record; the key can be used again.
    kv.idempotency_delete("k1").await.unwrap();
    assert_eq!(kv.idempotency_get("k1").await.unwrap(), None);
    assert_eq!(
        kv.idempotency_put_if_absent("k1", b"sandbox-c", day)
            .await
            .unwrap(),
        IdempotencyOutcome::Inserted
    );

    // Expiry comes from the value, not the lease.
    let soon = SystemTime::now() + Duration::from_millis(700);
    assert_eq!(
        kv.idempotency_put_if_absent("k2", b"old", soon)
            .await
            .unwrap(),
        IdempotencyOutcome::Inserted
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        kv.idempotency_get("k2").await.unwrap(),
        None,
        "an expired record reads as absent"
    );
    assert_eq!(
        kv.idempotency_put_if_absent("k2", b"new", day)
            .await
            .unwrap(),
        IdempotencyOutcome::Inserted
    );
    assert_eq!(
        kv.idempotency_get("k2").await.unwrap().unwrap().value,
        b"new"
    );

    // Concurrent first uses: exactly one wins.
    let mut tasks = Vec::new();
    for i in 0..20 {
        let kv = kv.clone();
        tasks.push(tokio::spawn(async move {
            kv.idempotency_put_if_absent("k3", format!("v{i}").as_bytes(), day)
                .await
                .unwrap()
        }));
    }
    let mut inserted = 0;
    let mut seen = HashSet::new();
    for t in tasks {
        match t.await.unwrap() {
            IdempotencyOutcome::Inserted => inserted += 1,
            IdempotencyOutcome::Exists(r) => {
                seen.insert(r.value);
            }
        }
    }
    assert_eq!(inserted, 1);
    assert!(seen.len() <= 1, "every loser sees the one winner: {seen:?}");
}

pub async fn election(kv: &Kv) {
    let never = CancellationToken::new();
    assert_eq!(kv.observe("reaper").await.unwrap(), None);
    let a = kv.campaign("reaper", "node-a", &never).await.unwrap();
    let seen = kv.observe("reaper").await.unwrap().unwrap();
    assert_eq!((seen.candidate.as_str(), seen.epoch), ("node-a", a.epoch()));

    let b = {
        let kv = kv.clone();
        tokio::spawn(async move {
            kv.campaign("reaper", "node-b", &CancellationToken::new())
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!b.is_finished(), "only one leader");
    let a_epoch = a.epoch();
    let a_fence = a.fence();
    // The leader dies without resigning: the other candidate takes over after the TTL.
    a.abandon();
    // etcd expires leases on its own schedule (and a loaded host delays it): allow twice the
    // slack before calling the hand-over lost.
    let b = tokio::time::timeout(SESSION_TTL + 2 * EXPIRY_SLACK, b)
        .await
        .expect("hand-over")
        .unwrap()
        .unwrap();
    assert!(b.epoch() > a_epoch);
    let seen = kv.observe("reaper").await.unwrap().unwrap();
    assert_eq!((seen.candidate.as_str(), seen.epoch), ("node-b", b.epoch()));
    let stale = kv
        .write(Write::put("leader-only", "a").fenced(&a_fence))
        .await
        .unwrap();
    assert_eq!(stale, WriteOutcome::Fenced);
    assert!(kv
        .write(Write::put("leader-only", "b").fenced(&b.fence()))
        .await
        .unwrap()
        .is_committed());

    // Resign hands over at once; a cancelled campaign gives up.
    let c = {
        let kv = kv.clone();
        tokio::spawn(async move {
            kv.campaign("reaper", "node-c", &CancellationToken::new())
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    b.resign().await.unwrap();
    let c = tokio::time::timeout(Duration::from_secs(5), c)
        .await
        .expect("resign hands over")
        .unwrap()
        .unwrap();
    assert_eq!(
        kv.observe("reaper").await.unwrap().unwrap().candidate,
        "node-c"
    );
    let cancel = CancellationToken::new();
    let d = {
        let (kv, cancel) = (kv.clone(), cancel.clone());
        tokio::spawn(async move { kv.campaign("reaper", "node-d", &cancel).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    cancel.cancel();
    let d = tokio::time::timeout(Duration::from_secs(5), d)
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(d, Err(KvError::Cancelled)), "{d:?}");
    c.resign().await.unwrap();
    assert_eq!(kv.observe("reaper").await.unwrap(), None);
}

macro_rules! conformance {
    ($backend:ident) => {
        mod $backend {
            macro_rules! case {
                ($name:ident) => {
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        let backend = crate::support::$backend().await;
                        crate::$name(&backend.kv).await;
                    }
                };
            }
            case!(plain_keys);
            case!(cas_race);
            case!(lease_expiry_and_keep_alive);
            case!(keep_alive_loss);
            case!(lock_exclusion_and_waiting);
            case!(lock_fencing);
            case!(counter_at_limit);
            case!(idempotency);
            case!(election);
        }
    };
}

conformance!(embedded);
conformance!(etcd);

#[tokio::test]
async fn embedded_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let config = vmon_kv::EmbeddedConfig::new(dir.path());
    {
        let kv = Kv::open_embedded(&config).await.unwrap();
        kv.put("persisted", "yes").await.unwrap();
        assert!(kv.acquire("team", 5).await.unwrap());
    }
    // The first handle's sweeper may still hold the file briefly.
    let mut reopened = None;
    for _ in 0..50 {
        match Kv::open_embedded(&config).await {
            Ok(kv) => {
                reopened = Some(kv);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let kv = reopened.expect("reopen the embedded store");
    assert_eq!(kv.get("persisted").await.unwrap().unwrap().value, b"yes");
    assert_eq!(kv.counter("team").await.unwrap(), 1);
    let next = kv.put("after", "x").await.unwrap();
    assert!(
        next > kv.get("persisted").await.unwrap().unwrap().mod_revision,
        "revisions continue"
    );
}

/// A crashed owner's forked child shares the database's lock until it execs: an open waits a
/// bounded while for such a lock to go, and still refuses one that stays.
#[tokio::test]
async fn embedded_open_waits_a_bounded_while_for_a_held_lock() {
    let dir = tempfile::tempdir().unwrap();
    let config = vmon_kv::EmbeddedConfig::new(dir.path());
    drop(Kv::open_embedded(&config).await.unwrap());
    let file = dir.path().join("kv.redb");
    assert!(file.is_file(), "the store lives in {}", file.display());
    let held = lock_file(&file).await;
    let start = std::time::Instant::now();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        drop(held);
    });
    let kv = Kv::open_embedded(&config)
        .await
        .expect("opens once the lock is let go");
    assert!(
        start.elapsed() >= Duration::from_millis(1400),
        "it waited for the lock"
    );
    release.join().unwrap();
    kv.put("k", "v").await.unwrap();
    drop(kv);
    let _held = lock_file(&file).await;
    assert!(
        Kv::open_embedded(&config).await.is_err(),
        "a lock that stays is refused"
    );
}

/// Takes an exclusive `flock` on `file` as another process would (the last handle's sweeper may
/// still hold it briefly).
async fn lock_file(file: &std::path::Path) -> std::fs::File {
    for _ in 0..50 {
        let f = std::fs::File::open(file).unwrap();
        if f.try_lock().is_ok() {
            return f;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("cannot lock {}", file.display());
}
