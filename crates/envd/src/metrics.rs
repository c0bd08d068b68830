//! `GET /metrics`: CPU, memory and disk of the guest, as the node samples them.

use serde::Serialize;

use crate::agent::Agent;

/// Cumulative CPU jiffies from `/proc/stat`.
#[derive(Debug, Clone, Copy)]
pub struct CpuSample {
    total: u64,
    idle: u64,
}

fn cpu_sample() -> Option<CpuSample> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    if v.len() < 4 {
        return None;
    }
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    let total: u64 = v.iter().take(8).sum();
    let idle = v[3] + v.get(4).copied().unwrap_or(0);
    Some(CpuSample { total, idle })
}

fn meminfo() -> (u64, u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let get = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    let total = get("MemTotal:");
    let available = get("MemAvailable:");
    (total, total.saturating_sub(available), get("Cached:"))
}

fn disk(path: &str) -> (u64, u64) {
    let Ok(st) = rustix::fs::statvfs(path) else {
        return (0, 0);
    };
    let total = st.f_blocks.saturating_mul(st.f_frsize);
    let used = st
        .f_blocks
        .saturating_sub(st.f_bfree)
        .saturating_mul(st.f_frsize);
    (used, total)
}

#[derive(Debug, Serialize)]
pub struct Metrics {
    ts: i64,
    cpu_count: u32,
    cpu_used_pct: f32,
    mem_total: u64,
    mem_used: u64,
    mem_cache: u64,
    mem_total_mib: u64,
    mem_used_mib: u64,
    disk_used: u64,
    disk_total: u64,
}

/// Samples now; CPU use is measured since the previous call (or over 100 ms on the first).
pub async fn collect(agent: &Agent) -> Metrics {
    let previous = *agent.cpu_sample.lock().unwrap_or_else(|p| p.into_inner());
    let previous = match previous {
        Some(p) => Some(p),
        None => {
            let first = cpu_sample();
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            first
        }
    };
    let now = cpu_sample();
    *agent.cpu_sample.lock().unwrap_or_else(|p| p.into_inner()) = now;
    let cpu_used_pct = match (previous, now) {
        (Some(a), Some(b)) if b.total > a.total => {
            let busy = (b.total - a.total).saturating_sub(b.idle.saturating_sub(a.idle));
            ((busy as f64 / (b.total - a.total) as f64 * 10000.0).round() / 100.0) as f32
        }
        _ => 0.0,
    };
    let (mem_total, mem_used, mem_cache) = meminfo();
    let (disk_used, disk_total) = disk("/");
    // SAFETY: sysconf has no preconditions.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    Metrics {
        ts: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0),
        cpu_count: cpus.max(1) as u32,
        cpu_used_pct,
        mem_total,
        mem_used,
        mem_cache,
        mem_total_mib: mem_total / (1024 * 1024),
        mem_used_mib: mem_used / (1024 * 1024),
        disk_used,
        disk_total,
    }
}
