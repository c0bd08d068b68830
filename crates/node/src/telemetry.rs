//! Guest telemetry: envd `GET /metrics` of every running sandbox scraped every 5 s into
//! `sandboxes/<id>/metrics.jsonl`, console logs parsed into entries, and the cleanup that
//! removes a sandbox's directory 7 days after its last execution ended.
//!
//! Everything here comes from an untrusted guest: answers, lines and files are size-bounded,
//! parsed defensively and clamped. Sample timestamps are the host's clock; log timestamps are
//! the guest's only while they are plausible for the file they were read from.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{Read, Seek, SeekFrom, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use vmon_proto::node::{LogDirection, LogEntry, LogLevel, LogQuery, MetricSample};

/// How often every running sandbox is sampled.
pub const SCRAPE_EVERY: Duration = Duration::from_secs(5);
/// How long a sandbox's samples and logs stay after its last execution ended.
pub const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// How often the cleanup looks for expired sandbox directories.
const CLEANUP_EVERY: Duration = Duration::from_secs(600);
/// `metrics.jsonl` is rotated to `metrics.1.jsonl` past this size (7 days at 5 s is ~18 MB).
const MAX_METRICS_FILE: u64 = 16 << 20;
/// Largest envd `/metrics` answer accepted.
const MAX_METRICS_ANSWER: usize = 16 << 10;
/// Longest console line kept; the rest is cut.
pub const MAX_LINE: usize = 16 << 10;
/// Most bytes read from one console log (its tail).
const MAX_CONSOLE_READ: u64 = 8 << 20;
/// Most bytes read over all of a sandbox's console logs (the newest executions win).
const MAX_CONSOLE_TOTAL: u64 = 64 << 20;
/// Most entries one log query returns.
pub const MAX_LOG_LIMIT: usize = 10_000;
/// Most fields kept per JSON line, and the longest field value.
const MAX_FIELDS: usize = 64;
const MAX_FIELD_VALUE: usize = 4 << 10;
/// How far outside its file's lifetime a guest timestamp may be and still be believed.
const CLOCK_SLACK_MS: i64 = 60_000;

const METRICS_FILE: &str = "metrics.jsonl";
const METRICS_OLD: &str = "metrics.1.jsonl";

/// The node's in-memory part: the newest sample of each running sandbox.
#[derive(Default)]
pub struct Telemetry {
    latest: Mutex<HashMap<String, MetricSample>>,
}

impl Telemetry {
    fn latest(&self) -> std::sync::MutexGuard<'_, HashMap<String, MetricSample>> {
        self.latest.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The newest sample of each listed sandbox that has one.
    pub fn latest_of(&self, ids: &[String]) -> Vec<(String, MetricSample)> {
        let latest = self.latest();
        ids.iter()
            .filter_map(|id| latest.get(id).map(|s| (id.clone(), s.clone())))
            .collect()
    }
}

/// What the scraper needs of one running sandbox.
pub(crate) struct Target {
    pub sandbox_id: String,
    pub envd: SocketAddr,
    pub token: Option<String>,
    /// The running execution's console log, kept within [`MAX_CONSOLE_FILE`].
    pub console: Option<PathBuf>,
}

/// A running execution's console log is cut back to [`CONSOLE_KEEP`] (its newest part) once
/// it is larger than this: a guest flooding its serial port costs a bounded amount of disk.
pub const MAX_CONSOLE_FILE: u64 = 4 << 20;
pub const CONSOLE_KEEP: u64 = 2 << 20;

/// Caps one console log, moving its `console.skip` mark (warm-up output to leave out) back by
/// what was cut.
pub fn cap_console(path: &Path) -> std::io::Result<u64> {
    let removed = vmon_vm::console::cap(path, MAX_CONSOLE_FILE, CONSOLE_KEEP)?;
    if removed > 0 {
        if let Some(skip_file) = path.parent().map(|d| d.join("console.skip")) {
            if let Some(skip) = std::fs::read_to_string(&skip_file)
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
            {
                std::fs::write(&skip_file, skip.saturating_sub(removed).to_string())?;
            }
        }
    }
    Ok(removed)
}

fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Sandbox ids name directories: nothing else may reach the filesystem.
fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

fn sandbox_dir(data_dir: &Path, id: &str) -> Option<PathBuf> {
    valid_id(id).then(|| data_dir.join("sandboxes").join(id))
}

