"""Races a single node has: an HTTP request or an SDK call that arrives while the timeout's
auto-pause is in flight. E2B's own `test_auto_resume_wakes_on_http_request` got a 502 on a
loaded machine: its request met the auto-pause. Ordered by the api's fault points
(`VMON_FAULT_DIR`, `crates/faults`), not by timing: the auto-pause is held after
the node paused the guest and before the record says so (`pause:commit`); the racing request
or call goes out and the test waits until the proxy (`proxy:await-pause`) or the sandbox's lock
(`lock:busy`) shows it waiting on the pause; then the pause is let go. The same races with
every other call are `crates/api/tests/races.rs`."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2b import Sandbox, SandboxState

from conftest import wait_for
from test_idle import events
from test_lifecycle import process_alive, start_ram_state

pytestmark = pytest.mark.skipif(
    os.environ.get("VMON_E2E_EXTERNAL") == "1", reason="fault points need the session's own vmon up"
)


def arm(vmon, point: str, how: str) -> None:
    (vmon.fault_dir / point).write_text(how)


def release(vmon, point: str) -> None:
    (vmon.fault_dir / point).unlink(missing_ok=True)


def reached(vmon, point: str, sandbox_id: str) -> None:
    f = vmon.fault_dir / f"{point}.reached"
    wait_for(
        lambda: f.exists() and sandbox_id in f.read_text().split(),
        180,
        interval=0.05,
        what=f"fault point {point}",
    )


def hold_auto_pause(vmon, sbx: Sandbox) -> None:
    """Ends the sandbox's timeout and returns once its auto-pause holds at `pause:commit`."""
    arm(vmon, "pause:commit", sbx.sandbox_id)
    sbx.set_timeout(1)
    reached(vmon, "pause:commit", sbx.sandbox_id)


def get(url: str) -> tuple[int, str]:
    r = httpx.get(url, timeout=300)
    return r.status_code, r.text


def test_http_request_meeting_the_auto_pause_wakes_the_sandbox(new_sandbox, vmon):
    sbx = new_sandbox(timeout=600, lifecycle={"on_timeout": "pause", "auto_resume": True})
    sid = sbx.sandbox_id
    pid, token = start_ram_state(sbx)
    sbx.commands.run("mkdir -p /tmp/www && echo hello > /tmp/www/index.txt")
    sbx.commands.run("cd /tmp/www && python3 -m http.server 8000", background=True)
    url = f"http://{sbx.get_host(8000)}/index.txt"
    wait_for(lambda: get(url) == (200, "hello\n"), 60, what="the sandbox's HTTP server")
    try:
        arm(vmon, "proxy:await-pause", "pass")
        hold_auto_pause(vmon, sbx)
        with ThreadPoolExecutor(1) as ex:
            request = ex.submit(get, url)
            reached(vmon, "proxy:await-pause", sid)
            assert not request.done(), request.result()
            release(vmon, "pause:commit")
            assert request.result() == (200, "hello\n")
    finally:
        release(vmon, "pause:commit")
        release(vmon, "proxy:await-pause")
    assert Sandbox.get_info(sid).state == SandboxState.RUNNING
    kinds = [(e["type"], (e.get("eventData") or {}).get("reason") or (e.get("eventData") or {}).get("trigger"))
             for e in events(vmon, sid)]
    assert ("sandbox.lifecycle.paused", "timeout") in kinds, kinds
    assert ("sandbox.lifecycle.resumed", "traffic") in kinds, kinds
    assert process_alive(sbx, pid)
    assert sbx.commands.run("cat /dev/shm/token").stdout.strip() == token


def test_connect_meeting_the_auto_pause_resumes_after_it(new_sandbox, vmon):
    sbx = new_sandbox(timeout=600, lifecycle={"on_timeout": "pause"})
    sid = sbx.sandbox_id
    pid, token = start_ram_state(sbx)
    try:
        arm(vmon, "lock:busy", "pass")
        hold_auto_pause(vmon, sbx)
        with ThreadPoolExecutor(1) as ex:
            connect = ex.submit(Sandbox.connect, sid, timeout=600)
            reached(vmon, "lock:busy", sid)
            assert not connect.done(), connect.result()
            release(vmon, "pause:commit")
            resumed = connect.result()
    finally:
        release(vmon, "pause:commit")
        release(vmon, "lock:busy")
    assert Sandbox.get_info(sid).state == SandboxState.RUNNING
    types = [e["type"] for e in events(vmon, sid)]
    assert types.count("sandbox.lifecycle.paused") == 1, types
    assert types[-1] == "sandbox.lifecycle.resumed", types
    assert process_alive(resumed, pid)
    assert resumed.commands.run("cat /dev/shm/token").stdout.strip() == token
