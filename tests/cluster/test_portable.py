"""Builds and paused sandboxes travel through the object store (garage): creates spread over
both nodes (the second fetches the template), a sandbox paused on a node that then dies
resumes on the other at once (the dead node refuses connections; its lease need not end)
with its memory and files, and traffic for a sandbox on the other
"host" reaches it through this host's proxy, which hands it to that host's ingress."""

from __future__ import annotations

import time

import httpx
from e2b import Sandbox

from conftest import DIR, wait_for

HOLDER = r"""
import hashlib, os, signal, time
data = bytearray(os.urandom(32 << 20))
open('/home/user/want', 'w').write(hashlib.sha256(data).hexdigest())
def again(*_):
    open('/home/user/got.tmp', 'w').write(hashlib.sha256(data).hexdigest())
    os.replace('/home/user/got.tmp', '/home/user/got')
signal.signal(signal.SIGUSR1, again)
open('/home/user/ready', 'w').write(str(os.getpid()))
while True:
    time.sleep(3600)
"""


def _cat(sbx, path: str) -> str:
    return sbx.commands.run(f"cat {path} 2>/dev/null || true").stdout.strip()


def _base_build(cluster) -> str:
    templates = httpx.get(
        f"{cluster.api_a}/templates", headers={"X-API-Key": cluster.api_key}, timeout=30,
        verify=cluster.ssl_context() or True,
    ).json()
    return next(t for t in templates if "base" in (t.get("aliases") or []))["buildID"]


def _has_object_store() -> bool:
    return (DIR / "s3.env").exists()


def test_the_cluster_has_an_object_store(cluster):
    assert _has_object_store(), "scripts/cluster.sh started no garage (scripts/install-garage.sh)"
    # The template's build reaches the store in the background after it was made.
    base = _base_build(cluster)
    wait_for(lambda: cluster.stored(base), 300, 1, "the base template to be uploaded")


def test_creates_spread_over_both_nodes(cluster):
    wait_for(lambda: cluster.stored(_base_build(cluster)), 300, 1, "the base template to be uploaded")
    sbxs = []
    try:
        for _ in range(6):
            sbxs.append(Sandbox.create("base", timeout=300))
        where = [cluster.node_of(s.sandbox_id) for s in sbxs]
        assert set(where) == {1, 2}, where
        for s in sbxs:
            assert s.commands.run("echo ok").stdout.strip() == "ok"
    finally:
        for s in sbxs:
            s.kill()


def test_traffic_for_another_host_goes_through_its_ingress(cluster):
    wait_for(lambda: cluster.stored(_base_build(cluster)), 300, 1, "the base template to be uploaded")
    sbxs = []
    try:
        on2 = None
        for _ in range(8):
            s = Sandbox.create("base", timeout=300)
            sbxs.append(s)
            if cluster.node_of(s.sandbox_id) == 2:
                on2 = s
                break
        assert on2, "no create reached node 2"
        # E2B_SANDBOX_URL is host-1's proxy: it hands host-2's traffic to proxy2.
        assert on2.commands.run("echo via-ingress").stdout.strip() == "via-ingress"
        cluster.kill_process("proxy2")
        try:
            failed = False
            try:
                on2.commands.run("echo unreachable", timeout=10, request_timeout=15)
            except Exception:
                failed = True
            assert failed, "host-2's sandbox answered with host-2's ingress down"
        finally:
            cluster.start("proxy2")
        wait_for(lambda: _answers(on2), 60, 1, "host-2's sandbox to answer again")
    finally:
        for s in sbxs:
            s.kill()


def _answers(sbx) -> bool:
    try:
        return sbx.commands.run("echo back", timeout=10, request_timeout=15).stdout.strip() == "back"
    except Exception:
        return False


def test_a_sandbox_paused_on_a_dead_node_resumes_on_the_other_with_its_memory(cluster):
    wait_for(lambda: cluster.stored(_base_build(cluster)), 300, 1, "the base template to be uploaded")
    sbx = Sandbox.create("base", timeout=600)
    sid = sbx.sandbox_id
    try:
        sbx.files.write("/home/user/holder.py", HOLDER)
        sbx.commands.run("setsid nohup python3 /home/user/holder.py >/home/user/holder.log 2>&1 </dev/null &")
        wait_for(lambda: _cat(sbx, "/home/user/ready"), 180, 1, "the memory holder to start")
        pid, want = _cat(sbx, "/home/user/ready"), _cat(sbx, "/home/user/want")
        sbx.commands.run("head -c 8388608 /dev/urandom > /home/user/blob && sha256sum /home/user/blob > /home/user/blob.sum")
        blob_sum = _cat(sbx, "/home/user/blob.sum").split()[0]
        assert sbx.pause()
        paused = cluster.admin_sandbox(sid)
        origin = int(paused["node"].removeprefix("node"))
        wait_for(lambda: cluster.stored(paused["buildID"]), 300, 0.5, "the pause to reach the object store")
        cluster.kill_process(f"node{origin}")
        try:
            # At once, while the dead node is still registered (its lease has seconds left):
            # the resume is not sent to it and waits for nothing.
            assert f"node{origin}" in [n["id"] for n in cluster.admin("/admin/nodes")]
            t0 = time.monotonic()
            again = Sandbox.connect(sid, timeout=600)
            print(f"resumed on the other node in {time.monotonic() - t0:.1f}s")
            assert cluster.node_of(sid) == 3 - origin
            assert again.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
            again.commands.run(f"rm -f /home/user/got; kill -USR1 {pid}")
            wait_for(lambda: _cat(again, "/home/user/got"), 60, 0.5, "the holder to re-hash")
            assert _cat(again, "/home/user/got") == want
            assert again.commands.run("sha256sum /home/user/blob").stdout.split()[0] == blob_sum
        finally:
            cluster.start(f"node{origin}")
            wait_for(lambda: cluster.node_alive(origin), 120, 1, "the node to come back")
    finally:
        Sandbox.kill(sid)
