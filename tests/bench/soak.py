"""`vmon bench soak`: pause/resume cycles that must never lose a byte, as a user drives them.

One sandbox holds a process with 64 MiB of random memory (it keeps the bytes' SHA-256 and
re-hashes them on SIGUSR1) and a 64 MiB random file. Each cycle pauses it (with memory) and
resumes it through the official SDK, rotating through three kinds of resume:

- kept: `connect` at once, so the node's parked QEMU continues;
- files: `connect` after the parked QEMU has been let go (the server runs with
  VMON_PARK_SECS=2), so the resume restores from the build's files;
- restart: `vmon up` is stopped and started again on the same data dir between pause and
  resume, so the resume is the restarted node's.

After every resume the process must be the same pid, its memory must hash as before, and the
file must hash as before. The first mismatch ends the run with a non-zero exit. Prints the
cycles of each kind, the failures (none, or the run stops), and pause/resume medians.

VMON_SOAK_CYCLES (default 50) cycles; always starts its own server (built binary from
$CARGO_TARGET_DIR/$VMON_BENCH_PROFILE, default release) with a data dir under /var/tmp and the
shared image cache.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import REPO, machine  # noqa: E402

HOLDER = r"""
import hashlib, os, signal, sys, time
data = bytearray(os.urandom(64 << 20))
want = hashlib.sha256(data).hexdigest()
open('/home/user/holder.want', 'w').write(want)
def again(*_):
    open('/home/user/holder.got.tmp', 'w').write(hashlib.sha256(data).hexdigest())
    os.replace('/home/user/holder.got.tmp', '/home/user/holder.got')
signal.signal(signal.SIGUSR1, again)
open('/home/user/holder.ready', 'w').write(str(os.getpid()))
while True:
    time.sleep(3600)
