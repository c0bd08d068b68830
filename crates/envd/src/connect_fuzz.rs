//! Property tests of Connect request framing (streaming envelopes and unary bodies) against
//! arbitrary client bytes split at arbitrary frame boundaries.
//!
//! Bounded for CI: `PROPTEST_CASES` overrides the number of cases of every property.

use std::cell::Cell;
use std::collections::VecDeque;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use proptest::prelude::*;

use super::*;

/// Cases for a target: `PROPTEST_CASES` when set, else `default`; no regression files.
pub(crate) fn cases(default: u32) -> ProptestConfig {
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

pub(crate) fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(f)
}

/// A request body made of the given frames. It records how many data bytes it handed out,
/// and checks on every poll that the reader asks for more only while it holds less than one
/// whole envelope of the largest allowed size.
struct Feed {
    frames: VecDeque<Result<Frame<Bytes>, std::io::Error>>,
    handed: Rc<Cell<usize>>,
    /// Bytes the reader has returned as whole envelopes so far (kept by the test).
    consumed: Rc<Cell<usize>>,
    /// The most the reader may hold when it asks for more.
    hold_max: usize,
    over: Rc<Cell<Option<usize>>>,
}

impl http_body::Body for Feed {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let held = self.handed.get() - self.consumed.get();
        if held > self.hold_max && self.over.get().is_none() {
            self.over.set(Some(held));
        }
        let next = self.frames.pop_front();
        if let Some(Ok(f)) = &next {
            if let Some(d) = f.data_ref() {
                self.handed.set(self.handed.get() + d.len());
            }
        }
        Poll::Ready(next)
    }
}

/// Splits `bytes` into data frames at the cut points (modulo its length; empty frames kept),
/// with a trailers frame where asked and an error frame at the end if `fail`.
fn frames(
    bytes: &[u8],
    cuts: &[usize],
    trailers_at: Option<usize>,
    fail: bool,
) -> VecDeque<Result<Frame<Bytes>, std::io::Error>> {
    let mut at: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    at.push(0);
    at.push(bytes.len());
    at.sort_unstable();
    let mut out: VecDeque<_> = at
        .windows(2)
        .map(|w| Ok(Frame::data(Bytes::copy_from_slice(&bytes[w[0]..w[1]]))))
        .collect();
    if let Some(t) = trailers_at {
        out.insert(t % (out.len() + 1), Ok(Frame::trailers(HeaderMap::new())));
    }
    if fail {
        out.push_back(Err(std::io::Error::other("connection reset")));
    }
    out
}

#[derive(Debug, PartialEq)]
enum Step {
    Msg(Vec<u8>),
    End,
    TooBig,
    Compressed,
    Truncated,
    Canceled,
}

fn step(r: Result<Option<Bytes>, ConnectError>) -> Step {
    match r {
        Ok(Some(p)) => Step::Msg(p.to_vec()),
        Ok(None) => Step::End,
        Err(e) => match e.code {
            Code::ResourceExhausted => Step::TooBig,
            Code::Unimplemented => Step::Compressed,
            Code::InvalidArgument => Step::Truncated,
            Code::Canceled => Step::Canceled,
            other => panic!("unexpected code {other:?}: {}", e.message),
        },
    }
}

/// What the reader must yield for a body of `data` (then an error if `fail`).
fn model(data: &[u8], limit: usize, fail: bool) -> Vec<Step> {
    let mut out = Vec::new();
    let mut rest = data;
    loop {
        if rest.len() >= 5 {
            let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            if len > limit {
                out.push(Step::TooBig);
                return out;
            }
            if rest[0] & FLAG_COMPRESSED != 0 {
                out.push(Step::Compressed);
                return out;
            }
            if rest.len() >= 5 + len {
                if rest[0] & FLAG_END_STREAM != 0 {
                    out.push(Step::End);
                    return out;
                }
                out.push(Step::Msg(rest[5..5 + len].to_vec()));
                rest = &rest[5 + len..];
                continue;
            }
        }
        out.push(if fail {
            Step::Canceled
        } else if rest.is_empty() {
            Step::End
        } else {
            Step::Truncated
        });
        return out;
    }
}

