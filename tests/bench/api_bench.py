"""`vmon bench api`: the E2B API through the official Python SDK, as a user sees it.

Measures create -> first command -> kill for 20 back-to-back, 10 paced (1.5 s apart) and 10 parallel sandboxes; a
burst of 20 creates in a loop (wall, then one command in each), twice, 20 s apart (the second meets a pool grown by the
first); the everyday loop (create -> command -> pause -> connect -> command -> fork x1 -> kill, 20 times back to back,
each step's median and p95, and where each create's, resume's and fork child's QEMU came from, read from the server's
log: its template's warm pool, a blank process, a fresh spawn or its parked QEMU); `commands.run("true")` in a running
sandbox; fork x1; the pause and connect (resume) round trips; and, through `e2b-code-interpreter`, create -> first `run_code("1+1")` and a warm
`run_code("1+1")` on `code-interpreter-v1` (5 sandboxes, VMON_BENCH_CI), then in one more sandbox warm
`run_code("1+1")` alternating between its server (Jupyter kernels) and the stdlib worker it replaced, taken
from git history (VMON_BENCH_CI_WORKER, a revision; `-` skips it) and started beside it on port 49997;
prints medians and p99 with the machine.
A count set to 0 (VMON_BENCH_SEQ, _PAR, _PACED, _LOOP, _BURST, _CYCLES, _CI) skips its part.

With a server of its own, the everyday loop also prints where each command's time went (issue 42):
the server runs with `VMON_LOG=...,vmon_proxy=debug,vmon_node=debug`, and the bench reads the
proxy's `proxied:` lines (routing, the guest's response headers, the body's end), envd's own
`process started` / `process ended` lines in the sandbox's console log (the command's life in the
guest, by the guest's clock), and the node's pool refills (whether a warm-up ran beside the
command). VMON_BENCH_LOOP_THINK (seconds, default 0) waits between each create and its first
command; VMON_BENCH_BINARY runs another `vmon` binary; VMON_BENCH_DATA keeps the server's data dir
there between runs (its `base` template is built once).

Against a running server when E2B_API_URL / E2B_API_KEY / E2B_SANDBOX_URL are set; otherwise it
starts its own `vmon up` (built binary from target/, data dir under /var/tmp with the shared
image cache) and stops it at the end.
"""

from __future__ import annotations

import calendar
import concurrent.futures
import contextlib
import math
import os
import platform
import re
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

REPO = Path(__file__).resolve().parents[2]
# The code-interpreter server before issue 16 (a stdlib worker per context, no Jupyter): the
# kernels' A/B runs it beside the template's server in one sandbox.
STDLIB_WORKER_REV = "7a2442d"
STDLIB_WORKER_PATH = "crates/image/assets/code_interpreter.py"
STDLIB_WORKER_PORT = 49997


def pct(v: list[float], p: float) -> float:
    s = sorted(v)
    k = max(1, math.ceil(p * len(s)))
    return s[k - 1]


def strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def row(name: str, v: list[float]) -> None:
    if not v:
        return
    print(f"| {name} | {statistics.median(v):.0f} ms | {pct(v, 0.99):.0f} ms | {len(v)} |")


def row95(name: str, v: list[float]) -> None:
    """A row with the 95th percentile (the everyday loop's rows)."""
    if v:
        print(f"| {name} | {statistics.median(v):.0f} ms | {pct(v, 0.95):.0f} ms | {len(v)} |")


def starts_since(log: Path | None, offset: int) -> list[tuple[str, str]]:
    """(sandbox, from) of each "sandbox started" line the server logged past byte `offset`:
    where its QEMU came from (pool: a warmed template process; blank; fresh; parked)."""
    if log is None:
        return []
    with open(log, "rb") as f:
        f.seek(offset)
        text = strip_ansi(f.read().decode(errors="replace"))
    out = []
    for line in text.splitlines():
        if "sandbox started" in line:
            sid = re.search(r"sandbox=\"?([\w-]+)", line)
            src = re.search(r"from=\"?(\w+)", line)
            if sid and src:
                out.append((sid.group(1), src.group(1)))
    return out


def log_time(line: str) -> float | None:
    """The UTC time (epoch seconds) a tracing line of the server starts with."""
    m = re.match(r"\s*(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z", line)
    if not m:
        return None
    whole, _, frac = m.group(1).partition(".")
    t = calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S"))
    return t + float(f"0.{frac or 0}")


