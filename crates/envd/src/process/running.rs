//! One started process: its child, its output fan-out to any number of streams, its input.
//!
//! Output is read continuously whether or not a client is listening (so a process never blocks
//! on a full pipe because nobody is connected); a bounded tail of it is kept so that a client that
//! connects later sees recent output first. A listening client applies back-pressure.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::CString;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::ChildStdin;
use tokio::sync::mpsc;

use super::pty::{self, PtyMaster};
use crate::rpc::process::{DataEvent, EndEvent, ProcessConfig};
use crate::user::User;

/// Output kept per process for clients that connect later.
const HISTORY_BYTES: usize = 1 << 20;
/// Read size for pipes and terminals.
const CHUNK: usize = 32 * 1024;
/// After the child exits, how long to wait for its output pipes to drain before ending the stream
/// (a background grandchild may hold them open forever).
const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// What a subscriber receives after the start event.
#[derive(Debug, Clone)]
pub enum Event {
    Data(DataEvent),
    End(EndEvent),
}

struct Hub {
    history: VecDeque<DataEvent>,
    history_bytes: usize,
    subscribers: Vec<mpsc::Sender<Event>>,
    end: Option<EndEvent>,
}

/// A process started through the Process service.
pub struct Process {
    pub pid: u32,
    pub config: ProcessConfig,
    pub tag: Option<String>,
    stdin: tokio::sync::Mutex<Option<ChildStdin>>,
    pty: Option<PtyMaster>,
    hub: Mutex<Hub>,
}

/// Everything needed to start a child.
pub struct Spec {
    pub config: ProcessConfig,
    pub tag: Option<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: PathBuf,
    pub user: User,
    pub pty: Option<(u16, u16)>,
    pub stdin: bool,
    pub timeout: Option<Duration>,
}

/// The running processes by pid.
pub type Table = Arc<Mutex<HashMap<u32, Arc<Process>>>>;

