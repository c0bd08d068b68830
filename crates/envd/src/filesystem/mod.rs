//! `filesystem.Filesystem`: file operations done with the requesting user's permissions.

pub mod entry;
pub mod watch;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Response};
use hyper::body::Incoming;

use crate::agent::Agent;
use crate::connect::{self, Body, Code, ConnectError, EnvelopeReader, Kind};
use crate::rpc::filesystem::*;
use crate::rpc::process::Empty;
use crate::user::{run_as, User};
use entry::entry_info;
use watch::Watch;

const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);

pub fn kind(method: &str) -> Option<Kind> {
    Some(match method {
        "WatchDir" => Kind::ServerStream,
        "Stat" | "MakeDir" | "Move" | "ListDir" | "Remove" | "CreateWatcher"
        | "GetWatcherEvents" | "RemoveWatcher" => Kind::Unary,
        _ => return None,
    })
}

pub async fn dispatch(
    agent: Arc<Agent>,
    user: User,
    method: &str,
    headers: HeaderMap,
    body: Incoming,
) -> Response<Body> {
    if method == "WatchDir" {
        let mut reader = EnvelopeReader::new(body);
        let msg = match reader.next_message::<WatchRequest>().await {
            Ok(m) => m.unwrap_or_default(),
            Err(e) => return connect::stream_error_response(e),
        };
        // Keeps the connection reusable (`EnvelopeReader::drain`).
        tokio::spawn(reader.drain(
            connect::MAX_MESSAGE_BYTES,
            std::time::Duration::from_secs(10),
        ));
        return watch_dir(&user, &headers, msg).await;
    }
    macro_rules! unary {
        ($f:expr) => {
            connect::unary_response(match connect::read_unary(body).await {
                Ok(msg) => $f(msg).await,
                Err(e) => Err(e),
            })
        };
    }
    match method {
        "Stat" => unary!(|m: PathRequest| stat(&user, m)),
        "MakeDir" => unary!(|m: PathRequest| make_dir(&user, m)),
        "Move" => unary!(|m: MoveRequest| move_entry(&user, m)),
        "ListDir" => unary!(|m: ListDirRequest| list_dir(&user, m)),
        "Remove" => unary!(|m: PathRequest| remove(&user, m)),
        "CreateWatcher" => unary!(|m: WatchRequest| create_watcher(&agent, &user, m)),
        "GetWatcherEvents" => unary!(|m: WatcherRequest| async move {
            agent
                .watchers
                .take_events(&m.watcher_id)
                .map(|events| GetWatcherEventsResponse { events })
        }),
        "RemoveWatcher" => unary!(|m: WatcherRequest| async move {
            agent.watchers.remove(&m.watcher_id).map(|_| Empty {})
        }),
        _ => ConnectError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem/{method} is not implemented"),
        )
        .into_response(),
    }
}

fn required(path: &str) -> Result<(), ConnectError> {
    if path.is_empty() {
        return Err(ConnectError::invalid("path is required"));
    }
    Ok(())
}

fn io_err(e: std::io::Error, what: &str, p: &Path) -> ConnectError {
    ConnectError::from_io(&e, format!("{what} {}", p.display()))
}

async fn stat(user: &User, m: PathRequest) -> Result<EntryResponse, ConnectError> {
    required(&m.path)?;
    let p = user.resolve(&m.path)?;
    run_as(user, move || {
        entry_info(&p)
            .map(|entry| EntryResponse { entry })
            .map_err(|e| io_err(e, "stat", &p))
    })
    .await
}

async fn make_dir(user: &User, m: PathRequest) -> Result<EntryResponse, ConnectError> {
    required(&m.path)?;
    let p = user.resolve(&m.path)?;
    run_as(user, move || {
        match std::fs::metadata(&p) {
            Ok(meta) if meta.is_dir() => {
                return Err(ConnectError::new(
                    Code::AlreadyExists,
                    format!("directory {} already exists", p.display()),
                ))
            }
            Ok(_) => {
                return Err(ConnectError::invalid(format!(
                    "path {} already exists and is not a directory",
                    p.display()
                )))
            }
            Err(_) => {}
        }
        std::fs::create_dir_all(&p).map_err(|e| io_err(e, "creating directory", &p))?;
        entry_info(&p)
            .map(|entry| EntryResponse { entry })
            .map_err(|e| io_err(e, "stat", &p))
    })
    .await
}

