"""Create, commands, files, list, timeouts, kill and isolation through the official SDK."""

from __future__ import annotations

import os
from datetime import datetime, timezone

import httpx
import pytest
from e2b import (
    CommandExitException,
    NotFoundException,
    RateLimitException,
    Sandbox,
    SandboxQuery,
    SandboxState,
)

from conftest import wait_for


def test_create_with_metadata_envs_timeout(new_sandbox):
    sbx = new_sandbox("base", timeout=600, metadata={"job": "42"}, envs={"FOO": "bar"})
    assert sbx.sandbox_id.startswith("i") and len(sbx.sandbox_id) == 21
    r = sbx.commands.run("echo $FOO")
    assert r.exit_code == 0
    assert r.stdout == "bar\n"
    info = sbx.get_info()
    assert info.metadata == {"job": "42"}
    assert info.state == SandboxState.RUNNING
    lifetime = (info.end_at - info.started_at).total_seconds()
    assert 590 <= lifetime <= 610
    assert sbx.is_running()


def test_commands_foreground_background_stdin_kill_reconnect(new_sandbox):
    sbx = new_sandbox()
    r = sbx.commands.run("echo out; echo err >&2; exit 0", cwd="/tmp", user="root")
    assert r.stdout == "out\n" and r.stderr == "err\n"
    assert sbx.commands.run("whoami", user="root").stdout.strip() == "root"

    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("exit 3")
    assert e.value.exit_code == 3

    # Background + stdin.
    h = sbx.commands.run("read line; echo got:$line", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello\n")
    assert h.wait().stdout.strip() == "got:hello"

    # Kill a long runner.
    h = sbx.commands.run("sleep 600", background=True)
    assert any(p.pid == h.pid for p in sbx.commands.list())
    assert sbx.commands.kill(h.pid) is True
    wait_for(lambda: all(p.pid != h.pid for p in sbx.commands.list()), 30, what="killed process gone")
    assert sbx.commands.kill(h.pid) is False

    # Reconnect to a running command and see its output continue.
    h = sbx.commands.run("for i in 1 2 3; do echo tick$i; sleep 1; done", background=True)
    again = sbx.commands.connect(h.pid)
    out = again.wait().stdout
    assert "tick3" in out


def test_files(new_sandbox):
    sbx = new_sandbox()
    sbx.files.write("/home/user/dir/hello.txt", "hello world")
    assert sbx.files.read("/home/user/dir/hello.txt") == "hello world"
    assert sbx.files.exists("/home/user/dir/hello.txt")
    names = [e.name for e in sbx.files.list("/home/user/dir")]
    assert names == ["hello.txt"]
    assert sbx.commands.run("cat /home/user/dir/hello.txt").stdout == "hello world"
    sbx.files.remove("/home/user/dir/hello.txt")
    assert not sbx.files.exists("/home/user/dir/hello.txt")


def test_list_with_filters(new_sandbox):
    tag = os.urandom(4).hex()
    a = new_sandbox(metadata={"suite": tag, "role": "a"})
    b = new_sandbox(metadata={"suite": tag, "role": "b"})
    found = Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items()
    assert {s.sandbox_id for s in found} == {a.sandbox_id, b.sandbox_id}
    only_a = Sandbox.list(query=SandboxQuery(metadata={"suite": tag, "role": "a"})).next_items()
    assert [s.sandbox_id for s in only_a] == [a.sandbox_id]

    b.pause()
    running = Sandbox.list(
        query=SandboxQuery(metadata={"suite": tag}, state=[SandboxState.RUNNING])
    ).next_items()
    assert [s.sandbox_id for s in running] == [a.sandbox_id]
    paused = Sandbox.list(
        query=SandboxQuery(metadata={"suite": tag}, state=[SandboxState.PAUSED])
    ).next_items()
    assert [s.sandbox_id for s in paused] == [b.sandbox_id]

    # Paging: one at a time still finds both.
    pager = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), limit=1)
    seen = []
    while pager.has_next:
        seen += [s.sandbox_id for s in pager.next_items()]
    assert sorted(seen) == sorted([a.sandbox_id, b.sandbox_id])


def test_set_timeout(new_sandbox):
    sbx = new_sandbox(timeout=300)
    before = sbx.get_info().end_at
    sbx.set_timeout(30)
    after = sbx.get_info().end_at
    assert after < before
    assert abs((after - datetime.now(timezone.utc)).total_seconds() - 30) < 15


def test_timeout_kills(new_sandbox):
    sbx = new_sandbox(timeout=3)
    wait_for(lambda: not sbx.is_running(), 60, what="expired sandbox gone")
    with pytest.raises(NotFoundException):
        sbx.get_info()


