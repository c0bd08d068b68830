"""End-to-end fixtures: one `vmon up` per test session, the official SDK configured only by
E2B_API_URL, E2B_API_KEY, E2B_SANDBOX_URL and E2B_VOLUME_API_URL.

Each session gets its own data dir (VMON_E2E_DATA_DIR, default /var/tmp/vmon-e2e/run-<pid>), so
concurrent sessions never share a node; its `images/` is a link to the shared guest-image cache
(VMON_IMAGE_CACHE, default $VMON_TEST_DATA_DIR/images), which survives runs.
Set VMON_E2E_EXTERNAL=1 to run against an already running server configured by the three
E2B_* variables instead (team-creating tests are then skipped).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
E2E_ROOT = Path("/var/tmp/vmon-e2e")
DATA_DIR = Path(os.environ.get("VMON_E2E_DATA_DIR", str(E2E_ROOT / f"run-{os.getpid()}")))
IMAGE_CACHE = Path(
    os.environ.get(
        "VMON_IMAGE_CACHE",
        str(Path(os.environ.get("VMON_TEST_DATA_DIR", "/var/tmp/vmon-ci")) / "images"),
    )
)
KEEP = {"images"}
# First start builds the base template (and maybe the guest image) under TCG: the exports come
# at once, `/health` says ready (200) once creates are admitted.
STARTUP_TIMEOUT = float(os.environ.get("VMON_E2E_STARTUP_TIMEOUT", "3600"))


def _health(api_url: str) -> tuple[int, dict]:
    """`GET /health` of the api: its status and JSON body (503 `building` during the first
    build, 200 `ready` after); (0, {}) while nothing answers."""
    import json

    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=5) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}
    except (OSError, ValueError):
        return 0, {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build() -> Path:
    subprocess.run(
        ["cargo", "build", "-p", "vmon", "-p", "vmon-envd"],
        cwd=REPO,
        check=True,
    )
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return target / "debug" / "vmon"


def _kill_leftover_vms() -> None:
    """QEMU processes outlive their node by design (re-adoption); in tests, the ones this data
    dir's node started are ours to stop once the server is gone."""
    mine = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"qemu-system-x86_64") and any(str(DATA_DIR).encode() + b"/" in a for a in cmd):
            mine.append(int(proc.name))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in mine:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGTERM and mine:
            time.sleep(3)


def _remove_stale_runs() -> None:
    """Data dirs of earlier sessions whose process is gone."""
    if not E2E_ROOT.is_dir():
        return
    for d in E2E_ROOT.glob("run-*"):
        try:
            pid = int(d.name.removeprefix("run-"))
        except ValueError:
            continue
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


def _reset_data_dir() -> None:
    _remove_stale_runs()
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    IMAGE_CACHE.mkdir(parents=True, exist_ok=True)
    link = DATA_DIR / "images"
    if not link.exists():
        link.symlink_to(IMAGE_CACHE)
    for entry in DATA_DIR.iterdir():
        if entry.name in KEEP:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


