//! Property tests of `/files` multipart uploads against arbitrary bodies, boundaries and chunk
//! splits: a clean 4xx or the files written, never a panic, and multipart framing held in
//! bounded memory whatever the body.
//!
//! Bounded for CI: `PROPTEST_CASES` overrides the number of cases of every property.
//!
//! Arbitrary bodies are uploaded with a `path` parameter, so whatever a mutated part names,
//! nothing is written outside the test's own directory.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use proptest::prelude::*;

use super::*;

use crate::connect::fuzz::{block_on, cases};

/// The test process's own identity, so no switch happens, with `home` as its home.
fn me(home: &Path) -> User {
    // SAFETY: geteuid/getegid have no preconditions.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    User {
        name: "fuzz".into(),
        uid,
        gid,
        home: home.to_path_buf(),
        shell: "/bin/sh".into(),
        groups: vec![gid],
    }
}

fn split(bytes: &[u8], cuts: &[usize]) -> Vec<Bytes> {
    let mut at: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    at.extend([0, bytes.len()]);
    at.sort_unstable();
    at.windows(2)
        .map(|w| Bytes::copy_from_slice(&bytes[w[0]..w[1]]))
        .collect()
}

/// A body that is always ready, counting the bytes taken from it.
fn body_of(chunks: Vec<Bytes>, pulled: Arc<AtomicU64>) -> ByteStream {
    Box::pin(futures::stream::iter(chunks).map(move |c| {
        pulled.fetch_add(c.len() as u64, Ordering::Relaxed);
        Ok(c)
    }))
}

async fn upload_with(
    user: &User,
    body: ByteStream,
    content_type: &str,
    query_path: Option<String>,
) -> Result<Vec<WriteInfo>, StatusCode> {
    let metadata = BTreeMap::new();
    let fut = upload_multipart(user, body, content_type, query_path, &metadata);
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .expect("an upload never hangs on a finished body")
        .map_err(|r| r.status())
}

#[derive(Debug, Clone)]
struct Part {
    name: String,
    file: Option<String>,
    data: Vec<u8>,
}

fn part() -> impl Strategy<Value = Part> {
    (
        "[a-z]{1,8}",
        prop::option::weighted(0.7, "[a-z][a-z0-9_.]{0,11}"),
        prop::collection::vec(
            prop_oneof![4 => any::<u8>(), 1 => Just(b'\r'), 1 => Just(b'\n'), 1 => Just(b'-')],
            0..300,
        ),
    )
        .prop_map(|(name, file, data)| Part { name, file, data })
}