def test_kill(vmon):
    sbx = Sandbox.create()
    sid = sbx.sandbox_id
    assert sbx.kill() is True
    assert not sbx.is_running()
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sid)
    assert Sandbox.kill(sid) is False
    assert sid not in [s.sandbox_id for s in Sandbox.list().next_items()]


def test_team_isolation(vmon, new_sandbox, monkeypatch):
    sbx = new_sandbox()
    other_key = vmon.create_team(f"other-{os.urandom(3).hex()}")
    monkeypatch.setenv("E2B_API_KEY", other_key)
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id)
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id)
    assert Sandbox.kill(sbx.sandbox_id) is False
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]
    monkeypatch.setenv("E2B_API_KEY", vmon.api_key)
    assert sbx.is_running()


def test_concurrency_limit_429(vmon, monkeypatch):
    key = vmon.create_team(f"small-{os.urandom(3).hex()}", max_concurrent=1)
    monkeypatch.setenv("E2B_API_KEY", key)
    first = Sandbox.create()
    try:
        with pytest.raises(RateLimitException):
            Sandbox.create()
        # Paused sandboxes do not count.
        first.pause()
        second = Sandbox.create()
        second.kill()
    finally:
        first.kill()


def test_idempotency_key(vmon):
    headers = {"X-API-Key": vmon.api_key, "Idempotency-Key": f"e2e-{os.urandom(6).hex()}"}
    body = {"templateID": "base", "timeout": 120}
    with httpx.Client(base_url=vmon.api_url, timeout=300) as c:
        a = c.post("/v2/sandboxes", json=body, headers=headers)
        b = c.post("/v2/sandboxes", json=body, headers=headers)
        assert a.status_code == 201, a.text
        assert b.status_code == 201, b.text
        assert a.json()["sandboxID"] == b.json()["sandboxID"]
        assert c.delete(f"/sandboxes/{a.json()['sandboxID']}", headers={"X-API-Key": vmon.api_key}).status_code == 204

    # The SDK's own parameter.
    key = f"sdk-{os.urandom(6).hex()}"
    s1 = Sandbox.create(idempotency_key=key)
    s2 = Sandbox.create(idempotency_key=key)
    try:
        assert s1.sandbox_id == s2.sandbox_id
    finally:
        s1.kill()


def test_bad_input(vmon):
    h = {"X-API-Key": vmon.api_key}
    with httpx.Client(base_url=vmon.api_url, timeout=60) as c:
        r = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": "soon"}, headers=h)
        assert r.status_code == 400 and r.json()["code"] == 400 and r.json()["message"]
        r = c.post("/v2/sandboxes", json={"templateID": "no-such-template"}, headers=h)
        assert r.status_code == 404
        r = c.post("/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": "e2b_bad"})
        assert r.status_code == 401
        r = c.post("/sandboxes/inope/fork", json={"count": 0}, headers=h)
        assert r.status_code == 400


def test_proxy_errors(vmon, new_sandbox):
    with httpx.Client(base_url=vmon.sandbox_url, timeout=60) as c:
        r = c.get("/health", headers={"E2b-Sandbox-Id": "inosuchsandbox000000000", "E2b-Sandbox-Port": "49983"})
        assert r.status_code == 502 and "was not found" in r.json()["message"]
        sbx = new_sandbox()
        hdr = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
        assert c.get("/health", headers=hdr).status_code == 204
        assert c.post("/init", headers=hdr, json={}).status_code == 403
        r = c.get("/", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "4999"})
        assert r.status_code == 502 and "port is not open" in r.json()["message"]
        # By Host too.
        r = c.get("/health", headers={"Host": f"49983-{sbx.sandbox_id}.vmon.local"})
        assert r.status_code == 204


def test_a_port_is_reached_by_get_host(new_sandbox):
    # The documented way to reach a server inside a sandbox: `get_host(port)` and plain HTTP
    # (`{port}-{id}.localhost:<proxy port>`, resolved by the system to loopback).
    sbx = new_sandbox()
    sbx.files.write("/home/user/site/hello.txt", "served from the sandbox")
    sbx.commands.run("cd /home/user/site && python3 -m http.server 8000", background=True)
    host = sbx.get_host(8000)
    assert host.startswith(f"8000-{sbx.sandbox_id}."), host

    def served():
        try:
            r = httpx.get(f"http://{host}/hello.txt", timeout=10)
        except httpx.HTTPError:
            return None
        return r if r.status_code == 200 else None

    r = wait_for(served, timeout=60, what="the sandbox's server through get_host")
    assert r.text == "served from the sandbox"
