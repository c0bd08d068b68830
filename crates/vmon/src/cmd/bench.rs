//! `vmon bench snapshot`: create, pause, resume and fork figures on this machine, printed as
//! medians and p99 with the machine, QEMU version and accelerator; `boot`, and the SDK-driven
//! `api` and `template` benchmarks (`tests/bench/`).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmon_node::{Node, NodeConfig};
use vmon_proto::node::{NetworkPolicy, NodeCalls, Running, StartSpec, TemplateSpec};

mod snapshot;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand)]
enum What {
    /// Memory snapshots: create (pooled, cold), pause, resume, fork, idle fork PSS.
    Snapshot(SnapshotArgs),
    /// Cold boots: cached image lookup, boot to envd health, RSS of an idle VM.
    Boot(BootArgs),
    /// The E2B API through the official Python SDK (runs `tests/bench/api_bench.py` with the
    /// repository's venv; against `E2B_API_URL` if set, else its own `vmon up`).
    Api,
    /// The proxy's hop to envd alone: `GET /health` through the proxy with a kept-alive
    /// client (`tests/bench/proxy_hop_bench.py`; `VMON_PROXY_KEEP_ALIVE=0` for the A side).
    ProxyHop,
    /// Template builds through the official Template SDK: a first build, a cached rebuild, a
    /// last-step rebuild, and creates from the result against creates from `base` (runs
    /// `tests/bench/template_bench.py` like `api`).
    Template,
    /// Desktop sandboxes through the official `e2b-desktop` SDK: create to first screenshot,
    /// screenshot latency, input to a visible change, pause/resume with Firefox open
    /// (`tests/bench/desktop_bench.py`, like `api`).
    Desktop,
    /// A local cluster (`scripts/cluster.sh`): create, pause, resume on the same node and on
    /// another node from the object store for 16/64/256 MiB dirtied, upload times
    /// (`tests/bench/cluster_bench.py`).
    Cluster,
    /// Live migration on a local cluster: total time, switch, QEMU's downtime, the gap a
    /// client sees, memory sent, for idle and 64 MiB/s-writing guests of 512 MiB and 1 GiB;
    /// a drain of 10 idle sandboxes (`tests/bench/migrate_bench.py`).
    Migrate,
    /// The object store's own upload and download MiB/s (the store in `VMON_S3_*`) beside the
    /// data dir's disk, for a file of `--mib` MiB.
    S3(S3Args),
    /// Pause/resume cycles that must keep a process's memory and a file byte for byte,
    /// rotating kept-QEMU, from-files and after-restart resumes (`tests/bench/soak.py`).
    Soak(SoakArgs),
    /// SIGKILLs of `vmon up` (and now and then a QEMU) at random instants of a stream of SDK
    /// calls, each followed by a restart and a check of what the SDK was told
    /// (`tests/bench/chaos.py`).
    Chaos(ChaosArgs),
    /// The cluster checker for a long run on a local cluster of its own: seeded SDK calls
    /// (creates, writes to files and memory, pauses, resumes, forks, kills) while parts are
    /// cut, killed and restarted, or stopped, some past the grace; prints the operations,
    /// faults and violations (`tests/bench/cluster_checker.py`, `tests/cluster/checker.py`).
    ClusterChecker(CheckerArgs),
    /// Idle sandboxes in steps up to `--max`: host memory per sandbox, the QEMUs' PSS and the
    /// create latency as the count grows (`tests/bench/density_bench.py`).
    Density(DensityArgs),
}

#[derive(clap::Args)]
struct DensityArgs {
    #[arg(long, default_value_t = 50)]
    max: usize,
    #[arg(long, default_value_t = 10)]
    step: usize,
}

#[derive(clap::Args)]
struct ChaosArgs {
    #[arg(long, default_value_t = 20)]
    kills: usize,
    /// Replays a run (its seed is printed); random when absent.
    #[arg(long)]
    seed: Option<u64>,
}

#[derive(clap::Args)]
struct CheckerArgs {
    /// How long the client runs its calls (the final check comes after).
    #[arg(long, default_value_t = 1800)]
    secs: u64,
    /// Replays a run's choices (its seed is printed); random when absent.
    #[arg(long)]
    seed: Option<u64>,
}

#[derive(clap::Args)]
struct SoakArgs {
    #[arg(long, default_value_t = 50)]
    cycles: usize,
}

