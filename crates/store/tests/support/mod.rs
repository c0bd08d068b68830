//! Test servers: PostgreSQL clusters made by the test itself (initdb in a temp dir owned by
//! `postgres`, the server on a free loopback port with its socket in the temp dir), killed on
//! drop and by the kernel if the test process dies first.
#![allow(dead_code)]

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use vmon_store::{Store, StoreConfig};

pub const PG_BIN: &str = "/usr/lib/postgresql/15/bin";
pub const KEY: [u8; 32] = [7; 32];

/// A loopback port free right now, below the kernel's ephemeral range (32768+) so outgoing
/// connections do not take it while the server restarts.
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

pub fn id_of(flag: &str) -> u32 {
    let out = Command::new("id")
        .args([flag, "postgres"])
        .output()
        .expect("run id");
    assert!(
        out.status.success(),
        "there is no `postgres` user: install the Debian package postgresql-15"
    );
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("numeric id")
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

pub struct Postgres {
    dir: tempfile::TempDir,
    port: u16,
    uid: u32,
    gid: u32,
    fsync: bool,
    /// More `postgres` arguments (`-c ssl=on`, ...).
    extra: Vec<String>,
    child: Option<Child>,
}

impl Postgres {
    /// A fresh cluster. `fsync` off is fine for tests that crash only the server, not the OS.
    pub async fn start(fsync: bool) -> Postgres {
        Postgres::start_with(fsync, Vec::new()).await
    }

    /// [`Postgres::start`] with more server arguments.
    pub async fn start_with(fsync: bool, extra: Vec<String>) -> Postgres {
        for tool in ["initdb", "postgres"] {
            let path = Path::new(PG_BIN).join(tool);
            assert!(
                path.exists(),
                "{} is missing: install the Debian package postgresql-15",
                path.display()
            );
        }
        let (uid, gid) = (id_of("-u"), id_of("-g"));
        let dir = tempfile::Builder::new()
            .prefix("vmon-pg-")
            .tempdir()
            .expect("temp dir");
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))
            .expect("chown the temp dir to postgres");
        let data = dir.path().join("data");
        let initdb = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(Path::new(PG_BIN).join("initdb"))
            .args([
                "--auth=trust",
                "--username=postgres",
                "--no-sync",
                "--encoding=UTF8",
                "-D",
            ])
            .arg(&data)
            .output()
            .expect("run initdb");
        assert!(
            initdb.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&initdb.stdout),
            String::from_utf8_lossy(&initdb.stderr)
        );
        let mut pg = Postgres {
            dir,
            port: free_port(),
            uid,
            gid,
            fsync,
            extra,
            child: None,
        };
        pg.spawn();
        pg.wait_ready().await;
        pg
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("postgres.log"))
            .expect("log file");
        let mut command = Command::new(Path::new(PG_BIN).join("postgres"));
        command
            .arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(self.dir.path())
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                &format!("fsync={}", if self.fsync { "on" } else { "off" }),
            ])
            .args(["-c", "max_connections=50", "-c", "shared_buffers=32MB"])
            .args(&self.extra)
            .uid(self.uid)
            .gid(self.gid)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log);
        die_with_parent(&mut command);
        self.child = Some(command.spawn().expect("spawn postgres"));
    }

    async fn wait_ready(&self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .is_ok()
            {
                let ready = Command::new(Path::new(PG_BIN).join("pg_isready"))
                    .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q"])
                    .status();
                if ready.map(|s| s.success()).unwrap_or(true) {
                    return;
                }
            }
            if tokio::time::Instant::now() > deadline {
                panic!("postgres did not start:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }

    /// Immediate shutdown (like a crash: no checkpoint, clients cut off), then waits for exit.
    pub fn stop_immediately(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on our own child's pid; no memory is touched.
            unsafe {
                libc::kill(child.id() as libc::pid_t, libc::SIGQUIT);
            }
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same data dir and port (crash recovery runs).
    pub async fn start_again(&mut self) {
        self.spawn();
        self.wait_ready().await;
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A store under test plus what keeps it alive.
pub struct Backend {
    pub store: Store,
    pub config: StoreConfig,
    pub postgres: Option<Postgres>,
    pub dir: Option<tempfile::TempDir>,
}

impl Backend {
    /// A second, independent `Store` on the same database (another process, in effect).
    pub async fn open_another(&self) -> Store {
        Store::open(&self.config)
            .await
            .expect("open a second store")
    }
}

pub async fn sqlite() -> Backend {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = StoreConfig::sqlite(dir.path().join("vmon.db"), KEY);
    let store = Store::open(&config).await.expect("open sqlite store");
    Backend {
        store,
        config,
        postgres: None,
        dir: Some(dir),
    }
}

pub async fn postgres() -> Backend {
    let pg = Postgres::start(false).await;
    let config = StoreConfig::postgres(pg.url(), KEY);
    let store = Store::open(&config).await.expect("open postgres store");
    Backend {
        store,
        config,
        postgres: Some(pg),
        dir: None,
    }
}
