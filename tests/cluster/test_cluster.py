"""The cluster as users and operators meet it: the SDK against either api replica for the
same sandboxes, and what happens when parts die (an api replica mid-create, the etcd leader
during creates and pauses, a node with running sandboxes). Real VMs, real etcd, PostgreSQL."""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.server
import json
import socket
import threading
import time

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import NotFoundException

from conftest import wait_for


def _events(cluster, sandbox_id: str, api: str | None = None) -> list[dict]:
    r = httpx.get(
        f"{api or cluster.api_a}/events/sandboxes/{sandbox_id}",
        params={"limit": 100, "orderAsc": "true"},
        headers={"X-API-Key": cluster.api_key},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _running_records(cluster) -> set[str]:
    return {s.sandbox_id for s in Sandbox.list(api_url=cluster.api_a).next_items() if s.state.value == "running"}


def _all_vms(cluster) -> set[str]:
    out = set()
    for i in (1, 2):
        if cluster.node_alive(i):
            out |= cluster.running_on(i)
    return out


def test_the_sdk_works_through_either_replica(cluster):
    a, b = cluster.api_a, cluster.api_b
    sbx = Sandbox.create("base", timeout=300, api_url=a)
    sid = sbx.sandbox_id
    try:
        assert sbx.commands.run("echo from-a").stdout.strip() == "from-a"
        sbx.files.write("/home/user/note.txt", "written through replica A")
        pid = sbx.commands.run("sleep 3600 >/dev/null 2>&1 & echo $!").stdout.strip()
        # Replica B sees the sandbox A made, and drives it.
        assert sid in [s.sandbox_id for s in Sandbox.list(api_url=b).next_items()]
        assert Sandbox.get_info(sid, api_url=b).sandbox_id == sid
        via_b = Sandbox.connect(sid, api_url=b)
        assert via_b.files.read("/home/user/note.txt") == "written through replica A"
        assert via_b.pause()
        assert Sandbox.get_info(sid, api_url=a).state.value == "paused"
        # Resumed through A: memory kept (the process) and the file.
        again = Sandbox.connect(sid, api_url=a, timeout=300)
        assert again.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
        assert again.files.read("/home/user/note.txt") == "written through replica A"
        Sandbox.set_timeout(sid, 200, api_url=b)
        assert Sandbox.kill(sid, api_url=b)
        with pytest.raises(NotFoundException):
            Sandbox.get_info(sid, api_url=a)
        kinds = [e["type"].rsplit(".", 1)[1] for e in _events(cluster, sid, api=b)]
        # (connecting to a running sandbox sets its timeout: the first `updated`)
        assert kinds == ["created", "updated", "paused", "resumed", "updated", "killed"], kinds
    finally:
        try:
            Sandbox.kill(sid, api_url=a)
        except Exception:
            pass


def test_snapshots_and_templates_are_the_same_from_every_replica(cluster):
    a, b = cluster.api_a, cluster.api_b
    src = Sandbox.create("base", timeout=300, api_url=a)
    try:
        src.files.write("/home/user/snap.txt", "snapshot through A")
        info = src.create_snapshot("cluster-snap", api_url=a)
        listed = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=src.sandbox_id, api_url=b).next_items()]
        assert info.snapshot_id in listed
        # A sandbox from the snapshot, made through B, has the file.
        clone = Sandbox.create(info.snapshot_id, timeout=300, api_url=b)
        assert clone.files.read("/home/user/snap.txt") == "snapshot through A"
        clone.kill()
        names = lambda api: sorted(  # noqa: E731
            (t["templateID"], tuple(sorted(t.get("aliases") or [])))
            for t in httpx.get(f"{api}/templates", headers={"X-API-Key": cluster.api_key}, timeout=30).json()
        )
        assert names(a) == names(b)
        assert Sandbox.delete_snapshot(info.snapshot_id, api_url=b) is True
        assert info.snapshot_id not in [
            s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=src.sandbox_id, api_url=a).next_items()
        ]
    finally:
        src.kill()


@pytest.mark.parametrize("delay", [0.05, 0.4, 1.0])
def test_an_api_replica_killed_mid_create_leaves_a_sandbox_or_nothing(cluster, delay):
    before = _running_records(cluster)
    outcome = {}

    def create():
        try:
            outcome["sandbox"] = Sandbox.create("base", timeout=300, api_url=cluster.api_b)
        except Exception as e:  # the replica died under the request
            outcome["error"] = e

    t = threading.Thread(target=create)
    t.start()
    time.sleep(delay)
    cluster.kill_process("api2")
    t.join(120)
    try:
        # Whatever the create reached: once the leader has looked (a dead leader's lease must
        # expire first), every VM has a record and every running record has its VM.
        def consistent():
            records, vms = _running_records(cluster) - before, _all_vms(cluster) - before
            return records == vms and (records, vms)

        wait_for(consistent, 90, 1, "records and VMs to agree")
        made = _running_records(cluster) - before
        assert len(made) <= 1
        for sid in made:
            s = Sandbox.connect(sid, api_url=cluster.api_a)
            assert s.commands.run("echo ok").stdout.strip() == "ok"
            s.kill()
    finally:
        cluster.start("api2")
        wait_for(lambda: _listening(cluster.api_port(2)), 120, what="api2 to listen")