#[derive(clap::Args)]
struct BootArgs {
    #[arg(long, default_value_t = 3)]
    runs: usize,
    #[arg(long, default_value_t = 512)]
    memory_mb: u32,
}

#[derive(clap::Args)]
struct SnapshotArgs {
    /// Repetitions of each measurement.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Guest RAM of the benchmark template.
    #[arg(long, default_value_t = 1024)]
    memory_mb: u32,
    /// Dirty sizes (MiB) to pause with.
    #[arg(long, value_delimiter = ',', default_value = "16,64,256")]
    dirty: Vec<u32>,
    /// Skip the fork ×10 and PSS part.
    #[arg(long)]
    no_fork10: bool,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Median and p99 (nearest rank) of a sample.
pub fn summary(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let med = if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
    };
    let rank = ((0.99 * s.len() as f64).ceil() as usize).clamp(1, s.len());
    (med, s[rank - 1])
}

pub fn machine_line() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .next()
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0 / 1024.0)
        .unwrap_or(0.0);
    format!(
        "{cores} cores, {cpu}, {mem_gib:.0} GiB, kernel {}",
        kernel.trim()
    )
}

fn row(name: &str, v: &[f64], unit: &str) {
    let (med, p99) = summary(v);
    println!(
        "| {name} | {med:.1} {unit} | {p99:.1} {unit} | {} |",
        v.len()
    );
}

fn spec(id: &str, build: &str) -> StartSpec {
    StartSpec {
        egress: Default::default(),
        gpus: 0,
        volumes: Vec::new(),
        sandbox_id: id.to_string(),
        execution_id: format!("e{}", rand_hex()),
        build_id: build.to_string(),
        cold_boot: false,
        env_vars: Default::default(),
        envd_access_token: Some(format!("t{}", rand_hex())),
        network: NetworkPolicy {
            allow_internet_access: true,
            ..Default::default()
        },
    }
}

fn rand_hex() -> String {
    let mut b = [0u8; 8];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut b);
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

