//! Directory watching on inotify, with watches added as the requesting user.

use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokio::io::unix::AsyncFd;

use super::entry::entry_info;
use crate::connect::{Code, ConnectError};
use crate::rpc::filesystem::{EventType, FilesystemEvent};
use crate::user::{self, User};

const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_ATTRIB
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF
    | libc::IN_ONLYDIR;

/// Most events a polled watcher keeps between two polls; older ones are dropped.
const MAX_PENDING_EVENTS: usize = 10_000;

/// An inotify event: watch descriptor, mask, name.
pub type RawEvent = (i32, u32, std::ffi::OsString);

/// One watched tree.
pub struct Watch {
    fd: AsyncFd<OwnedFd>,
    /// Watch descriptor to directory path relative to the root ("" for the root itself).
    dirs: HashMap<i32, PathBuf>,
    root: PathBuf,
    recursive: bool,
    include_entry: bool,
    user: User,
}

/// Network filesystems where inotify misses remote changes.
fn is_network_fs(path: &Path) -> bool {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: zeroed statfs is a valid out-parameter.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is NUL-terminated; st is writable.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return false;
    }
    const NETWORK: &[i64] = &[
        0x6969,
        0x517B,
        0xFF53_4D42u32 as i64,
        0xFE53_4D42u32 as i64,
        0x6573_5546,
        0x0102_1997,
    ];
    NETWORK.contains(&(st.f_type as i64))
}

/// Adds watches for `dir` (and, if recursive, every directory under it); runs as the user.
fn add_tree(fd: i32, root: &Path, rel: &Path, recursive: bool) -> io::Result<Vec<(i32, PathBuf)>> {
    let mut out = Vec::new();
    let mut stack = vec![rel.to_path_buf()];
    while let Some(rel) = stack.pop() {
        let abs = if rel.as_os_str().is_empty() {
            root.to_path_buf()
        } else {
            root.join(&rel)
        };
        let c = CString::new(abs.as_os_str().as_bytes())
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: fd is an inotify fd; c is NUL-terminated.
        let wd = unsafe { libc::inotify_add_watch(fd, c.as_ptr(), MASK) };
        if wd < 0 {
            let err = io::Error::last_os_error();
            if out.is_empty() {
                return Err(err);
            }
            continue; // a subdirectory vanished or is unreadable: watch the rest
        }
        out.push((wd, rel.clone()));
        if recursive {
            if let Ok(rd) = std::fs::read_dir(&abs) {
                for e in rd.flatten() {
                    if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                        stack.push(rel.join(e.file_name()));
                    }
                }
            }
        }
    }
    Ok(out)
}

impl Watch {
    pub async fn new(
        user: &User,
        path: &str,
        recursive: bool,
        include_entry: bool,
        allow_network_mounts: bool,
    ) -> Result<Watch, ConnectError> {
        let root = user.resolve(path)?;
        // SAFETY: inotify_init1 returns a new fd or -1.
        let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if raw < 0 {
            return Err(ConnectError::from_io(
                &io::Error::last_os_error(),
                "creating watcher",
            ));
        }
        // SAFETY: raw is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let r = root.clone();
        let added = user::run_as(user, move || {
            let meta = std::fs::metadata(&r)
                .map_err(|e| ConnectError::from_io(&e, format!("watching {}", r.display())))?;
            if !meta.is_dir() {
                return Err(ConnectError::invalid(format!(
                    "path {} is not a directory",
                    r.display()
                )));
            }
            if !allow_network_mounts && is_network_fs(&r) {
                return Err(ConnectError::new(
                    Code::FailedPrecondition,
                    format!(
                        "{} is on a network filesystem; set allow_network_mounts to watch it",
                        r.display()
                    ),
                ));
            }
            add_tree(raw, &r, Path::new(""), recursive)
                .map_err(|e| ConnectError::from_io(&e, format!("watching {}", r.display())))
        })
        .await?;
        // SAFETY: the OwnedFd is moved into the AsyncFd and stays open for its whole lifetime.
        let fd = unsafe { AsyncFd::register(fd) }
            .map_err(|e| ConnectError::from_io(&e.into_parts().1, "registering watcher"))?;
        Ok(Watch {
            fd,
            dirs: added.into_iter().collect(),
            root,
            recursive,
            include_entry,
            user: user.clone(),
        })
    }

    /// Waits for the next batch of events.
    pub async fn next_events(&mut self) -> io::Result<Vec<FilesystemEvent>> {
        let raw = self.read_raw().await?;
        Ok(self.process(raw).await)
    }