/// What the scraper needs from its owner (the node).
pub(crate) trait Scraped: Send + Sync + 'static {
    /// Running sandboxes that may be sampled now (busy ones wait a round).
    fn scrape_targets(&self) -> Vec<Target>;
    /// Where each sandbox's samples are kept (`<data>/sandboxes/<id>`).
    fn data_dir(&self) -> &Path;
    /// The newest samples, kept in memory.
    fn telemetry(&self) -> &Telemetry;
}

/// Runs the scraper and the cleanup for as long as the node lives.
pub(crate) fn spawn<N: Scraped>(node: Weak<N>) {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(SCRAPE_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut last_cleanup: Option<tokio::time::Instant> = None;
        loop {
            ticker.tick().await;
            let Some(node) = node.upgrade() else { return };
            scrape_all(&node).await;
            if last_cleanup.is_none_or(|t| t.elapsed() >= CLEANUP_EVERY) {
                last_cleanup = Some(tokio::time::Instant::now());
                let running: HashSet<String> = node
                    .scrape_targets()
                    .into_iter()
                    .map(|t| t.sandbox_id)
                    .collect();
                let data_dir = node.data_dir().to_path_buf();
                let removed = tokio::task::spawn_blocking(move || {
                    cleanup(&data_dir, &running, SystemTime::now())
                })
                .await
                .unwrap_or_default();
                if !removed.is_empty() {
                    tracing::info!(count = removed.len(), "removed expired sandbox telemetry");
                }
            }
        }
    });
}

/// Samples every running sandbox once, in parallel; a guest that does not answer in time
/// simply has no sample this round.
async fn scrape_all<N: Scraped>(node: &Arc<N>) {
    let targets = node.scrape_targets();
    let ids: HashSet<String> = targets.iter().map(|t| t.sandbox_id.clone()).collect();
    let mut tasks = tokio::task::JoinSet::new();
    for t in targets {
        tasks.spawn(async move {
            if let Some(console) = t.console.clone() {
                let capped = tokio::task::spawn_blocking(move || cap_console(&console)).await;
                match capped {
                    Ok(Ok(n)) if n > 0 => {
                        tracing::info!(sandbox = %t.sandbox_id, bytes = n, "console log cut back")
                    }
                    Ok(Err(e)) if e.kind() != std::io::ErrorKind::NotFound => {
                        tracing::warn!(sandbox = %t.sandbox_id, "capping the console log: {e}")
                    }
                    _ => {}
                }
            }
            let sample = scrape(t.envd, t.token.as_deref()).await;
            (t.sandbox_id, sample)
        });
    }
    let data_dir = node.data_dir().to_path_buf();
    while let Some(done) = tasks.join_next().await {
        let Ok((id, sample)) = done else { continue };
        match sample {
            Ok(sample) => {
                let Some(dir) = sandbox_dir(&data_dir, &id) else {
                    continue;
                };
                let line = sample.clone();
                let written = tokio::task::spawn_blocking(move || append_sample(&dir, &line)).await;
                if let Ok(Err(e)) = written {
                    tracing::warn!(sandbox = %id, "writing a metrics sample failed: {e:#}");
                }
                node.telemetry().latest().insert(id, sample);
            }
            Err(e) => tracing::debug!(sandbox = %id, "metrics scrape failed: {e:#}"),
        }
    }
    node.telemetry().latest().retain(|id, _| ids.contains(id));
}

async fn scrape(addr: SocketAddr, token: Option<&str>) -> anyhow::Result<MetricSample> {
    let headers: Vec<(&str, String)> = token
        .map(|t| vec![("x-access-token", t.to_string())])
        .unwrap_or_default();
    let (status, body) = crate::envd_client::request(
        addr,
        "GET",
        "/metrics",
        &headers,
        Vec::new(),
        Duration::from_secs(3),
    )
    .await?;
    if status != 200 {
        anyhow::bail!("envd /metrics answered {status}");
    }
    if body.len() > MAX_METRICS_ANSWER {
        anyhow::bail!("envd /metrics answer is {} bytes", body.len());
    }
    let v: Value = serde_json::from_slice(&body)?;
    parse_envd_metrics(&v, now_unix()).ok_or_else(|| anyhow::anyhow!("not a metrics object"))
}

