//! Property tests of the QMP line reader and reply dispatch against arbitrary peer bytes.
//!
//! Bounded for CI: `PROPTEST_CASES` overrides the number of cases of every property.

use std::collections::HashMap;
use std::pin::Pin;
use std::task::{Context, Poll};

use proptest::prelude::*;
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};

use super::*;

fn cases(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Hands out the given chunks one read at a time (split further if the caller's buffer is
/// smaller), then end of file.
struct Chunks {
    chunks: std::collections::VecDeque<Vec<u8>>,
}

impl AsyncRead for Chunks {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        while let Some(front) = self.chunks.front_mut() {
            if front.is_empty() {
                self.chunks.pop_front();
                continue;
            }
            let n = front.len().min(buf.remaining());
            buf.put_slice(&front[..n]);
            front.drain(..n);
            break;
        }
        Poll::Ready(Ok(()))
    }
}

/// Splits `bytes` at the given cut points (taken modulo its length).
fn split(bytes: &[u8], cuts: &[usize]) -> std::collections::VecDeque<Vec<u8>> {
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|c| c % (bytes.len() + 1))
        .chain([0, bytes.len()])
        .collect();
    at.sort_unstable();
    at.dedup();
    at.windows(2).map(|w| bytes[w[0]..w[1]].to_vec()).collect()
}

#[derive(Debug, PartialEq)]
enum Got {
    Line(String),
    TooLong,
    NotUtf8,
    Closed,
}

fn got(r: Result<String, QmpError>) -> Got {
    match r {
        Ok(l) => Got::Line(l),
        Err(QmpError::Protocol(m)) if m.contains("too long") => Got::TooLong,
        Err(QmpError::Protocol(m)) if m.contains("UTF-8") => Got::NotUtf8,
        Err(QmpError::Closed) => Got::Closed,
        Err(e) => panic!("unexpected error {e}"),
    }
}

/// What the reader must answer for `bytes`: every line in turn up to the first error.
fn model(bytes: &[u8], max: usize) -> Vec<Got> {
    let mut out = Vec::new();
    let mut rest = bytes;
    loop {
        match rest.iter().position(|&b| b == b'\n') {
            Some(pos) => {
                let line = &rest[..pos];
                rest = &rest[pos + 1..];
                if line.len() > max {
                    out.push(Got::TooLong);
                    return out;
                }
                match String::from_utf8(line.to_vec()) {
                    Ok(l) => out.push(Got::Line(l)),
                    Err(_) => {
                        out.push(Got::NotUtf8);
                        return out;
                    }
                }
            }
            None => {
                out.push(if rest.len() > max {
                    Got::TooLong
                } else {
                    Got::Closed
                });
                return out;
            }
        }
    }
}

/// Bytes that are mostly lines: newlines, ASCII, and some invalid UTF-8.
fn peer_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        prop_oneof![
            3 => Just(b'\n'),
            10 => 0x20u8..0x7f,
            1 => any::<u8>(),
        ],
        0..600,
    )
}

proptest! {
    #![proptest_config(cases(512))]

    /// Whatever the peer sends and however it arrives, the reader yields exactly the model's
    /// lines and errors, and an over-long line is an error even when its newline follows.
    #[test]
    fn line_reader_matches_the_model(
        bytes in peer_bytes(),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
        max in 0usize..80,
        cap in 1usize..40,
    ) {
        let want = model(&bytes, max);
        let mut rd = tokio::io::BufReader::with_capacity(cap, Chunks { chunks: split(&bytes, &cuts) });
        let have: Vec<Got> = rt().block_on(async {
            let mut have = Vec::new();
            loop {
                let g = got(read_line_bounded(&mut rd, max).await);
                let last = !matches!(g, Got::Line(_));
                if let Got::Line(l) = &g {
                    assert!(l.len() <= max, "a line of {} bytes passed a bound of {max}", l.len());
                }
                have.push(g);
                if last {
                    return have;
                }
            }
        });
        prop_assert_eq!(have, want);
    }
}

