//! `process.Process`: start, observe, feed and signal processes as the requesting user.

pub mod pty;
pub mod running;

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Response};
use hyper::body::Incoming;

use crate::agent::Agent;
use crate::connect::{self, Body, Code, ConnectError, EnvelopeReader, Kind, StreamSender};
use crate::rpc::process::*;
use crate::user::{self, User};
use running::{Event, Process, Spec, Subscription};

/// Keepalive interval when the client asks for none (upstream envd's default).
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);

/// The kind of each method, or `None` if the service has no such method.
pub fn kind(method: &str) -> Option<Kind> {
    Some(match method {
        "Start" | "Connect" => Kind::ServerStream,
        "StreamInput" => Kind::ClientStream,
        "List" | "Update" | "SendInput" | "SendSignal" | "CloseStdin" => Kind::Unary,
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
    match method {
        "Start" => match first_message::<StartRequest>(body).await {
            Ok(msg) => start(agent, user, &headers, msg).await,
            Err(e) => connect::stream_error_response(e),
        },
        "Connect" => match first_message::<SelectorRequest>(body).await {
            Ok(msg) => connect_to(&agent, &headers, msg),
            Err(e) => connect::stream_error_response(e),
        },
        "StreamInput" => connect::client_stream_response(stream_input(&agent, body).await),
        "List" => connect::unary_response(
            connect::read_unary::<ListRequest>(body)
                .await
                .map(|_| list(&agent)),
        ),
        "Update" => connect::unary_response(match connect::read_unary(body).await {
            Ok(msg) => update(&agent, msg),
            Err(e) => Err(e),
        }),
        "SendInput" => connect::unary_response(match connect::read_unary(body).await {
            Ok(msg) => send_input(&agent, msg).await,
            Err(e) => Err(e),
        }),
        "SendSignal" => connect::unary_response(match connect::read_unary(body).await {
            Ok(msg) => send_signal(&agent, msg),
            Err(e) => Err(e),
        }),
        "CloseStdin" => connect::unary_response(match connect::read_unary(body).await {
            Ok(msg) => close_stdin(&agent, msg).await,
            Err(e) => Err(e),
        }),
        _ => ConnectError::new(
            Code::Unimplemented,
            format!("process.Process/{method} is not implemented"),
        )
        .into_response(),
    }
}

async fn first_message<T: serde::de::DeserializeOwned + Default>(
    body: Incoming,
) -> Result<T, ConnectError> {
    let mut reader = EnvelopeReader::new(body);
    let msg = reader.next_message::<T>().await?.unwrap_or_default();
    // The body's end (a streamed body's last chunk) may come after the message: read it
    // apart, so the connection stays reusable (`EnvelopeReader::drain`).
    tokio::spawn(reader.drain(connect::MAX_MESSAGE_BYTES, Duration::from_secs(10)));
    Ok(msg)
}

fn keepalive_interval(headers: &HeaderMap) -> Duration {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_KEEPALIVE)
}

fn find(agent: &Agent, sel: Option<&ProcessSelector>) -> Result<Arc<Process>, ConnectError> {
    let sel = sel.ok_or_else(|| ConnectError::invalid("process selector is required"))?;
    let table = agent.processes.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(pid) = sel.pid {
        return table
            .get(&pid)
            .cloned()
            .ok_or_else(|| ConnectError::not_found(format!("process with pid {pid} not found")));
    }
    if let Some(tag) = &sel.tag {
        return table
            .values()
            .find(|p| p.tag.as_deref() == Some(tag.as_str()))
            .cloned()
            .ok_or_else(|| ConnectError::not_found(format!("process with tag {tag} not found")));
    }
    Err(ConnectError::invalid(
        "process selector needs a pid or a tag",
    ))
}

async fn start(
    agent: Arc<Agent>,
    user: User,
    headers: &HeaderMap,
    msg: StartRequest,
) -> Response<Body> {
    let spec = match spec_for(&agent, user, headers, msg).await {
        Ok(s) => s,
        Err(e) => return connect::stream_error_response(e),
    };
    let cmd = spec.config.cmd.clone();
    let process = match Process::start(spec, agent.processes.clone()) {
        Ok(p) => p,
        Err(e) => {
            return connect::stream_error_response(ConnectError::invalid(format!(
                "error starting process '{cmd}': {e}"
            )))
        }
    };
    let sub = process.subscribe();
    let (resp, tx) = connect::stream_response();
    let keepalive = keepalive_interval(headers);
    let deadline = connect::timeout(headers).map(|t| tokio::time::Instant::now() + t);
    tokio::spawn(stream_events(process.pid, sub, tx, keepalive, deadline));
    resp
}

async fn spec_for(
    agent: &Agent,
    user: User,
    headers: &HeaderMap,
    msg: StartRequest,
) -> Result<Spec, ConnectError> {
    let config = msg
        .process
        .ok_or_else(|| ConnectError::invalid("process config is required"))?;
    if config.cmd.is_empty() {
        return Err(ConnectError::invalid("process cmd is required"));
    }
    let defaults = agent.defaults();
    let cwd = match config.cwd.as_deref() {
        None | Some("") => agent.default_cwd(&user),
        Some(c) => user::resolve_in(c, &user.home)?,
    };
    let check = cwd.clone();
    let is_dir = user::run_as(&user, move || {
        Ok(std::fs::metadata(&check).map(|m| m.is_dir()))
    })
    .await?;
    if !matches!(is_dir, Ok(true)) {
        return Err(ConnectError::invalid(format!(
            "cwd '{}' does not exist",
            cwd.display()
        )));
    }
    let mut env = std::collections::BTreeMap::new();
    env.insert(
        "PATH".to_string(),
        std::env::var("PATH").unwrap_or_else(|_| {
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()
        }),
    );
    env.insert("HOME".into(), user.home.display().to_string());
    env.insert("USER".into(), user.name.clone());
    env.insert("LOGNAME".into(), user.name.clone());
    if !user.shell.is_empty() {
        env.insert("SHELL".into(), user.shell.clone());
    }
    env.extend(defaults.env_vars);
    env.extend(config.envs.iter().map(|(k, v)| (k.clone(), v.clone())));
    if env
        .keys()
        .any(|k| k.is_empty() || k.contains('=') || k.contains('\0'))
        || env.values().any(|v| v.contains('\0'))
        || config.args.iter().any(|a| a.contains('\0'))
        || config.cmd.contains('\0')
    {
        return Err(ConnectError::invalid(
            "command, arguments and environment must not contain NUL or '=' in names",
        ));
    }
    let pty = msg.pty.map(|p| {
        let size = p.size.unwrap_or_default();
        let clamp = |v: u32, d: u16| {
            if v == 0 {
                d
            } else {
                v.min(u16::MAX as u32) as u16
            }
        };
        (clamp(size.cols, 80), clamp(size.rows, 24))
    });
    Ok(Spec {
        config,
        tag: msg.tag,
        env,
        cwd,
        user,
        pty,
        stdin: msg.stdin.unwrap_or(true),
        timeout: connect::timeout(headers),
    })
}

fn connect_to(agent: &Agent, headers: &HeaderMap, msg: SelectorRequest) -> Response<Body> {
    let process = match find(agent, msg.process.as_ref()) {
        Ok(p) => p,
        Err(e) => return connect::stream_error_response(e),
    };
    let sub = process.subscribe();
    let (resp, tx) = connect::stream_response();
    let deadline = connect::timeout(headers).map(|t| tokio::time::Instant::now() + t);
    tokio::spawn(stream_events(
        process.pid,
        sub,
        tx,
        keepalive_interval(headers),
        deadline,
    ));
    resp
}

/// Streams start, the kept output, live output and the end, with keepalives in between.
async fn stream_events(
    pid: u32,
    mut sub: Subscription,
    tx: StreamSender,
    keepalive: Duration,
    deadline: Option<tokio::time::Instant>,
) {
    let send = |event: ProcessEvent| EventResponse { event };
    if tx
        .send(&send(ProcessEvent::Start(StartEvent { pid })))
        .await
        .is_err()
    {
        return;
    }
    for d in std::mem::take(&mut sub.history) {
        if tx.send(&send(ProcessEvent::Data(d))).await.is_err() {
            return;
        }
    }
    if let Some(end) = sub.ended.take() {
        if tx.send(&send(ProcessEvent::End(end))).await.is_ok() {
            tx.finish(Ok(())).await;
        }
        return;
    }
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let deadline_sleep = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(deadline_sleep);
    loop {
        tokio::select! {
            ev = sub.live.recv() => match ev {
                Some(Event::Data(d)) => {
                    if tx.send(&send(ProcessEvent::Data(d))).await.is_err() {
                        return;
                    }
                    ticker.reset();
                }
                Some(Event::End(end)) => {
                    if tx.send(&send(ProcessEvent::End(end))).await.is_ok() {
                        tx.finish(Ok(())).await;
                    }
                    return;
                }
                None => {
                    tx.finish(Err(ConnectError::new(Code::Unknown, "process output ended without an end event"))).await;
                    return;
                }
            },
            _ = ticker.tick() => {
                if tx.send(&send(ProcessEvent::Keepalive(Empty2 {}))).await.is_err() {
                    return;
                }
            }
            _ = &mut deadline_sleep => {
                tx.finish(Err(ConnectError::new(Code::DeadlineExceeded, "the request deadline passed"))).await;
                return;
            }
            _ = tx.closed() => return,
        }
    }
}

fn list(agent: &Agent) -> ListResponse {
    let table = agent.processes.lock().unwrap_or_else(|p| p.into_inner());
    let mut processes: Vec<ProcessInfo> = table
        .values()
        .map(|p| ProcessInfo {
            config: p.config.clone(),
            pid: p.pid,
            tag: p.tag.clone(),
        })
        .collect();
    processes.sort_by_key(|p| p.pid);
    ListResponse { processes }
}

fn update(agent: &Agent, msg: UpdateRequest) -> Result<Empty, ConnectError> {
    let p = find(agent, msg.process.as_ref())?;
    if let Some(pty) = msg.pty {
        let size = pty.size.unwrap_or_default();
        if size.cols == 0
            || size.rows == 0
            || size.cols > u16::MAX as u32
            || size.rows > u16::MAX as u32
        {
            return Err(ConnectError::invalid(
                "pty size must have cols and rows in 1..=65535",
            ));
        }
        p.resize(size.cols as u16, size.rows as u16).map_err(|e| {
            ConnectError::new(Code::FailedPrecondition, format!("resizing pty: {e}"))
        })?;
    }
    Ok(Empty {})
}

async fn write_input(p: &Process, input: ProcessInput) -> Result<(), ConnectError> {
    let fail = |e: std::io::Error| {
        ConnectError::new(Code::FailedPrecondition, format!("writing input: {e}"))
    };
    if let Some(data) = input.pty {
        p.write_pty(&data).await.map_err(fail)?;
    } else if let Some(data) = input.stdin {
        if p.has_pty() {
            // A terminal has no separate stdin: what is typed goes to the terminal.
            p.write_pty(&data).await.map_err(fail)?;
        } else {
            p.write_stdin(&data).await.map_err(fail)?;
        }
    }
    Ok(())
}

async fn send_input(agent: &Agent, msg: SendInputRequest) -> Result<Empty, ConnectError> {
    let p = find(agent, msg.process.as_ref())?;
    write_input(&p, msg.input.unwrap_or_default()).await?;
    Ok(Empty {})
}

async fn stream_input(agent: &Agent, body: Incoming) -> Result<Empty, ConnectError> {
    let mut reader = EnvelopeReader::new(body);
    let mut process: Option<Arc<Process>> = None;
    while let Some(msg) = reader.next_message::<StreamInputRequest>().await? {
        if let Some(start) = msg.start {
            process = Some(find(agent, start.process.as_ref())?);
        } else if let Some(data) = msg.data {
            let p = process
                .as_ref()
                .ok_or_else(|| ConnectError::invalid("the first message must be start"))?;
            write_input(p, data.input.unwrap_or_default()).await?;
        }
    }
    Ok(Empty {})
}

fn send_signal(agent: &Agent, msg: SendSignalRequest) -> Result<Empty, ConnectError> {
    let p = find(agent, msg.process.as_ref())?;
    let sig = match msg.signal {
        9 => libc::SIGKILL,
        15 => libc::SIGTERM,
        n => return Err(ConnectError::invalid(format!("unsupported signal {n}"))),
    };
    p.signal(sig);
    Ok(Empty {})
}

async fn close_stdin(agent: &Agent, msg: SelectorRequest) -> Result<Empty, ConnectError> {
    let p = find(agent, msg.process.as_ref())?;
    if p.has_pty() {
        return Err(ConnectError::new(
            Code::FailedPrecondition,
            "cannot close stdin of a PTY process; send Ctrl+D (0x04) instead",
        ));
    }
    p.close_stdin().await;
    Ok(Empty {})
}