async fn move_entry(user: &User, m: MoveRequest) -> Result<EntryResponse, ConnectError> {
    required(&m.source)?;
    required(&m.destination)?;
    let (src, dst) = (user.resolve(&m.source)?, user.resolve(&m.destination)?);
    run_as(user, move || {
        std::fs::symlink_metadata(&src).map_err(|e| io_err(e, "moving", &src))?;
        if let Some(parent) = dst.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io_err(e, "creating directory", parent))?;
        }
        std::fs::rename(&src, &dst).map_err(|e| io_err(e, "moving to", &dst))?;
        entry_info(&dst)
            .map(|entry| EntryResponse { entry })
            .map_err(|e| io_err(e, "stat", &dst))
    })
    .await
}

async fn list_dir(user: &User, m: ListDirRequest) -> Result<ListDirResponse, ConnectError> {
    let p = user.resolve(&m.path)?;
    let depth = m.depth.max(1);
    run_as(user, move || {
        let meta = std::fs::metadata(&p).map_err(|e| io_err(e, "listing", &p))?;
        if !meta.is_dir() {
            return Err(ConnectError::invalid(format!(
                "path {} is not a directory",
                p.display()
            )));
        }
        let mut entries = Vec::new();
        walk(&p, depth, &mut entries).map_err(|e| io_err(e, "listing", &p))?;
        Ok(ListDirResponse { entries })
    })
    .await
}

/// Depth-first, names in lexical order, not following symlinked directories.
fn walk(dir: &Path, depth: u32, out: &mut Vec<EntryInfo>) -> std::io::Result<()> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .collect();
    names.sort();
    for path in names {
        let Ok(info) = entry_info(&path) else {
            continue;
        };
        let recurse = depth > 1 && info.file_type == FileType::Directory && !info.is_symlink;
        out.push(info);
        if recurse {
            // An unreadable subdirectory is listed but not descended into.
            let _ = walk(&path, depth - 1, out);
        }
    }
    Ok(())
}

async fn remove(user: &User, m: PathRequest) -> Result<Empty, ConnectError> {
    required(&m.path)?;
    let p = user.resolve(&m.path)?;
    run_as(user, move || {
        let meta = match std::fs::symlink_metadata(&p) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Empty {}),
            Err(e) => return Err(io_err(e, "removing", &p)),
        };
        let res = if meta.is_dir() {
            std::fs::remove_dir_all(&p)
        } else {
            std::fs::remove_file(&p)
        };
        res.map_err(|e| io_err(e, "removing", &p))?;
        Ok(Empty {})
    })
    .await
}

async fn create_watcher(
    agent: &Agent,
    user: &User,
    m: WatchRequest,
) -> Result<CreateWatcherResponse, ConnectError> {
    let w = Watch::new(
        user,
        &m.path,
        m.recursive,
        m.include_entry,
        m.allow_network_mounts,
    )
    .await?;
    Ok(CreateWatcherResponse {
        watcher_id: agent.watchers.add(w),
    })
}

async fn watch_dir(user: &User, headers: &HeaderMap, m: WatchRequest) -> Response<Body> {
    let mut w = match Watch::new(
        user,
        &m.path,
        m.recursive,
        m.include_entry,
        m.allow_network_mounts,
    )
    .await
    {
        Ok(w) => w,
        Err(e) => return connect::stream_error_response(e),
    };
    let keepalive = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_KEEPALIVE);
    let deadline = connect::timeout(headers);
    let (resp, tx) = connect::stream_response();
    tokio::spawn(async move {
        if tx.send(&WatchDirResponse::Start(Empty {})).await.is_err() {
            return;
        }
        let mut ticker =
            tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        let end = async {
            match deadline {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(end);
        loop {
            tokio::select! {
                raw = w.read_raw() => match raw {
                    Ok(raw) => {
                        for ev in w.process(raw).await {
                            if tx.send(&WatchDirResponse::Filesystem(ev)).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(e) => {
                        tx.finish(Err(ConnectError::internal(format!("watching: {e}")))).await;
                        return;
                    }
                },
                _ = ticker.tick() => {
                    if tx.send(&WatchDirResponse::Keepalive(Empty {})).await.is_err() {
                        return;
                    }
                }
                _ = &mut end => {
                    tx.finish(Err(ConnectError::new(Code::DeadlineExceeded, "the request deadline passed"))).await;
                    return;
                }
                _ = tx.closed() => return,
            }
        }
    });
    resp
}