/// One thing the peer says in the dispatch test.
#[derive(Debug, Clone)]
enum Said {
    Return(u64, u32),
    Error(u64, String),
    Event(String),
    NoReturn(u64),
    /// Never a JSON object: skipped by the reader.
    Noise(String),
}

fn said() -> impl Strategy<Value = Said> {
    prop_oneof![
        (0u64..6, any::<u32>()).prop_map(|(id, v)| Said::Return(id, v)),
        (0u64..6, "[A-Za-z]{0,12}").prop_map(|(id, c)| Said::Error(id, c)),
        "[A-Z_]{1,10}".prop_map(Said::Event),
        (0u64..6).prop_map(Said::NoReturn),
        "[^{\n\r]{0,40}".prop_map(Said::Noise),
    ]
}

fn line_of(s: &Said) -> String {
    match s {
        Said::Return(id, v) => json!({"return": {"v": v}, "id": id}).to_string(),
        Said::Error(id, c) => json!({"error": {"class": c, "desc": "d"}, "id": id}).to_string(),
        Said::Event(e) => json!({"event": e, "data": {"x": 1}, "timestamp": {}}).to_string(),
        Said::NoReturn(id) => json!({"id": id, "nothing": true}).to_string(),
        Said::Noise(n) => n.clone(),
    }
}

#[derive(Debug, PartialEq)]
enum Outcome {
    Return(Value),
    Command(String),
    Protocol,
    Closed,
}