def log_field(line: str, name: str) -> str | None:
    m = re.search(rf"\b{name}=\"?([^\s\"]+)", line)
    return m.group(1) if m else None


def guest_life_ms(data: Path, sid: str, nth: int) -> float | None:
    """How long the `nth` (0-based) `echo hi` of sandbox `sid` lived in its guest, from envd's own
    `process started` / `process ended` lines (the guest's clock) in its console logs."""
    import json

    runs = sorted((data / "sandboxes" / sid).glob("*/console.log"), key=lambda p: p.stat().st_mtime)
    lives = []
    for log in runs:
        skip = 0
        try:
            skip = int((log.parent / "console.skip").read_text().strip() or 0)
        except (OSError, ValueError):
            pass
        started: dict[int, float] = {}
        with open(log, "rb") as f:
            f.seek(skip)
            for raw in f:
                i = raw.find(b"{")
                if i < 0 or b"process" not in raw:
                    continue
                try:
                    rec = json.loads(raw[i:])
                except ValueError:
                    continue
                fields = rec.get("fields", rec)  # envd's JSON lines are flattened
                if "echo hi" not in str(fields.get("cmd", "")):
                    continue
                t = log_time(str(rec.get("timestamp", "")))
                pid = fields.get("pid")
                if t is None or pid is None:
                    continue
                if fields.get("message") == "process started":
                    started[pid] = t
                elif fields.get("message") == "process ended" and pid in started:
                    lives.append((t - started.pop(pid)) * 1e3)
    return lives[nth] if nth < len(lives) else None


def command_stages(log: Path, cmds: list[tuple[str, int, float, float]]) -> dict[str, dict[str, list[float]]]:
    """Where each command's time went: for (sandbox, nth command, wall start, wall end) the proxy's
    routing, its wait for the guest's response headers and the body's end, envd's own life of the
    process, and whether a template's pool refill (a warm-up) ran during it."""
    text = strip_ansi(log.read_text(errors="replace"))
    proxied: dict[str, list[dict[str, float]]] = {}
    refills: list[tuple[float, float]] = []
    making: dict[str, float] = {}
    for line in text.splitlines():
        t = log_time(line)
        if t is None:
            continue
        if "proxied: headers" in line and log_field(line, "path") == "/process.Process/Start":
            sid = log_field(line, "sandbox") or ""
            proxied.setdefault(sid, []).append({
                "route": float(log_field(line, "route_ms") or 0),
                "headers": float(log_field(line, "headers_ms") or 0)})
        elif "proxied: end" in line and log_field(line, "path") == "/process.Process/Start":
            sid = log_field(line, "sandbox") or ""
            for p in proxied.get(sid, []):
                if "end" not in p:
                    p["end"] = float(log_field(line, "end_ms") or 0)
                    break
        elif "pool refill making a process" in line:
            key = log_field(line, "pool") or ""
            if not key.startswith("blank:"):
                making[key] = t
        elif "pool refill made a process" in line or "pool refill failed" in line:
            key = log_field(line, "pool") or ""
            if key in making:
                refills.append((making.pop(key), t))
    out: dict[str, dict[str, list[float]]] = {}
    for sid, nth, t0, t1 in cmds:
        label = "first command" if nth == 0 else "command after resume"
        row_ = out.setdefault(label, {})
        beside = any(a < t1 and b > t0 for a, b in refills) or any(a < t1 for a in making.values())
        row_.setdefault("SDK total, with a warm-up beside it" if beside else "SDK total, no warm-up beside it",
                        []).append((t1 - t0) * 1e3)
        row_.setdefault("SDK total", []).append((t1 - t0) * 1e3)
        seen = proxied.get(sid, [])
        if nth < len(seen):
            p = seen[nth]
            row_.setdefault("proxy: routing", []).append(p["route"])
            row_.setdefault("proxy: request in -> guest's headers", []).append(p["headers"])
            if "end" in p:
                row_.setdefault("proxy: request in -> body's end", []).append(p["end"])
                row_.setdefault("outside the proxy (SDK, client, loopback)", []).append((t1 - t0) * 1e3 - p["end"])
        life = guest_life_ms(log.parent, sid, nth)
        if life is not None:
            row_.setdefault("guest: envd's process start -> end", []).append(life)
    return out


