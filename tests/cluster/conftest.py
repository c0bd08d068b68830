"""Cluster fixtures: one local cluster per session, started by `scripts/cluster.sh up --detach`
(3 etcd members, PostgreSQL, the S3 store when installed, 2 nodes, 2 api replicas, a proxy),
each part its own process, and the official SDK pointed at it by E2B_* variables only.

VMON_CLUSTER_TEST_DIR (default /var/tmp/vmon-cluster-test) holds the parts' state and logs;
its guest images link to the shared cache (VMON_IMAGE_CACHE, default
$VMON_TEST_DATA_DIR/images). VMON_CLUSTER_TEST_PORT (default 3300) is the first port.

The cluster runs with TLS (`VMON_CLUSTER_TLS=1`: node RPC, the api replicas and PostgreSQL
over TLS with a CA of its own) unless VMON_CLUSTER_TEST_TLS=0; the exports it prints
(`SSL_CERT_FILE`, ...) go into this process's environment before the SDK makes its
(cached) TLS transport.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DIR = Path(os.environ.get("VMON_CLUSTER_TEST_DIR", "/var/tmp/vmon-cluster-test"))
PORT = int(os.environ.get("VMON_CLUSTER_TEST_PORT", "3300"))
IMAGE_CACHE = Path(
    os.environ.get(
        "VMON_IMAGE_CACHE",
        str(Path(os.environ.get("VMON_TEST_DATA_DIR", "/var/tmp/vmon-ci")) / "images"),
    )
)
SCRIPT = REPO / "scripts" / "cluster.sh"
TLS = os.environ.get("VMON_CLUSTER_TEST_TLS", "1") != "0"
# The fault ports (`Cluster.cut`): on unless VMON_CLUSTER_TEST_FAULTS=0.
FAULTS = os.environ.get("VMON_CLUSTER_TEST_FAULTS", "1") != "0"
# The team's volume byte quota in the cluster (small: test_volumes_s3 passes it).
VOLUME_QUOTA = 32 << 20


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class Cluster:
    def __init__(self, env: dict[str, str], exports: dict[str, str]):
        self.env = env
        self.api_a = exports["E2B_API_URL"]
        self.api_b = exports["VMON_API_URL_B"]
        self.sandbox_url = exports["E2B_SANDBOX_URL"]
        self.api_key = exports["E2B_API_KEY"]
        self.token = (DIR / "node-token").read_text().strip()
        self.tls = TLS
        self.ca = DIR / "tls" / "ca.pem"
        self.scheme = "https" if TLS else "http"

    def ssl_context(self) -> ssl.SSLContext | None:
        """Verifies the cluster's https against its CA (None without TLS)."""
        return ssl.create_default_context(cafile=str(self.ca)) if self.tls else None

    def script(self, *args: str) -> None:
        subprocess.run([str(SCRIPT), *args], env=self.env, check=True, timeout=600)

    def pid(self, part: str) -> int | None:
        try:
            return int((DIR / "pids" / f"{part}.pid").read_text())
        except (OSError, ValueError):
            return None

    def kill_process(self, part: str) -> None:
        """kill -9 of the part's own process (a node's VMs survive it, as after a crash)."""
        pid = self.pid(part)
        assert pid, f"{part} has no pid"
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), 10, what=f"{part} to die")

    def start(self, part: str) -> None:
        self.script("start", part)

    @contextlib.contextmanager
    def cut(self, part: str, secs: int):
        """`part` (node1, node2, api1, api2) loses etcd and PostgreSQL (its packets dropped)
        for the block, at most `secs` seconds: the kernel ends the cut then even if this
        process dies (nft set elements with a timeout), and the block's end heals it."""
        self.script("cut", part, str(secs))
        try:
            yield
        finally:
            self.script("heal", part)

    def api_port(self, i: int) -> int:
        return PORT if i == 1 else PORT + 10

    def node_port(self, i: int) -> int:
        return PORT + 20 + i

    def node_rpc(self, i: int, call: str, arg: dict | None = None):
        req = urllib.request.Request(
            f"{self.scheme}://127.0.0.1:{self.node_port(i)}/v1/{call}",
            data=json.dumps(arg or {}).encode(),
            headers={"authorization": f"Bearer {self.token}", "content-type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30, context=self.ssl_context()) as r:
            return json.loads(r.read())["ok"]

    def running_on(self, i: int) -> set[str]:
        """Sandbox ids node i runs (template build VMs left out)."""
        return {r["sandbox_id"] for r in self.node_rpc(i, "list_running") if r["sandbox_id"].startswith("i")}

    def node_of(self, sandbox_id: str) -> int | None:
        for i in (1, 2):
            try:
                if sandbox_id in self.running_on(i):
                    return i
            except OSError:
                continue
        return None

    def node_alive(self, i: int) -> bool:
        try:
            self.node_rpc(i, "list_running")
            return True
        except OSError:
            return False

    def admin(self, path: str, api: str | None = None):
        """GET an admin route with the cluster's admin token."""
        token = (DIR / "api" / "admin-token").read_text().strip()
        req = urllib.request.Request(f"{api or self.api_a}{path}", headers={"x-admin-token": token})
        with urllib.request.urlopen(req, timeout=30, context=self.ssl_context()) as r:
            return json.loads(r.read())

    def admin_sandbox(self, sandbox_id: str) -> dict:
        return next(s for s in self.admin("/admin/sandboxes") if s["sandboxID"] == sandbox_id)

    def stored(self, build_id: str) -> bool:
        """Whether some live node says the build is in the object store."""
        for i in (1, 2):
            try:
                if self.node_rpc(i, "build_info", {"build_id": build_id}).get("stored"):
                    return True
            except (OSError, KeyError, AttributeError):
                continue
        return False

    def etcd_context(self, client_cert: bool = True) -> ssl.SSLContext:
        """TLS to etcd: its members verified against the cluster's CA, with the operator's
        client certificate (`DIR/tls/client.pem`) unless `client_cert` is false."""
        ctx = ssl.create_default_context(cafile=str(self.ca))
        if client_cert:
            ctx.load_cert_chain(str(DIR / "tls" / "client.pem"), str(DIR / "tls" / "client.key"))
        return ctx

    def etcd(self, i: int, path: str, body: dict, client_cert: bool = True) -> dict:
        """A call to etcd member i's JSON gateway (`/v3/...`) over TLS."""
        port = PORT + 29 + 2 * i
        req = urllib.request.Request(
            f"https://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(req, timeout=5, context=self.etcd_context(client_cert)) as r:
            return json.loads(r.read())

    def etcd_status(self, i: int) -> dict:
        return self.etcd(i, "/v3/maintenance/status", {})


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def _build() -> Path:
    subprocess.run(["cargo", "build", "-p", "vmon", "-p", "vmon-envd"], cwd=REPO, check=True)
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return target / "debug" / "vmon"


@pytest.fixture(scope="session")
def cluster():
    binary = _build()
    env = dict(os.environ)
    env.update(
        VMON_BIN=str(binary),
        VMON_CLUSTER_DIR=str(DIR),
        VMON_CLUSTER_PORT=str(PORT),
        VMON_IMAGES_DIR=str(IMAGE_CACHE),
        VMON_PREBUILD_CODE_INTERPRETER="0",
        VMON_WEBHOOK_ALLOW="127.0.0.1/32",
        VMON_CLUSTER_TLS="1" if TLS else "0",
        # Each client part reaches etcd and PostgreSQL through ports of its own, which
        # `cluster.cut(...)` drops for a bounded time (scripts/cluster.sh, "faults";
        # test_fence.py, checker_cases.py). VMON_CLUSTER_TEST_FAULTS=0 turns them off.
        VMON_CLUSTER_FAULTS="1" if FAULTS else "0",
        # A lapsed node is suspect for this long before its sandboxes are reported orphaned
        # (default 300 s): longer than a stall test's lapse, short enough for the orphan test.
        VMON_NODE_GRACE_SECS="20",
        VMON_MAX_VOLUME_BYTES=str(VOLUME_QUOTA),
    )
    subprocess.run([str(SCRIPT), "down"], env=env, check=False, timeout=300)
    shutil.rmtree(DIR, ignore_errors=True)
    IMAGE_CACHE.mkdir(parents=True, exist_ok=True)
    try:
        out = subprocess.run(
            [str(SCRIPT), "up", "--detach"], env=env, check=True, timeout=3600, stdout=subprocess.PIPE, text=True
        ).stdout
    except BaseException:
        # What did start stops with it (its logs stay in DIR/logs).
        subprocess.run([str(SCRIPT), "down"], env=env, check=False, timeout=300)
        raise
    exports = {}
    for line in out.splitlines():
        if line.startswith("export "):
            k, _, v = line.removeprefix("export ").partition("=")
            exports[k] = v
    for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_VOLUME_API_URL"):
        os.environ[k] = exports[k]
    if TLS:
        for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "VMON_API_CA_FILE"):
            os.environ[k] = exports[k]
    c = Cluster(env, exports)
    try:
        yield c
    finally:
        subprocess.run([str(SCRIPT), "down"], env=env, check=False, timeout=300)
