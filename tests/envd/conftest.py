"""Runs envd as a host process on 127.0.0.1:49983 and points the official SDK at it.

With E2B_DEBUG=true the SDK makes no control-plane calls and talks to envd at
http://localhost:49983 directly (sandbox id "debug_sandbox_id", no access token), which is
exactly an envd-only test. Run as root: envd switches to the test user per request.
"""

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

os.environ["E2B_DEBUG"] = "true"
os.environ.pop("E2B_SANDBOX_URL", None)

ROOT = Path(__file__).resolve().parents[2]
TEST_USER = "vmontest"
PORT = 49983


def _envd_binary() -> Path:
    explicit = os.environ.get("ENVD_BIN")
    if explicit:
        return Path(explicit)
    subprocess.run(
        ["cargo", "build", "-q", "-p", "vmon-envd", "--bin", "envd"], cwd=ROOT, check=True
    )
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "debug" / "envd"


def _ensure_user() -> None:
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", TEST_USER], check=True)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry))
    return out


@pytest.fixture(scope="session")
def envd():
    if os.geteuid() != 0:
        pytest.skip("envd tests need root (envd switches users)")
    _ensure_user()
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", PORT)) == 0:
            pytest.fail(f"port {PORT} is already in use; the SDK's debug mode needs it")
    proc = subprocess.Popen(
        [str(_envd_binary()), "--addr", f"127.0.0.1:{PORT}", "--default-user", TEST_USER],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.time() + 20
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1) as r:
                if r.status == 204:
                    break
        except OSError:
            pass
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail("envd did not become healthy")
        time.sleep(0.05)
    yield proc
    for child in _children(proc.pid):
        for target in (-child, child):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
    proc.kill()
    proc.wait()


@pytest.fixture
def sbx(envd):
    from e2b import Sandbox

    sandbox = Sandbox.create()
    yield sandbox
    # Leave nothing running for the next test.
    for p in sandbox.commands.list():
        sandbox.commands.kill(p.pid)


@pytest.fixture
def user_dir(envd, request):
    path = Path(f"/tmp/envd-sdk-{request.node.name}-{os.getpid()}")
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    user = pwd.getpwnam(TEST_USER)
    os.chown(path, user.pw_uid, user.pw_gid)
    yield str(path)
    shutil.rmtree(path, ignore_errors=True)
