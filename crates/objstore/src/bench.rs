//! Upload and download throughput of one file against the store (`vmon bench cluster`).

use std::path::Path;
use std::time::Instant;

use crate::{ObjectStore, Result};

/// What one round trip measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchResult {
    pub mib: u64,
    pub upload_mib_s: f64,
    pub download_mib_s: f64,
}

/// Writes `mib` MiB of random bytes in `dir`, uploads them to `bench/<random>`, downloads
/// them back (sha256 checked), deletes the object and the files, and reports MiB/s each way.
pub async fn bench(store: &ObjectStore, dir: &Path, mib: u64) -> Result<BenchResult> {
    let tag = format!("{:016x}", rand::Rng::gen::<u64>(&mut rand::thread_rng()));
    let src = dir.join(format!("bench-{tag}.up"));
    let back = dir.join(format!("bench-{tag}.down"));
    let key = format!("bench/{tag}");
    let r = async {
        let path = src.clone();
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            use std::io::Write;
            let mut f = std::io::BufWriter::new(std::fs::File::create(&path)?);
            let mut block = vec![0u8; 1 << 20];
            for _ in 0..mib {
                rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut block);
                f.write_all(&block)?;
            }
            f.into_inner().map_err(|e| e.into_error())?.sync_all()
        })
        .await
        .map_err(|e| anyhow::anyhow!("bench file task: {e}"))??;
        let t = Instant::now();
        let (_, sha) = store.put_file(&key, &src).await?;
        let up = t.elapsed().as_secs_f64();
        let t = Instant::now();
        store.get_to_file(&key, &back, Some(&sha)).await?;
        let down = t.elapsed().as_secs_f64();
        let m = mib as f64;
        Ok(BenchResult {
            mib,
            upload_mib_s: m / up.max(1e-9),
            download_mib_s: m / down.max(1e-9),
        })
    }
    .await;
    let _ = store.delete(&key).await;
    let _ = std::fs::remove_file(&src);
    let _ = std::fs::remove_file(&back);
    r
}
