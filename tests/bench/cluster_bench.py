"""`vmon bench cluster`: create, pause and resume on a local cluster (`scripts/cluster.sh`), on
the same node and on another node (from the object store), for 16, 64 and 256 MiB of guest
memory dirtied; and what the disk and the S3 server themselves do, measured in the same run.

For each size, a sandbox gets a process holding that much random memory, then:
- pause (with memory): how long the SDK's pause takes; then how long until its build is in
  the object store (the upload runs after the pause returned);
- resume on the same node (its parked QEMU, at once);
- pause again, wait for the upload, kill -9 the sandbox's node, and resume: the cluster
  restores it on the other node from the object store (the time of the SDK's connect after
  the node's lease ended); the process's memory must hash as before.

Prints medians (one sample per size unless VMON_BENCH_ROUNDS) and the machine. Starts its own
cluster (VMON_BENCH_CLUSTER_DIR, default /var/tmp/vmon-bench-cluster; port 3400) with the
built binary ($CARGO_TARGET_DIR/$VMON_BENCH_PROFILE, default release).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster_up  # noqa: E402
from api_bench import REPO, machine  # noqa: E402

DIR = Path(os.environ.get("VMON_BENCH_CLUSTER_DIR", "/var/tmp/vmon-bench-cluster"))
PORT = int(os.environ.get("VMON_BENCH_CLUSTER_PORT", "3400"))
SIZES = [16, 64, 256]
ROUNDS = int(os.environ.get("VMON_BENCH_ROUNDS", "1"))
SCRIPT = REPO / "scripts" / "cluster.sh"

HOLDER = r"""
import hashlib, os, signal, sys, time
data = bytearray({mib} << 20)
view = memoryview(data)
for i in range(0, len(data), 1 << 20):
    view[i:i + (1 << 20)] = os.urandom(1 << 20)
open('/home/user/want', 'w').write(hashlib.sha256(data).hexdigest())
def again(*_):
    open('/home/user/got.tmp', 'w').write(hashlib.sha256(data).hexdigest())
    os.replace('/home/user/got.tmp', '/home/user/got')
signal.signal(signal.SIGUSR1, again)
open('/home/user/ready', 'w').write(str(os.getpid()))
while True:
    time.sleep(3600)
"""


def cat(sbx, path: str) -> str:
    return sbx.commands.run(f"cat {path} 2>/dev/null || true").stdout.strip()


def main() -> None:
    env = cluster_up.start(DIR, PORT)
    from e2b import Sandbox

    token = (DIR / "node-token").read_text().strip()
    admin = (DIR / "api" / "admin-token").read_text().strip()
    api = os.environ["E2B_API_URL"]
    s3 = (DIR / "s3.env").exists()

    def admin_sandbox(sid: str) -> dict:
        req = urllib.request.Request(f"{api}/admin/sandboxes", headers={"x-admin-token": admin})
        with urllib.request.urlopen(req, timeout=30) as r:
            return next(s for s in json.loads(r.read()) if s["sandboxID"] == sid)

    def node_rpc(i: int, call: str, arg: dict):
        req = urllib.request.Request(
            f"http://127.0.0.1:{PORT + 20 + i}/v1/{call}",
            data=json.dumps(arg).encode(),
            headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def wait_stored(sid: str, timeout: float = 600) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            a = admin_sandbox(sid)
            node = int(a["node"].removeprefix("node"))
            info = node_rpc(node, "build_info", {"build_id": a["buildID"]}).get("ok") or {}
            if info.get("stored"):
                return time.monotonic() - t0
            time.sleep(0.05)
        return None

    results: dict[str, list[float]] = {}
    handles = []
    raw = ""

    def add(name: str, v: float) -> None:
        results.setdefault(name, []).append(v)

    try:
        for _ in range(ROUNDS):
            for mib in SIZES:
                t0 = time.monotonic()
                sbx = Sandbox.create("base", timeout=900)
                add("create", time.monotonic() - t0)
                sbx.files.write("/home/user/holder.py", HOLDER.replace("{mib}", str(mib)))
                # timeout=0: the SDK's default would end it; the handle is kept so that its
                # stream stays open while the holder runs.
                handles.append(sbx.commands.run("python3 /home/user/holder.py", background=True, timeout=0))
                t = time.monotonic()
                while not cat(sbx, "/home/user/ready"):
                    if time.monotonic() - t > 300:
                        ps = sbx.commands.run("cat /home/user/holder.log; ps aux").stdout
                        raise RuntimeError(f"the holder did not start:\n{ps}")
                    time.sleep(0.2)
                pid = cat(sbx, "/home/user/ready")
                want = cat(sbx, "/home/user/want")
                sid = sbx.sandbox_id
                t0 = time.monotonic()
                sbx.pause()
                add(f"pause {mib} MiB", time.monotonic() - t0)
                if s3:
                    up = wait_stored(sid)
                    if up is not None:
                        add(f"upload after pause {mib} MiB", up)
                t0 = time.monotonic()
                sbx = Sandbox.connect(sid, timeout=900)
                add(f"resume same node {mib} MiB", time.monotonic() - t0)
                if s3:
                    sbx.pause()
                    if wait_stored(sid) is None:
                        raise RuntimeError("the pause never reached the object store")
                    origin = admin_sandbox(sid)["node"]
                    pidfile = DIR / "pids" / f"{origin}.pid"
                    os.kill(int(pidfile.read_text()), signal.SIGKILL)
                    # The registry forgets it when its lease ends (10 s).
                    time.sleep(12)
                    t0 = time.monotonic()
                    sbx = Sandbox.connect(sid, timeout=900)
                    add(f"resume other node {mib} MiB", time.monotonic() - t0)
                    now = admin_sandbox(sid)["node"]
                    assert now != origin, (now, origin)
                    sbx.commands.run(f"rm -f /home/user/got; kill -USR1 {pid}")
                    t = time.monotonic()
                    while not cat(sbx, "/home/user/got"):
                        if time.monotonic() - t > 120:
                            raise RuntimeError("the process did not answer after the move")
                        time.sleep(0.2)
                    got = cat(sbx, "/home/user/got")
                    if got != want:
                        raise RuntimeError(f"memory changed across nodes: {want} != {got}")
                    subprocess.run([str(SCRIPT), "start", origin], env=env, check=True)
                    time.sleep(3)
                sbx.kill()
        if s3:
            # The store's and the disk's own limits, in the same run.
            s3env = dict(env)
            for line in (DIR / "s3.env").read_text().splitlines():
                if line.startswith("export "):
                    k, _, v = line.removeprefix("export ").partition("=")
                    s3env[k] = v
            raw = subprocess.run(
                [env["VMON_BIN"], "--data-dir", str(DIR / "node1"), "bench", "s3", "--mib", "256"],
                env=s3env, check=True, stdout=subprocess.PIPE, text=True,
            ).stdout
    finally:
        cluster_up.stop(env)

    print(f"vmon bench cluster  ({machine()})")
    print("  local cluster: 3 etcd, PostgreSQL, 2 nodes, 2 api replicas" + (", garage" if s3 else ", no object store"))
    for name, vs in results.items():
        print(f"  {name:32s} median {statistics.median(vs) * 1000:8.0f} ms  (n={len(vs)})")
    if s3:
        print("  " + raw.strip().replace("\n", "\n  "))
    else:
        print("  resume on another node: not measured (no object store: scripts/install-garage.sh)")


if __name__ == "__main__":
    main()
