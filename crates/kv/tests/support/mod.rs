//! Test servers: etcd members started by the test itself, on free loopback ports, in temp dirs,
//! killed on drop (and by the kernel if the test process dies first).
#![allow(dead_code)]

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use vmon_kv::{EmbeddedConfig, EtcdConfig, Kv};

pub const ETCD: &str = "/usr/bin/etcd";
pub const SESSION_TTL: Duration = Duration::from_secs(2);

/// A loopback port free right now, below the kernel's ephemeral range (32768+) so outgoing
/// connections do not take it before the server binds it.
pub fn free_port() -> u16 {
    for _ in 0..1000 {
        let port = 20000 + (rand::random::<u16>() % 12000);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free loopback port");
    listener.local_addr().expect("local addr").port()
}

fn binary(path: &str, package: &str) -> PathBuf {
    let path = PathBuf::from(path);
    assert!(
        path.exists(),
        "{} is missing: install the Debian package `{package}`",
        path.display()
    );
    path
}

struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

/// An etcd cluster of `n` members on loopback.
pub struct EtcdCluster {
    dir: tempfile::TempDir,
    members: Vec<Member>,
    token: String,
}

impl EtcdCluster {
    pub async fn start(n: usize) -> EtcdCluster {
        // A port can still be taken between picking and binding it: a member that exits at
        // start gets the whole cluster started again on fresh ports.
        for _ in 0..3 {
            let mut cluster = Self::spawn_all(n);
            if cluster.wait_ready().await {
                return cluster;
            }
            cluster.kill_all();
        }
        panic!("etcd members kept exiting at start (ports taken?)");
    }

    fn spawn_all(n: usize) -> EtcdCluster {
        let etcd = binary(ETCD, "etcd-server");
        let dir = tempfile::tempdir().expect("temp dir");
        let members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: free_port(),
                peer_port: free_port(),
                child: None,
            })
            .collect();
        let token = format!("t{}", rand_suffix());
        let mut cluster = EtcdCluster {
            dir,
            members,
            token,
        };
        for i in 0..n {
            cluster.spawn(&etcd, i, "new");
        }
        cluster
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn spawn(&mut self, etcd: &Path, i: usize, state: &str) {
        let initial = self.initial_cluster();
        let m = &self.members[i];
        let data = self.dir.path().join(&m.name);
        let log = std::fs::File::create(self.dir.path().join(format!("{}.log", m.name)))
            .expect("log file");
        let client = format!("http://127.0.0.1:{}", m.client_port);
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let mut command = Command::new(etcd);
        command
            .arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&data)
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args([
                "--initial-cluster",
                &initial,
                "--initial-cluster-state",
                state,
            ])
            .args(["--initial-cluster-token", &self.token])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log);
        die_with_parent(&mut command);
        let child = command.spawn().expect("spawn etcd");
        self.members[i].child = Some(child);
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("http://127.0.0.1:{}", m.client_port))
            .collect()
    }

    pub fn endpoint(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.members[i].client_port)
    }

    /// Waits for every member and a leader; false when a member exited (its port was taken).
    async fn wait_ready(&mut self) -> bool {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            for m in self.members.iter_mut() {
                if let Some(c) = m.child.as_mut() {
                    if matches!(c.try_wait(), Ok(Some(_))) {
                        return false;
                    }
                }
            }
            let mut ready = true;
            for (i, m) in self.members.iter().enumerate() {
                if m.child.is_none() {
                    continue;
                }
                if self.status(i).await.is_none() {
                    ready = false;
                }
            }
            if ready && self.leader().await.is_some() {
                return true;
            }
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "etcd did not become ready; logs in {}:\n{}",
                    self.dir.path().display(),
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// (member id, leader id) as member `i` sees it.
    async fn status(&self, i: usize) -> Option<(u64, u64)> {
        let options = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_millis(500))
            .with_timeout(Duration::from_millis(500));
        let mut client = etcd_client::Client::connect([self.endpoint(i)], Some(options))
            .await
            .ok()?;
        let status = client.status().await.ok()?;
        let member = status.header()?.member_id();
        (status.leader() != 0).then_some((member, status.leader()))
    }

    /// The index of the current raft leader among running members.
    pub async fn leader(&self) -> Option<usize> {
        for (i, m) in self.members.iter().enumerate() {
            if m.child.is_none() {
                continue;
            }
            if let Some((member, leader)) = self.status(i).await {
                if member == leader {
                    return Some(i);
                }
            }
        }
        None
    }

    /// Waits until a running member other than `not` leads.
    pub async fn wait_new_leader(&self, not: usize) -> usize {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(l) = self.leader().await {
                if l != not {
                    return l;
                }
            }
            assert!(tokio::time::Instant::now() < deadline, "no new etcd leader");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn kill_all(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }

    pub fn logs(&self) -> String {
        let mut out = String::new();
        for m in &self.members {
            let log = std::fs::read_to_string(self.dir.path().join(format!("{}.log", m.name)))
                .unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            out.push_str(&format!(
                "--- {} ---\n{}\n",
                m.name,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            ));
        }
        out
    }

    pub fn config(&self) -> EtcdConfig {
        let mut config = EtcdConfig::new(self.endpoints());
        config.session_ttl = SESSION_TTL;
        config.prefix = format!("/test-{}/", rand_suffix());
        config
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        self.kill_all();
    }
}

fn rand_suffix() -> String {
    format!("{:x}", rand::random::<u64>())
}

/// The child gets SIGKILL when the test process dies, even by a panic that aborts.
pub fn die_with_parent(command: &mut Command) {
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// A backend under test plus what keeps it alive.
pub struct Backend {
    pub kv: Kv,
    _etcd: Option<EtcdCluster>,
    _dir: Option<tempfile::TempDir>,
}

pub async fn embedded() -> Backend {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut config = EmbeddedConfig::new(dir.path());
    config.session_ttl = SESSION_TTL;
    let kv = Kv::open_embedded(&config).await.expect("open embedded kv");
    Backend {
        kv,
        _etcd: None,
        _dir: Some(dir),
    }
}

pub async fn etcd() -> Backend {
    let cluster = EtcdCluster::start(1).await;
    let kv = Kv::connect_etcd(&cluster.config())
        .await
        .expect("connect to etcd");
    Backend {
        kv,
        _etcd: Some(cluster),
        _dir: None,
    }
}
