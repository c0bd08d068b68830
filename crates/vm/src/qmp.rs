//! A typed async client for QEMU's machine protocol on a unix socket.
//!
//! One reader task owns the socket's read half: replies go to the waiting caller by `id`, events
//! to a broadcast channel. Every reply line is size-bounded: QEMU is trusted more than a guest,
//! but a wedged or hostile peer must not make the node allocate without limit.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::sync::{broadcast, oneshot, Mutex};

/// Longest QMP line accepted (query-commands is ~20 KB; device state never travels here).
const MAX_LINE: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("cannot reach QMP at {path}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("QMP connection lost")]
    Closed,
    #[error("QMP {command} failed: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    #[error("QMP {0} timed out")]
    Timeout(String),
    #[error("QMP protocol error: {0}")]
    Protocol(String),
}

type Pending = Arc<std::sync::Mutex<HashMap<u64, oneshot::Sender<Result<Value, QmpError>>>>>;

/// An event QEMU sent on its own.
#[derive(Debug, Clone, Deserialize)]
pub struct QmpEvent {
    pub event: String,
    #[serde(default)]
    pub data: Value,
}

pub struct Qmp {
    writer: Mutex<tokio::net::unix::OwnedWriteHalf>,
    pending: Pending,
    next_id: AtomicU64,
    events: broadcast::Sender<QmpEvent>,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Qmp {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

#[derive(Debug, Deserialize)]
pub struct Status {
    pub status: String,
    #[serde(default)]
    pub running: bool,
}

#[derive(Debug, Deserialize)]
pub struct MigrationInfo {
    #[serde(default)]
    pub status: Option<String>,
    #[serde(default, rename = "error-desc")]
    pub error_desc: Option<String>,
}

impl Qmp {
    /// Connects, retrying until `deadline` (QEMU creates the socket shortly after exec).
    pub async fn connect(path: &Path, deadline: Duration) -> Result<Qmp, QmpError> {
        let start = tokio::time::Instant::now();
        // A socket path is limited to 107 bytes; a long data dir (a pooled process's socket
        // moved into `sandboxes/<id>/<execution>/`) passes it. Reach it through the
        // directory's descriptor instead, whose `/proc/self/fd/N/` path is short.
        let dir = (path.as_os_str().len() > 100)
            .then(|| path.parent().and_then(|d| std::fs::File::open(d).ok()))
            .flatten();
        let short = match (&dir, path.file_name()) {
            (Some(d), Some(name)) => {
                use std::os::fd::AsRawFd;
                Some(
                    Path::new("/proc/self/fd")
                        .join(d.as_raw_fd().to_string())
                        .join(name),
                )
            }
            _ => None,
        };
        let target = short.as_deref().unwrap_or(path);
        let stream = loop {
            match UnixStream::connect(target).await {
                Ok(s) => break s,
                Err(e) if start.elapsed() >= deadline => {
                    return Err(QmpError::Connect {
                        path: path.display().to_string(),
                        source: e,
                    })
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        };
        let (rd, wr) = stream.into_split();
        let mut rd = BufReader::new(rd);
        // The greeting. A client that connects the moment the socket exists can see an event
        // (a `RESUME` as the machine starts) before it: skip a few of those.
        let mut skipped = 0;
        loop {
            let line = read_line(&mut rd).await?;
            if line.contains("\"QMP\"") {
                break;
            }
            let is_event = serde_json::from_str::<Value>(&line)
                .map(|v| v.get("event").is_some())
                .unwrap_or(false);
            if !is_event || skipped >= 16 {
                return Err(QmpError::Protocol(format!(
                    "unexpected greeting {line:.200}"
                )));
            }
            skipped += 1;
        }
        let pending: Pending = Arc::default();
        let (events, _) = broadcast::channel(256);
        let reader = tokio::spawn(read_loop(rd, pending.clone(), events.clone()));
        let qmp = Qmp {
            writer: Mutex::new(wr),
            pending,
            next_id: AtomicU64::new(1),
            events,
            reader,
        };
        qmp.execute_raw("qmp_capabilities", Value::Null, Duration::from_secs(10))
            .await?;
        Ok(qmp)
    }

    pub fn events(&self) -> broadcast::Receiver<QmpEvent> {
        self.events.subscribe()
    }

    /// Runs one command and returns its raw `return` value.
    pub async fn execute_raw(
        &self,
        command: &str,
        arguments: Value,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        self.execute_fd(command, arguments, None, timeout).await
    }

    /// Runs one command, passing `fd` along with it (SCM_RIGHTS), as `getfd` and `add-fd`
    /// expect.
    async fn execute_fd(
        &self,
        command: &str,
        arguments: Value,
        fd: Option<std::os::fd::BorrowedFd<'_>>,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut msg = json!({"execute": command, "id": id});
        if !arguments.is_null() {
            msg["arguments"] = arguments;
        }
        let (tx, rx) = oneshot::channel();
        if let Ok(mut p) = self.pending.lock() {
            p.insert(id, tx);
        }
        let mut line = msg.to_string();
        line.push('\n');
        {
            let mut w = self.writer.lock().await;
            let sent = match fd {
                None => w.write_all(line.as_bytes()).await.is_ok(),
                Some(fd) => send_with_fd(w.as_ref(), line.as_bytes(), fd).await.is_ok(),
            };
            if !sent {
                if let Ok(mut p) = self.pending.lock() {
                    p.remove(&id);
                }
                return Err(QmpError::Closed);
            }
        }
        let reply = match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(QmpError::Closed),
            Err(_) => {
                if let Ok(mut p) = self.pending.lock() {
                    p.remove(&id);
                }
                Err(QmpError::Timeout(command.to_string()))
            }
        };
        reply.map_err(|e| match e {
            QmpError::Command { class, desc, .. } => QmpError::Command {
                command: command.to_string(),
                class,
                desc,
            },
            other => other,
        })
    }

    pub async fn execute<T: DeserializeOwned>(
        &self,
        command: &str,
        arguments: Value,
    ) -> Result<T, QmpError> {
        let v = self
            .execute_raw(command, arguments, Duration::from_secs(60))
            .await?;
        serde_json::from_value(v).map_err(|e| QmpError::Protocol(format!("{command}: {e}")))
    }

    async fn exec_unit(&self, command: &str, arguments: Value) -> Result<(), QmpError> {
        self.execute_raw(command, arguments, Duration::from_secs(60))
            .await
            .map(|_| ())
    }

    pub async fn stop(&self) -> Result<(), QmpError> {
        self.exec_unit("stop", Value::Null).await
    }

    pub async fn cont(&self) -> Result<(), QmpError> {
        self.exec_unit("cont", Value::Null).await
    }

    pub async fn quit(&self) -> Result<(), QmpError> {
        self.exec_unit("quit", Value::Null).await
    }

    pub async fn system_powerdown(&self) -> Result<(), QmpError> {
        self.exec_unit("system_powerdown", Value::Null).await
    }

    pub async fn query_status(&self) -> Result<Status, QmpError> {
        self.execute("query-status", Value::Null).await
    }

    /// The names of every command this QEMU offers.
    pub async fn query_commands(&self) -> Result<Vec<String>, QmpError> {
        #[derive(Deserialize)]
        struct C {
            name: String,
        }
        let v: Vec<C> = self.execute("query-commands", Value::Null).await?;
        Ok(v.into_iter().map(|c| c.name).collect())
    }

    /// Write requests the guest has completed, summed over its block devices. A booting guest
    /// writes its root file system's superblock as the root is mounted read-write, before its
    /// init runs: no write yet is a boot that has not reached its root.
    pub async fn disk_writes(&self) -> Result<u64, QmpError> {
        let v = self
            .execute_raw("query-blockstats", Value::Null, Duration::from_secs(10))
            .await?;
        Ok(v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| d["stats"]["wr_operations"].as_u64())
            .sum())
    }

    /// Where each vCPU is (`CPU#n` and its `RIP=… HLT=…` line from the human monitor's
    /// `info registers -a`): a report of a guest that stopped making progress.
    pub async fn cpu_positions(&self) -> Result<Vec<String>, QmpError> {
        let v = self
            .execute_raw(
                "human-monitor-command",
                json!({"command-line": "info registers -a"}),
                Duration::from_secs(10),
            )
            .await?;
        Ok(v.as_str()
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("CPU#") || l.starts_with("RIP="))
            .take(2 * 64)
            .map(|l| l.chars().take(200).collect())
            .collect())
    }

    /// Writes every device's state (no RAM) to `path`.
    pub async fn save_devices_state(&self, path: &Path) -> Result<(), QmpError> {
        self.exec_unit(
            "xen-save-devices-state",
            json!({"filename": path.display().to_string(), "live": false}),
        )
        .await
    }

    /// Turns off the self-announce QEMU starts after an incoming load (gratuitous ARPs the guest
    /// itself sends with virtio-net's guest-announce): every slot gives its guest the same MAC
    /// and address, so there is nothing to announce, and the guest's first moments after a
    /// restore are better spent answering.
    /// Also asks for `MIGRATION` events, so the end of a load is told, not polled for.
    pub async fn prepare_incoming(&self) -> Result<(), QmpError> {
        self.exec_unit("migrate-set-parameters", json!({"announce-rounds": 0}))
            .await?;
        self.exec_unit(
            "migrate-set-capabilities",
            json!({"capabilities": [{"capability": "events", "state": true}]}),
        )
        .await
    }

    /// Loads a device-state stream into a QEMU started with `-incoming defer`, and waits until
    /// the load has finished.
    pub async fn migrate_incoming_file(&self, path: &Path) -> Result<(), QmpError> {
        // The file goes over the socket as an fd: no shell and `cat` spawned per restore.
        let file = std::fs::File::open(path)
            .map_err(|e| QmpError::Protocol(format!("cannot open {}: {e}", path.display())))?;
        use std::os::fd::AsFd;
        self.execute_fd(
            "getfd",
            json!({"fdname": "vmon-incoming"}),
            Some(file.as_fd()),
            Duration::from_secs(10),
        )
        .await?;
        drop(file);
        let mut events = self.events();
        self.exec_unit("migrate-incoming", json!({"uri": "fd:vmon-incoming"}))
            .await?;
        let start = tokio::time::Instant::now();
        loop {
            // Wait for a MIGRATION event (when asked for), checking the state at least every
            // 20 ms either way.
            let tick = tokio::time::sleep(Duration::from_millis(20));
            tokio::pin!(tick);
            loop {
                tokio::select! {
                    ev = events.recv() => match ev {
                        Ok(e) if e.event == "MIGRATION" => {
                            let st = e.data.get("status").and_then(Value::as_str).unwrap_or("");
                            if matches!(st, "completed" | "failed" | "cancelled") {
                                break;
                            }
                        }
                        Ok(_) => {}
                        Err(broadcast::error::RecvError::Lagged(_)) => break,
                        Err(broadcast::error::RecvError::Closed) => return Err(QmpError::Closed),
                    },
                    _ = &mut tick => break,
                }
            }
            let m: MigrationInfo = self.execute("query-migrate", Value::Null).await?;
            match m.status.as_deref() {
                Some("completed") => return Ok(()),
                Some("failed") | Some("cancelled") => {
                    return Err(QmpError::Command {
                        command: "migrate-incoming".into(),
                        class: "MigrationFailed".into(),
                        desc: m.error_desc.unwrap_or_else(|| "load failed".into()),
                    })
                }
                _ => {}
            }
            // Some QEMUs report no status on the destination: the run state tells.
            let s = self.query_status().await?;
            if s.status == "paused" || s.status == "running" {
                if m.status.is_none() {
                    return Ok(());
                }
            } else if s.status == "postmigrate" || s.status == "internal-error" {
                return Err(QmpError::Protocol(format!(
                    "incoming load ended in {}",
                    s.status
                )));
            }
            if start.elapsed() > Duration::from_secs(60) {
                return Err(QmpError::Timeout("migrate-incoming".into()));
            }
        }
    }

    /// Hands QEMU the descriptor `fd` under `name` (`getfd`), for a later `fd:<name>` URI.
    pub async fn getfd(&self, name: &str, fd: std::os::fd::BorrowedFd<'_>) -> Result<(), QmpError> {
        self.execute_fd(
            "getfd",
            json!({ "fdname": name }),
            Some(fd),
            Duration::from_secs(10),
        )
        .await
        .map(|_| ())
    }

    /// The active (top) layer of the disk behind device `qdev_id`, as QEMU has it: its node name
    /// and file. `None` when no such device has a medium.
    pub async fn block_top(&self, qdev_id: &str) -> Result<Option<(String, String)>, QmpError> {
        #[derive(Deserialize)]
        struct Inserted {
            #[serde(rename = "node-name")]
            node_name: String,
            file: String,
        }
        #[derive(Deserialize)]
        struct Device {
            #[serde(default)]
            qdev: String,
            #[serde(default)]
            device: String,
            inserted: Option<Inserted>,
        }
        let devices: Vec<Device> = self.execute("query-block", Value::Null).await?;
        // A `-device … id=X` disk shows as `/machine/peripheral/X/virtio-backend`.
        let wanted = format!("/machine/peripheral/{qdev_id}/");
        Ok(devices
            .into_iter()
            .find(|d| d.qdev.starts_with(&wanted) || d.qdev == qdev_id || d.device == qdev_id)
            .and_then(|d| d.inserted)
            .map(|i| (i.node_name, i.file)))
    }

    /// Switches the running disk `node` to a new overlay created at `file`; the old image
    /// becomes read-only backing.
    pub async fn blockdev_snapshot_sync(
        &self,
        node: &str,
        file: &Path,
        new_node: &str,
    ) -> Result<(), QmpError> {
        self.exec_unit(
            "blockdev-snapshot-sync",
            json!({
                "node-name": node,
                "snapshot-file": file.display().to_string(),
                "snapshot-node-name": new_node,
                "format": "qcow2",
            }),
        )
        .await
    }
}

/// Writes `data` with one SCM_RIGHTS message carrying `fd`.
async fn send_with_fd(
    sock: &UnixStream,
    data: &[u8],
    fd: std::os::fd::BorrowedFd<'_>,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let raw = fd.as_raw_fd();
    let sent = loop {
        sock.writable().await?;
        match sock.try_io(tokio::io::Interest::WRITABLE, || {
            // SAFETY: every pointer in msg refers to a live local buffer of the stated length;
            // the control buffer is sized by CMSG_SPACE for one int and CMSG_FIRSTHDR is checked.
            unsafe {
                let mut iov = libc::iovec {
                    iov_base: data.as_ptr() as *mut libc::c_void,
                    iov_len: data.len(),
                };
                let space = libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) as usize;
                let mut cbuf = vec![0u8; space];
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = &mut iov;
                msg.msg_iovlen = 1;
                msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
                msg.msg_controllen = space as _;
                let cmsg = libc::CMSG_FIRSTHDR(&msg);
                if cmsg.is_null() {
                    return Err(std::io::Error::other("no room for SCM_RIGHTS"));
                }
                (*cmsg).cmsg_level = libc::SOL_SOCKET;
                (*cmsg).cmsg_type = libc::SCM_RIGHTS;
                (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
                std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut libc::c_int, raw);
                let n = libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL);
                if n < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            }
        }) {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    };
    if sent < data.len() {
        // The fd went with the first byte; the rest of the line is plain data.
        let mut rest = &data[sent..];
        while !rest.is_empty() {
            sock.writable().await?;
            match sock.try_write(rest) {
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

async fn read_line<R: tokio::io::AsyncBufRead + Unpin>(rd: &mut R) -> Result<String, QmpError> {
    read_line_bounded(rd, MAX_LINE).await
}

/// One line without its `\n`; a line of more than `max` bytes is an error, and never more than
/// `max` bytes of it are held.
async fn read_line_bounded<R: tokio::io::AsyncBufRead + Unpin>(
    rd: &mut R,
    max: usize,
) -> Result<String, QmpError> {
    let mut buf = Vec::new();
    loop {
        let chunk = rd.fill_buf().await.map_err(|_| QmpError::Closed)?;
        if chunk.is_empty() {
            return Err(QmpError::Closed);
        }
        let newline = chunk.iter().position(|&b| b == b'\n');
        let take = newline.unwrap_or(chunk.len());
        if buf.len() + take > max {
            return Err(QmpError::Protocol("reply line too long".into()));
        }
        buf.extend_from_slice(&chunk[..take]);
        match newline {
            Some(pos) => {
                rd.consume(pos + 1);
                break;
            }
            None => rd.consume(take),
        }
    }
    String::from_utf8(buf).map_err(|_| QmpError::Protocol("reply is not UTF-8".into()))
}

async fn read_loop<R: tokio::io::AsyncBufRead + Unpin>(
    mut rd: R,
    pending: Pending,
    events: broadcast::Sender<QmpEvent>,
) {
    loop {
        let line = match read_line(&mut rd).await {
            Ok(l) => l,
            Err(_) => break,
        };
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if v.get("event").is_some() {
            if let Ok(ev) = serde_json::from_value::<QmpEvent>(v) {
                let _ = events.send(ev);
            }
            continue;
        }
        let Some(id) = v.get("id").and_then(Value::as_u64) else {
            continue;
        };
        let Some(tx) = pending.lock().ok().and_then(|mut p| p.remove(&id)) else {
            continue;
        };
        let result = if let Some(r) = v.get("return") {
            Ok(r.clone())
        } else if let Some(e) = v.get("error") {
            Err(QmpError::Command {
                command: String::new(),
                class: e["class"].as_str().unwrap_or("Error").to_string(),
                desc: e["desc"].as_str().unwrap_or("").to_string(),
            })
        } else {
            Err(QmpError::Protocol(format!(
                "reply without return: {line:.200}"
            )))
        };
        let _ = tx.send(result);
    }
    // Connection gone: fail everyone still waiting.
    if let Ok(mut p) = pending.lock() {
        for (_, tx) in p.drain() {
            let _ = tx.send(Err(QmpError::Closed));
        }
    }
}

#[cfg(test)]
#[path = "qmp_fuzz.rs"]
mod fuzz;

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

    /// A scripted QMP peer: sends `before` lines, then answers every command with success.
    async fn peer(path: &Path, before: &'static [&'static str]) -> tokio::task::JoinHandle<()> {
        let listener = tokio::net::UnixListener::bind(path).expect("bind");
        tokio::spawn(async move {
            let Ok((s, _)) = listener.accept().await else {
                return;
            };
            let (rd, mut wr) = s.into_split();
            for l in before {
                let _ = wr.write_all(format!("{l}\r\n").as_bytes()).await;
            }
            let mut lines = BufReader::new(rd).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                let id = serde_json::from_str::<Value>(&l)
                    .ok()
                    .and_then(|v| v.get("id").cloned())
                    .unwrap_or(Value::Null);
                let answer = json!({"return": {}, "id": id}).to_string();
                let _ = wr.write_all(format!("{answer}\r\n").as_bytes()).await;
            }
        })
    }

    const GREETING: &str = r#"{"QMP": {"version": {}, "capabilities": ["oob"]}}"#;
    const RESUME: &str = r#"{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "RESUME"}"#;

    #[tokio::test]
    async fn an_event_before_the_greeting_is_skipped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qmp.sock");
        let _peer = peer(&path, &[RESUME, GREETING]).await;
        let qmp = Qmp::connect(&path, Duration::from_secs(5))
            .await
            .expect("connect despite the early event");
        qmp.execute_raw("stop", Value::Null, Duration::from_secs(5))
            .await
            .expect("a command after it");
    }

    #[tokio::test]
    async fn anything_else_before_the_greeting_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qmp.sock");
        let _peer = peer(&path, &[r#"{"hello": 1}"#, GREETING]).await;
        match Qmp::connect(&path, Duration::from_secs(5)).await {
            Err(QmpError::Protocol(m)) => assert!(m.contains("unexpected greeting"), "{m}"),
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("a non-QMP peer was accepted"),
        }
    }
}