def test_the_etcd_leader_killed_during_creates_and_pauses(cluster):
    leader = None
    for i in (1, 2, 3):
        st = cluster.etcd_status(i)
        if st["header"]["member_id"] == st["leader"]:
            leader = i
    assert leader, "no etcd leader"
    done: dict[str, list[str]] = {}
    errors: list[str] = []

    def stream():
        for n in range(4):
            try:
                s = Sandbox.create("base", timeout=300)
            except Exception as e:
                errors.append(f"create {n}: {e}")
                continue
            ops = done.setdefault(s.sandbox_id, ["created"])
            for op in ("pause", "resume", "kill"):
                try:
                    if op == "pause":
                        s.pause()
                    elif op == "resume":
                        s = Sandbox.connect(s.sandbox_id, timeout=300)
                    else:
                        s.kill()
                    ops.append({"pause": "paused", "resume": "resumed", "kill": "killed"}[op])
                except Exception as e:
                    errors.append(f"{op} {s.sandbox_id}: {e}")

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(1.5)
    cluster.kill_process(f"etcd{leader}")
    t.join(600)
    cluster.start(f"etcd{leader}")
    assert done, f"nothing succeeded: {errors}"
    for sid, ops in done.items():
        kinds = [e["type"].rsplit(".", 1)[1] for e in _events(cluster, sid)]
        # Every transition the client saw succeed is recorded exactly once, in order; one the
        # client saw fail may have committed (its answer was lost) but never twice.
        assert kinds[: len(ops)] == ops, (sid, kinds, ops, errors)
        for k in ("created", "paused", "resumed", "killed"):
            assert kinds.count(k) <= 1, (sid, kinds)
        if ops[-1] != "killed":
            try:
                Sandbox.kill(sid)
            except NotFoundException:
                pass
    wait_for(lambda: not (_all_vms(cluster) & set(done)), 60, what="the stream's VMs to be gone")


class _Hooks(http.server.BaseHTTPRequestHandler):
    received: list[tuple[dict[str, str], bytes]] = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        self.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_dead_nodes_sandboxes_are_reported_orphaned_and_stay_dead(cluster):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hooks)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    secret = "cluster-hook-secret"
    hook = httpx.post(
        f"{cluster.api_b}/events/webhooks",
        headers={"X-API-Key": cluster.api_key},
        json={
            "name": "cluster",
            "url": f"http://127.0.0.1:{server.server_address[1]}/hook",
            "signatureSecret": secret,
            "events": ["sandbox.lifecycle.killed"],
        },
        timeout=30,
    )
    assert hook.status_code == 201, hook.text
    sbxs = [Sandbox.create("base", timeout=300) for _ in range(2)]
    ids = {s.sandbox_id for s in sbxs}
    nodes = {cluster.node_of(s) for s in ids}
    assert None not in nodes
    victim = min(nodes)
    on_victim = {s for s in ids if cluster.node_of(s) == victim}
    cluster.kill_process(f"node{victim}")
    t0 = time.monotonic()
    # Its lease (10 s), then the grace (VMON_NODE_GRACE_SECS, 20 s in these tests).
    wait_for(lambda: not (on_victim & _running_records(cluster)), 90, 0.5, "the orphans to be reported")
    print(f"orphans reported {time.monotonic() - t0:.1f}s after the node died")
    for sid in on_victim:
        last = _events(cluster, sid)[-1]
        assert last["type"] == "sandbox.lifecycle.killed"
        assert last["eventData"]["kill_reason"] == "orphaned"

    def hooks_for(sid):
        return [
            (h, b) for h, b in _Hooks.received if json.loads(b).get("sandbox_id") == sid
        ]

    for sid in on_victim:
        (h, body), = wait_for(lambda: hooks_for(sid), 30, what="the orphan's webhook")
        payload = json.loads(body)
        assert payload["type"] == "sandbox.lifecycle.killed"
        assert payload["event_data"]["kill_reason"] == "orphaned"
        expected = base64.b64encode(hashlib.sha256(secret.encode() + body).digest()).decode().rstrip("=")
        assert hmac.compare_digest(expected, h["e2b-signature"])
    # The node comes back with its data dir: it re-adopts its VMs, and the cluster kills them
    # (they were reported killed), never resurrecting them.
    cluster.start(f"node{victim}")
    wait_for(lambda: cluster.node_alive(victim), 120, what="the node to come back")
    wait_for(lambda: not (cluster.running_on(victim) & on_victim), 60, what="the re-adopted VMs to be killed")
    assert not (on_victim & _running_records(cluster))
    for sid in ids - on_victim:
        Sandbox.kill(sid)
    httpx.delete(f"{cluster.api_a}/events/webhooks/{hook.json()['id']}", headers={"X-API-Key": cluster.api_key})


