"""Idle auto-suspend (seed 004's IdlePolicy, from `vmon.idle.*` metadata and the `vmonIdle`
create field) and sandbox health (`GET /sandboxes/{id}/health`, the same fields in
`GET /sandboxes/{id}`), on real VMs through the official SDK and raw REST.

The idle windows are the minimum (60 s); the session's server scans every second
(`VMON_IDLE_SCAN_MS` in conftest.py). The waits that are independent run at once: the health
scenario runs on its own sandbox while the idle ones sit without traffic.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime

import httpx
import pytest
from e2b import Sandbox, SandboxState
from e2b.exceptions import SandboxException

from conftest import wait_for
from test_lifecycle import process_alive, start_ram_state

WINDOW = 60


def api(vmon) -> httpx.Client:
    return httpx.Client(base_url=vmon.api_url, headers={"X-API-Key": vmon.api_key}, timeout=120)


def events(vmon, sandbox_id: str) -> list[dict]:
    with api(vmon) as c:
        r = c.get(f"/events/sandboxes/{sandbox_id}", params={"orderAsc": "true", "limit": 100})
    assert r.status_code == 200, r.text
    return r.json()


def health(vmon, sandbox_id: str) -> dict:
    with api(vmon) as c:
        r = c.get(f"/sandboxes/{sandbox_id}/health")
    assert r.status_code == 200, r.text
    return r.json()


def detail(vmon, sandbox_id: str) -> dict:
    with api(vmon) as c:
        r = c.get(f"/sandboxes/{sandbox_id}")
    assert r.status_code == 200, r.text
    return r.json()


def state_of(sandbox_id: str) -> str:
    try:
        return Sandbox.get_info(sandbox_id).state.value
    except Exception as e:  # the SDK's NotFound once it was killed
        if "not found" in str(e).lower() or "404" in str(e):
            return "gone"
        raise


def at(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def health_after_memory_and_cold_resumes(vmon, sbx: Sandbox) -> None:
    """Health of a fresh sandbox, after a memory pause + resume, after a filesystem-only
    pause + resume (a cold boot)."""
    h = health(vmon, sbx.sandbox_id)
    assert (h["state"], h["stateLocation"], h["resumeGeneration"]) == ("running", "running", 0), h
    assert h["kernelStateLost"] is False and h["lastResume"] is None, h
    pid, token = start_ram_state(sbx)

    assert sbx.pause() is True
    h = health(vmon, sbx.sandbox_id)
    assert h["state"] == "paused" and h["stateLocation"] in ("parked", "disk"), h
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert process_alive(resumed, pid)
    h = health(vmon, sbx.sandbox_id)
    assert h["resumeGeneration"] == 1 and h["kernelStateLost"] is False, h
    last = h["lastResume"]
    assert last["kind"] in ("restore", "parked") and last["trigger"] == "connect", h
    assert isinstance(last["durationMs"], int) and last["durationMs"] >= 0, h
    d = detail(vmon, sbx.sandbox_id)
    assert (d["resumeGeneration"], d["kernelStateLost"], d["stateLocation"]) == (1, False, "running"), d
    assert d["lastResume"]["kind"] == last["kind"], d

    assert resumed.pause(mode="filesystem") is True
    h = health(vmon, sbx.sandbox_id)
    assert h["state"] == "paused" and h["stateLocation"] == "disk", h
    cold = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert cold.files.read("/home/user/on-disk.txt") == "disk state"
    h = health(vmon, sbx.sandbox_id)
    assert h["kernelStateLost"] is True and h["lastResume"]["kind"] == "cold_boot", h
    assert h["resumeGeneration"] == 1, "a cold boot is not a memory resume"
    assert detail(vmon, sbx.sandbox_id)["kernelStateLost"] is True


def test_idle_suspend_resume_end_and_health(new_sandbox, vmon):
    suspends = new_sandbox(timeout=900, metadata={"vmon.idle.max_idle_seconds": str(WINDOW)})
    ends = new_sandbox(
        timeout=900,
        metadata={
            "vmon.idle.max_idle_seconds": str(WINDOW),
            "vmon.idle.suspended_duration_seconds": "0",
        },
    )
    healthy = new_sandbox(timeout=900)
    pid, token = start_ram_state(suspends)
    ends.commands.run("true")
    # The last traffic of `suspends` is within this call (the polls below go to the api, not
    # through the proxy).
    last_traffic = time.time()
    suspends.commands.run("true")

    h = health(vmon, suspends.sandbox_id)
    assert h["vmonIdle"] == {
        "maxIdleSeconds": WINDOW,
        "autoResume": True,
        "suspendedDurationSeconds": 900 - WINDOW,
    }, h
    assert h["idleSuspended"] is False and h["idleSeconds"] < WINDOW, h
    assert health(vmon, healthy.sandbox_id)["vmonIdle"] is None

    # The health scenario's own sandbox, meanwhile (its traffic is its own).
    failure: list[BaseException] = []

    def run_health():
        try:
            health_after_memory_and_cold_resumes(vmon, healthy)
        except BaseException as e:  # reported below
            failure.append(e)

    t = threading.Thread(target=run_health)
    t.start()

    # Suspended within a bounded time after the window (the scan runs every second; a
    # pause under TCG takes seconds).
    wait_for(lambda: state_of(suspends.sandbox_id) == "paused", WINDOW + 120, interval=1,
             what="the idle suspend")
    wait_for(lambda: state_of(ends.sandbox_id) == "gone", WINDOW + 120, interval=1,
             what="the end on suspend (suspended_duration_seconds=0)")
    t.join(600)
    assert not t.is_alive(), "the health scenario did not finish"
    if failure:
        raise failure[0]

    paused = [e for e in events(vmon, suspends.sandbox_id) if e["type"] == "sandbox.lifecycle.paused"]
    assert len(paused) == 1, paused
    assert paused[0]["eventData"]["reason"] == "idle" and paused[0]["eventData"]["memory"] is True, paused
    assert at(paused[0]["timestamp"]) >= last_traffic + WINDOW - 1, "suspended before its window"
    killed = [e for e in events(vmon, ends.sandbox_id) if e["type"] == "sandbox.lifecycle.killed"]
    assert [e["eventData"]["kill_reason"] for e in killed] == ["idle"], killed
    h = health(vmon, suspends.sandbox_id)
    assert h["idleSuspended"] is True and h["suspendedUntil"], h
    assert h["stateLocation"] in ("parked", "disk"), h

    # A request through the proxy (the SDK's envd call) resumes it and succeeds; the
    # process kept its memory.
    assert suspends.commands.run("cat /dev/shm/token").stdout.strip() == token
    assert state_of(suspends.sandbox_id) == "running"
    assert process_alive(suspends, pid)
    resumed = [e for e in events(vmon, suspends.sandbox_id) if e["type"] == "sandbox.lifecycle.resumed"]
    assert len(resumed) == 1, resumed
    assert resumed[0]["eventData"]["reason"] == "idle", resumed
    assert resumed[0]["eventData"]["trigger"] == "traffic", resumed
    h = health(vmon, suspends.sandbox_id)
    assert h["idleSuspended"] is False and h["resumeGeneration"] == 1, h
    assert h["lastResume"]["trigger"] == "traffic" and h["kernelStateLost"] is False, h


@pytest.mark.parametrize(
    "metadata, says",
    [
        ({"vmon.idle.max_idle_seconds": "30"}, "at least 60"),
        ({"vmon.idle.max_idle_seconds": "soon"}, "whole number"),
        ({"vmon.idle.max_idle_seconds": "600"}, "less than the sandbox's timeout"),
        ({"vmon.idle.auto_resume": "maybe"}, "true or false"),
        ({"vmon.idle.max_idle_seconds": "60", "vmon.idle.suspended_duration_seconds": "-5"},
         "suspended_duration_seconds"),
        ({"vmon.idle.max_idle": "60"}, "unknown metadata key"),
    ],
)
def test_invalid_idle_metadata_is_400(vmon, metadata, says):
    with api(vmon) as c:
        r = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300, "metadata": metadata})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["code"] == 400 and says in body["message"], body


def test_invalid_idle_field_is_400_and_the_sdk_raises(vmon):
    with api(vmon) as c:
        r = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300,
                                          "vmonIdle": {"maxIdleSeconds": 59}})
        assert r.status_code == 400 and r.json()["code"] == 400, r.text
        r = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300,
                                          "vmonIdle": {"suspendedDurationSeconds": "x"}})
        assert r.status_code == 400, r.text
    # The official SDK raises its create's 400 as a SandboxException carrying the message.
    with pytest.raises(SandboxException, match="true or false"):
        Sandbox.create(timeout=100, metadata={"vmon.idle.max_idle_seconds": "60", "vmon.idle.auto_resume": "no way"})


def test_idle_field_and_null_turn_it_on_and_off(vmon, sandboxes):
    with api(vmon) as c:
        r = c.post("/v2/sandboxes", json={
            "templateID": "base", "timeout": 300,
            "vmonIdle": {"maxIdleSeconds": 120, "autoResume": False, "suspendedDurationSeconds": 30},
            # The field wins over metadata.
            "metadata": {"vmon.idle.max_idle_seconds": "90"},
        })
        assert r.status_code == 201, r.text
        on = r.json()["sandboxID"]
        r = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300, "vmonIdle": None,
                                          "metadata": {"vmon.idle.max_idle_seconds": "90"}})
        assert r.status_code == 201, r.text
        off = r.json()["sandboxID"]
    try:
        assert health(vmon, on)["vmonIdle"] == {
            "maxIdleSeconds": 120, "autoResume": False, "suspendedDurationSeconds": 30,
        }
        assert detail(vmon, on)["vmonIdle"]["maxIdleSeconds"] == 120
        assert health(vmon, off)["vmonIdle"] is None
        assert state_of(on) == SandboxState.RUNNING.value
    finally:
        for sid in (on, off):
            try:
                Sandbox.kill(sid)
            except Exception:
                pass