/// Runs a reader with payload bound `limit` over `frames` until it ends or fails; returns its
/// steps, and the largest number of bytes it held while asking for more, if over the bound.
fn run(
    frames: VecDeque<Result<Frame<Bytes>, std::io::Error>>,
    limit: usize,
) -> (Vec<Step>, Option<usize>) {
    let consumed = Rc::new(Cell::new(0));
    let over = Rc::new(Cell::new(None));
    let feed = Feed {
        frames,
        handed: Rc::default(),
        consumed: consumed.clone(),
        // Less than a whole header plus the largest payload.
        hold_max: 4 + limit,
        over: over.clone(),
    };
    let mut reader = EnvelopeReader {
        body: feed,
        buf: BytesMut::new(),
        limit,
    };
    let steps = block_on(async {
        let mut steps = Vec::new();
        // A bad reader could loop forever; no valid body has this many envelopes.
        for _ in 0..10_000 {
            let s = step(reader.next().await);
            let done = !matches!(s, Step::Msg(_));
            if let Step::Msg(p) = &s {
                consumed.set(consumed.get() + 5 + p.len());
            }
            steps.push(s);
            if done {
                break;
            }
        }
        steps
    });
    (steps, over.get())
}

/// Something that looks like an envelope, or not quite.
fn piece() -> impl Strategy<Value = Vec<u8>> {
    let flags = prop_oneof![6 => Just(0u8), 1 => Just(FLAG_END_STREAM), 1 => Just(FLAG_COMPRESSED), 1 => any::<u8>()];
    let len_error =
        prop_oneof![8 => Just(0i64), 2 => -3i64..4, 1 => any::<u32>().prop_map(i64::from)];
    prop_oneof![
        8 => (flags, len_error, prop::collection::vec(any::<u8>(), 0..48)).prop_map(
            |(flags, err, payload)| {
                let len = if err > 4 {
                    err as u32
                } else {
                    (payload.len() as i64 + err).max(0) as u32
                };
                let mut out = vec![flags];
                out.extend_from_slice(&len.to_be_bytes());
                out.extend_from_slice(&payload);
                out
            }
        ),
        1 => prop::collection::vec(any::<u8>(), 0..12),
    ]
}

proptest! {
    #![proptest_config(cases(512))]

    /// Arbitrary (mostly envelope-shaped) bytes at arbitrary frame boundaries: the reader
    /// yields exactly what the model says, never panics, and never holds a whole maximal
    /// envelope while asking for more.
    #[test]
    fn envelopes_match_the_model(
        pieces in prop::collection::vec(piece(), 0..8),
        cuts in prop::collection::vec(any::<usize>(), 0..16),
        trailers_at in prop::option::of(any::<usize>()),
        fail in any::<bool>(),
        limit in 0usize..64,
    ) {
        let data = pieces.concat();
        let want = model(&data, limit, fail);
        let (have, over) = run(frames(&data, &cuts, trailers_at, fail), limit);
        prop_assert_eq!(over, None, "held more than {} bytes while reading", 4 + limit);
        prop_assert_eq!(have, want);
    }

    /// Purely random bytes: same model, same bound.
    #[test]
    fn random_bytes_match_the_model(
        data in prop::collection::vec(any::<u8>(), 0..256),
        cuts in prop::collection::vec(any::<usize>(), 0..16),
        limit in prop_oneof![0usize..64, Just(MAX_MESSAGE_BYTES)],
    ) {
        let want = model(&data, limit, false);
        let (have, over) = run(frames(&data, &cuts, None, false), limit);
        prop_assert_eq!(over, None);
        prop_assert_eq!(have, want);
    }

    /// N valid messages, optionally closed by an end-stream envelope and trailed by junk that
    /// must be ignored, split anywhere: the same N messages come out, then the end.
    #[test]
    fn valid_envelopes_round_trip(
        messages in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 0..10),
        end_stream in any::<bool>(),
        junk in prop::collection::vec(any::<u8>(), 0..16),
        cuts in prop::collection::vec(any::<usize>(), 0..24),
        slack in 0usize..8,
    ) {
        let end = end_stream_payload(&Ok(()));
        let limit = messages.iter().map(Vec::len).chain([end.len()]).max().unwrap_or(0) + slack;
        let mut data = Vec::new();
        for m in &messages {
            data.extend_from_slice(&envelope(0, m));
        }
        if end_stream {
            data.extend_from_slice(&envelope(FLAG_END_STREAM, &end));
            data.extend_from_slice(&junk);
        }
        let (have, over) = run(frames(&data, &cuts, None, false), limit);
        prop_assert_eq!(over, None);
        let mut want: Vec<Step> = messages.into_iter().map(Step::Msg).collect();
        want.push(Step::End);
        prop_assert_eq!(have, want);
    }

    /// A unary body: the bytes themselves when within the bound, resource-exhausted past it,
    /// canceled when the body fails first.
    #[test]
    fn unary_bodies_are_bounded(
        data in prop::collection::vec(any::<u8>(), 0..200),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
        trailers_at in prop::option::of(any::<usize>()),
        fail in any::<bool>(),
        limit in 0usize..220,
    ) {
        let body = Feed {
            frames: frames(&data, &cuts, trailers_at, fail),
            handed: Rc::default(),
            consumed: Rc::default(),
            hold_max: usize::MAX,
            over: Rc::default(),
        };
        let got = block_on(read_bounded(body, limit));
        match got {
            Ok(b) => {
                prop_assert!(!fail && data.len() <= limit);
                prop_assert_eq!(&b[..], &data[..]);
            }
            Err(e) if e.code == Code::ResourceExhausted => prop_assert!(data.len() > limit),
            Err(e) => {
                prop_assert_eq!(e.code, Code::Canceled);
                prop_assert!(fail && data.len() <= limit);
            }
        }
    }
}

