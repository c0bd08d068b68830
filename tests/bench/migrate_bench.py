"""`vmon bench migrate`: live migration on a local cluster (`scripts/cluster.sh`).

For an idle guest and for a guest writing 64 MiB/s into its memory, each with 512 MiB of RAM
(the base template) and 1 GiB (a template built for it): the whole move (`totalMs`), the
switch (source handed over to target running, `switchMs`), QEMU's own downtime estimate, the
memory sent and its rounds, and the downtime a client sees: the largest gap between answers
of an HTTP server in the guest polled through the proxy every 20 ms during the move (the guest's
own clocks stop with it, so the gap is measured outside). Then a drain of 10 idle sandboxes:
the time from `POST /admin/nodes/{id}/drain` to `drained`.

Prints medians (VMON_BENCH_ROUNDS moves per case, default 3) and the machine. Starts its own
cluster (VMON_BENCH_CLUSTER_DIR, default /var/tmp/vmon-bench-migrate; port 3500, no TLS) with
the built binary ($CARGO_TARGET_DIR/$VMON_BENCH_PROFILE, default release).
VMON_BENCH_MIGRATE_1G=0 leaves out the 1 GiB cases (their template build takes minutes).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster_up  # noqa: E402
from api_bench import machine  # noqa: E402

DIR = Path(os.environ.get("VMON_BENCH_CLUSTER_DIR", "/var/tmp/vmon-bench-migrate"))
PORT = int(os.environ.get("VMON_BENCH_CLUSTER_PORT", "3500"))
ROUNDS = int(os.environ.get("VMON_BENCH_ROUNDS", "3"))
WITH_1G = os.environ.get("VMON_BENCH_MIGRATE_1G", "1") != "0"

# Rewrites 1 MiB of a 256 MiB buffer every 1/64 s: 64 MiB/s of guest memory dirtied.
WRITER = r"""
import os, time
buf = bytearray(256 << 20)
chunk = os.urandom(1 << 20)
i = 0
while True:
    t = time.monotonic()
    off = (i % 256) << 20
    buf[off:off + (1 << 20)] = chunk
    i += 1
    time.sleep(max(0.0, 1 / 64 - (time.monotonic() - t)))
"""


def main() -> None:
    env = cluster_up.start(DIR, PORT, VMON_CLUSTER_TLS="0")
    try:
        run(env)
    finally:
        cluster_up.stop(env)


def run(env: dict) -> None:
    from e2b import Sandbox, Template

    admin = (DIR / "api" / "admin-token").read_text().strip()
    api = os.environ["E2B_API_URL"]

    def call(method: str, path: str, body: dict | None = None):
        req = urllib.request.Request(
            f"{api}{path}",
            data=None if body is None else json.dumps(body).encode(),
            headers={"x-admin-token": admin, "content-type": "application/json"},
            method=method,
        )
        try:
            with urllib.request.urlopen(req, timeout=900) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    templates = {"512": "base"}
    if WITH_1G:
        t0 = time.monotonic()
        Template.build(Template().from_base_image(), alias="bench-1g", cpu_count=1, memory_mb=1024)
        print(f"# 1 GiB template built in {time.monotonic() - t0:.0f} s")
        templates["1024"] = "bench-1g"

    results: dict[str, dict[str, list[float]]] = {}
    for mib, tpl in templates.items():
        for kind in ("idle", "writing 64 MiB/s"):
            sbx = Sandbox.create(tpl, timeout=1800)
            sbx.commands.run("setsid nohup python3 -m http.server 8000 -d /tmp >/dev/null 2>&1 </dev/null &")
            if kind != "idle":
                sbx.files.write("/home/user/writer.py", WRITER)
                sbx.commands.run("setsid nohup python3 /home/user/writer.py >/dev/null 2>&1 </dev/null &")
            url = f"{os.environ['E2B_SANDBOX_URL'].rstrip('/')}/"
            host = sbx.get_host(8000)
            # The proxy routes by Host; the SDK's sandbox URL is the proxy itself.
            time.sleep(3)
            case = f"{mib} MiB, {kind}"
            r = results.setdefault(case, {})
            for _ in range(ROUNDS):
                stop, gap = threading.Event(), []
                th = threading.Thread(target=largest_gap_host, args=(url, host, stop, gap))
                th.start()
                time.sleep(1)
                status, rep = call("POST", f"/admin/sandboxes/{sbx.sandbox_id}/migrate", {})
                time.sleep(1)
                stop.set()
                th.join()
                if status != 200:
                    print(f"# {case}: migration failed: {status} {rep}")
                    continue
                for k, v in (
                    ("total ms", rep["totalMs"]),
                    ("switch ms", rep["switchMs"]),
                    ("guest stopped ms", rep["downtimeMs"]),
                    ("qemu downtime ms", rep["qemuDowntimeMs"]),
                    ("client-seen gap ms", gap[0] * 1000 if gap else float("nan")),
                    ("memory sent MiB", rep["ramBytes"] / (1 << 20)),
                    ("rounds", rep["rounds"]),
                    # The page check after QEMU's last round (docs/operations.md): pages
                    # hashed, stale pages the target was sent again, and its time.
                    ("checked pages", rep.get("checkedPages", 0)),
                    ("repaired pages", rep.get("repairedPages", 0)),
                    ("check ms", rep.get("checkMs", 0)),
                ):
                    r.setdefault(k, []).append(v)
            sbx.kill()

    # A drain of 10 idle sandboxes: all placed on node1 first (node2 takes no new work).
    call("POST", "/admin/nodes/node2/drain")
    time.sleep(2)
    boxes = [Sandbox.create("base", timeout=1800) for _ in range(10)]
    call("DELETE", "/admin/nodes/node2/drain")
    t0 = time.monotonic()
    call("POST", "/admin/nodes/node1/drain")
    drained = None
    while time.monotonic() - t0 < 1800:
        status, s = call("GET", "/admin/nodes/node1/drain")
        if status == 200 and s["state"] == "drained":
            drained = time.monotonic() - t0
            break
        time.sleep(0.2)
    call("DELETE", "/admin/nodes/node1/drain")
    for b in boxes:
        b.kill()

    print(f"# vmon bench migrate — {machine()}")
    print(f"# medians of {ROUNDS} moves per case; cluster of 2 nodes on this host, no TLS")
    for case, r in results.items():
        fields = ", ".join(
            f"{k} {statistics.median(v):.0f}" for k, v in r.items() if v
        )
        print(f"{case}: {fields}")
    print(f"drain of 10 idle sandboxes: {drained:.1f} s" if drained else "drain: did not finish")


def largest_gap_host(url: str, host: str, stop: threading.Event, out: list) -> None:
    """The largest gap between answers of `url` asked with `Host: host`, until `stop`."""
    last = time.monotonic()
    gap = 0.0
    while not stop.is_set():
        try:
            req = urllib.request.Request(url, headers={"Host": host})
            with urllib.request.urlopen(req, timeout=5) as r:
                r.read()
            now = time.monotonic()
            gap = max(gap, now - last)
            last = now
        except Exception:
            pass
        time.sleep(0.02)
    out.append(gap)


if __name__ == "__main__":
    main()