def everyday_loop(Sandbox, n: int, log: Path | None) -> tuple[dict[str, list[float]], dict[str, dict[str, int]],
                                                                 dict[str, dict[str, list[float]]]]:
    """create -> command -> pause -> connect -> command -> fork x1 -> kill, `n` times back to back, as a
    user's agent runs it. Returns each step's times and, when the server's log is ours, where the
    QEMU of each create, resume and fork child came from and where each command's time went."""
    steps: dict[str, list[float]] = {k: [] for k in (
        "create", "first command", "pause", "connect (resume)", "command after resume", "fork x1",
        "kill (source and child)", "whole iteration")}
    ids: dict[str, set[str]] = {"create": set(), "fork child": set()}
    offset = log.stat().st_size if log else 0
    think = float(os.environ.get("VMON_BENCH_LOOP_THINK", "0"))
    cmds: list[tuple[str, int, float, float]] = []

    def timed(step: str, f):
        t = time.perf_counter()
        r = f()
        steps[step].append((time.perf_counter() - t) * 1e3)
        return r

    def command(sid: str, nth: int, step: str, sbx) -> None:
        w0 = time.time()
        out = timed(step, lambda: sbx.commands.run("echo hi"))
        cmds.append((sid, nth, w0, time.time()))
        assert out.stdout.strip() == "hi", out

    for _ in range(n):
        t0 = time.perf_counter()
        sbx = timed("create", lambda: Sandbox.create("base", timeout=300))
        ids["create"].add(sbx.sandbox_id)
        if think:
            time.sleep(think)
        command(sbx.sandbox_id, 0, "first command", sbx)
        assert timed("pause", sbx.pause)
        sbx = timed("connect (resume)", lambda: Sandbox.connect(sbx.sandbox_id, timeout=300))
        command(sbx.sandbox_id, 1, "command after resume", sbx)
        children = timed("fork x1", lambda: sbx.fork(count=1, timeout=300))
        for c in children:
            if isinstance(c, Exception):
                raise c
            ids["fork child"].add(c.sandbox_id)

        def kill_all():
            sbx.kill()
            for c in children:
                c.kill()

        timed("kill (source and child)", kill_all)
        steps["whole iteration"].append((time.perf_counter() - t0) * 1e3)

    origins: dict[str, dict[str, int]] = {}
    seen: set[str] = set()
    for sid, src in starts_since(log, offset):
        if any(sid in x or x in sid for x in ids["fork child"]):
            kind = "fork child"
        elif any(sid in x or x in sid for x in ids["create"]):
            kind = "resume" if sid in seen else "create"
            seen.add(sid)
        else:
            continue
        origins.setdefault(kind, {}).setdefault(src, 0)
        origins[kind][src] += 1
    return steps, origins, (command_stages(log, cmds) if log else {})


GUEST_HTTP_PORT = 8000
# A small HTTP/1.1 server with keep-alive (http.server speaks 1.0 and closes by default).
GUEST_HTTP_SERVER = (
    "import http.server as h\n"
    "class H(h.BaseHTTPRequestHandler):\n"
    "    protocol_version = 'HTTP/1.1'\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.send_header('content-length', '2'); self.end_headers()\n"
    "        self.wfile.write(b'ok')\n"
    "    def log_message(self, *a): pass\n"
    f"h.ThreadingHTTPServer(('0.0.0.0', {GUEST_HTTP_PORT}), H).serve_forever()\n")