/// Turns envd's answer into a sample taken at `now`, clamping what makes no sense.
pub fn parse_envd_metrics(v: &Value, now: i64) -> Option<MetricSample> {
    let obj = v.as_object()?;
    let uint = |k: &str| -> u64 {
        match obj.get(k) {
            Some(Value::Number(n)) => n
                .as_u64()
                .or_else(|| {
                    n.as_f64()
                        .filter(|f| f.is_finite() && *f > 0.0)
                        .map(|f| f.min(u64::MAX as f64) as u64)
                })
                .unwrap_or(0),
            _ => 0,
        }
    };
    let pct = obj
        .get("cpu_used_pct")
        .and_then(Value::as_f64)
        .filter(|f| f.is_finite())
        .unwrap_or(0.0)
        .clamp(0.0, 100.0);
    let mem_total = uint("mem_total");
    let disk_total = uint("disk_total");
    Some(MetricSample {
        timestamp_unix: now,
        cpu_count: uint("cpu_count").min(4096) as u32,
        cpu_used_pct: ((pct * 100.0).round() / 100.0) as f32,
        mem_used: uint("mem_used").min(mem_total),
        mem_total,
        mem_cache: uint("mem_cache").min(mem_total),
        disk_used: uint("disk_used").min(disk_total),
        disk_total,
    })
}

fn sample_json(s: &MetricSample) -> Value {
    serde_json::json!({
        "ts": s.timestamp_unix,
        "cpu_count": s.cpu_count,
        "cpu_used_pct": s.cpu_used_pct,
        "mem_used": s.mem_used,
        "mem_total": s.mem_total,
        "mem_cache": s.mem_cache,
        "disk_used": s.disk_used,
        "disk_total": s.disk_total,
    })
}

/// Appends one line to the sandbox's `metrics.jsonl`, rotating it when it grew too big.
pub fn append_sample(dir: &Path, s: &MetricSample) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(METRICS_FILE);
    if std::fs::metadata(&path).is_ok_and(|m| m.len() > MAX_METRICS_FILE) {
        std::fs::rename(&path, dir.join(METRICS_OLD))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)?;
    let mut line = sample_json(s).to_string();
    line.push('\n');
    f.write_all(line.as_bytes())?;
    Ok(())
}

/// The samples of a sandbox within `[start, end]` (Unix seconds), oldest first.
pub fn read_samples(data_dir: &Path, id: &str, start: i64, end: i64) -> Vec<MetricSample> {
    let Some(dir) = sandbox_dir(data_dir, id) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for name in [METRICS_OLD, METRICS_FILE] {
        let Ok(f) = std::fs::File::open(dir.join(name)) else {
            continue;
        };
        let mut text = Vec::new();
        if f.take(2 * MAX_METRICS_FILE).read_to_end(&mut text).is_err() {
            continue;
        }
        for line in text.split(|b| *b == b'\n') {
            let Ok(v) = serde_json::from_slice::<Value>(line) else {
                continue;
            };
            let Some(ts) = v.get("ts").and_then(Value::as_i64) else {
                continue;
            };
            if ts < start || ts > end {
                continue;
            }
            if let Some(s) = parse_envd_metrics(&v, ts) {
                out.push(s);
            }
        }
    }
    out.sort_by_key(|s| s.timestamp_unix);
    out
}

/// Removes sandbox directories that run nothing and whose newest file is older than the
/// retention; returns their ids.
pub fn cleanup(data_dir: &Path, running: &HashSet<String>, now: SystemTime) -> Vec<String> {
    let mut removed = Vec::new();
    let Ok(rd) = std::fs::read_dir(data_dir.join("sandboxes")) else {
        return removed;
    };
    for e in rd.flatten() {
        let id = e.file_name().to_string_lossy().to_string();
        if running.contains(&id) || !e.path().is_dir() {
            continue;
        }
        let mut newest = mtime(&e.path());
        let mut live = false;
        for ex in std::fs::read_dir(e.path()).into_iter().flatten().flatten() {
            newest = newest.max(mtime(&ex.path()));
            if ex.path().is_dir() {
                // A sandbox.json means an execution the node still owns (or will re-adopt).
                live |= crate::sandbox::SandboxState::path(&ex.path()).exists();
                for f in std::fs::read_dir(ex.path()).into_iter().flatten().flatten() {
                    newest = newest.max(mtime(&f.path()));
                }
            }
        }
        let expired = now.duration_since(newest).is_ok_and(|age| age > RETENTION);
        if !live && expired && std::fs::remove_dir_all(e.path()).is_ok() {
            removed.push(id);
        }
    }
    removed
}

