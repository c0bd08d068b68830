"""Operators see the fleet: Debian's Prometheus scrapes the session's `vmon up` with the rules of
deploy/prometheus/rules.yml; `promtool check rules` accepts them, every rule's query and every
dashboard query (deploy/grafana/vmon.json) evaluates on the real scrapes, the rules the
transitions below feed return series, every metric a query names is one vmon exports, and no
alert fires on a healthy server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import _free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "rules.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "vmon.json"

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
SELECTOR = re.compile(r"\b((?:vmon_[a-z0-9_]+)|up)\b(\{[^}]*\})?(?!\s*\()")


def rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"]]


def selectors(expr: str) -> list[str]:
    """The series selectors of a query (metric names with their matchers)."""
    return [name + (matchers or "") for name, matchers in SELECTOR.findall(expr)]


class Prometheus:
    def __init__(self, workdir: Path, target: str, token_file: Path):
        self.port = _free_port()
        rules_copy = workdir / "rules.yml"
        doc = yaml.safe_load(RULES.read_text())
        # The rules as shipped, evaluated every second instead of every 30 s.
        for g in doc["groups"]:
            g["interval"] = "1s"
        rules_copy.write_text(yaml.safe_dump(doc))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules_copy)],
            "scrape_configs": [{
                "job_name": "vmon-api",
                "authorization": {"credentials_file": str(token_file)},
                "static_configs": [{"targets": [target]}],
            }],
        }
        cfg = workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        check = subprocess.run(["promtool", "check", "config", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        wait_for(lambda: self._ready(), timeout=60, what="Prometheus ready")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, "prometheus exited; see its log"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def query(self, expr: str) -> list[dict]:
        answer = self.api("query", query=expr)
        assert answer.get("status") == "success", f"{expr}: {answer}"
        return answer["data"]["result"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture
def prometheus(vmon):
    if vmon.fault_dir is None:
        pytest.fail("needs the session's own vmon up (its admin token file)")
    workdir = Path(tempfile.mkdtemp(prefix="vmon-prom-", dir="/var/tmp"))
    target = urllib.parse.urlsplit(vmon.api_url).netloc
    token_file = Path(vmon.env["VMON_DATA_DIR"]) / "admin-token"
    p = Prometheus(workdir, target, token_file)
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

    raw = urllib.request.urlopen(urllib.request.Request(
        f"{vmon.api_url}/metrics",
        headers={"Authorization": f"Bearer {(Path(vmon.env['VMON_DATA_DIR']) / 'admin-token').read_text().strip()}"},
    ), timeout=30).read().decode()
    declared = set(re.findall(r"^# TYPE (\S+) ", raw, re.M))

    def check_selectors(expr: str) -> None:
        for sel in selectors(expr):
            name = sel.split("{")[0]
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name == "up" or family in declared, f"{sel}: vmon exports no {family}"
            if not name.startswith(MAY_BE_EMPTY):
                assert prometheus.query(sel), f"{sel} selects nothing on a real scrape"

    for rule in rules():
        name = rule.get("record") or rule["alert"]
        result = prometheus.query(rule["expr"])
        if EXPECT[name] == "series":
            assert result, f"{name}: no series"
        elif EXPECT[name] == "none":
            assert not result, f"{name} returns {result} on a healthy single machine"
        check_selectors(rule["expr"])

    # Prometheus itself evaluated every rule without an error.
    groups = prometheus.api("rules")["data"]["groups"]
    evaluated = [r for g in groups for r in g["rules"]]
    assert len(evaluated) == len(EXPECT)
    assert all(r["health"] == "ok" for r in evaluated), [(r["name"], r.get("lastError")) for r in evaluated]
    alerts = prometheus.api("alerts")["data"]["alerts"]
    assert all(a["labels"]["alertname"] == "VmonCreateSlow" for a in alerts), alerts

    # Every dashboard query evaluates and names only what vmon exports.
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        prometheus.query(expr)
        check_selectors(expr)
    # The running version is reported.
    version = re.search(r'^version = "([^"]+)"', (REPO / "Cargo.toml").read_text(), re.M)
    assert version
    assert prometheus.query(f'vmon_build_info{{version="{version.group(1)}"}}')