    /// Waits for raw inotify events; cancel-safe (nothing is consumed until it returns).
    pub async fn read_raw(&self) -> io::Result<Vec<RawEvent>> {
        let mut buf = vec![0u8; 64 * 1024];
        let n = loop {
            let mut guard = self.fd.readable().await?;
            let res = guard.try_io(|fd| {
                // SAFETY: buf is writable for its length.
                let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match res {
                Ok(Ok(n)) => break n,
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        };
        let mut raw = Vec::new();
        let mut off = 0;
        const HDR: usize = std::mem::size_of::<libc::inotify_event>();
        while off + HDR <= n {
            // SAFETY: the kernel wrote a whole inotify_event header at off; read unaligned.
            let ev: libc::inotify_event =
                unsafe { std::ptr::read_unaligned(buf[off..].as_ptr().cast()) };
            let name_start = off + HDR;
            let name_end = (name_start + ev.len as usize).min(n);
            let name = &buf[name_start..name_end];
            let name = name.split(|b| *b == 0).next().unwrap_or(&[]);
            raw.push((
                ev.wd,
                ev.mask,
                std::ffi::OsStr::from_bytes(name).to_os_string(),
            ));
            off = name_end;
        }
        Ok(raw)
    }

    /// Turns raw events into client events, adding watches for new subdirectories.
    pub async fn process(&mut self, raw: Vec<RawEvent>) -> Vec<FilesystemEvent> {
        let mut events = Vec::new();
        for (wd, mask, name) in raw {
            if mask & libc::IN_IGNORED != 0 {
                self.dirs.remove(&wd);
                continue;
            }
            let Some(dir) = self.dirs.get(&wd).cloned() else {
                continue;
            };
            let rel = if name.is_empty() {
                dir.clone()
            } else {
                dir.join(&name)
            };
            let event_type = if mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
                EventType::Create
            } else if mask & libc::IN_MODIFY != 0 {
                EventType::Write
            } else if mask & (libc::IN_DELETE | libc::IN_DELETE_SELF) != 0 {
                EventType::Remove
            } else if mask & (libc::IN_MOVED_FROM | libc::IN_MOVE_SELF) != 0 {
                EventType::Rename
            } else if mask & libc::IN_ATTRIB != 0 {
                EventType::Chmod
            } else {
                continue;
            };
            // Self events on subdirectories are reported by their parent already.
            if name.is_empty() && !dir.as_os_str().is_empty() {
                continue;
            }
            let abs = self.root.join(&rel);
            if self.recursive && event_type == EventType::Create && mask & libc::IN_ISDIR != 0 {
                let (fd, root, r) = (
                    self.fd.get_ref().as_raw_fd(),
                    self.root.clone(),
                    rel.clone(),
                );
                if let Ok(Ok(added)) =
                    user::run_as(&self.user, move || Ok(add_tree(fd, &root, &r, true))).await
                {
                    self.dirs.extend(added);
                }
            }
            let entry = if self.include_entry && event_type != EventType::Remove {
                let p = abs.clone();
                user::run_as(&self.user, move || Ok(entry_info(&p).ok()))
                    .await
                    .ok()
                    .flatten()
            } else {
                None
            };
            events.push(FilesystemEvent {
                name: rel.display().to_string(),
                event_type,
                entry,
            });
        }
        events
    }
}

/// A watcher created by `CreateWatcher`, polled by `GetWatcherEvents`.
struct Polled {
    events: Arc<Mutex<VecDeque<FilesystemEvent>>>,
    error: Arc<Mutex<Option<String>>>,
    task: tokio::task::JoinHandle<()>,
}

/// The polled watchers by id.
#[derive(Default)]
pub struct Watchers {
    map: Mutex<HashMap<String, Polled>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn new_id() -> String {
    let mut b = [0u8; 12];
    // SAFETY: b is writable for its length.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        b[..8].copy_from_slice(&(t.as_nanos() as u64).to_le_bytes());
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Watchers {
    pub fn add(&self, mut watch: Watch) -> String {
        let id = new_id();
        let events = Arc::new(Mutex::new(VecDeque::new()));
        let error = Arc::new(Mutex::new(None));
        let (ev, er) = (events.clone(), error.clone());
        let task = tokio::spawn(async move {
            loop {
                match watch.next_events().await {
                    Ok(batch) => {
                        let mut q = lock(&ev);
                        q.extend(batch);
                        while q.len() > MAX_PENDING_EVENTS {
                            q.pop_front();
                        }
                    }
                    Err(e) => {
                        *lock(&er) = Some(e.to_string());
                        return;
                    }
                }
            }
        });
        lock(&self.map).insert(
            id.clone(),
            Polled {
                events,
                error,
                task,
            },
        );
        id
    }

    pub fn take_events(&self, id: &str) -> Result<Vec<FilesystemEvent>, ConnectError> {
        let map = lock(&self.map);
        let w = map
            .get(id)
            .ok_or_else(|| ConnectError::not_found(format!("watcher {id} not found")))?;
        if let Some(e) = lock(&w.error).clone() {
            return Err(ConnectError::internal(format!("watcher failed: {e}")));
        }
        let events = lock(&w.events).drain(..).collect();
        Ok(events)
    }

    pub fn remove(&self, id: &str) -> Result<(), ConnectError> {
        let w = lock(&self.map)
            .remove(id)
            .ok_or_else(|| ConnectError::not_found(format!("watcher {id} not found")))?;
        w.task.abort();
        Ok(())
    }
}