fn mtime(p: &Path) -> SystemTime {
    std::fs::symlink_metadata(p)
        .and_then(|m| m.modified())
        .unwrap_or(UNIX_EPOCH)
}

/// A line cut to at most `MAX_LINE` bytes on a character boundary.
fn bounded(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

fn level_of(s: &str) -> LogLevel {
    match s.to_ascii_lowercase().as_str() {
        "trace" | "debug" => LogLevel::Debug,
        "warn" | "warning" => LogLevel::Warn,
        "error" | "err" | "fatal" | "panic" | "critical" | "crit" => LogLevel::Error,
        _ => LogLevel::Info,
    }
}

fn rfc3339_ms(s: &str) -> Option<i64> {
    let t = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).ok()
}

/// One console line as an entry, and the guest's timestamp for it if it carried one.
pub fn parse_line(raw: &str) -> Option<(LogEntry, Option<i64>)> {
    let line = bounded(raw.trim_end_matches(['\r', '\n']), MAX_LINE);
    if line.trim().is_empty() {
        return None;
    }
    let trimmed = line.trim_start();
    if trimmed.starts_with('{') {
        if let Ok(serde_json::Value::Object(map)) = serde_json::from_str::<Value>(trimmed) {
            let mut message = String::new();
            let mut level = LogLevel::Info;
            let mut ts = None;
            let mut fields = BTreeMap::new();
            for (k, v) in map {
                match (k.as_str(), &v) {
                    ("message" | "msg", Value::String(m)) if message.is_empty() => {
                        message = m.clone()
                    }
                    ("level", Value::String(l)) => level = level_of(l),
                    ("timestamp" | "time", Value::String(t)) if ts.is_none() => ts = rfc3339_ms(t),
                    _ if fields.len() < MAX_FIELDS => {
                        let value = match v {
                            Value::String(s) => s,
                            other => other.to_string(),
                        };
                        fields.insert(bounded(&k, 256), bounded(&value, MAX_FIELD_VALUE));
                    }
                    _ => {}
                }
            }
            let entry = LogEntry {
                timestamp_ms: 0,
                level,
                message,
                fields,
                line,
            };
            return Some((entry, ts));
        }
    }
    // Kernel text: "[    1.234567] message"; anything else is kept as it is.
    let message = match trimmed.strip_prefix('[').and_then(|r| r.split_once("] ")) {
        Some((uptime, rest)) if uptime.trim().parse::<f64>().is_ok() => rest.to_string(),
        _ => trimmed.to_string(),
    };
    let mut fields = BTreeMap::new();
    fields.insert("logger".to_string(), "console".to_string());
    Some((
        LogEntry {
            timestamp_ms: 0,
            level: LogLevel::Info,
            message,
            fields,
            line,
        },
        None,
    ))
}

/// Parses one console log: guest timestamps within `[born, modified]` (plus slack) are
/// believed; other lines take the previous believed one (leading lines, the first).
pub fn parse_console(text: &str, born_ms: i64, modified_ms: i64) -> Vec<LogEntry> {
    let lo = born_ms - CLOCK_SLACK_MS;
    let hi = modified_ms + CLOCK_SLACK_MS;
    let mut parsed: Vec<(LogEntry, Option<i64>)> = text
        .split('\n')
        .filter_map(parse_line)
        .map(|(e, ts)| (e, ts.filter(|t| (lo..=hi).contains(t))))
        .collect();
    let first = parsed.iter().find_map(|(_, t)| *t).unwrap_or(born_ms);
    let mut last = first;
    for (e, ts) in &mut parsed {
        last = ts.unwrap_or(last).max(lo);
        e.timestamp_ms = last;
    }
    parsed.into_iter().map(|(e, _)| e).collect()
}