"""


class Server:
    """`vmon up` on one data dir and fixed ports, restartable."""

    def __init__(self) -> None:
        target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
        self.binary = target / os.environ.get("VMON_BENCH_PROFILE", "release") / "vmon"
        if not self.binary.exists():
            sys.exit(f"{self.binary} is missing: cargo build --release -p vmon -p vmon-envd")
        self.data = Path(f"/var/tmp/vmon-soak-{os.getpid()}")
        shutil.rmtree(self.data, ignore_errors=True)
        self.data.mkdir(parents=True)
        cache = Path(os.environ.get("VMON_TEST_DATA_DIR", "/var/tmp/vmon-ci")) / "images"
        cache.mkdir(parents=True, exist_ok=True)
        (self.data / "images").symlink_to(cache)
        ports = []
        for _ in range(2):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ports.append(s.getsockname()[1])
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
        self.env.update(VMON_DATA_DIR=str(self.data), VMON_API_LISTEN=f"127.0.0.1:{ports[0]}",
                        VMON_PROXY_LISTEN=f"127.0.0.1:{ports[1]}", VMON_PARK_SECS="2",
                        # The soak never uses the code interpreter, and restarting every third
                        # cycle would begin its first-start build again each time, never done.
                        VMON_PREBUILD_CODE_INTERPRETER="0")
        self.proc: subprocess.Popen | None = None
        self.exports: dict[str, str] = {}

    def start(self) -> None:
        log = open(self.data / "vmon-up.log", "a")
        self.proc = subprocess.Popen([str(self.binary), "up"], env=self.env, stdout=subprocess.PIPE,
                                     stderr=log, text=True, start_new_session=True)
        exports: dict[str, str] = {}

        def read(p: subprocess.Popen) -> None:
            assert p.stdout is not None
            for line in p.stdout:
                if line.startswith("export ") and "=" in line:
                    k, v = line[len("export "):].strip().split("=", 1)
                    exports[k] = v

        threading.Thread(target=read, args=(self.proc,), daemon=True).start()
        deadline = time.monotonic() + 3600
        while len(exports) < 3:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"vmon up did not start; see {self.data}/vmon-up.log")
            time.sleep(0.2)
        health = f"{exports['E2B_API_URL'].rstrip('/')}/health"
        while True:
            try:
                with urllib.request.urlopen(health, timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"vmon up did not become ready; see {self.data}/vmon-up.log")
            time.sleep(0.5)
        self.exports = exports
        os.environ.update(exports)

    def stop(self) -> None:
        if self.proc is None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    def kill_vms(self) -> None:
        """The QEMUs this data dir's node started (they outlive the server by design)."""
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"qemu-system-x86_64") and any(
                    str(self.data).encode() + b"/" in a for a in cmd):
                try:
                    os.kill(int(p.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def main() -> None:
    cycles = int(os.environ.get("VMON_SOAK_CYCLES", "50"))
    server = Server()
    server.start()
    from e2b import Sandbox  # after the environment is set

    failures: list[str] = []
    kinds = {"kept": 0, "files": 0, "restart": 0}
    pauses: list[float] = []
    resumes: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        sbx = Sandbox.create("base", timeout=3600)
        sbx.files.write("/home/user/holder.py", HOLDER)
        # timeout=0: the SDK's default (60 s) would have envd kill the holder mid-run.
        sbx.commands.run("python3 /home/user/holder.py", background=True, timeout=0)
        deadline = time.monotonic() + 300
        while sbx.commands.run("cat /home/user/holder.ready 2>/dev/null || true").stdout.strip() == "":
            if time.monotonic() > deadline:
                sys.exit("the memory holder never started")
            time.sleep(0.5)
        pid = sbx.commands.run("cat /home/user/holder.ready").stdout.strip()
        want_mem = sbx.commands.run("cat /home/user/holder.want").stdout.strip()
        sbx.commands.run("head -c 64M /dev/urandom > /home/user/blob && sync")
        want_file = sbx.commands.run("sha256sum /home/user/blob").stdout.split()[0]
        sid = sbx.sandbox_id

        for i in range(cycles):
            kind = ("kept", "files", "restart")[i % 3]
            t = time.perf_counter()
            if not sbx.pause():
                failures.append(f"cycle {i}: pause answered false")
                break
            pauses.append((time.perf_counter() - t) * 1e3)
            if kind == "files":
                time.sleep(4)  # past VMON_PARK_SECS: the parked QEMU is let go
            elif kind == "restart":
                server.stop()
                server.start()
            t = time.perf_counter()
            sbx = Sandbox.connect(sid, timeout=3600)
            run = sbx.commands.run
            run("rm -f /home/user/holder.got")
            resumes[kind].append((time.perf_counter() - t) * 1e3)
            got_pid = run("pgrep -f holder.py | head -n 1 || true").stdout.strip()
            run(f"kill -USR1 {pid} || true")
            got_mem = ""
            deadline = time.monotonic() + 120
            while got_mem == "" and time.monotonic() < deadline:
                got_mem = run("cat /home/user/holder.got 2>/dev/null || true").stdout.strip()
                if got_mem == "":
                    time.sleep(0.3)
            got_file = run("sha256sum /home/user/blob").stdout.split()[0]
            kinds[kind] += 1
            for what, want, got in [("pid", pid, got_pid), ("memory", want_mem, got_mem),
                                    ("file", want_file, got_file)]:
                if want != got:
                    failures.append(f"cycle {i} ({kind}): {what} {got!r} != {want!r}")
            if failures:
                break
            print(f"cycle {i + 1}/{cycles} ({kind}) ok", flush=True)
        sbx.kill()
    finally:
        server.stop()
        server.kill_vms()

    print("\n## vmon bench soak (official Python SDK)\n")
    print(f"machine: {machine()}\n")
    print(f"cycles: {sum(kinds.values())} of {cycles} ({kinds}); failures: {len(failures)}")
    for f in failures:
        print(f"FAILED {f}")
    print("\n| what | median | n |\n|---|---|---|")
    if pauses:
        print(f"| pause (64 MiB process + 64 MiB file) | {statistics.median(pauses):.0f} ms | {len(pauses)} |")
    for k, v in resumes.items():
        if v:
            print(f"| resume ({k}) | {statistics.median(v):.0f} ms | {len(v)} |")
    if failures or sum(kinds.values()) < cycles:
        sys.exit(1)
    shutil.rmtree(server.data, ignore_errors=True)


if __name__ == "__main__":
    main()
