"""Guest metrics and console logs through the official SDK and raw HTTP, while a sandbox runs
and after it is killed."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from e2b import Sandbox

from conftest import wait_for


def _logs(vmon, sandbox_id: str) -> httpx.Response:
    with httpx.Client(base_url=vmon.api_url, timeout=60) as c:
        return c.get(f"/sandboxes/{sandbox_id}/logs", headers={"X-API-Key": vmon.api_key})


def _process_events(vmon, sandbox_id: str, marker: str) -> set[str]:
    r = _logs(vmon, sandbox_id)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["logs"]) == len(body["logEntries"])
    return {
        e["fields"].get("event_type", "")
        for e in body["logEntries"]
        if e["fields"].get("logger") == "process" and marker in e["fields"].get("cmd", "")
    }


def test_metrics_and_logs_while_running_and_after_kill(new_sandbox, vmon):
    sbx = new_sandbox(timeout=600)
    marker = "telemetry-marker-42"
    assert sbx.commands.run(f"echo {marker}").stdout.strip() == marker

    # The node scrapes every 5 s: after ~12 s there are samples.
    time.sleep(12)
    metrics = wait_for(lambda: sbx.get_metrics(), 60, what="metrics samples")
    m = metrics[-1]
    assert m.cpu_count >= 1
    assert 0 <= m.cpu_used_pct <= 100
    assert 0 < m.mem_used <= m.mem_total
    assert 0 < m.disk_used <= m.disk_total
    assert m.timestamp.tzinfo is not None

    both = {"process_start", "process_end"}
    wait_for(
        lambda: both <= _process_events(vmon, sbx.sandbox_id, marker),
        60,
        what="process_start/process_end lines",
    )

    with httpx.Client(base_url=vmon.api_url, timeout=60) as c:
        latest = c.get(
            "/sandboxes/metrics",
            params={"sandbox_ids": sbx.sandbox_id},
            headers={"X-API-Key": vmon.api_key},
        )
        assert latest.status_code == 200, latest.text
        assert sbx.sandbox_id in latest.json()["sandboxes"]
        # The platform's metrics are the operator's: 401 without the admin token.
        denied = c.get("/metrics", headers={"X-API-Key": vmon.api_key})
        assert denied.status_code == 401 and denied.json()["code"] == 401, denied.text
        admin = (Path(vmon.env["VMON_DATA_DIR"]) / "admin-token").read_text().strip()
        prom = c.get("/metrics", headers={"Authorization": f"Bearer {admin}"})
        assert prom.status_code == 200, prom.text
        assert 'vmon_sandboxes{state="running"}' in prom.text

    assert sbx.kill() is True
    # Killed: gone from the API, but its metrics and logs stay readable.
    after = Sandbox.get_metrics(sbx.sandbox_id)
    assert len(after) >= len(metrics) >= 1
    assert both <= _process_events(vmon, sbx.sandbox_id, marker)
    printed = vmon.vmon("sandbox", "logs", sbx.sandbox_id)
    assert marker in printed and "process_end" in printed