/// Reads the tail of a console log (at most `max` bytes, from the first whole line), never
/// its first `from` bytes.
fn read_tail(path: &Path, max: u64, from: u64) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let skip = len.saturating_sub(max).max(from.min(len));
    f.seek(SeekFrom::Start(skip))?;
    let mut bytes = Vec::new();
    f.take(max).read_to_end(&mut bytes)?;
    if skip > from {
        let cut = bytes
            .iter()
            .position(|b| *b == b'\n')
            .map_or(bytes.len(), |i| i + 1);
        bytes.drain(..cut);
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Every entry of these console logs (oldest execution first), ordered by time.
pub fn read_entries(consoles: &[PathBuf]) -> Vec<LogEntry> {
    let mut budget = MAX_CONSOLE_TOTAL;
    let mut chunks = Vec::new();
    // Newest executions first, so the budget keeps the recent past.
    for path in consoles.iter().rev() {
        if budget == 0 {
            break;
        }
        let Ok(meta) = std::fs::metadata(path) else {
            continue;
        };
        let max = MAX_CONSOLE_READ.min(budget);
        // A pooled process warmed up before it became this sandbox: its output is not ours.
        let from = path
            .parent()
            .and_then(|d| std::fs::read_to_string(d.join("console.skip")).ok())
            .and_then(|t| t.trim().parse::<u64>().ok())
            .unwrap_or(0);
        let Ok(text) = read_tail(path, max, from) else {
            continue;
        };
        budget = budget.saturating_sub(meta.len().min(max));
        let modified = meta.modified().map(unix_ms).unwrap_or(0);
        let born = path
            .parent()
            .and_then(|d| std::fs::metadata(d).ok())
            .and_then(|m| m.created().or_else(|_| m.modified()).ok())
            .map(unix_ms)
            .unwrap_or(modified)
            .min(modified);
        chunks.push(parse_console(&text, born, modified));
    }
    let mut all: Vec<LogEntry> = chunks.into_iter().rev().flatten().collect();
    all.sort_by_key(|e| e.timestamp_ms);
    all
}

/// Applies a query to entries ordered by time.
pub fn select(entries: Vec<LogEntry>, q: &LogQuery) -> Vec<LogEntry> {
    let limit = q.limit.min(MAX_LOG_LIMIT);
    let needle = q
        .search
        .as_deref()
        .filter(|s| !s.is_empty())
        .map(str::to_lowercase);
    let keep = |e: &LogEntry| {
        q.min_level.is_none_or(|l| e.level >= l)
            && needle
                .as_deref()
                .is_none_or(|n| e.line.to_lowercase().contains(n))
    };
    match q.direction {
        LogDirection::Forward => entries
            .into_iter()
            .filter(|e| q.cursor_ms.is_none_or(|c| e.timestamp_ms >= c))
            .filter(|e| keep(e))
            .take(limit)
            .collect(),
        LogDirection::Backward => entries
            .into_iter()
            .rev()
            .filter(|e| q.cursor_ms.is_none_or(|c| e.timestamp_ms <= c))
            .filter(|e| keep(e))
            .take(limit)
            .collect(),
    }
}

#[cfg(test)]
#[path = "telemetry_fuzz.rs"]
mod fuzz;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envd_metrics_are_clamped() {
        let v = serde_json::json!({
            "ts": 1, "cpu_count": 2, "cpu_used_pct": 250.0, "mem_total": 100, "mem_used": 400,
            "mem_cache": -3, "disk_used": 5, "disk_total": 10
        });
        let s = parse_envd_metrics(&v, 1000).expect("object");
        assert_eq!(s.timestamp_unix, 1000);
        assert_eq!(s.cpu_used_pct, 100.0);
        assert_eq!(s.mem_used, 100);
        assert_eq!(s.mem_cache, 0);
        assert_eq!(s.disk_used, 5);
        assert!(parse_envd_metrics(&serde_json::json!([1]), 0).is_none());
        let nan = serde_json::json!({"cpu_used_pct": "x", "cpu_count": 1e30});
        let s = parse_envd_metrics(&nan, 0).expect("object");
        assert_eq!((s.cpu_used_pct, s.cpu_count), (0.0, 4096));
    }

    #[test]
    fn samples_round_trip_through_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sb = dir.path().join("sandboxes").join("sb1");
        for ts in [10, 15, 20] {
            let s = MetricSample {
                timestamp_unix: ts,
                cpu_count: 2,
                cpu_used_pct: 1.5,
                mem_used: 1,
                mem_total: 2,
                mem_cache: 0,
                disk_used: 3,
                disk_total: 4,
            };
            append_sample(&sb, &s).expect("append");
        }
        std::fs::OpenOptions::new()
            .append(true)
            .open(sb.join(METRICS_FILE))
            .and_then(|mut f| f.write_all(b"garbage\n{\"ts\":\"x\"}\n"))
            .expect("garbage");
        let got = read_samples(dir.path(), "sb1", 12, 20);
        assert_eq!(
            got.iter().map(|s| s.timestamp_unix).collect::<Vec<_>>(),
            vec![15, 20]
        );
        assert!(read_samples(dir.path(), "../x", 0, 100).is_empty());
    }

    #[test]
    fn console_lines_become_entries() {
        let text = concat!(
            "[    0.123456] Linux version 6.1\r\n",
            "{\"level\":\"info\",\"logger\":\"init\",\"msg\":\"init ready\"}\r\n",
            "{\"timestamp\":\"2026-01-01T00:00:10.5Z\",\"level\":\"INFO\",\"message\":\"process started\",",
            "\"logger\":\"process\",\"event_type\":\"process_start\",\"pid\":154,\"exited\":true}\r\n",
            "{\"timestamp\":\"1970-01-01T00:00:00Z\",\"level\":\"WARN\",\"message\":\"bad clock\"}\n",
            "\n",
        );
        let born = rfc3339_ms("2026-01-01T00:00:00Z").expect("ts");
        let e = parse_console(text, born, born + 20_000);
        assert_eq!(e.len(), 4);
        assert_eq!(e[0].message, "Linux version 6.1");
        assert_eq!(e[1].fields["logger"], "init");
        assert_eq!(e[2].fields["pid"], "154");
        assert_eq!(e[2].fields["exited"], "true");
        assert_eq!(e[2].fields["event_type"], "process_start");
        assert_eq!(e[2].timestamp_ms, born + 10_500);
        // Leading lines take the first believed time; the implausible one the previous.
        assert_eq!(e[0].timestamp_ms, born + 10_500);
        assert_eq!(e[3].timestamp_ms, born + 10_500);
        assert_eq!(e[3].level, LogLevel::Warn);
    }

    #[test]
    fn warm_up_output_is_skipped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ex = dir.path().join("e1");
        std::fs::create_dir_all(&ex).expect("mkdir");
        std::fs::write(ex.join("console.log"), "pool line\nmine\n").expect("write");
        std::fs::write(ex.join("console.skip"), "10").expect("write");
        let e = read_entries(&[ex.join("console.log")]);
        assert_eq!(
            e.iter().map(|e| e.message.as_str()).collect::<Vec<_>>(),
            vec!["mine"]
        );
    }

    #[test]
    fn long_lines_are_cut() {
        let long = format!("{}é", "x".repeat(MAX_LINE - 1));
        let (e, _) = parse_line(&long).expect("entry");
        assert!(e.line.len() <= MAX_LINE);
    }

    #[test]
    fn queries_walk_both_ways() {
        let entries: Vec<LogEntry> = (0..10)
            .map(|i| LogEntry {
                timestamp_ms: i * 100,
                level: if i % 2 == 0 {
                    LogLevel::Info
                } else {
                    LogLevel::Error
                },
                message: format!("m{i}"),
                fields: BTreeMap::new(),
                line: format!("line {i}"),
            })
            .collect();
        let fwd = select(
            entries.clone(),
            &LogQuery {
                cursor_ms: Some(300),
                limit: 3,
                ..Default::default()
            },
        );
        assert_eq!(
            fwd.iter().map(|e| e.timestamp_ms).collect::<Vec<_>>(),
            vec![300, 400, 500]
        );
        let back = select(
            entries.clone(),
            &LogQuery {
                cursor_ms: Some(650),
                direction: LogDirection::Backward,
                limit: 2,
                min_level: Some(LogLevel::Error),
                ..Default::default()
            },
        );
        assert_eq!(
            back.iter().map(|e| e.timestamp_ms).collect::<Vec<_>>(),
            vec![500, 300]
        );
        let found = select(
            entries,
            &LogQuery {
                limit: 100,
                search: Some("LINE 7".into()),
                ..Default::default()
            },
        );
        assert_eq!(found.len(), 1);
    }

    #[test]
    fn cleanup_keeps_running_and_recent_sandboxes() {
        let dir = tempfile::tempdir().expect("tempdir");
        for id in ["old", "other", "running"] {
            let ex = dir.path().join("sandboxes").join(id).join("e1");
            std::fs::create_dir_all(&ex).expect("mkdir");
            std::fs::write(ex.join("console.log"), "x").expect("write");
        }
        let running = HashSet::from(["running".to_string()]);
        assert!(cleanup(dir.path(), &running, SystemTime::now()).is_empty());
        let later = SystemTime::now() + RETENTION + Duration::from_secs(60);
        let mut removed = cleanup(dir.path(), &running, later);
        removed.sort();
        assert_eq!(removed, vec!["old".to_string(), "other".to_string()]);
        assert!(dir.path().join("sandboxes/running").exists());
    }
}