/// JSON values built from the field names the request types know, so decoding reaches their
/// custom deserializers (numbers or strings for integers, base64, enums, nulls).
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        "[a-zA-Z0-9+/=_-]{0,12}".prop_map(Value::String),
        any::<String>().prop_map(Value::String),
    ];
    let keys = prop::sample::select(vec![
        "process",
        "pty",
        "tag",
        "stdin",
        "cmd",
        "args",
        "envs",
        "cwd",
        "size",
        "cols",
        "rows",
        "pid",
        "input",
        "start",
        "data",
        "keepalive",
        "signal",
        "selector",
        "path",
        "source",
        "destination",
        "depth",
        "username",
        "watchId",
        "recursive",
        "x",
    ]);
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(keys.clone(), inner, 0..6).prop_map(|m| Value::Object(
                m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
            )),
        ]
    })
}

fn decode_all(bytes: &[u8]) {
    use crate::rpc::{filesystem as fs, process as p};
    let _ = decode::<serde_json::Value>(bytes);
    let _ = decode::<p::StartRequest>(bytes);
    let _ = decode::<p::UpdateRequest>(bytes);
    let _ = decode::<p::SendInputRequest>(bytes);
    let _ = decode::<p::StreamInputRequest>(bytes);
    let _ = decode::<p::ListRequest>(bytes);
    let _ = decode::<p::SendSignalRequest>(bytes);
    let _ = decode::<p::SelectorRequest>(bytes);
    let _ = decode::<fs::PathRequest>(bytes);
    let _ = decode::<fs::MoveRequest>(bytes);
    let _ = decode::<fs::ListDirRequest>(bytes);
    let _ = decode::<fs::WatchRequest>(bytes);
    let _ = decode::<fs::WatcherRequest>(bytes);
}

proptest! {
    #![proptest_config(cases(512))]

    /// Messages decode into every request type or fail with invalid-argument; never a panic.
    #[test]
    fn messages_decode_or_are_invalid(v in json_value(), raw in prop::collection::vec(any::<u8>(), 0..64)) {
        let text = serde_json::to_vec(&v).expect("serialize");
        decode_all(&text);
        decode_all(&raw);
    }
}

#[test]
fn deep_nesting_and_blank_messages() {
    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Empty {}
    // Deep nesting is refused by the parser, not by the stack.
    let deep = "[".repeat(100_000);
    let code = decode::<serde_json::Value>(deep.as_bytes())
        .map(|_| ())
        .map_err(|e| e.code);
    assert_eq!(code, Err(Code::InvalidArgument));
    // Whitespace only is the empty message; anything else must parse.
    assert!(decode::<Empty>(b" \n\t").is_ok());
    assert!(decode::<Empty>(b" x").is_err());
}