def proxy_overhead(Sandbox, n: int, data: Path | None) -> tuple[dict[str, list[float]], str]:
    """A small GET to a guest's HTTP server through the proxy and straight to the guest's address
    (read from the api's admin route, so only with a server of our own), alternating, one sandbox,
    each over a kept-alive connection and over a new connection per request."""
    import http.client
    import json
    from urllib.parse import urlparse

    if data is None:
        return {}, "skipped: the guest's address needs the admin token of a server of our own"
    token = (data / "admin-token").read_text().strip()
    api = urlparse(os.environ["E2B_API_URL"])
    proxy = urlparse(os.environ["E2B_SANDBOX_URL"])
    sbx = Sandbox.create("base", timeout=300)
    try:
        sbx.files.write("/tmp/bench_http.py", GUEST_HTTP_SERVER)
        sbx.commands.run("python3 /tmp/bench_http.py", background=True)
        conn = http.client.HTTPConnection(api.hostname, api.port, timeout=30)
        conn.request("GET", f"/admin/routes/{sbx.sandbox_id}", headers={"x-admin-token": token})
        guest = json.loads(conn.getresponse().read())["guestIp"]
        conn.close()
        via_headers = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": str(GUEST_HTTP_PORT)}

        def get(c: http.client.HTTPConnection, headers: dict[str, str]) -> float:
            t = time.perf_counter()
            c.request("GET", "/", headers=headers)
            r = c.getresponse()
            body = r.read()
            ms = (time.perf_counter() - t) * 1e3
            assert r.status == 200 and body == b"ok", (r.status, body)
            return ms

        deadline = time.monotonic() + 120
        while True:  # the server's start (Python under TCG)
            try:
                get(http.client.HTTPConnection(guest, GUEST_HTTP_PORT, timeout=5), {})
                break
            except (OSError, AssertionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        out: dict[str, list[float]] = {}
        kept = {"proxy": http.client.HTTPConnection(proxy.hostname, proxy.port, timeout=30),
                "direct": http.client.HTTPConnection(guest, GUEST_HTTP_PORT, timeout=30)}
        for i in range(n + 10):
            for way in ("proxy", "direct"):
                host, port, headers = ((proxy.hostname, proxy.port, via_headers) if way == "proxy"
                                       else (guest, GUEST_HTTP_PORT, {}))
                a = get(kept[way], headers)
                fresh = http.client.HTTPConnection(host, port, timeout=30)
                b = get(fresh, headers)
                fresh.close()
                if i >= 10:  # the first ten warm the path up
                    out.setdefault(f"{way}, kept-alive connection", []).append(a)
                    out.setdefault(f"{way}, a new connection per request", []).append(b)
        return out, ""
    finally:
        sbx.kill()


def machine() -> str:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{os.cpu_count()} cores, {cpu}, kernel {platform.release()}"


def start_server() -> tuple[subprocess.Popen, dict[str, str], Path]:
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    profile = os.environ.get("VMON_BENCH_PROFILE", "release")
    binary = Path(os.environ.get("VMON_BENCH_BINARY") or target / profile / "vmon")
    if not binary.exists():
        sys.exit(f"{binary} is missing: cargo build --release -p vmon -p vmon-envd")
    kept = os.environ.get("VMON_BENCH_DATA")
    data = Path(kept or f"/var/tmp/vmon-bench-api-{os.getpid()}")
    if not kept:
        shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("VMON_TEST_DATA_DIR", "/var/tmp/vmon-ci")) / "images"
    cache.mkdir(parents=True, exist_ok=True)
    if not (data / "images").is_symlink():
        (data / "images").symlink_to(cache)
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    # The stage breakdown of the everyday loop reads the proxy's and the pool's debug lines.
    env["VMON_LOG"] = ",".join(x for x in (env.get("VMON_LOG", "info"), "vmon_proxy=debug", "vmon_node::pool=debug")
                               if x)
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    env.update(VMON_DATA_DIR=str(data), VMON_API_LISTEN=f"127.0.0.1:{ports[0]}",
               VMON_PROXY_LISTEN=f"127.0.0.1:{ports[1]}")
    # A burst keeps 20 sandboxes at once, the default team's whole limit: leave it room.
    env.setdefault("VMON_MAX_CONCURRENT", "64")
    log = open(data / "vmon-up.log", "a" if kept else "w")
    proc = subprocess.Popen([str(binary), "up"], env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)
    exports: dict[str, str] = {}

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("export ") and "=" in line:
                k, v = line[len("export "):].strip().split("=", 1)
                exports[k] = v

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 3600
    while len(exports) < 3:
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"vmon up did not start; see {data}/vmon-up.log")
        time.sleep(0.2)
    # The exports come at once; creates are admitted once `/health` says ready (200).
    health = f"{exports['E2B_API_URL'].rstrip('/')}/health"
    while True:
        try:
            with urllib.request.urlopen(health, timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:  # 503 while building (HTTPError is an OSError), or not answering
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"vmon up did not become ready; see {data}/vmon-up.log")
        time.sleep(1)
    return proc, exports, data


