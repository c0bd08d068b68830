//! `vmon bench snapshot`: create, pause, resume and fork figures of one node, with PSS.

use super::*;

/// What `vmon bench snapshot` measured, in ms (PSS in MiB).
#[derive(Default)]
struct SnapshotFigures {
    pooled: Vec<f64>,
    cold: Vec<f64>,
    /// Per dirtied size: pause times, and resumes from the build's files.
    pauses: Vec<(u32, Vec<f64>)>,
    resumes: Vec<(u32, Vec<f64>)>,
    /// Resumes of a kept QEMU, every size.
    hot: Vec<f64>,
    fork1: Vec<f64>,
    fork10: Vec<f64>,
    /// PSS of idle fork children, and one child's by mapping.
    pss: Vec<f64>,
    pss_breakdown: String,
    /// Warmed and blank processes' PSS.
    warm_pss: Vec<f64>,
    disk_mibps: f64,
}

pub(super) async fn snapshot(data_dir: &Path, a: SnapshotArgs) -> anyhow::Result<()> {
    let mut cfg = NodeConfig::new(data_dir.to_path_buf());
    cfg.pool_size = 1;
    let blanks = cfg.blank_pool_size;
    let node = Node::open(cfg).await?;
    let tpl = bench_template(&node, a.memory_mb).await?;
    let n = a.runs.max(1);
    let mut f = SnapshotFigures::default();
    eprintln!("warming up");
    node.warm(&tpl);
    wait_pool(&node, &tpl).await;
    let w = node.start(spec("benchwarm", &tpl)).await?;
    node.kill("benchwarm", &w.execution_id).await?;
    wait_pool(&node, &tpl).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    f.warm_pss = node
        .warm_pids()
        .into_iter()
        .filter_map(pss_kib)
        .map(|k| k / 1024.0)
        .collect();
    // The limit a pause's capture runs against: this disk's write bandwidth, measured now.
    f.disk_mibps = disk_write_mibps(data_dir, a.dirty.iter().copied().max().unwrap_or(256))?;
    snapshot_creates(&node, &tpl, n, &mut f).await?;
    // The rest with the node's defaults: blank processes per RAM base (no warm pool needed).
    node.set_blank_pool_size(blanks);
    snapshot_pauses(&node, &tpl, n, blanks, &a.dirty, &mut f).await?;
    let counts: Vec<usize> = if a.no_fork10 { vec![1] } else { vec![1, 10] };
    snapshot_forks(&node, &tpl, n, blanks, &counts, &mut f).await?;
    snapshot_report(&node, &tpl, blanks, a.memory_mb, &f).await;
    node.drain_pool().await;
    Ok(())
}

/// The benchmark's template (1 vCPU, `memory_mb`), built unless it exists.
async fn bench_template(node: &Node, memory_mb: u32) -> anyhow::Result<String> {
    let tpl = format!("bench-{}-{}", memory_mb, node.image().await?.manifest.hash);
    node.build_template(TemplateSpec {
        build_id: tpl.clone(),
        vcpus: 1,
        memory_mb,
        disk_mb: 0,
        start_cmd: None,
        ready_cmd: None,
        warm_request: None,
        env_vars: Default::default(),
        image: None,
        layer: None,
    })
    .await?;
    Ok(tpl)
}

/// Creates from the warm pool, then with no pool at all (the pools are emptied).
async fn snapshot_creates(
    node: &Arc<Node>,
    tpl: &str,
    n: usize,
    f: &mut SnapshotFigures,
) -> anyhow::Result<()> {
    for i in 0..n {
        wait_pool(node, tpl).await;
        let id = format!("bp{i}{}", rand_hex());
        let t = Instant::now();
        let r = node.start(spec(&id, tpl)).await?;
        f.pooled.push(ms(t.elapsed()));
        node.kill(&id, &r.execution_id).await?;
    }
    node.set_pool_size(0);
    node.set_blank_pool_size(0);
    node.drain_pool().await;
    for i in 0..n {
        let id = format!("bc{i}{}", rand_hex());
        let t = Instant::now();
        let r = node.start(spec(&id, tpl)).await?;
        f.cold.push(ms(t.elapsed()));
        node.kill(&id, &r.execution_id).await?;
    }
    Ok(())
}

/// Per dirtied size: a pause, a resume of the kept QEMU, a second pause, and a resume from
/// the build's files alone.
async fn snapshot_pauses(
    node: &Arc<Node>,
    tpl: &str,
    n: usize,
    blanks: usize,
    dirty: &[u32],
    f: &mut SnapshotFigures,
) -> anyhow::Result<()> {
    for &mib in dirty {
        let mut v = Vec::new();
        let mut from_files = Vec::new();
        for i in 0..n {
            let id = format!("bd{mib}x{i}{}", rand_hex());
            let r = node.start(spec(&id, tpl)).await?;
            wait_blanks(node, tpl, blanks).await;
            exec(
                node,
                &id,
                &format!("head -c {mib}M /dev/urandom > /dev/shm/dirty"),
            )
            .await?;
            let t = Instant::now();
            let b = node.pause(&id, &r.execution_id, true).await?;
            v.push(ms(t.elapsed()));
            // Resume the kept QEMU, pause again, then resume from the build's files alone.
            let t = Instant::now();
            let r2 = node.start(spec(&id, &b.build_id)).await?;
            f.hot.push(ms(t.elapsed()));
            let b2 = node.pause(&id, &r2.execution_id, true).await?;
            node.let_go_parked(&b2.build_id).await;
            wait_blanks(node, tpl, blanks).await;
            let t = Instant::now();
            let r3 = node.start(spec(&id, &b2.build_id)).await?;
            from_files.push(ms(t.elapsed()));
            node.kill(&id, &r3.execution_id).await?;
            node.delete_build(&b2.build_id).await?;
            node.delete_build(&b.build_id).await?;
        }
        f.pauses.push((mib, v));
        f.resumes.push((mib, from_files));
    }
    Ok(())
}