async fn exec(node: &Node, id: &str, cmd: &str) -> anyhow::Result<()> {
    let out = node.exec(id, "root", cmd, Duration::from_secs(300)).await?;
    if out.exit_code != 0 {
        anyhow::bail!("{cmd}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

async fn wait_pool(node: &Node, build: &str) {
    let start = Instant::now();
    while node.pool_depth(build) == 0 && start.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the blank processes for `build`'s RAM base are back (steady state).
async fn wait_blanks(node: &Node, build: &str, blanks: usize) {
    let start = Instant::now();
    while node.blank_depth(build) < blanks && start.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One process's PSS split by mapping kind: the largest anonymous regions (MiB), the heap, the
/// guest RAM file, and every other file-backed mapping together.
fn pss_parts(pid: u32) -> String {
    let Ok(t) = std::fs::read_to_string(format!("/proc/{pid}/smaps")) else {
        return String::new();
    };
    let mut regions: Vec<(String, f64)> = Vec::new();
    let mut name = String::new();
    for line in t.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            let path = line.split_whitespace().nth(5).unwrap_or("");
            name = if path.is_empty() {
                "anonymous".into()
            } else if path.ends_with(".mem") {
                "guest RAM (base file, shared + private copies)".into()
            } else if path == "[heap]" {
                "heap".into()
            } else if path.starts_with('[') {
                path.to_string()
            } else {
                "other files (QEMU, libraries)".into()
            };
        } else if let Some(v) = line.strip_prefix("Pss:") {
            let kib: f64 = v
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(0.0);
            regions.push((name.clone(), kib));
        }
    }
    let mut anon: Vec<f64> = regions
        .iter()
        .filter(|(n, _)| n == "anonymous")
        .map(|(_, k)| *k)
        .collect();
    anon.sort_by(|a, b| b.total_cmp(a));
    let mut sums: Vec<(String, f64)> = Vec::new();
    for (n, k) in regions.iter().filter(|(n, _)| n != "anonymous") {
        match sums.iter_mut().find(|(m, _)| m == n) {
            Some(e) => e.1 += k,
            None => sums.push((n.clone(), *k)),
        }
    }
    let mib = |k: f64| k / 1024.0;
    let mut out = format!(
        "anonymous {:.1} MiB (largest regions {}), ",
        mib(anon.iter().sum()),
        anon.iter()
            .take(3)
            .map(|k| format!("{:.1}", mib(*k)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    out.push_str(
        &sums
            .iter()
            .filter(|(_, k)| *k >= 512.0)
            .map(|(n, k)| format!("{n} {:.1} MiB", mib(*k)))
            .collect::<Vec<_>>()
            .join(", "),
    );
    out
}

fn pss_kib(pid: u32) -> Option<f64> {
    let t = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    t.lines()
        .find(|l| l.starts_with("Pss:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

pub async fn run(data_dir: &Path, args: Args) -> anyhow::Result<()> {
    match args.what {
        What::Snapshot(a) => snapshot::snapshot(data_dir, a).await,
        What::Boot(a) => boot(data_dir, a).await,
        What::Api => python_bench("api_bench.py", &[]).await,
        What::ProxyHop => python_bench("proxy_hop_bench.py", &[]).await,
        What::Template => python_bench("template_bench.py", &[]).await,
        What::Cluster => python_bench("cluster_bench.py", &[]).await,
        What::Desktop => python_bench("desktop_bench.py", &[]).await,
        What::Migrate => python_bench("migrate_bench.py", &[]).await,
        What::S3(a) => s3(data_dir, a).await,
        What::Soak(a) => {
            python_bench("soak.py", &[("VMON_SOAK_CYCLES", a.cycles.to_string())]).await
        }
        What::Density(a) => {
            python_bench(
                "density_bench.py",
                &[
                    ("VMON_DENSITY_MAX", a.max.to_string()),
                    ("VMON_DENSITY_STEP", a.step.to_string()),
                ],
            )
            .await
        }
        What::ClusterChecker(a) => {
            let mut env = vec![("VMON_CHECKER_SECS", a.secs.to_string())];
            if let Some(seed) = a.seed {
                env.push(("VMON_CHECKER_SEED", seed.to_string()));
            }
            python_bench("cluster_checker.py", &env).await
        }
        What::Chaos(a) => {
            let mut env = vec![("VMON_CHAOS_KILLS", a.kills.to_string())];
            if let Some(seed) = a.seed {
                env.push(("VMON_CHAOS_SEED", seed.to_string()));
            }
            python_bench("chaos.py", &env).await
        }
    }
}

#[derive(clap::Args)]
pub struct S3Args {
    /// Size of the file sent and fetched.
    #[arg(long, default_value_t = 256)]
    mib: u64,
}

/// `vmon bench s3`: the disk (write + fsync, then read of a file as large) and the store.
async fn s3(data_dir: &Path, a: S3Args) -> anyhow::Result<()> {
    let cfg = vmon_objstore::ObjectStoreConfig::from_env()?
        .ok_or_else(|| anyhow::anyhow!("set VMON_S3_ENDPOINT and the other VMON_S3_* variables"))?;
    let store = vmon_objstore::ObjectStore::new(cfg)?;
    std::fs::create_dir_all(data_dir)?;
    let path = data_dir.join(format!("bench-disk-{}", std::process::id()));
    let mib = a.mib;
    let p = path.clone();
    let (write_s, read_s) = tokio::task::spawn_blocking(move || -> std::io::Result<(f64, f64)> {
        use std::io::{Read, Write};
        let block = vec![0x5au8; 1 << 20];
        let t = std::time::Instant::now();
        let mut f = std::fs::File::create(&p)?;
        for _ in 0..mib {
            f.write_all(&block)?;
        }
        f.sync_all()?;
        let w = t.elapsed().as_secs_f64();
        // Read back what the page cache holds: the disk's best case, as a fetch writes and
        // a restore reads it.
        let t = std::time::Instant::now();
        let mut f = std::fs::File::open(&p)?;
        let mut buf = vec![0u8; 1 << 20];
        while f.read(&mut buf)? > 0 {}
        Ok((w, t.elapsed().as_secs_f64()))
    })
    .await??;
    let _ = std::fs::remove_file(&path);
    let r = vmon_objstore::bench(&store, data_dir, mib).await?;
    let m = mib as f64;
    println!("vmon bench s3  ({mib} MiB)");
    println!("  disk write+fsync {:8.0} MiB/s", m / write_s.max(1e-9));
    println!("  disk read        {:8.0} MiB/s", m / read_s.max(1e-9));
    println!("  store upload     {:8.0} MiB/s", r.upload_mib_s);
    println!("  store download   {:8.0} MiB/s", r.download_mib_s);
    Ok(())
}

/// The repository this binary was built in (target/<profile>/vmon → ../..), or the cwd.
fn repo_dir() -> std::path::PathBuf {
    let from_exe = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent()?.parent()?.parent().map(Path::to_path_buf));
    match from_exe {
        Some(d) if d.join("tests/bench/api_bench.py").is_file() => d,
        _ => std::env::current_dir().unwrap_or_default(),
    }
}

/// Runs one of the SDK benchmarks in `tests/bench/` with the repository's venv.
async fn python_bench(name: &str, env: &[(&str, String)]) -> anyhow::Result<()> {
    let repo = repo_dir();
    let script = repo.join("tests/bench").join(name);
    let python = repo.join(".venv/bin/python");
    if !script.is_file() || !python.is_file() {
        anyhow::bail!(
            "needs {} and {} (run scripts/install-deps.sh in the repository)",
            script.display(),
            python.display()
        );
    }
    let status = tokio::process::Command::new(python)
        .arg(script)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .status()
        .await?;
    if !status.success() {
        anyhow::bail!("{name} failed ({status})");
    }
    Ok(())
}

fn rss_kib(pid: u32) -> Option<f64> {
    let t = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    t.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

async fn boot(data_dir: &Path, a: BootArgs) -> anyhow::Result<()> {
    let mut cfg = NodeConfig::new(data_dir.to_path_buf());
    cfg.pool_size = 0;
    let t = Instant::now();
    let node = Node::open(cfg).await?;
    let open_ms = ms(t.elapsed());
    let recipe = vmon_image::Recipe::for_host(super::image::default_envd()?)?;
    let mut cached = Vec::new();
    for _ in 0..a.runs.max(1) {
        let t = Instant::now();
        vmon_image::build(data_dir, &recipe).await?;
        cached.push(ms(t.elapsed()));
    }
    let mut boots = Vec::new();
    let mut rss = Vec::new();
    let open = NetworkPolicy {
        allow_internet_access: true,
        ..Default::default()
    };
    for i in 0..a.runs.max(1) {
        let id = format!("bb{i}{}", rand_hex());
        let t = Instant::now();
        let r = node.boot_image(&id, 1, a.memory_mb, &open).await?;
        boots.push(ms(t.elapsed()));
        tokio::time::sleep(Duration::from_secs(5)).await;
        if let Some(k) = node.qemu_pid(&id).await.and_then(rss_kib) {
            rss.push(k / 1024.0);
        }
        node.kill(&id, &r.execution_id).await?;
    }
    println!("## vmon bench boot\n");
    println!(
        "machine: {}; {}; accelerator {}; guest {} MiB, 1 vCPU\n",
        machine_line(),
        node.qemu_version(),
        node.accel().accel.as_str(),
        a.memory_mb
    );
    println!("| operation | median | p99 | n |\n|---|---|---|---|");
    row(
        "node open (probe, image lookup, recovery)",
        &[open_ms],
        "ms",
    );
    row("image build, cached (hash + lookup)", &cached, "ms");
    row("cold boot to envd /health + /init", &boots, "ms");
    row("RSS of an idle VM (5 s after boot)", &rss, "MiB");
    node.drain_pool().await;
    Ok(())
}

/// MiB/s of a `mib` MiB fsynced write of incompressible data into `dir` (the file is removed).
fn disk_write_mibps(dir: &Path, mib: u32) -> anyhow::Result<f64> {
    use std::io::Write;
    let path = dir.join(format!(".bench-disk-{}", rand_hex()));
    let mut block = vec![0u8; 1 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for b in block.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let t = Instant::now();
    let r = (|| {
        let mut f = std::fs::File::create(&path)?;
        for i in 0..mib {
            block[0] = i as u8;
            f.write_all(&block)?;
        }
        f.sync_all()?;
        anyhow::Ok(())
    })();
    let secs = t.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&path);
    r?;
    Ok(f64::from(mib) / secs.max(1e-6))
}

#[cfg(test)]
mod tests {
    use super::summary;

    #[test]
    fn median_and_p99() {
        let (m, p) = summary(&[5.0, 1.0, 3.0]);
        assert_eq!(m, 3.0);
        assert_eq!(p, 5.0);
        let (m, _) = summary(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(m, 2.5);
    }
}