def stop_server(proc: subprocess.Popen) -> None:
    """Stops a `vmon up` that start_server started (its whole session)."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def bench_server():
    """The server a bench measures: the running one the E2B_* variables name (yields None),
    else a `vmon up` of its own (yields its data dir; the E2B_* variables are set for the SDK),
    measured only once its background build of code-interpreter-v1 is done, stopped at the end."""
    if os.environ.get("E2B_API_URL"):
        yield None
        return
    proc, exports, data = start_server()
    os.environ.update(exports)
    try:
        wait_code_interpreter(data)
        yield data
    finally:
        stop_server(proc)


def timed(into: list[float], f, *args, **kwargs):
    """Runs `f`, appends its wall time (ms) to `into` and returns its result."""
    t0 = time.perf_counter()
    try:
        return f(*args, **kwargs)
    finally:
        into.append((time.perf_counter() - t0) * 1e3)


def wait_code_interpreter(data: Path) -> None:
    """A server of our own builds code-interpreter-v1 in the background after `base`: a TCG
    cold boot that would share the two cores with everything measured. Waits for it, unless
    VMON_PREBUILD_CODE_INTERPRETER=0 told the server not to build it."""
    if os.environ.get("VMON_PREBUILD_CODE_INTERPRETER", "").strip() in ("0", "false", "no"):
        return
    log = data / "vmon-up.log"
    deadline = time.monotonic() + 1800
    while 'template ready alias="code-interpreter-v1"' not in strip_ansi(log.read_text()):
        if time.monotonic() > deadline:
            sys.exit(f"code-interpreter-v1 was not built; see {log}")
        time.sleep(1)
    time.sleep(5)  # its warm pool process


def kernel_vs_stdlib_worker(CodeSandbox, n: int) -> tuple[list[float], list[float], str]:
    """Warm `run_code("1+1")` in one sandbox, alternating between the template's server and the
    stdlib worker of STDLIB_WORKER_REV started beside it: both behind the same proxy, guest and
    SDK, so what differs is the server. ([], [], why) when the worker cannot be had."""
    rev = os.environ.get("VMON_BENCH_CI_WORKER", STDLIB_WORKER_REV)
    if rev == "-":
        return [], [], "skipped (VMON_BENCH_CI_WORKER=-)"
    try:
        source = subprocess.run(["git", "show", f"{rev}:{STDLIB_WORKER_PATH}"], cwd=REPO,
                                capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return [], [], f"skipped: no {rev}:{STDLIB_WORKER_PATH} in git ({e})"
    import e2b_code_interpreter.code_interpreter_sync as sdk

    csb = CodeSandbox.create(timeout=600)
    try:
        csb.files.write("/tmp/stdlib_worker.py", source)
        csb.commands.run(f"cd /home/user && VMON_CI_PORT={STDLIB_WORKER_PORT} "
                         "nohup python3 /tmp/stdlib_worker.py >/tmp/stdlib_worker.log 2>&1 &")
        csb.commands.run(f"for i in $(seq 600); do curl -sf http://127.0.0.1:{STDLIB_WORKER_PORT}/health "
                         ">/dev/null && exit 0; sleep 0.5; done; exit 1", timeout=400)
        kernel: list[float] = []
        worker: list[float] = []
        default_port = sdk.JUPYTER_PORT
        try:
            for i in range(n + 2):
                for port, out in ((default_port, kernel), (STDLIB_WORKER_PORT, worker)):
                    sdk.JUPYTER_PORT = port  # the SDK's port for the jupyter server
                    t = time.perf_counter()
                    assert csb.run_code("1+1").text == "2"
                    if i >= 2:  # the first two of each warm up the path
                        out.append((time.perf_counter() - t) * 1e3)
        finally:
            sdk.JUPYTER_PORT = default_port
        return kernel, worker, ""
    finally:
        csb.kill()


def main() -> None:
    own = None
    if not os.environ.get("E2B_API_URL"):
        proc, exports, data = start_server()
        os.environ.update(exports)
        own = (proc, data)
    from e2b import Sandbox  # after the environment is set

    seq_n = int(os.environ.get("VMON_BENCH_SEQ", "20"))
    par_n = int(os.environ.get("VMON_BENCH_PAR", "10"))
    cycles = int(os.environ.get("VMON_BENCH_CYCLES", "5"))
    paced_n = int(os.environ.get("VMON_BENCH_PACED", "10"))
    ci_n = int(os.environ.get("VMON_BENCH_CI", "5"))
    burst_n = int(os.environ.get("VMON_BENCH_BURST", "20"))
    loop_n = int(os.environ.get("VMON_BENCH_LOOP", "20"))
    proxy_n = int(os.environ.get("VMON_BENCH_PROXY", "200"))

    kills: list[float] = []

    def lifecycle() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        sbx = Sandbox.create("base", timeout=300)
        t1 = time.perf_counter()
        out = sbx.commands.run("echo hi")
        assert out.stdout.strip() == "hi", out
        t2 = time.perf_counter()
        sbx.kill()
        t3 = time.perf_counter()
        kills.append((t3 - t2) * 1e3)
        return (t1 - t0) * 1e3, (t2 - t0) * 1e3, (t3 - t0) * 1e3

    lifecycle()  # warm-up: pool, connections
    if own:
        wait_code_interpreter(own[1])
    seq = [lifecycle() for _ in range(seq_n)]
    paced = []
    for _ in range(paced_n):
        time.sleep(1.5)  # an agent's think time: the pool refills in between
        paced.append(lifecycle())
    t = time.perf_counter()
    par = []
    if par_n:
        with concurrent.futures.ThreadPoolExecutor(par_n) as ex:
            par = list(ex.map(lambda _: lifecycle(), range(par_n)))
    par_wall = (time.perf_counter() - t) * 1e3

    # The everyday loop, after a quiet moment (the pool back at its base, as a user meets it).
    loop_steps, loop_origins, loop_stages = {}, {}, {}
    if loop_n:
        time.sleep(5)
        loop_steps, loop_origins, loop_stages = everyday_loop(Sandbox, loop_n,
                                                              own[1] / "vmon-up.log" if own else None)

    proxy_rows, proxy_note = (proxy_overhead(Sandbox, proxy_n, own[1] if own else None) if proxy_n
                              else ({}, "skipped (VMON_BENCH_PROXY=0)"))

    # Bursts: `Sandbox.create` in a loop (the "20 creates back to back"), then one
    # command in each; the second burst comes 20 s later, when the pool has grown by demand.
    bursts: list[tuple[float, list[float], list[float]]] = []
    for i in range(2 if burst_n else 0):
        if i:
            time.sleep(20)
        made, each, firsts = [], [], []
        t = time.perf_counter()
        for _ in range(burst_n):
            t1 = time.perf_counter()
            made.append(Sandbox.create("base", timeout=300))
            each.append((time.perf_counter() - t1) * 1e3)
        wall = (time.perf_counter() - t) * 1e3
        for sb in made:
            t1 = time.perf_counter()
            assert sb.commands.run("echo hi").stdout.strip() == "hi"
            firsts.append((time.perf_counter() - t1) * 1e3)
        for sb in made:
            sb.kill()
        bursts.append((wall, each, firsts))

    warm_true, forks = [], []
    sbx = Sandbox.create("base", timeout=300)
    sbx.commands.run("true")
    for _ in range(20):
        t = time.perf_counter()
        sbx.commands.run("true")
        warm_true.append((time.perf_counter() - t) * 1e3)
    for _ in range(5):
        t = time.perf_counter()
        children = sbx.fork(count=1, timeout=300)
        forks.append((time.perf_counter() - t) * 1e3)
        for c in children:
            if isinstance(c, Exception):
                raise c
            c.kill()
    sbx.kill()

    pauses, connects = [], []
    sbx = Sandbox.create("base", timeout=300)
    sbx.commands.run("head -c 16M /dev/urandom > /dev/shm/state")
    for _ in range(cycles):
        t = time.perf_counter()
        assert sbx.pause()
        pauses.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=300)
        sbx.commands.run("true")
        connects.append((time.perf_counter() - t) * 1e3)
    sbx.kill()

    ci_create, ci_first, ci_warm = [], [], []
    if ci_n:
        from e2b_code_interpreter import Sandbox as CodeSandbox

        CodeSandbox.create(timeout=300, request_timeout=1800).kill()  # waits for the template
        time.sleep(5)  # its warm pool process
        for _ in range(ci_n):
            t = time.perf_counter()
            csb = CodeSandbox.create(timeout=300)
            t1 = time.perf_counter()
            assert csb.run_code("1+1").text == "2"
            t2 = time.perf_counter()
            ci_create.append((t1 - t) * 1e3)
            ci_first.append((t2 - t1) * 1e3)
            for _ in range(5):
                t = time.perf_counter()
                assert csb.run_code("1+1").text == "2"
                ci_warm.append((time.perf_counter() - t) * 1e3)
            csb.kill()
    ab_kernel, ab_worker, ab_note = (kernel_vs_stdlib_worker(CodeSandbox, 20) if ci_n
                                     else ([], [], "skipped (VMON_BENCH_CI=0)"))

    print("## vmon bench api (official Python SDK)\n")
    print(f"machine: {machine()}; server {os.environ['E2B_API_URL']}\n")
    print("| operation | median | p99 | n |\n|---|---|---|---|")
    row("create (back to back)", [s[0] for s in seq])
    row("create -> first command done (back to back)", [s[1] for s in seq])
    row("create -> command -> kill (back to back)", [s[2] for s in seq])
    row("create (1.5 s apart)", [s[0] for s in paced])
    row("create -> first command done (1.5 s apart)", [s[1] for s in paced])
    row(f"create -> command -> kill ({par_n} parallel, each)", [p[2] for p in par])
    row("kill (every lifecycle above)", kills[1:])
    if par:
        print(f"| {par_n} parallel, wall | {par_wall:.0f} ms | | 1 |")
    for i, (wall, each, firsts) in enumerate(bursts):
        label = "first burst" if i == 0 else "second burst, 20 s later"
        print(f"| {burst_n} creates in a loop, wall ({label}) | {wall:.0f} ms | | 1 |")
        row(f"create in a burst ({label})", each)
        row(f"first command after a burst's create ({label})", firsts)
    row("first command after create (back to back)", [s[1] - s[0] for s in seq])
    row("commands.run('true') in a running sandbox", warm_true)
    row("fork x1 (sandbox.fork(count=1))", forks)
    row("pause (16 MiB dirtied)", pauses)
    row("connect (resume) -> command done", connects)
    if loop_steps:
        print(f"\n### everyday loop: create -> command -> pause -> connect -> command -> fork x1 -> kill, "
              f"{loop_n} times back to back\n")
        print("| step | median | p95 | n |\n|---|---|---|---|")
        for name, v in loop_steps.items():
            row95(f"loop: {name}", v)
        if loop_origins:
            print("\nwhere each QEMU came from (server log): "
                  + "; ".join(f"{kind}: " + ", ".join(f"{src} {n}" for src, n in sorted(c.items()))
                              for kind, c in loop_origins.items()))
        elif not own:
            print("\n(pool hits not counted: the server's log is not this bench's)")
        for label, parts in loop_stages.items():
            print(f"\nwhere the loop's {label} went (medians of the commands with each figure):\n")
            print("| stage | median | p95 | n |\n|---|---|---|---|")
            for name, v in parts.items():
                row95(name, v)
        print("\n| operation | median | p99 | n |\n|---|---|---|---|")
    if proxy_rows or proxy_note:
        print(f"\n### the proxy's overhead: GET / of a guest's small HTTP server, {proxy_n} each way, "
              "alternating, one sandbox\n")
        if proxy_note:
            print(proxy_note)
        print("| way | median | p99 | n |\n|---|---|---|---|")
        for name, v in proxy_rows.items():
            row(name, v)
        for kind in ("kept-alive connection", "a new connection per request"):
            via, direct = proxy_rows.get(f"proxy, {kind}"), proxy_rows.get(f"direct, {kind}")
            if via and direct:
                print(f"| proxy minus direct ({kind}), p50 / p99 | "
                      f"{statistics.median(via) - statistics.median(direct):.2f} ms | "
                      f"{pct(via, 0.99) - pct(direct, 0.99):.2f} ms | |")
        print("\n| operation | median | p99 | n |\n|---|---|---|---|")
    row("code-interpreter-v1: create", ci_create)
    row("code-interpreter-v1: first run_code('1+1') after create", ci_first)
    row("code-interpreter-v1: warm run_code('1+1')", ci_warm)
    if ab_note:
        print(f"| warm run_code, kernels vs stdlib worker | {ab_note} | | |")
    else:
        row("warm run_code('1+1'), one sandbox alternating: Jupyter kernel (port 49999)", ab_kernel)
        row(f"warm run_code('1+1'), one sandbox alternating: stdlib worker of {STDLIB_WORKER_REV} "
            f"(port {STDLIB_WORKER_PORT})", ab_worker)

    if own:
        stop_server(own[0])


if __name__ == "__main__":
    main()
