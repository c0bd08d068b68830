//! The memory check at the end of a live migration: after QEMU's last round, with both guests
//! stopped, the target's RAM is made equal to the source's page by page.
//!
//! QEMU's own copy can miss guest writes under TCG (see [`vmon_vm::ram_check`]), and a guest
//! that runs on with a stale kernel page crashes sooner or later. So before the target may
//! run, the source names every page its guest wrote since its restore over a `check` channel;
//! both sides hash those pages at once, the source sends its hashes, and the target names the
//! pages that differ; the source sends those pages and the target writes them in. Only then
//! does the copy count as done. A check that fails fails the migration (the guest runs on at
//! the source).
//!
//! The channel's frames are little-endian `u64`s: source → target `n`, `n` pages (sorted),
//! then `n` hashes; target → source `m`, `m` pages; source → target `m` pages of 4 KiB; target
//! → source `m` (written). The target bounds `n` by the machine's page count before it reads
//! any of it.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use vmon_vm::memory::PAGE;
use vmon_vm::ram_check::{self, PageDigest};

use super::migrate::{progress, Incoming};
use super::Node;
use crate::channel::ChannelIo;
use crate::rpc::RemoteNode;
use crate::sandbox::{Live, RamSource};

/// What the check found and did.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RamCheck {
    /// Pages compared (the source guest's pages written since its restore).
    pub checked: u64,
    /// Pages the target held otherwise and got from the source.
    pub repaired: u64,
    pub ms: u64,
}

impl Node {
    /// Source, QEMU has handed over: checks (and repairs) the target's copy of the guest's RAM.
    pub(super) async fn check_target_ram(
        &self,
        migration_id: &str,
        l: &Live,
        vm: &vmon_vm::Vm,
        target: &RemoteNode,
    ) -> anyhow::Result<RamCheck> {
        let t0 = Instant::now();
        let RamSource::Private { mem_base, .. } = &l.state.ram else {
            bail!("only a restored guest's memory can be checked");
        };
        let ram_file = self.builds.artifact(mem_base);
        let pid = vm.pid;
        let pages = {
            let ram_file = ram_file.clone();
            tokio::task::spawn_blocking(move || ram_check::private_pages(pid, &ram_file))
                .await
                .context("pages task")??
        };
        let mut ch = target
            .open_channel(migration_id, "check")
            .await
            .context("opening the memory check channel")?;
        // The pages first: the target hashes its copies while this side hashes its own.
        ch.write_all(&u64s_frame(Some(pages.len() as u64), &pages))
            .await?;
        ch.flush().await?;
        let (pages, hashes) = {
            let ram_file = ram_file.clone();
            tokio::task::spawn_blocking(move || {
                ram_check::page_hashes(pid, &ram_file, &pages).map(|h| (pages, h))
            })
            .await
            .context("digest task")??
        };
        ch.write_all(&u64s_frame(None, &hashes)).await?;
        ch.flush().await?;
        let digest = PageDigest { pages, hashes };
        let m = read_u64(&mut ch).await?;
        if m > digest.pages.len() as u64 {
            bail!(
                "the target names {m} pages of {} checked",
                digest.pages.len()
            );
        }
        let bad = read_u64s(&mut ch, m as usize).await?;
        if !bad.is_empty() {
            let data = {
                let bad = bad.clone();
                tokio::task::spawn_blocking(move || ram_check::read_pages(pid, &ram_file, &bad))
                    .await
                    .context("read task")??
            };
            ch.write_all(&data).await?;
            ch.flush().await?;
        }
        let written = read_u64(&mut ch).await?;
        if written != m {
            bail!("the target wrote {written} of {m} pages");
        }
        let check = RamCheck {
            checked: digest.pages.len() as u64,
            repaired: m,
            ms: t0.elapsed().as_millis() as u64,
        };
        if check.repaired > 0 {
            tracing::warn!(
                migration = migration_id,
                sandbox = %l.state.id,
                pages = check.repaired,
                first = ?&bad[..bad.len().min(8)],
                "the memory copy missed guest writes; the target got the source's pages"
            );
        }
        Ok(check)
    }