fn encode(parts: &[Part], boundary: &str, preamble: &[u8], epilogue: &[u8]) -> Vec<u8> {
    let mut out = preamble.to_vec();
    if !preamble.is_empty() {
        out.extend_from_slice(b"\r\n");
    }
    for p in parts {
        out.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        let disposition = match &p.file {
            Some(f) => format!("form-data; name=\"{}\"; filename=\"{f}\"", p.name),
            None => format!("form-data; name=\"{}\"", p.name),
        };
        out.extend_from_slice(format!("Content-Disposition: {disposition}\r\n").as_bytes());
        if p.file.is_some() {
            out.extend_from_slice(b"Content-Type: application/octet-stream\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(&p.data);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    out.extend_from_slice(epilogue);
    out
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

proptest! {
    #![proptest_config(cases(256))]

    /// Well-formed uploads of files and plain fields, split anywhere: exactly the files are
    /// written, with their contents (the last of a repeated name wins).
    #[test]
    fn valid_uploads_write_every_file(
        parts in prop::collection::vec(part(), 0..6),
        boundary in "[A-Za-z0-9'()+_,./:=?-]{1,40}",
        preamble in prop::collection::vec(any::<u8>(), 0..40),
        epilogue in prop::collection::vec(any::<u8>(), 0..40),
        cuts in prop::collection::vec(any::<usize>(), 0..20),
        quoted in any::<bool>(),
    ) {
        let delimiter = format!("\r\n--{boundary}");
        prop_assume!(parts.iter().all(|p| !contains(&p.data, delimiter.as_bytes())));
        prop_assume!(!contains(&preamble, format!("--{boundary}").as_bytes()));
        let dir = tempfile::tempdir().expect("tempdir");
        let user = me(dir.path());
        let body = encode(&parts, &boundary, &preamble, &epilogue);
        // Outside quotes a boundary is a token.
        let quoted = quoted || boundary.contains(['(', ')', ',', '/', ':', '=', '?']);
        let ct = if quoted {
            format!("multipart/form-data; boundary=\"{boundary}\"")
        } else {
            format!("multipart/form-data; boundary={boundary}")
        };
        let pulled = Arc::new(AtomicU64::new(0));
        let got = block_on(upload_with(&user, body_of(split(&body, &cuts), pulled), &ct, None));
        let files: Vec<&Part> = parts.iter().filter(|p| p.file.is_some()).collect();
        if files.is_empty() {
            prop_assert_eq!(got.map(|w| w.len()), Err(StatusCode::BAD_REQUEST));
            return Ok(());
        }
        let written = got.map_err(|s| TestCaseError::fail(format!("valid upload refused: {s}")))?;
        prop_assert_eq!(written.len(), files.len());
        let mut last = BTreeMap::new();
        for p in &files {
            last.insert(p.file.clone().unwrap_or_default(), p.data.clone());
        }
        for (name, data) in last {
            let on_disk = std::fs::read(dir.path().join(&name)).expect("written file");
            prop_assert_eq!(on_disk, data, "{}", name);
        }
    }

    /// The same bodies mutated (bytes flipped, inserted, cut), and arbitrary bodies, boundaries
    /// and content types: a 4xx or success, never a panic or a hang, and success only for
    /// the one file the `path` parameter names.
    #[test]
    fn arbitrary_uploads_are_ok_or_4xx(
        parts in prop::collection::vec(part(), 0..4),
        boundary in "[A-Za-z0-9-]{1,20}",
        edits in prop::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 0..6),
        random in prop::option::weighted(0.2, prop::collection::vec(any::<u8>(), 0..400)),
        content_type in prop_oneof![
            8 => Just(None),
            1 => any::<String>().prop_map(Some),
            1 => "multipart/form-data;[ -~]{0,40}".prop_map(Some),
        ],
        cuts in prop::collection::vec(any::<usize>(), 0..20),
    ) {
        let mut body = random.unwrap_or_else(|| encode(&parts, &boundary, b"", b""));
        for (at, byte, op) in edits {
            let at = at % (body.len() + 1);
            match op {
                0 if at < body.len() => body[at] = byte,
                1 => body.insert(at, byte),
                _ => body.truncate(at),
            }
        }
        let ct = content_type.unwrap_or_else(|| format!("multipart/form-data; boundary={boundary}"));
        let dir = tempfile::tempdir().expect("tempdir");
        let user = me(dir.path());
        let pulled = Arc::new(AtomicU64::new(0));
        let got = block_on(upload_with(
            &user,
            body_of(split(&body, &cuts), pulled),
            &ct,
            Some("upload.bin".into()),
        ));
        match got {
            Ok(written) => {
                prop_assert_eq!(written.len(), 1);
                prop_assert_eq!(&written[0].path, &dir.path().join("upload.bin").display().to_string());
            }
            Err(status) => prop_assert!(status.is_client_error(), "{}", status),
        }
        // Nothing else appeared.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("read_dir")
            .flatten()
            .map(|e| e.file_name())
            .collect();
        prop_assert!(names.iter().all(|n| n == "upload.bin"), "{:?}", names);
    }
}

const CHUNK_OF_TEST: usize = 64 << 10;

/// `total` bytes of `fill` after `head`, in always-ready chunks.
fn endless(head: &[u8], fill: u8, total: usize) -> Vec<Bytes> {
    let mut chunks = vec![Bytes::copy_from_slice(head)];
    let mut left = total;
    while left > 0 {
        let n = left.min(CHUNK_OF_TEST);
        chunks.push(Bytes::from(vec![fill; n]));
        left -= n;
    }
    chunks
}

/// Framing that never ends (a preamble without a boundary, part headers without their end) is
/// refused after a bounded amount is read, not buffered to the end of the body.
#[test]
fn unterminated_framing_is_bounded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let user = me(dir.path());
    let bound = MAX_MULTIPART_OVERHEAD + 3 * CHUNK_OF_TEST as u64;
    for head in [
        &b""[..],
        b"--B\r\nContent-Disposition: form-data; name=\"a\"; filename=\"a\"\r\nX-Pad: ",
    ] {
        let pulled = Arc::new(AtomicU64::new(0));
        let body = body_of(endless(head, b'a', 32 << 20), pulled.clone());
        let got = block_on(upload_with(
            &user,
            body,
            "multipart/form-data; boundary=B",
            None,
        ));
        assert_eq!(got.map(|w| w.len()), Err(StatusCode::BAD_REQUEST));
        let pulled = pulled.load(Ordering::Relaxed);
        assert!(
            pulled <= bound,
            "read {pulled} bytes of framing (bound {bound})"
        );
    }
}

/// A large file (and a large plain field before it) in always-ready chunks streams through:
/// the bound is on framing, not on content.
#[test]
fn large_parts_stream_through() {
    let dir = tempfile::tempdir().expect("tempdir");
    let user = me(dir.path());
    let size = 6 << 20;
    let mut body = Vec::new();
    body.extend_from_slice(b"--B\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\n");
    body.extend_from_slice(&vec![b'n'; size]);
    body.extend_from_slice(
        b"\r\n--B\r\nContent-Disposition: form-data; name=\"f\"; filename=\"big\"\r\n\r\n",
    );
    body.extend((0..size).map(|i| (i % 251) as u8));
    body.extend_from_slice(b"\r\n--B--\r\n");
    let chunks: Vec<Bytes> = body
        .chunks(CHUNK_OF_TEST)
        .map(Bytes::copy_from_slice)
        .collect();
    let pulled = Arc::new(AtomicU64::new(0));
    let got = block_on(upload_with(
        &user,
        body_of(chunks, pulled),
        "multipart/form-data; boundary=B",
        None,
    ));
    let written = got.expect("a large upload is accepted");
    assert_eq!(written.len(), 1);
    let on_disk = std::fs::read(dir.path().join("big")).expect("written");
    assert_eq!(on_disk.len(), size);
    assert!(on_disk
        .iter()
        .enumerate()
        .all(|(i, b)| *b == (i % 251) as u8));
}