class Server:
    def __init__(self, binary: Path, env: dict[str, str], api_url: str, sandbox_url: str, api_key: str):
        self.binary = binary
        self.env = env
        self.api_url = api_url
        self.sandbox_url = sandbox_url
        self.api_key = api_key
        # Where the api's fault points are armed (test_races.py); None against an external
        # server.
        self.fault_dir: Path | None = Path(env["VMON_FAULT_DIR"]) if env.get("VMON_FAULT_DIR") else None

    def vmon(self, *args: str) -> str:
        """Runs a `vmon` verb against this server's data dir; returns stdout."""
        out = subprocess.run(
            [str(self.binary), *args],
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return out.stdout

    def create_team(self, name: str, max_concurrent: int | None = None) -> str:
        """A new team; returns its API key."""
        args = ["team", "create", name]
        if max_concurrent is not None:
            args += ["--max-concurrent", str(max_concurrent)]
        return self.vmon(*args).strip()


def _test_ca(d: Path) -> Path:
    """A CA and a certificate it signs for 127.0.0.1 (`leaf.pem`, `leaf.key`), for the https
    webhook receiver; returns the CA's PEM file."""
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = lambda *a: subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=vmon e2e CA")
    run("req", *ec, "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", "/CN=127.0.0.1")
    (d / "leaf.ext").write_text(
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n"
    )
    run("x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "leaf.pem", "-days", "2", "-extfile", "leaf.ext")
    return d / "ca.pem"


@pytest.fixture(scope="session")
def vmon():
    if os.environ.get("VMON_E2E_EXTERNAL") == "1":
        yield Server(
            Path("vmon"),
            dict(os.environ),
            os.environ["E2B_API_URL"],
            os.environ["E2B_SANDBOX_URL"],
            os.environ["E2B_API_KEY"],
        )
        return

    binary = _build()
    _kill_leftover_vms()
    _reset_data_dir()
    api_port, proxy_port = _free_port(), _free_port()
    env = dict(os.environ)
    for k in [k for k in env if k.startswith("E2B_")]:
        del env[k]
    env.update(
        VMON_DATA_DIR=str(DATA_DIR),
        VMON_API_LISTEN=f"127.0.0.1:{api_port}",
        VMON_PROXY_LISTEN=f"127.0.0.1:{proxy_port}",
        VMON_LOG=os.environ.get("VMON_LOG", "info"),
        # The webhook tests' receivers listen on this machine, over http and https (a CA
        # made here signs the https receiver's certificate).
        VMON_WEBHOOK_ALLOW="127.0.0.1/32",
        # The OCI tests' registry listens on this machine too.
        VMON_REGISTRY_ALLOW="127.0.0.1/32",
        # test_isolation.py's private server: the one private address allowOut may open.
        VMON_PRIVATE_ALLOW="10.231.78.2/32",
        VMON_WEBHOOK_CA_FILE=str(_test_ca(DATA_DIR / "webhook-tls")),
        # Idle auto-suspend (test_idle.py): look for idle sandboxes every second, so a
        # 60 s window is acted on soon after it passes.
        VMON_IDLE_SCAN_MS=os.environ.get("VMON_IDLE_SCAN_MS", "1000"),
        # The secret-injection tests' HTTPS receiver has a certificate the same CA signs.
        VMON_EGRESS_CA_FILE=str(DATA_DIR / "webhook-tls" / "ca.pem"),
        # Fault points (test_races.py): nothing is held until a test arms a point here.
        VMON_FAULT_DIR=str(DATA_DIR / "faults"),
    )
    (DATA_DIR / "faults").mkdir(parents=True, exist_ok=True)
    log_path = DATA_DIR / "vmon-up.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [str(binary), "up"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    exports: dict[str, str] = {}

    def read_exports():
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.strip()
            if line.startswith("export ") and "=" in line:
                k, v = line[len("export "):].split("=", 1)
                exports[k] = v

    reader = threading.Thread(target=read_exports, daemon=True)
    reader.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while len(exports) < 4:
        if proc.poll() is not None:
            raise RuntimeError(f"vmon up exited with {proc.returncode}; see {log_path}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"vmon up printed no exports within {STARTUP_TIMEOUT}s; see {log_path}")
        time.sleep(0.2)
    # The exports come before the guest image and `base` are built; an SDK create meanwhile
    # gets 503 (and raises), so the tests start once the platform says it is ready.
    last_report = 0.0
    while True:
        status, body = _health(exports["E2B_API_URL"])
        if status == 200 and body.get("status") == "ready":
            break
        if proc.poll() is not None:
            raise RuntimeError(f"vmon up exited with {proc.returncode}; see {log_path}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(
                f"vmon up was not ready within {STARTUP_TIMEOUT}s ({body.get('message')}); see {log_path}"
            )
        if time.monotonic() - last_report > 60:
            print(f"waiting for vmon up: {body.get('message', status)}", file=sys.stderr)
            last_report = time.monotonic()
        time.sleep(1)

    saved = {k: os.environ.get(k) for k in exports}
    os.environ.update(exports)
    server = Server(binary, env, exports["E2B_API_URL"], exports["E2B_SANDBOX_URL"], exports["E2B_API_KEY"])
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except Exception:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _kill_leftover_vms()
        log.close()
        print(f"vmon up log: {log_path}", file=sys.stderr)


@pytest.fixture
def sandboxes(vmon):
    """Kills what a test created, even when it fails."""
    from e2b import Sandbox

    made: list[Sandbox] = []
    yield made
    for s in made:
        try:
            s.kill()
        except Exception:
            pass


@pytest.fixture
def new_sandbox(sandboxes):
    from e2b import Sandbox

    def make(*args, **kwargs) -> Sandbox:
        sbx = Sandbox.create(*args, **kwargs)
        sandboxes.append(sbx)
        return sbx

    return make


def wait_for(predicate, timeout: float = 120.0, interval: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last value {last!r})")
