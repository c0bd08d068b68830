"""The code interpreter's server against the stdlib worker it replaced, both run as host
processes (the host's own CPU: what a KVM guest comes close to), beside a real envd.

`1+1` over one kept-alive HTTP connection per server, alternating, VMON_BENCH_N each (default
200) after 10 to warm up; prints medians and p90 with the machine. The worker is taken from
git history (VMON_BENCH_CI_WORKER, default 7a2442d); VMON_BENCH_WORKER_NODELAY=1 gives it the
same TCP_NODELAY the server sets. envd is target/release/envd or ENVD_BIN.

    .venv/bin/python tests/bench/ci_native_bench.py
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVER = REPO / "crates/image/assets/code_interpreter.py"
WORKER_PATH = "crates/image/assets/code_interpreter.py"
TOKEN = "bench-" + os.urandom(8).hex()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(port: int, path: str, status: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"process on port {port} exited ({proc.returncode})")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", path)
            if c.getresponse().status == status:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"nothing answered on port {port}")


def worker_source(tmp: Path) -> Path:
    rev = os.environ.get("VMON_BENCH_CI_WORKER", "7a2442d")
    src = subprocess.run(["git", "show", f"{rev}:{WORKER_PATH}"], cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    if os.environ.get("VMON_BENCH_WORKER_NODELAY") == "1":
        at = src.index("    def log_message(self")
        src = (src[:at] + "    def setup(self):\n        super().setup()\n"
               "        import socket as _s\n"
               "        self.connection.setsockopt(_s.IPPROTO_TCP, _s.TCP_NODELAY, 1)\n\n"
               + src[at:])
    path = tmp / "worker.py"
    path.write_text(src)
    return path


def main() -> None:
    n = int(os.environ.get("VMON_BENCH_N", "200"))
    envd_bin = os.environ.get("ENVD_BIN") or str(REPO / "target/release/envd")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        marker = tmp / "envd-init"
        envd_port = free_port()
        procs = []
        envd = subprocess.Popen([envd_bin, "--addr", f"127.0.0.1:{envd_port}", "--access-token",
                                 TOKEN, "--init-marker", str(marker)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_up(envd_port, "/health", 204, envd)
            c = http.client.HTTPConnection("127.0.0.1", envd_port, timeout=30)
            c.request("POST", "/init", body=json.dumps({"accessToken": TOKEN}),
                      headers={"Content-Type": "application/json", "X-Access-Token": TOKEN})
            assert c.getresponse().status == 204
            env = dict(os.environ, VMON_CI_ENVD=f"http://127.0.0.1:{envd_port}",
                       VMON_CI_ENVD_INIT_MARKER=str(marker), HOME=str(tmp))
            servers = {"kernels (this tree)": SERVER, "stdlib worker": worker_source(tmp)}
            ports = {}
            for name, path in servers.items():
                port = free_port()
                p = subprocess.Popen([sys.executable, str(path), "--host", "127.0.0.1", "--port",
                                      str(port)], env=env, cwd=tmp, start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                procs.append(p)
                wait_up(port, "/health", 200, p)
                ports[name] = port
            conns = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                     for name, port in ports.items()}

            def cell(name: str) -> float:
                c = conns[name]
                t = time.perf_counter()
                c.request("POST", "/execute", body=json.dumps({"code": "1+1"}),
                          headers={"Content-Type": "application/json", "X-Access-Token": TOKEN})
                r = c.getresponse()
                body = r.read()
                dt = (time.perf_counter() - t) * 1e3
                assert r.status == 200 and b'"2"' in body, body[:200]
                return dt

            for _ in range(10):
                for name in conns:
                    cell(name)
            times = {name: [] for name in conns}
            for _ in range(n):
                for name in conns:
                    times[name].append(cell(name))
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            envd.kill()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    print(f"machine: {os.cpu_count()} cores, {cpu}, kernel {platform.release()}")
    print("| server | median | p90 | n |\n|---|---|---|---|")
    for name, v in times.items():
        v.sort()
        print(f"| {name} | {statistics.median(v):.2f} ms | {v[int(len(v) * 0.9)]:.2f} ms | {len(v)} |")


if __name__ == "__main__":
    main()
