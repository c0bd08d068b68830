"""Operators see the fleet: Debian's Prometheus scrapes the session's `vmon up` with the rules of
deploy/prometheus/rules.yml; `promtool check rules` accepts them, every rule's query and every
dashboard query (deploy/grafana/vmon.json) evaluates on the real scrapes, the rules the
transitions below feed return series, every metric a query names is one vmon exports, and no
alert fires on a healthy server."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from prometheus_harness import (  # noqa: E402
    RULES, Prometheus, check_selectors, dashboard_queries, declared, rules, wait_for,
)

# What each rule returns on one healthy machine after a few transitions: series, or none
# (alerts that do not fire; the nodes' figures, which only a cluster replica reports). A rule
# added to rules.yml must say here what it returns.
EXPECT = {
    "vmon:sandbox_transitions:rate5m": "series",
    "vmon:sandbox_transition_errors:ratio5m": "series",
    "vmon:sandbox_transition_duration_seconds:p95_5m": "series",
    "vmon:sandboxes:max": "series",
    "vmon:cluster_free_memory:ratio": "none",
    "vmon:cluster_free_slots:sum": "none",
    "VmonApiDown": "none",
    "VmonNoApi": "none",
    "VmonTransitionErrors": "none",
    # One create's latency: under a loaded TCG host it may pass the threshold.
    "VmonCreateSlow": "any",
    "VmonWebhookDeliveriesFailing": "none",
    "VmonNodeMissing": "none",
    "VmonNodeHeartbeatLate": "none",
    "VmonNodeDiskLow": "none",
    "VmonNodeMemoryLow": "none",
    "VmonClusterCapacityLow": "none",
    "VmonNodeDrainedLong": "none",
    "VmonMixedVersions": "none",
}
# Families a single machine declares but may leave without series.
MAY_BE_EMPTY = ("vmon_node_", "vmon_pool_depth")


@pytest.fixture
def prometheus(vmon):
    if vmon.fault_dir is None:
        pytest.fail("needs the session's own vmon up (its admin token file)")
    workdir = Path(tempfile.mkdtemp(prefix="vmon-prom-", dir="/var/tmp"))
    target = urllib.parse.urlsplit(vmon.api_url).netloc
    token_file = Path(vmon.env["VMON_DATA_DIR"]) / "admin-token"
    p = Prometheus(workdir, [target], token_file)
    try:
        yield p
    finally:
        p.close()
        shutil.rmtree(workdir, ignore_errors=True)


def test_promtool_accepts_the_rules():
    out = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout, out.stdout
    assert sorted(EXPECT) == sorted(r.get("record") or r["alert"] for r in rules())


def test_the_rules_and_the_dashboard_evaluate_on_real_scrapes(vmon, prometheus, new_sandbox):
    # Transitions of each outcome: a create and a kill that succeed, a kill of no sandbox (404).
    sbx = new_sandbox()
    sbx.kill()
    req = urllib.request.Request(f"{vmon.api_url}/sandboxes/nosuchsandbox", method="DELETE",
                                 headers={"X-API-Key": vmon.api_key})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 404

    # Scraped (twice after the transitions, for the rates), and the recording rules evaluated.
    wait_for(lambda: prometheus.query('vmon_sandbox_transitions_total{operation="kill",outcome="error"}'),
             timeout=60, what="the 404 kill scraped")
    time.sleep(3)
    for name, want in EXPECT.items():
        if name.startswith("vmon:") and want == "series":
            wait_for(lambda: prometheus.query(name), timeout=60, what=f"{name} recorded")

    exposition = urllib.request.urlopen(urllib.request.Request(
        f"{vmon.api_url}/metrics",
        headers={"Authorization": f"Bearer {(Path(vmon.env['VMON_DATA_DIR']) / 'admin-token').read_text().strip()}"},
    ), timeout=30).read().decode()
    exported = declared(exposition)

    for rule in rules():
        name = rule.get("record") or rule["alert"]
        result = prometheus.query(rule["expr"])
        if EXPECT[name] == "series":
            assert result, f"{name}: no series"
        elif EXPECT[name] == "none":
            assert not result, f"{name} returns {result} on a healthy single machine"
        check_selectors(prometheus, rule["expr"], exported, MAY_BE_EMPTY)

    # Prometheus itself evaluated every rule without an error.
    groups = prometheus.api("rules")["data"]["groups"]
    evaluated = [r for g in groups for r in g["rules"]]
    assert len(evaluated) == len(EXPECT)
    assert all(r["health"] == "ok" for r in evaluated), [(r["name"], r.get("lastError")) for r in evaluated]
    alerts = prometheus.api("alerts")["data"]["alerts"]
    assert all(a["labels"]["alertname"] == "VmonCreateSlow" for a in alerts), alerts

    # Every dashboard query evaluates and names only what vmon exports.
    exprs = dashboard_queries()
    assert len(exprs) >= 10
    for expr in exprs:
        prometheus.query(expr)
        check_selectors(prometheus, expr, exported, MAY_BE_EMPTY)
    # The running version is reported.
    version = re.search(r'^version = "([^"]+)"', (REPO / "Cargo.toml").read_text(), re.M)
    assert version
    assert prometheus.query(f'vmon_build_info{{version="{version.group(1)}"}}')
