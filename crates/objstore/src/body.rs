//! Request and response bodies: files streamed up, bounded reads, sparse downloads.

use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, Context};
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use crate::client::{ReqBody, IDLE};

fn io_err(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// A body streamed from `len` bytes of `file` at `offset`, fed into `hash` as it is read.
pub(crate) async fn file_body(
    path: &Path,
    offset: u64,
    len: u64,
    hash: Arc<Mutex<Sha256>>,
) -> anyhow::Result<ReqBody> {
    let mut f = tokio::fs::File::open(path)
        .await
        .with_context(|| format!("opening {}", path.display()))?;
    f.seek(std::io::SeekFrom::Start(offset)).await?;
    let reader = f.take(len);
    let stream = tokio_stream_of(reader).map(move |r| {
        r.inspect(|b| {
            if let Ok(mut h) = hash.lock() {
                h.update(b);
            }
        })
        .map(Frame::data)
    });
    Ok(BodyExt::boxed(StreamBody::new(stream)))
}

/// Reads `r` in 1 MiB chunks.
fn tokio_stream_of(
    r: impl tokio::io::AsyncRead + Unpin + Send + 'static,
) -> impl futures::Stream<Item = std::io::Result<Bytes>> + Send {
    futures::stream::unfold((r, false), |(mut r, done)| async move {
        if done {
            return None;
        }
        let mut buf = vec![0u8; 1 << 20];
        let mut filled = 0;
        while filled < buf.len() {
            match r.read(&mut buf[filled..]).await {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) => return Some((Err(e), (r, true))),
            }
        }
        if filled == 0 {
            return None;
        }
        buf.truncate(filled);
        Some((Ok(Bytes::from(buf)), (r, false)))
    })
}

pub(crate) fn full(b: Bytes) -> ReqBody {
    BodyExt::boxed(Full::new(b).map_err(|never| match never {}))
}

/// Reads at most `max` bytes of `body`, failing beyond.
pub(crate) async fn read_bounded(mut body: Incoming, max: usize) -> anyhow::Result<Bytes> {
    let mut out = Vec::new();
    loop {
        let frame = tokio::time::timeout(IDLE, body.frame())
            .await
            .map_err(|_| anyhow!("the store stopped sending for {IDLE:?}"))?;
        let Some(frame) = frame else { break };
        if let Ok(data) = frame?.into_data() {
            if out.len() + data.len() > max {
                return Err(anyhow!("the store's answer is larger than {max} bytes"));
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(Bytes::from(out))
}

/// Seconds since the epoch of an S3 `LastModified` (RFC 3339).
/// Writes what arrives on `rx` to `file` in 1 MiB blocks, skipping all-zero blocks (holes in
/// a fresh file), hashing everything; sets the length and fsyncs at the end.
pub(crate) fn write_sparse(
    file: std::fs::File,
    rx: std::sync::mpsc::Receiver<Bytes>,
) -> std::io::Result<(u64, String)> {
    use std::os::unix::fs::FileExt;
    const BLOCK: usize = 1 << 20;
    let mut hash = Sha256::new();
    let mut buf: Vec<u8> = Vec::with_capacity(BLOCK);
    let mut offset = 0u64;
    let flush = |buf: &mut Vec<u8>, offset: &mut u64| -> std::io::Result<()> {
        if buf.iter().any(|&b| b != 0) {
            file.write_all_at(buf, *offset)?;
        }
        *offset += buf.len() as u64;
        buf.clear();
        Ok(())
    };
    for data in rx {
        hash.update(&data);
        let mut rest: &[u8] = &data;
        while !rest.is_empty() {
            let n = (BLOCK - buf.len()).min(rest.len());
            buf.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
            if buf.len() == BLOCK {
                flush(&mut buf, &mut offset)?;
            }
        }
    }
    flush(&mut buf, &mut offset)?;
    file.set_len(offset)?;
    file.sync_all().map_err(io_err)?;
    Ok((offset, hex::encode(hash.finalize())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downloads_keep_zero_blocks_as_holes_and_hash_every_byte() {
        let dir = tempfile::tempdir().expect("dir");
        let p = dir.path().join("f");
        let f = std::fs::File::create(&p).expect("create");
        let (tx, rx) = std::sync::mpsc::sync_channel(4);
        let mut data = vec![0u8; 3 << 20];
        data[(2 << 20) + 5] = 7;
        let want = crate::sha256_hex(&data);
        let writer = std::thread::spawn(move || write_sparse(f, rx));
        for c in data.chunks(300_001) {
            tx.send(Bytes::copy_from_slice(c)).expect("send");
        }
        drop(tx);
        let (len, sha) = writer.join().expect("join").expect("write");
        assert_eq!(len, 3 << 20);
        assert_eq!(sha, want);
        assert_eq!(std::fs::read(&p).expect("read"), data);
        use std::os::unix::fs::MetadataExt;
        let blocks = std::fs::metadata(&p).expect("meta").blocks();
        assert!(
            blocks * 512 < 2 << 20,
            "zero blocks were left as holes: {blocks}"
        );
    }
}