    /// Target: answers the source's memory check on `inc`, once the memory stream is in.
    pub(super) async fn serve_check(
        &self,
        inc: &Incoming,
        mut ch: ChannelIo,
    ) -> anyhow::Result<()> {
        let guard = inc.prepared.lock().await;
        let p = guard.as_ref().context("migration already taken")?;
        incoming_completed(&p.vm).await?;
        let max_pages = u64::from(inc.spec.memory_mb) * (1 << 20) / PAGE;
        let n = read_u64(&mut ch).await?;
        if n > max_pages {
            bail!("a check of {n} pages for a machine of {max_pages}");
        }
        let n = n as usize;
        let pages = read_u64s(&mut ch, n).await?;
        let ram_file = self.builds.artifact(&p.mem_base);
        let pid = p.vm.pid;
        // Ours are hashed while the source hashes its own and sends them.
        let ours = {
            let ram_file = ram_file.clone();
            let pages = pages.clone();
            tokio::task::spawn_blocking(move || ram_check::page_hashes(pid, &ram_file, &pages))
        };
        let hashes = read_u64s(&mut ch, n).await?;
        let ours = ours.await.context("check task")??;
        let bad = ram_check::differing(&PageDigest { pages, hashes }, &ours)?;
        ch.write_all(&u64s_frame(Some(bad.len() as u64), &bad))
            .await?;
        ch.flush().await?;
        if !bad.is_empty() {
            let mut data = vec![0u8; bad.len() * PAGE as usize];
            ch.read_exact(&mut data).await?;
            let pages = bad.clone();
            tokio::task::spawn_blocking(move || {
                ram_check::write_pages(pid, &ram_file, &pages, &data)
            })
            .await
            .context("write task")??;
        }
        ch.write_all(&(bad.len() as u64).to_le_bytes()).await?;
        ch.flush().await?;
        Ok(())
    }
}

/// Waits until a target QEMU has loaded the whole memory stream (it may lag the source's end
/// by a moment).
pub(super) async fn incoming_completed(vm: &vmon_vm::Vm) -> anyhow::Result<()> {
    let t0 = Instant::now();
    loop {
        let v = vm
            .qmp
            .execute_raw("query-migrate", Value::Null, Duration::from_secs(10))
            .await?;
        let pr = progress(&v);
        match pr.status.as_str() {
            "completed" => return Ok(()),
            "failed" | "cancelled" => bail!(
                "the memory stream failed on the target: {}",
                pr.error.unwrap_or_default()
            ),
            _ if t0.elapsed() > Duration::from_secs(30) => {
                bail!("the memory stream did not complete on the target")
            }
            _ => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

/// What a target QEMU says of a memory stream that broke off: its migration error and the
/// end of its stderr.
pub(super) async fn incoming_failure(inc: &Incoming) -> String {
    let guard = inc.prepared.lock().await;
    let Some(p) = guard.as_ref() else {
        return "the target's QEMU is gone".into();
    };
    let status = match p
        .vm
        .qmp
        .execute_raw("query-migrate", Value::Null, Duration::from_secs(5))
        .await
    {
        Ok(v) => {
            let pr = progress(&v);
            format!("{} {}", pr.status, pr.error.unwrap_or_default())
        }
        Err(e) => format!("no answer to query-migrate ({e})"),
    };
    let stderr = std::fs::read(p.run_dir.join("qemu.stderr"))
        .map(|b| {
            let tail = &b[b.len().saturating_sub(600)..];
            String::from_utf8_lossy(tail).trim().to_string()
        })
        .unwrap_or_default();
    format!("the target's QEMU: {status}; stderr: {stderr}")
}

/// `values` as little-endian `u64`s, after `count` when given.
fn u64s_frame(count: Option<u64>, values: &[u64]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(8 + values.len() * 8);
    for v in count.iter().chain(values) {
        frame.extend_from_slice(&v.to_le_bytes());
    }
    frame
}

async fn read_u64<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b).await?;
    Ok(u64::from_le_bytes(b))
}

async fn read_u64s<R: AsyncRead + Unpin>(r: &mut R, n: usize) -> std::io::Result<Vec<u64>> {
    let mut buf = vec![0u8; n * 8];
    r.read_exact(&mut buf).await?;
    Ok(buf
        .chunks_exact(8)
        .map(|c| {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            u64::from_le_bytes(b)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWrite;

    async fn write_u64s<W: AsyncWrite + Unpin>(w: &mut W, v: &[u64]) -> std::io::Result<()> {
        for x in v {
            w.write_all(&x.to_le_bytes()).await?;
        }
        Ok(())
    }

    #[tokio::test]
    async fn frames_round_trip_and_short_ones_fail() {
        let (mut a, mut b) = tokio::io::duplex(64);
        write_u64s(&mut a, &[3, 1 << 40, 7]).await.expect("frame");
        assert_eq!(read_u64(&mut b).await.expect("frame"), 3);
        assert_eq!(read_u64s(&mut b, 2).await.expect("frame"), vec![1 << 40, 7]);
        a.write_all(&[1, 2, 3]).await.expect("frame");
        drop(a);
        assert!(read_u64(&mut b).await.is_err());
        assert_eq!(u64s_frame(Some(2), &[5]).len(), 16);
        assert_eq!(
            u64s_frame(None, &[5, 6]),
            [5u64.to_le_bytes(), 6u64.to_le_bytes()].concat()
        );
    }
}
