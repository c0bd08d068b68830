"""The fleet as Prometheus sees it in a cluster: Debian's Prometheus scrapes both api replicas
with deploy/prometheus/rules.yml; each replica reports both nodes (capacity, load, heartbeat,
drain) under their ids and hosts, the cluster's capacity rules return series, and a node that
dies is named by `VmonNodeMissing` once its lease lapses, and no longer once it is back."""

from __future__ import annotations

import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from conftest import DIR, wait_for

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from prometheus_harness import (  # noqa: E402
    Prometheus, check_selectors, dashboard_queries, declared, rules,
)

# What a replica reports only after traffic or on one machine: may select nothing here.
MAY_BE_EMPTY = ("vmon_sandbox_", "vmon_pool_depth")


@pytest.fixture
def prometheus(cluster):
    workdir = Path(tempfile.mkdtemp(prefix="vmon-prom-", dir="/var/tmp"))
    targets = [f"127.0.0.1:{cluster.api_port(i)}" for i in (1, 2)]
    p = Prometheus(workdir, targets, DIR / "api" / "admin-token", cluster.ca if cluster.tls else None)
    try:
        yield p
    finally:
        p.close()
        shutil.rmtree(workdir, ignore_errors=True)


def nodes_seen(prom: Prometheus) -> set[tuple[str, str, str]]:
    return {(r["metric"]["instance"], r["metric"]["node"], r["metric"]["host"])
            for r in prom.query("vmon_node_vcpus")}


def test_the_nodes_and_a_lost_node_as_prometheus_sees_them(cluster, prometheus):
    want = {(f"127.0.0.1:{cluster.api_port(i)}", f"node{n}", f"host-{n}") for i in (1, 2) for n in (1, 2)}
    wait_for(lambda: nodes_seen(prometheus) == want, 90, what="both replicas reporting both nodes")

    # The recording rules see the nodes at their first evaluation after that scrape (every 1 s
    # here): asking at once raced it and found nothing.
    ratio = wait_for(lambda: prometheus.query("vmon:cluster_free_memory:ratio"), 30,
                     what="vmon:cluster_free_memory:ratio recorded")
    assert len(ratio) == 1 and 0 < float(ratio[0]["value"][1]) <= 1, ratio
    slots = wait_for(lambda: prometheus.query("vmon:cluster_free_slots:sum"), 30,
                     what="vmon:cluster_free_slots:sum recorded")
    assert len(slots) == 1 and 0 < float(slots[0]["value"][1]) <= 2 * 512, slots
    nodes = prometheus.query("max(vmon_nodes)")
    assert float(nodes[0]["value"][1]) == 2

    req = urllib.request.Request(f"{cluster.api_a}/metrics",
                                 headers={"x-admin-token": (DIR / "api" / "admin-token").read_text().strip()})
    with urllib.request.urlopen(req, timeout=30, context=cluster.ssl_context()) as r:
        exported = declared(r.read().decode())
    for rule in rules():
        prometheus.query(rule["expr"])
        check_selectors(prometheus, rule["expr"], exported, MAY_BE_EMPTY)
    for expr in dashboard_queries():
        prometheus.query(expr)
        check_selectors(prometheus, expr, exported, MAY_BE_EMPTY)
    missing = next(r["expr"] for r in rules() if r.get("alert") == "VmonNodeMissing")
    assert prometheus.query(missing) == []

    # node2 dies: once its lease lapses (10 s) it leaves the members and the rule names it.
    cluster.kill_process("node2")
    try:
        gone = wait_for(lambda: prometheus.query(missing), 60, what="VmonNodeMissing to name node2")
        assert [(g["metric"]["node"], g["metric"]["host"]) for g in gone] == [("node2", "host-2")], gone
    finally:
        cluster.start("node2")
    wait_for(lambda: nodes_seen(prometheus) == want, 120, what="node2 back in both replicas")
    assert prometheus.query(missing) == []
