//! Fault tests on a 3-member etcd cluster started by the test: the raft leader is killed while
//! lock holders, admission acquirers and election candidates run.

#![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

mod support;

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use vmon_kv::{Expect, Kv, Write, WriteOutcome};

use support::EtcdCluster;

/// Longer than a raft leader election (about 1–2 s here), as a production TTL must be.
const TTL: Duration = Duration::from_secs(5);

async fn client(cluster: &EtcdCluster, prefix: &str) -> Kv {
    let mut config = cluster.config();
    config.prefix = prefix.to_owned();
    config.session_ttl = TTL;
    config.retry_for = Duration::from_secs(20);
    Kv::connect_etcd(&config).await.expect("connect to etcd")
}

#[derive(Default)]
struct LockStats {
    inside: AtomicUsize,
    entries: AtomicUsize,
    overlaps: AtomicUsize,
    lost: AtomicBool,
    conflicts: AtomicUsize,
    errors: AtomicUsize,
}

async fn lock_worker(kv: Kv, stats: Arc<LockStats>, stop: CancellationToken) {
    while !stop.is_cancelled() {
        let guard = match kv.lock("sandbox/shared", Duration::from_secs(30)).await {
            Ok(g) => g,
            Err(error) => {
                eprintln!("lock failed: {error}");
                stats.errors.fetch_add(1, Ordering::SeqCst);
                continue;
            }
        };
        if stats.inside.fetch_add(1, Ordering::SeqCst) != 0 && !stats.lost.load(Ordering::SeqCst) {
            stats.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        stats.entries.fetch_add(1, Ordering::SeqCst);
        // Read-modify-write of a protected key, fenced: two holders at once would conflict.
        if let Ok(Some(current)) = kv.get("protected").await {
            let n: u64 = String::from_utf8_lossy(&current.value).parse().unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(10)).await;
            let write = Write::put("protected", (n + 1).to_string())
                .expect(Expect::Revision(current.mod_revision))
                .fenced(&guard.fence());
            match kv.write(write).await {
                Ok(WriteOutcome::Committed { .. }) => {}
                Ok(WriteOutcome::Conflict { current }) => {
                    // Our own retried write shows up as a conflict with our value.
                    if current.map(|c| c.value) != Some((n + 1).to_string().into_bytes()) {
                        stats.conflicts.fetch_add(1, Ordering::SeqCst);
                    }
                }
                Ok(WriteOutcome::Fenced) => stats.lost.store(true, Ordering::SeqCst),
                Err(error) => {
                    eprintln!("fenced write failed: {error}");
                    stats.errors.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        if guard.lost().is_cancelled() {
            stats.lost.store(true, Ordering::SeqCst);
        }
        stats.inside.fetch_sub(1, Ordering::SeqCst);
        let _ = guard.unlock().await;
    }
}

#[derive(Default)]
struct Admission {
    admitted_now: AtomicI64,
    max_admitted: AtomicI64,
    admissions: AtomicU64,
    refusals: AtomicU64,
    errors: AtomicU64,
}

async fn acquirer(kv: Kv, stats: Arc<Admission>, rounds: usize, limit: u64) {
    for _ in 0..rounds {
        match kv.acquire("team/t/running", limit).await {
            Ok(true) => {
                let now = stats.admitted_now.fetch_add(1, Ordering::SeqCst) + 1;
                stats.max_admitted.fetch_max(now, Ordering::SeqCst);
                stats.admissions.fetch_add(1, Ordering::SeqCst);
                // Held long enough that the 50 acquirers keep the counter at its limit.
                tokio::time::sleep(Duration::from_millis(250)).await;
                stats.admitted_now.fetch_sub(1, Ordering::SeqCst);
                // Release until it succeeds: a lost release would leak a slot, not over-admit.
                while kv.release("team/t/running").await.is_err() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            Ok(false) => {
                stats.refusals.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(error) => {
                eprintln!("acquire failed: {error}");
                stats.errors.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_etcd_leader_keeps_locks_counters_and_election_safe() {
    const LIMIT: u64 = 10;
    let mut cluster = EtcdCluster::start(3).await;
    let prefix = "/faults/";
    let (a, b) = (
        client(&cluster, prefix).await,
        client(&cluster, prefix).await,
    );
    a.put("protected", "0").await.unwrap();

    let never = CancellationToken::new();
    let first = a.campaign("reaper", "api-a", &never).await.unwrap();
    let second = {
        let b = b.clone();
        tokio::spawn(async move {
            b.campaign("reaper", "api-b", &CancellationToken::new())
                .await
        })
    };

    let stop = CancellationToken::new();
    let locks = Arc::new(LockStats::default());
    let mut workers = Vec::new();
    for kv in [&a, &b, &a, &b] {
        workers.push(tokio::spawn(lock_worker(
            kv.clone(),
            locks.clone(),
            stop.clone(),
        )));
    }
    let admission = Arc::new(Admission::default());
    let mut acquirers = Vec::new();
    for i in 0..50 {
        let kv = if i % 2 == 0 { a.clone() } else { b.clone() };
        acquirers.push(tokio::spawn(acquirer(kv, admission.clone(), 8, LIMIT)));
    }

    tokio::time::sleep(Duration::from_secs(1)).await;
    let leader = cluster.leader().await.expect("a raft leader");
    let entries_before = locks.entries.load(Ordering::SeqCst);
    cluster.kill(leader);
    // The vmon leader dies at the same moment.
    let old_epoch = first.epoch();
    first.abandon();
    let new_leader = cluster.wait_new_leader(leader).await;
    println!("etcd leader m{leader} killed; m{new_leader} leads");

    let second = tokio::time::timeout(TTL * 4, second)
        .await
        .expect("the election moved")
        .unwrap()
        .unwrap();
    assert!(second.epoch() > old_epoch);
    let seen = b.observe("reaper").await.unwrap().unwrap();
    assert_eq!(
        (seen.candidate.as_str(), seen.epoch),
        ("api-b", second.epoch())
    );

    for t in acquirers {
        t.await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.cancel();
    for t in workers {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("lock workers stop")
            .unwrap();
    }

    let entries = locks.entries.load(Ordering::SeqCst);
    println!(
        "lock entries {entries} ({entries_before} before the kill), lock errors {}, admissions {}, \
         refusals at the limit {}, max admitted at once {}, acquire errors {}",
        locks.errors.load(Ordering::SeqCst),
        admission.admissions.load(Ordering::SeqCst),
        admission.refusals.load(Ordering::SeqCst),
        admission.max_admitted.load(Ordering::SeqCst),
        admission.errors.load(Ordering::SeqCst),
    );
    assert!(
        entries > entries_before,
        "locks kept working after the kill"
    );
    assert_eq!(
        locks.overlaps.load(Ordering::SeqCst),
        0,
        "a lock was held twice"
    );
    assert_eq!(
        locks.conflicts.load(Ordering::SeqCst),
        0,
        "two holders wrote the protected key"
    );
    assert!(
        admission.max_admitted.load(Ordering::SeqCst) <= LIMIT as i64,
        "over-admission"
    );
    assert!(
        admission.refusals.load(Ordering::SeqCst) > 0,
        "the limit was reached"
    );
    assert_eq!(
        a.counter("team/t/running").await.unwrap(),
        0,
        "every admission was released exactly once"
    );
    let protected: u64 = String::from_utf8_lossy(&a.get("protected").await.unwrap().unwrap().value)
        .parse()
        .unwrap();
    println!("protected counter {protected}");
    second.resign().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_whole_cluster_fires_lease_loss() {
    let mut cluster = EtcdCluster::start(3).await;
    let kv = client(&cluster, "/loss/").await;
    let lease = kv.grant_lease(TTL).await.unwrap();
    let guard = kv.lock("sandbox/x", Duration::from_secs(5)).await.unwrap();
    let (lease_lost, lock_lost) = (lease.lost(), guard.lost());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!lease_lost.is_cancelled() && !lock_lost.is_cancelled());
    cluster.kill_all();
    let deadline = TTL + Duration::from_secs(2);
    tokio::time::timeout(deadline, lease_lost.cancelled())
        .await
        .expect("lease loss within a TTL");
    tokio::time::timeout(deadline, lock_lost.cancelled())
        .await
        .expect("lock loss within a TTL");
    guard.abandon();
    lease.abandon();
}
