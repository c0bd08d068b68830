"""Volumes in the object store: with garage the cluster's api runs with VMON_VOLUME_STORE=s3,
so a volume lives in the store and each node keeps a cache of what it mounts (no shared
filesystem). A sandbox on one node writes, a drain pauses it (volumes never live-migrate),
which writes the volume back; a sandbox on the other node reads it and writes, its kill
writes back; the paused sandbox resumes on the other node and sees that. The team's byte
quota bounds what a write-back keeps: over it, a pause is a 400 and the sandbox runs on."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import pytest
from e2b import Sandbox, Volume

from conftest import DIR, VOLUME_QUOTA, wait_for


def _admin_call(cluster, method: str, path: str):
    token = (DIR / "api" / "admin-token").read_text().strip()
    req = urllib.request.Request(
        f"{cluster.api_a}{path}", headers={"x-admin-token": token}, method=method
    )
    try:
        with urllib.request.urlopen(req, timeout=900, context=cluster.ssl_context()) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


# A volume's sandbox always cold-boots (and boots again when a loaded machine stalls it):
# longer than the SDK's 60 s default request timeout.
BOOT = 600


def _run(sbx, cmd: str, user: str = "user") -> str:
    return sbx.commands.run(cmd, timeout=120, user=user).stdout


def test_a_volume_travels_between_nodes_through_the_store(cluster):
    assert (DIR / "s3.env").exists(), "the cluster runs no garage (scripts/install-garage.sh)"
    vol = Volume.create(f"s3vol-{uuid.uuid4().hex[:10]}")
    a = Sandbox.create("base", volume_mounts={"/mnt/v": vol}, timeout=900, request_timeout=BOOT)
    sid, b = a.sandbox_id, None
    try:
        home = cluster.node_of(sid)
        assert home in (1, 2)
        _run(
            a,
            "echo from-a > /mnt/v/a.txt && mkdir -p /mnt/v/d && "
            "head -c 1048576 /dev/urandom > /mnt/v/d/blob && "
            "chown 1000:1000 /mnt/v/d/blob && chmod 640 /mnt/v/d/blob",
            user="root",
        )
        blob_sum = _run(a, "sha256sum /mnt/v/d/blob").split()[0]

        # Over the team's quota a write-back keeps nothing: the pause is refused, the
        # sandbox runs on, and a pause after the file is gone succeeds (the drain below).
        _run(a, f"head -c {VOLUME_QUOTA + (4 << 20)} /dev/urandom > /mnt/v/huge")
        with pytest.raises(Exception) as refused:
            a.pause(request_timeout=BOOT)
        assert "max_volume_bytes" in str(refused.value), refused.value
        assert cluster.admin_sandbox(sid)["state"] == "running"
        _run(a, "rm /mnt/v/huge")

        status, _ = _admin_call(cluster, "POST", f"/admin/nodes/node{home}/drain")
        assert status == 202

        def drained():
            s, body = _admin_call(cluster, "GET", f"/admin/nodes/node{home}/drain")
            return body if s == 200 and body["state"] == "drained" else None

        final = wait_for(drained, 600, 1, "the drain to finish")
        print("drain:", final)
        assert cluster.admin_sandbox(sid)["state"] == "paused"

        # The other node fills its cache from the store.
        b = Sandbox.create("base", volume_mounts={"/data": vol.name}, timeout=300, request_timeout=BOOT)
        assert cluster.node_of(b.sandbox_id) == 3 - home
        assert _run(b, "cat /data/a.txt") == "from-a\n"
        assert _run(b, "sha256sum /data/d/blob").split()[0] == blob_sum
        assert _run(b, "stat -c '%u:%g %a' /data/d/blob").strip() == "1000:1000 640"
        assert _run(b, "ls /data") == "a.txt\nd\n", "the refused write-back left nothing"
        _run(b, "echo from-b > /data/b.txt && rm /data/a.txt")
        b.kill()  # written back before the kill returns
        b = None

        again = Sandbox.connect(sid, timeout=900, request_timeout=BOOT)
        assert cluster.node_of(sid) == 3 - home
        assert _run(again, "cat /mnt/v/b.txt; ls /mnt/v") == "from-b\nb.txt\nd\n"
        assert _run(again, "sha256sum /mnt/v/d/blob").split()[0] == blob_sum
    finally:
        for n in (1, 2):
            _admin_call(cluster, "DELETE", f"/admin/nodes/node{n}/drain")
        if b is not None:
            b.kill()
        Sandbox.kill(sid)
        Volume.destroy(vol.volume_id)