/// Forks of `count` children each (checkpoint + every child up); the first ×10 round also
/// reads the idle children's PSS.
async fn snapshot_forks(
    node: &Arc<Node>,
    tpl: &str,
    n: usize,
    blanks: usize,
    counts: &[usize],
    f: &mut SnapshotFigures,
) -> anyhow::Result<()> {
    for &count in counts {
        let runs = if count == 10 { n.min(3) } else { n };
        for i in 0..runs {
            let src = format!("bf{count}x{i}{}", rand_hex());
            let r = node.start(spec(&src, tpl)).await?;
            exec(node, &src, "head -c 16M /dev/urandom > /dev/shm/state").await?;
            wait_blanks(node, tpl, blanks).await;
            let t = Instant::now();
            let b = node.checkpoint(&src, &r.execution_id, true).await?;
            let kids: Vec<String> = (0..count).map(|k| format!("{src}k{k}")).collect();
            let futs = kids.iter().map(|k| {
                let node: Arc<Node> = node.clone();
                let s = spec(k, &b.build_id);
                async move { node.start(s).await }
            });
            let started: Vec<Result<Running, _>> = futures::future::join_all(futs).await;
            let elapsed = ms(t.elapsed());
            if count == 1 {
                f.fork1.push(elapsed);
            } else {
                f.fork10.push(elapsed);
            }
            if count == 10 && i == 0 {
                tokio::time::sleep(Duration::from_secs(5)).await;
                for k in &kids {
                    if let Some(p) = node.qemu_pid(k).await.and_then(pss_kib) {
                        f.pss.push(p / 1024.0);
                    }
                }
                if let Some(pid) = node.qemu_pid(&kids[0]).await {
                    f.pss_breakdown = pss_parts(pid);
                }
            }
            for (k, r) in kids.iter().zip(started) {
                if let Ok(r) = r {
                    node.kill(k, &r.execution_id).await?;
                }
            }
            node.kill(&src, &r.execution_id).await?;
            node.delete_build(&b.build_id).await?;
        }
    }
    Ok(())
}

/// Prints the snapshot benchmark's table and notes.
async fn snapshot_report(
    node: &Node,
    tpl: &str,
    blanks: usize,
    memory_mb: u32,
    f: &SnapshotFigures,
) {
    println!("## vmon bench snapshot\n");
    println!(
        "machine: {}; {}; accelerator {} ({}); guest {} MiB, 1 vCPU\n",
        machine_line(),
        node.qemu_version(),
        node.accel().accel.as_str(),
        node.accel().reason,
        memory_mb
    );
    println!(
        "node: warm pool 1 per template, {blanks} blank processes per RAM base, paused QEMUs kept (parked) up to {}\n",
        node.park_max()
    );
    println!("| operation | median | p99 | n |\n|---|---|---|---|");
    row(
        "create, pooled (restore → envd /init answered)",
        &f.pooled,
        "ms",
    );
    row(
        "create, cold process (spawn + restore + /init)",
        &f.cold,
        "ms",
    );
    for (mib, v) in &f.pauses {
        row(&format!("pause with {mib} MiB dirtied"), v, "ms");
    }
    row(
        "resume, QEMU kept (cont + /init, all pause sizes)",
        &f.hot,
        "ms",
    );
    for (mib, v) in &f.resumes {
        row(
            &format!("resume from the build's files, {mib} MiB dirtied"),
            v,
            "ms",
        );
    }
    row("fork ×1 (checkpoint + child up)", &f.fork1, "ms");
    if !f.fork10.is_empty() {
        row("fork ×10 (checkpoint + 10 children up)", &f.fork10, "ms");
        row("PSS of each idle fork child", &f.pss, "MiB");
        println!(
            "\nOne idle fork child's PSS by mapping: {}",
            f.pss_breakdown
        );
    }
    println!(
        "\nThe data dir's disk writes {:.0} MiB/s (fsynced, measured in this run). \
         Pauses against it (dirtied MiB / median pause time):",
        f.disk_mibps
    );
    for (mib, v) in &f.pauses {
        let (m, _) = summary(v);
        if m > 0.0 {
            let rate = f64::from(*mib) / (m / 1e3);
            println!(
                "- {mib} MiB: {rate:.0} MiB/s, {:.2} of the disk's bandwidth",
                rate / f.disk_mibps
            );
        }
    }
    if !f.warm_pss.is_empty() {
        let (m, _) = summary(&f.warm_pss);
        println!(
            "\nEach warmed process kept ready for a template (restored, run, stopped): PSS {m:.1} MiB."
        );
    }
    wait_blanks(node, tpl, blanks).await;
    let blank_pss: Vec<f64> = node
        .blank_pids()
        .into_iter()
        .filter_map(pss_kib)
        .map(|k| k / 1024.0)
        .collect();
    if !blank_pss.is_empty() {
        let (m, _) = summary(&blank_pss);
        println!(
            "\nEach of the {} blank processes kept ready: PSS {m:.1} MiB (median).",
            blank_pss.len()
        );
    }
}