/// A subscription: the output so far (bounded), then live events.
pub struct Subscription {
    pub history: Vec<DataEvent>,
    pub ended: Option<EndEvent>,
    pub live: mpsc::Receiver<Event>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Process {
    /// Starts the child and its output pump, and registers it in `table`.
    pub fn start(spec: Spec, table: Table) -> io::Result<Arc<Process>> {
        let pty_pair = match spec.pty {
            Some((cols, rows)) => Some(pty::open(cols, rows, spec.user.uid, spec.user.gid)?),
            None => None,
        };
        let mut cmd = command(&spec, pty_pair.as_ref())?;
        become_user_at_exec(&mut cmd, &spec.user, &spec.cwd, pty_pair.is_some())?;
        let mut child = cmd.spawn()?;
        drop(cmd);

        let pid = child.id().unwrap_or(0);
        let (out_tx, out_rx) = mpsc::channel::<DataEvent>(64);
        let (master, mut readers) = match pty_pair {
            Some(pair) => {
                // The child holds its own copies; ours would keep the terminal open after it ends.
                drop(pair.slave);
                (Some(pair.master), Vec::new())
            }
            None => (None, pump_pipes(&mut child, &out_tx)),
        };
        let process = Arc::new(Process {
            pid,
            config: spec.config,
            tag: spec.tag,
            stdin: tokio::sync::Mutex::new(child.stdin.take()),
            pty: master,
            hub: Mutex::new(Hub {
                history: VecDeque::new(),
                history_bytes: 0,
                subscribers: Vec::new(),
                end: None,
            }),
        });
        if process.pty.is_some() {
            readers.push(tokio::spawn(process.clone().pump_pty(out_tx)));
        } else {
            drop(out_tx);
        }

        lock(&table).insert(pid, process.clone());
        tracing::info!(
            logger = "process",
            event_type = "process_start",
            pid,
            cmd = %command_line(&process.config),
            user = %spec.user.name,
            tag = process.tag.as_deref().unwrap_or(""),
            "process started"
        );
        tokio::spawn(
            process
                .clone()
                .supervise(child, out_rx, readers, spec.timeout, table),
        );
        Ok(process)
    }

    /// Reads the terminal's output until it closes or nobody takes it.
    async fn pump_pty(self: Arc<Self>, out_tx: mpsc::Sender<DataEvent>) {
        let mut buf = vec![0u8; CHUNK];
        while let Some(master) = self.pty.as_ref() {
            match master.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if out_tx
                        .send(DataEvent::Pty(buf[..n].to_vec()))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
    }

    /// Waits for the child's end (killing it at `timeout`), publishes it and unregisters it.
    async fn supervise(
        self: Arc<Self>,
        child: tokio::process::Child,
        out_rx: mpsc::Receiver<DataEvent>,
        readers: Vec<tokio::task::JoinHandle<()>>,
        timeout: Option<Duration>,
        table: Table,
    ) {
        let pid = self.pid;
        let killer = timeout.map(|t| {
            tokio::spawn(async move {
                tokio::time::sleep(t).await;
                signal(pid, libc::SIGKILL);
            })
        });
        let end = self.pump(child, out_rx, readers).await;
        if let Some(k) = killer {
            k.abort();
        }
        lock(&table).remove(&pid);
        tracing::info!(
            logger = "process",
            event_type = "process_end",
            pid,
            cmd = %command_line(&self.config),
            exit_code = end.exit_code,
            exited = end.exited,
            status = %end.status,
            "process ended"
        );
    }

    async fn pump(
        &self,
        mut child: tokio::process::Child,
        mut out_rx: mpsc::Receiver<DataEvent>,
        readers: Vec<tokio::task::JoinHandle<()>>,
    ) -> EndEvent {
        let wait = child.wait();
        tokio::pin!(wait);
        let mut status = None;
        let mut deadline = None;
        loop {
            tokio::select! {
                ev = out_rx.recv() => match ev {
                    Some(ev) => self.publish(Event::Data(ev)).await,
                    None => break,
                },
                st = &mut wait, if status.is_none() => {
                    status = Some(st);
                    deadline = Some(tokio::time::Instant::now() + DRAIN_GRACE);
                }
                _ = sleep_until(deadline), if deadline.is_some() => break,
            }
        }
        for r in readers {
            r.abort();
        }
        let status = match status {
            Some(s) => s,
            None => wait.await,
        };
        let end = end_event(status);
        self.publish(Event::End(end.clone())).await;
        end
    }

    async fn publish(&self, ev: Event) {
        let subscribers = {
            let mut hub = lock(&self.hub);
            match &ev {
                Event::Data(d) => {
                    hub.history_bytes += d.len();
                    hub.history.push_back(d.clone());
                    while hub.history_bytes > HISTORY_BYTES {
                        match hub.history.pop_front() {
                            Some(old) => hub.history_bytes -= old.len(),
                            None => break,
                        }
                    }
                }
                Event::End(e) => hub.end = Some(e.clone()),
            }
            hub.subscribers.retain(|s| !s.is_closed());
            hub.subscribers.clone()
        };
        for s in subscribers {
            // A closed subscriber is dropped at the next publish.
            let _ = s.send(ev.clone()).await;
        }
        if matches!(ev, Event::End(_)) {
            lock(&self.hub).subscribers.clear();
        }
    }

    /// Subscribes to this process's events.
    pub fn subscribe(&self) -> Subscription {
        let (tx, rx) = mpsc::channel(64);
        let mut hub = lock(&self.hub);
        let history = hub.history.iter().cloned().collect();
        let ended = hub.end.clone();
        if ended.is_none() {
            hub.subscribers.push(tx);
        }
        Subscription {
            history,
            ended,
            live: rx,
        }
    }

    pub fn has_pty(&self) -> bool {
        self.pty.is_some()
    }

    pub async fn write_stdin(&self, data: &[u8]) -> io::Result<()> {
        let mut stdin = self.stdin.lock().await;
        match stdin.as_mut() {
            Some(s) => {
                s.write_all(data).await?;
                s.flush().await
            }
            None => Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "stdin is not enabled or is closed",
            )),
        }
    }

    pub async fn write_pty(&self, data: &[u8]) -> io::Result<()> {
        match &self.pty {
            Some(m) => m.write_all(data).await,
            None => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "process has no terminal",
            )),
        }
    }

    pub async fn close_stdin(&self) {
        let mut stdin = self.stdin.lock().await;
        if let Some(mut s) = stdin.take() {
            let _ = s.shutdown().await;
        }
    }

    pub fn resize(&self, cols: u16, rows: u16) -> io::Result<()> {
        match &self.pty {
            Some(m) => m.resize(cols, rows),
            None => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "process has no terminal",
            )),
        }
    }

    pub fn signal(&self, sig: libc::c_int) {
        signal(self.pid, sig)
    }
}