proptest! {
    #![proptest_config(cases(256))]

    /// Replies reach the caller waiting on their id (the first one wins), events reach
    /// subscribers in order, noise is skipped, and at the end every caller still waiting is
    /// told the connection closed.
    #[test]
    fn replies_and_events_are_dispatched(
        script in prop::collection::vec(said(), 0..24),
        waiting in prop::collection::btree_set(0u64..6, 0..6),
        cuts in prop::collection::vec(any::<usize>(), 0..10),
        crlf in any::<bool>(),
    ) {
        let eol = if crlf { "\r\n" } else { "\n" };
        let text: String = script.iter().map(|s| line_of(s) + eol).collect();
        let mut want: HashMap<u64, Outcome> = HashMap::new();
        let mut want_events = Vec::new();
        for s in &script {
            let (id, outcome) = match s {
                Said::Return(id, v) => (*id, Outcome::Return(json!({"v": v}))),
                Said::Error(id, c) => (*id, Outcome::Command(c.clone())),
                Said::NoReturn(id) => (*id, Outcome::Protocol),
                Said::Event(e) => {
                    want_events.push(e.clone());
                    continue;
                }
                Said::Noise(_) => continue,
            };
            if waiting.contains(&id) {
                want.entry(id).or_insert(outcome);
            }
        }
        for id in &waiting {
            want.entry(*id).or_insert(Outcome::Closed);
        }

        let (have, events) = rt().block_on(async {
            let pending: Pending = Arc::default();
            let mut rxs = Vec::new();
            for id in &waiting {
                let (tx, rx) = oneshot::channel();
                pending.lock().expect("lock").insert(*id, tx);
                rxs.push((*id, rx));
            }
            let (events_tx, mut events_rx) = broadcast::channel(64);
            let rd = tokio::io::BufReader::with_capacity(
                16,
                Chunks { chunks: split(text.as_bytes(), &cuts) },
            );
            read_loop(rd, pending.clone(), events_tx).await;
            assert!(pending.lock().expect("lock").is_empty(), "callers left waiting");
            let mut have = HashMap::new();
            for (id, rx) in rxs {
                let o = match rx.await.expect("every caller is answered") {
                    Ok(v) => Outcome::Return(v),
                    Err(QmpError::Command { class, .. }) => Outcome::Command(class),
                    Err(QmpError::Protocol(_)) => Outcome::Protocol,
                    Err(QmpError::Closed) => Outcome::Closed,
                    Err(e) => panic!("unexpected {e}"),
                };
                have.insert(id, o);
            }
            let mut events = Vec::new();
            while let Ok(e) = events_rx.try_recv() {
                prop_assert_eq!(&e.data, &json!({"x": 1}));
                events.push(e.event);
            }
            Ok((have, events))
        })?;
        prop_assert_eq!(have, want);
        prop_assert_eq!(events, want_events);
    }

    /// Arbitrary bytes from the peer: the loop ends at end of file without panicking and
    /// answers every waiting caller.
    #[test]
    fn arbitrary_bytes_end_the_loop_cleanly(
        bytes in prop::collection::vec(any::<u8>(), 0..2048),
        cuts in prop::collection::vec(any::<usize>(), 0..10),
    ) {
        rt().block_on(async {
            let pending: Pending = Arc::default();
            let mut rxs = Vec::new();
            for id in 0..4u64 {
                let (tx, rx) = oneshot::channel();
                pending.lock().expect("lock").insert(id, tx);
                rxs.push(rx);
            }
            let (events_tx, _events_rx) = broadcast::channel(16);
            let rd = tokio::io::BufReader::new(Chunks { chunks: split(&bytes, &cuts) });
            read_loop(rd, pending.clone(), events_tx).await;
            assert!(pending.lock().expect("lock").is_empty());
            for rx in rxs {
                assert!(rx.await.is_ok(), "a caller was dropped unanswered");
            }
        });
    }

    /// The greeting read by `connect` from an arbitrary peer, which then hangs up: an error,
    /// never a panic or a hang. Up to 16 events before the greeting are skipped.
    #[test]
    fn any_greeting_is_survived(
        noise in prop::collection::vec(any::<u8>(), 0..512),
        events in prop::option::of(0usize..20),
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qmp.sock");
        let mut bytes = Vec::new();
        if let Some(n) = events {
            for _ in 0..n {
                bytes.extend_from_slice(b"{\"event\": \"RESUME\"}\r\n");
            }
            bytes.extend_from_slice(b"{\"QMP\": {}}\r\n");
        }
        bytes.extend_from_slice(&noise);
        let r = rt().block_on(async {
            let listener = tokio::net::UnixListener::bind(&path).expect("bind");
            let peer = tokio::spawn(async move {
                if let Ok((mut s, _)) = listener.accept().await {
                    let _ = s.write_all(&bytes).await;
                }
            });
            let r = tokio::time::timeout(
                Duration::from_secs(5),
                Qmp::connect(&path, Duration::from_secs(1)),
            )
            .await
            .expect("connect neither hangs nor waits out its command timeout");
            let _ = peer.await;
            r
        });
        match (events, r) {
            (_, Ok(_)) => prop_assert!(false, "a peer that hung up completed the handshake"),
            (Some(n), Err(e)) if n <= 16 => {
                prop_assert!(matches!(e, QmpError::Closed), "{}", e)
            }
            (Some(_), Err(e)) => prop_assert!(matches!(e, QmpError::Protocol(_)), "{}", e),
            (None, Err(_)) => {}
        }
    }
}

/// The real bound: a line one byte longer than `MAX_LINE` is refused even though its newline
/// arrives in the same buffer fill, and the reply after it never reaches the caller.
#[test]
fn a_line_just_over_the_bound_is_refused() {
    rt().block_on(async {
        let mut bytes = vec![b' '; MAX_LINE + 1];
        bytes.extend_from_slice(b"\n{\"return\": {}, \"id\": 1}\n");
        let rd = tokio::io::BufReader::new(Chunks {
            chunks: [bytes].into(),
        });
        let pending: Pending = Arc::default();
        let (tx, rx) = oneshot::channel();
        pending.lock().expect("lock").insert(1, tx);
        let (events_tx, _events_rx) = broadcast::channel(4);
        read_loop(rd, pending, events_tx).await;
        assert!(matches!(rx.await, Ok(Err(QmpError::Closed))));

        let mut exact = vec![b' '; MAX_LINE];
        exact.push(b'\n');
        let mut rd = tokio::io::BufReader::new(Chunks {
            chunks: [exact].into(),
        });
        let line = read_line(&mut rd)
            .await
            .expect("a line of exactly MAX_LINE");
        assert_eq!(line.len(), MAX_LINE);
    });
}
