"""Fencing and partitions on the local cluster (docs/architecture.md, "Fencing: never two
copies"): a node's own fence, fed by its lease's acknowledged refreshes, against a cut from
etcd (nft drops, scripts/cluster.sh `cut`) and a stall (SIGSTOP); an api replica cut from
its stores. The lease is 10 s, the grace (VMON_NODE_GRACE_SECS) 20 s here, so a node fences
itself 25 s after its last acknowledged refresh and the cluster reports its sandboxes killed
no sooner than 30 s after it.

A sandbox's QEMU is found by the tag its node recorded (`sandboxes/<id>/<run>/sandbox.json`)
in the process's command line (`-name vmon-<tag>`), so that the tests look at processes, not
at the node's own account of them.

Each case ends with the node it faulted back in the registry and taking new work, so the
cases after it (and the other files of the session) meet a whole cluster. The fault ports
are on in the cluster tests unless VMON_CLUSTER_TEST_FAULTS=0 (then these cases are skipped
with that reason: nothing can be cut).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
from e2b import Sandbox

import pytest

from conftest import DIR, FAULTS, wait_for
from test_cluster import _all_vms, _events, _logged, _running_records

pytestmark = pytest.mark.skipif(not FAULTS, reason="the fault ports are off (VMON_CLUSTER_TEST_FAULTS=0)")


def _qemu_tags(node: int, sandbox_id: str) -> set[str]:
    return {
        "vmon-" + json.loads(f.read_text())["qemu_tag"]
        for f in (DIR / f"node{node}" / "sandboxes" / sandbox_id).glob("*/sandbox.json")
    }


def _qemus(tags: set[str]) -> set[int]:
    """Live processes whose command line carries one of `tags` as a word."""
    out = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            words = (p / "cmdline").read_bytes().split(b"\0")
            state = (p / "stat").read_text().split(")")[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and any(w.decode(errors="replace") in tags for w in words):
            out.add(int(p.name))
    return out


def _members(cluster) -> list[str]:
    return [n["id"] for n in cluster.admin("/admin/nodes")]


def _raw_rpc(cluster, i: int, call: str, arg: dict) -> dict:
    """A node call's whole answer (`{"ok": ...}` or `{"err": ...}`)."""
    req = urllib.request.Request(
        f"{cluster.scheme}://127.0.0.1:{cluster.node_port(i)}/v1/{call}",
        data=json.dumps(arg).encode(),
        headers={"authorization": f"Bearer {cluster.token}", "content-type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=30, context=cluster.ssl_context()) as r:
        return json.loads(r.read())


def _running_sandbox(cluster):
    """A sandbox with a background process, its node, and its QEMU (tags, pids)."""
    sbx = Sandbox.create("base", timeout=300)
    pid = sbx.commands.run("sleep 100000 >/dev/null 2>&1 & echo $!").stdout.strip()
    victim = cluster.node_of(sbx.sandbox_id)
    assert victim, "the sandbox runs on no node"
    tags = _qemu_tags(victim, sbx.sandbox_id)
    qemus = _qemus(tags)
    assert qemus, f"no QEMU carries {tags}"
    return sbx, pid, victim, tags, qemus


def _takes_work(cluster, i: int) -> bool:
    """Whether node i looks at new work (neither lapsed nor fenced): a migration's commit
    stands for it, refused before it is looked at otherwise, and this one is unknown."""
    try:
        answer = json.dumps(_raw_rpc(cluster, i, "migrate_commit", {"migration_id": "none"}))
    except OSError:
        return False
    return "takes no new work" not in answer and "is fenced" not in answer


def _back(cluster, i: int) -> None:
    """Node i is registered again and takes new work."""
    wait_for(lambda: f"node{i}" in _members(cluster), 30, 0.5, f"node{i} to register again")
    # Registered again means held: the fence is lifted once the VMs are stopped and a
    # refresh is acknowledged, which the registration is.
    wait_for(lambda: _takes_work(cluster, i), 10, 0.2, f"node{i} to take new work again")


def _base_build(cluster) -> str:
    templates = httpx.get(f"{cluster.api_a}/templates", headers={"X-API-Key": cluster.api_key}, timeout=30).json()
    return next(t for t in templates if "base" in (t.get("aliases") or []))["buildID"]


def _kinds(cluster, sandbox_id: str) -> list[str]:
    return [e["type"] for e in _events(cluster, sandbox_id)]


def test_a_node_cut_from_etcd_within_the_grace_keeps_its_sandboxes(cluster):
    """Lapsed, not fenced: the node leaves the registry, takes no new work, and keeps its
    guests running (the same QEMU, the same process in the guest)."""
    sbx, pid, victim, tags, qemus = _running_sandbox(cluster)
    sid = sbx.sandbox_id
    try:
        with cluster.cut(f"node{victim}", 60):
            wait_for(lambda: f"node{victim}" not in _members(cluster), 30, 0.5, "the cut node's lease to end")
            # New work is refused once the node's own count passes the TTL (a migration's
            # commit stands for it: it is refused before it is looked at).
            wait_for(
                lambda: "takes no new work"
                in json.dumps(_raw_rpc(cluster, victim, "migrate_commit", {"migration_id": "none"})),
                15, 0.5, "the lapsed node to refuse new work",
            )
            assert _qemus(tags) == qemus, "a lapsed node leaves its VMs alone"
            assert sid in _running_records(cluster), "a suspect node's sandbox stays running"
        _back(cluster, victim)
        assert _qemus(tags) == qemus
        assert sbx.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
        assert "sandbox.lifecycle.killed" not in _kinds(cluster, sid)
        # Held again: new work is looked at (and this one is unknown).
        answer = _raw_rpc(cluster, victim, "migrate_commit", {"migration_id": "none"})
        assert "err" in answer and "takes no new work" not in json.dumps(answer), answer
    finally:
        Sandbox.kill(sid)


def test_a_node_cut_from_etcd_past_the_grace_stops_its_vms_on_its_own(cluster):
    """Nobody can tell a node cut from etcd to stop (it is out of the registry, so the leader
    calls it not): it stops its VMs itself, before the cluster reports them killed, and
    changes nothing after."""
    sbx, _, victim, tags, _ = _running_sandbox(cluster)
    sid = sbx.sandbox_id
    t0 = time.monotonic()
    with cluster.cut(f"node{victim}", 75):
        wait_for(lambda: not _qemus(tags), 50, 0.5, "the cut node to stop the sandbox's QEMU")
        stopped = time.monotonic() - t0
        print(f"the cut node stopped its VM {stopped:.1f}s into the cut")
        # Its last heartbeat was at most 2 s before the cut, the fence falls 25 s after it.
        assert stopped >= 20, f"stopped {stopped:.1f}s into the cut: before the grace"
        assert _logged(f"node{victim}", "fenced: stopping the VM", sid)
        answer = _raw_rpc(
            cluster, victim, "pause", {"sandbox_id": sid, "execution_id": "any", "memory": True}
        )
        assert "is fenced" in json.dumps(answer), answer
        wait_for(lambda: sid not in _running_records(cluster), 60, 0.5, "the sandbox to be reported killed")
        print(f"reported killed {time.monotonic() - t0:.1f}s into the cut")
    last = _events(cluster, sid)[-1]
    assert last["type"] == "sandbox.lifecycle.killed"
    assert last["eventData"]["kill_reason"] == "orphaned"
    _back(cluster, victim)
    assert sid not in cluster.running_on(victim)
    assert not _qemus(tags)
    assert _kinds(cluster, sid).count("sandbox.lifecycle.killed") == 1
    # What the fenced node did not write meanwhile (its uploads wait for the fence to lift)
    # is in the store once it is back: the template every node starts from, at least.
    wait_for(lambda: cluster.stored(_base_build(cluster)), 300, 1, "the base template to be in the store")
    # A new sandbox starts (on either node) right after.
    again = Sandbox.create("base", timeout=60)
    assert again.commands.run("echo up").stdout.strip() == "up"
    again.kill()


def test_a_node_stalled_past_the_grace_fences_before_anything_else_when_it_wakes(cluster):
    """SIGSTOP of a node agent past the grace: its QEMU runs on meanwhile (nothing can stop
    it), the cluster reports the sandbox killed; on SIGCONT the node stops that QEMU on its
    own and the sandbox stays killed, with one record of it."""
    sbx, _, victim, tags, qemus = _running_sandbox(cluster)
    sid = sbx.sandbox_id
    node_pid = cluster.pid(f"node{victim}")
    assert node_pid
    os.kill(node_pid, signal.SIGSTOP)
    try:
        wait_for(lambda: sid not in _running_records(cluster), 90, 0.5, "the sandbox to be reported killed")
        assert _qemus(tags) == qemus, "a stopped agent's QEMU runs on"
    finally:
        os.kill(node_pid, signal.SIGCONT)
    woke = time.monotonic()
    wait_for(lambda: not _qemus(tags), 20, 0.2, "the woken node to stop the QEMU")
    print(f"the woken node stopped its VM in {time.monotonic() - woke:.1f}s")
    assert _logged(f"node{victim}", "fenced: stopping the VM", sid)
    _back(cluster, victim)
    kinds = _kinds(cluster, sid)
    assert kinds.count("sandbox.lifecycle.killed") == 1 and kinds[-1] == "sandbox.lifecycle.killed", kinds
    assert sid not in _running_records(cluster)
    assert sid not in cluster.running_on(victim)


def _timed(method: str, url: str, cluster, **kw) -> tuple[int, dict, float]:
    """(status, JSON body, seconds) of one call with the team's key."""
    t0 = time.monotonic()
    r = httpx.request(method, url, headers={"X-API-Key": cluster.api_key}, timeout=60, **kw)
    took = time.monotonic() - t0
    try:
        body = r.json()
    except ValueError:
        body = {"text": r.text}
    return r.status_code, body, took


def test_an_api_replica_cut_from_its_stores_answers_503_and_makes_nothing(cluster):
    """api1 loses PostgreSQL and etcd: its calls answer 503 `{code, message}` within seconds
    (the store's connection deadline), a create through it leaves no sandbox behind, api2
    serves meanwhile, and api1 serves again once healed."""
    before = {s.sandbox_id for s in Sandbox.list(api_url=cluster.api_b).next_items()}
    with cluster.cut("api1", 60):
        status, body, took = _timed("GET", f"{cluster.api_a}/sandboxes", cluster)
        print(f"a list through the cut replica: {status} in {took:.1f}s")
        assert status == 503 and body.get("code") == 503 and body.get("message"), (status, body)
        assert took < 15, f"answered after {took:.1f}s"
        status, body, took = _timed(
            "POST", f"{cluster.api_a}/sandboxes", cluster, json={"templateID": "base", "timeout": 60}
        )
        print(f"a create through the cut replica: {status} in {took:.1f}s")
        assert status == 503 and body.get("code") == 503, (status, body)
        assert took < 15, f"answered after {took:.1f}s"
        status, _, _ = _timed("GET", f"{cluster.api_b}/sandboxes", cluster)
        assert status == 200, "the other replica serves meanwhile"
    wait_for(
        lambda: _timed("GET", f"{cluster.api_a}/sandboxes", cluster)[0] == 200, 60, 1, "api1 to serve again"
    )
    after = {s.sandbox_id for s in Sandbox.list(api_url=cluster.api_b).next_items()}
    assert after == before, f"the cut replica's create left {after - before}"
    assert not (_all_vms(cluster) - before), "no VM was started for it"


def test_a_sandbox_paused_on_a_stalled_node_resumes_on_the_other_and_creates_go_there(cluster):
    """SIGSTOP of the node holding a paused sandbox (its kernel still accepts connections, its
    agent answers nothing): the resume is not left waiting on it (a node call must finish its
    TLS handshake within 5 s) and runs on the other node from the object store, with its
    file and its process; a create meanwhile starts on the other node too. Woken within the
    grace, the stalled node keeps serving and holds no VM of the sandbox."""
    wait_for(lambda: cluster.stored(_base_build(cluster)), 300, 1, "the base template to be in the store")
    sbx = Sandbox.create("base", timeout=600)
    sid = sbx.sandbox_id
    try:
        sbx.files.write("/home/user/note.txt", "written before the stall")
        pid = sbx.commands.run("sleep 100000 >/dev/null 2>&1 & echo $!").stdout.strip()
        assert sbx.pause()
        paused = cluster.admin_sandbox(sid)
        origin = int(paused["node"].removeprefix("node"))
        other = 3 - origin
        wait_for(lambda: cluster.stored(paused["buildID"]), 300, 0.5, "the pause to reach the object store")
        node_pid = cluster.pid(f"node{origin}")
        assert node_pid
        os.kill(node_pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            again = Sandbox.connect(sid, timeout=600)
            print(f"resumed past the stalled node in {time.monotonic() - t0:.1f}s")
            assert sid in cluster.running_on(other), "the resume ran on the node that answers"
            assert again.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
            assert again.files.read("/home/user/note.txt") == "written before the stall"
            t0 = time.monotonic()
            fresh = Sandbox.create("base", timeout=60)
            print(f"created past the stalled node in {time.monotonic() - t0:.1f}s")
            assert fresh.sandbox_id in cluster.running_on(other)
            fresh.kill()
        finally:
            os.kill(node_pid, signal.SIGCONT)
        _back(cluster, origin)
        assert sid not in cluster.running_on(origin), "no second copy on the woken node"
        assert sid in cluster.running_on(other)
        assert _kinds(cluster, sid).count("sandbox.lifecycle.resumed") == 1
    finally:
        Sandbox.kill(sid)