/// The child's command: its program, arguments and environment, and its standard streams on
/// the terminal's slave or on pipes.
fn command(spec: &Spec, pty: Option<&pty::PtyPair>) -> io::Result<tokio::process::Command> {
    let mut cmd = tokio::process::Command::new(&spec.config.cmd);
    cmd.args(&spec.config.args)
        .env_clear()
        .envs(&spec.env)
        .kill_on_drop(false);
    match pty {
        Some(pair) => {
            cmd.stdin(Stdio::from(pair.slave.try_clone()?));
            cmd.stdout(Stdio::from(pair.slave.try_clone()?));
            cmd.stderr(Stdio::from(pair.slave.try_clone()?));
        }
        None => {
            cmd.stdin(if spec.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            });
            cmd.stdout(Stdio::piped());
            cmd.stderr(Stdio::piped());
        }
    }
    Ok(cmd)
}

/// Makes the child, between fork and exec, the leader of its own session (with the terminal as
/// its controlling one), then `user`, then moves it into `cwd`.
fn become_user_at_exec(
    cmd: &mut tokio::process::Command,
    user: &User,
    cwd: &Path,
    with_tty: bool,
) -> io::Result<()> {
    let cwd = CString::new(cwd.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let (uid, gid, groups) = (user.uid, user.gid, user.groups.clone());
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls on data prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let check = |rc: libc::c_int| {
                if rc < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(())
                }
            };
            // Own session (and process group), so signals reach the whole job.
            check(libc::setsid())?;
            if with_tty {
                check(libc::ioctl(0, libc::TIOCSCTTY, 0))?;
            }
            check(libc::setgroups(groups.len(), groups.as_ptr()))?;
            check(libc::setgid(gid))?;
            check(libc::setuid(uid))?;
            // After dropping privileges, so the user's own permissions decide.
            check(libc::chdir(cwd.as_ptr()))?;
            Ok(())
        });
    }
    Ok(())
}

/// One reader task per output pipe of the child, each sending what it reads to `out_tx`.
fn pump_pipes(
    child: &mut tokio::process::Child,
    out_tx: &mpsc::Sender<DataEvent>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut readers = Vec::new();
    if let Some(out) = child.stdout.take() {
        readers.push(tokio::spawn(pump_pipe(
            out,
            DataEvent::Stdout,
            out_tx.clone(),
        )));
    }
    if let Some(err) = child.stderr.take() {
        readers.push(tokio::spawn(pump_pipe(
            err,
            DataEvent::Stderr,
            out_tx.clone(),
        )));
    }
    readers
}

/// Signals the process's group (its whole job), or the process alone if that fails.
fn signal(pid: u32, sig: libc::c_int) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    if pid <= 0 {
        return;
    }
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        if libc::kill(-pid, sig) != 0 {
            libc::kill(pid, sig);
        }
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

async fn pump_pipe<R: AsyncRead + Unpin>(
    mut r: R,
    wrap: fn(Vec<u8>) -> DataEvent,
    tx: mpsc::Sender<DataEvent>,
) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if tx.send(wrap(buf[..n].to_vec())).await.is_err() {
                    break;
                }
            }
        }
    }
}

/// The end event, worded like Go's `ProcessState` (which the SDKs were written against).
fn end_event(status: io::Result<std::process::ExitStatus>) -> EndEvent {
    match status {
        Err(e) => EndEvent {
            exit_code: -1,
            exited: false,
            status: "unknown".into(),
            error: Some(format!("waiting for process: {e}")),
        },
        Ok(st) => {
            if let Some(code) = st.code() {
                let status = format!("exit status {code}");
                EndEvent {
                    exit_code: code,
                    exited: true,
                    error: (code != 0).then(|| status.clone()),
                    status,
                }
            } else {
                let sig = st.signal().unwrap_or(0);
                let mut status = format!("signal: {}", signal_name(sig));
                if st.core_dumped() {
                    status.push_str(" (core dumped)");
                }
                EndEvent {
                    exit_code: -1,
                    exited: false,
                    error: Some(status.clone()),
                    status,
                }
            }
        }
    }
}

fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGHUP => "hangup".into(),
        libc::SIGINT => "interrupt".into(),
        libc::SIGQUIT => "quit".into(),
        libc::SIGABRT => "aborted".into(),
        libc::SIGKILL => "killed".into(),
        libc::SIGSEGV => "segmentation fault".into(),
        libc::SIGPIPE => "broken pipe".into(),
        libc::SIGTERM => "terminated".into(),
        libc::SIGUSR1 => "user defined signal 1".into(),
        libc::SIGUSR2 => "user defined signal 2".into(),
        n => format!("signal {n}"),
    }
}

fn command_line(c: &ProcessConfig) -> String {
    let mut s = c.cmd.clone();
    for a in &c.args {
        s.push(' ');
        s.push_str(a);
    }
    s
}