def _logged(part: str, *words: str) -> bool:
    from conftest import DIR

    try:
        lines = (DIR / "logs" / f"{part}.log").read_text(errors="replace").splitlines()
    except OSError:
        return False
    return any(all(w in line for w in words) for line in lines)


def test_a_stalled_node_is_suspect_and_keeps_its_sandboxes_within_the_grace(cluster):
    """SIGSTOP of a node agent for longer than its lease (10 s) and less than the grace
    (VMON_NODE_GRACE_SECS, 20 s here): its guests keep running, the leader only marks it
    suspect, and once it is back (SIGCONT) the sandbox still runs and answers."""
    import os
    import signal

    sbx = Sandbox.create("base", timeout=300)
    sid = sbx.sandbox_id
    try:
        pid = sbx.commands.run("sleep 100000 >/dev/null 2>&1 & echo $!").stdout.strip()
        victim = cluster.node_of(sid)
        assert victim, "the sandbox runs on no node"
        node_pid = cluster.pid(f"node{victim}")
        os.kill(node_pid, signal.SIGSTOP)
        try:
            # Lapsed: the registration's lease ended, and the leader saw it gone.
            wait_for(
                lambda: f"node{victim}" not in [n["id"] for n in cluster.admin("/admin/nodes")],
                30, 0.5, "the stalled node's lease to end",
            )
            wait_for(
                lambda: _logged("api1", "registration lapsed", f"node{victim}")
                or _logged("api2", "registration lapsed", f"node{victim}"),
                30, 0.5, "the leader to mark the node suspect",
            )
            assert sid in _running_records(cluster), "a suspect node's sandbox stays running"
        finally:
            os.kill(node_pid, signal.SIGCONT)
        wait_for(
            lambda: f"node{victim}" in [n["id"] for n in cluster.admin("/admin/nodes")],
            30, 0.5, "the node to register again",
        )
        assert sbx.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
        assert sid in _running_records(cluster)
        kinds = [e["type"] for e in _events(cluster, sid)]
        assert "sandbox.lifecycle.killed" not in kinds, kinds
    finally:
        Sandbox.kill(sid)


def test_a_vm_no_record_names_is_killed(cluster):
    """What an api replica that died between the node's start and the record leaves: a VM
    on a node with no record. Made here by the node RPC itself; the leader kills it."""
    templates = httpx.get(f"{cluster.api_a}/templates", headers={"X-API-Key": cluster.api_key}, timeout=30).json()
    base = next(t for t in templates if "base" in (t.get("aliases") or []))
    build_id = base["buildID"]
    node = next(i for i in (1, 2) if _holds(cluster, i, build_id))
    stray = "i" + "s" * 20
    cluster.node_rpc(
        node,
        "start",
        {
            "sandbox_id": stray,
            "execution_id": "00000000-0000-4000-8000-000000000001",
            "build_id": build_id,
            "cold_boot": False,
            "env_vars": {},
            "envd_access_token": "t" * 32,
            "network": {"allow_internet_access": True, "allow_out": [], "deny_out": []},
        },
    )
    assert stray in cluster.running_on(node)
    wait_for(lambda: stray not in cluster.running_on(node), 60, what="the stray VM to be killed")


def _holds(cluster, i: int, build_id: str) -> bool:
    try:
        cluster.node_rpc(i, "build_info", {"build_id": build_id})
        return True
    except Exception:
        return False


def test_node_list_shows_every_node_with_its_load(cluster):
    import subprocess

    from conftest import DIR

    sbx = Sandbox.create("base", timeout=120)
    try:
        here = cluster.node_of(sbx.sandbox_id)
        out = subprocess.run(
            [cluster.env["VMON_BIN"], "--data-dir", str(DIR / "api"), "node", "list", "--url", cluster.api_b],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout
        rows = {r.split("\t")[0]: r.split("\t") for r in out.splitlines()[1:]}
        assert sorted(rows) == ["node1", "node2"], out
        assert rows["node1"][2] == "host-1" and rows["node2"][2] == "host-2"
        assert rows["node1"][1] == "active" and rows["node2"][1] == "active"
        # The heartbeat (every 2 s) carries the sandbox.
        def counted():
            out = subprocess.run(
                [cluster.env["VMON_BIN"], "--data-dir", str(DIR / "api"), "node", "list", "--url", cluster.api_a],
                capture_output=True, text=True, check=True, timeout=60,
            ).stdout
            rows = {r.split("\t")[0]: r.split("\t") for r in out.splitlines()[1:]}
            return int(rows[f"node{here}"][4]) >= 1
        wait_for(counted, 15, what="the node's heartbeat to count the sandbox")
    finally:
        sbx.kill()
