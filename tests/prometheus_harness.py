"""Debian's Prometheus and promtool against a running vmon, for the tests of the alert rules
(deploy/prometheus/rules.yml) and the dashboard (deploy/grafana/vmon.json):
tests/e2e/test_prometheus.py (one machine) and tests/cluster/test_prometheus.py (a cluster)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "rules.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "vmon.json"
SELECTOR = re.compile(r"\b((?:vmon_[a-z0-9_]+)|up)\b(\{[^}]*\})?(?!\s*\()")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def declared(exposition: str) -> set[str]:
    """The metric families a `/metrics` text declares (`# TYPE`)."""
    return set(re.findall(r"^# TYPE (\S+) ", exposition, re.M))


def rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"]]


def selectors(expr: str) -> list[str]:
    """The series selectors of a query (metric names with their matchers)."""
    return [name + (matchers or "") for name, matchers in SELECTOR.findall(expr)]


class Prometheus:
    def __init__(self, workdir: Path, targets: list[str], token_file: Path, ca_file: Path | None = None):
        self.port = _free_port()
        rules_copy = workdir / "rules.yml"
        doc = yaml.safe_load(RULES.read_text())
        # The rules as shipped, evaluated every second instead of every 30 s.
        for g in doc["groups"]:
            g["interval"] = "1s"
        rules_copy.write_text(yaml.safe_dump(doc))
        job = {
            "job_name": "vmon-api",
            "authorization": {"credentials_file": str(token_file)},
            "static_configs": [{"targets": targets}],
        }
        if ca_file is not None:
            job["scheme"] = "https"
            job["tls_config"] = {"ca_file": str(ca_file)}
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules_copy)],
            "scrape_configs": [job],
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
        wait_for(self._ready, timeout=60, what="Prometheus ready")

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



def check_selectors(prom: Prometheus, expr: str, exported: set[str], may_be_empty: tuple[str, ...]) -> None:
    """Every metric `expr` names is one vmon exports, and selects series unless it may be empty."""
    for sel in selectors(expr):
        name = sel.split("{")[0]
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name == "up" or family in exported, f"{sel}: vmon exports no {family}"
        if not name.startswith(may_be_empty):
            assert prom.query(sel), f"{sel} selects nothing on a real scrape"
