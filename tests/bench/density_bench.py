"""`vmon bench density`: how many idle sandboxes a host holds, and what each costs.

Starts idle `base` sandboxes through the official Python SDK in steps (VMON_DENSITY_STEP, default 10) up to
VMON_DENSITY_MAX (default 50; 200 of 512 MiB fit these 24 GiB machines by memory), each answering a command when made.
After each step, once the host has settled, it prints: the host memory the sandboxes took (the drop of MemAvailable
from before the first create: run it on an otherwise idle host), per sandbox, the median and largest PSS of the
sandboxes' QEMU processes (found by their pidfiles under the server's data dir), the count of all QEMU processes on
the host (the pool's included), and the create latency of that step. At the end every sandbox must still answer a command.

Against a running server when E2B_API_URL / E2B_API_KEY / E2B_SANDBOX_URL and VMON_DATA_DIR (its data dir) are set;
otherwise it starts its own `vmon up` like `vmon bench api`.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import api_bench  # noqa: E402  (the server start, percentiles and machine line are shared)


def mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def pss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def qemu_pids() -> set[int]:
    """Every QEMU process on the host."""
    out = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "comm").read_text().startswith("qemu-system"):
                out.add(int(proc.name))
        except OSError:
            continue
    return out


def sandbox_pids(data_dir: str) -> set[int]:
    """The QEMUs of running sandboxes: each keeps its pidfile in its run directory,
    `<data dir>/sandboxes/<id>/<execution>/qemu/qemu.pid` (a pooled process moves there when
    claimed)."""
    out = set()
    for f in Path(data_dir, "sandboxes").glob("*/*/qemu/qemu.pid"):
        try:
            out.add(int(f.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            continue
    return out & qemu_pids()


def main() -> None:
    max_n = int(os.environ.get("VMON_DENSITY_MAX", "50"))
    step = max(1, int(os.environ.get("VMON_DENSITY_STEP", "10")))
    own = None
    if not os.environ.get("E2B_API_URL"):
        os.environ.setdefault("VMON_MAX_CONCURRENT", str(max_n + 8))
        proc, exports, data = api_bench.start_server()
        os.environ.update(exports)
        own = (proc, data)
        api_bench.wait_code_interpreter(data)
    data_dir = os.environ.get("VMON_DATA_DIR") or (str(own[1]) if own else None)
    if not data_dir:
        sys.exit("against a running server, set VMON_DATA_DIR to its data dir (the sandboxes' QEMUs are found there)")
    from e2b import Sandbox  # after the environment is set

    # The pool and everything else the server keeps before any sandbox: not the sandboxes' cost.
    Sandbox.create("base", timeout=600).kill()
    time.sleep(10)
    before_mem = mem_available_mib()
    sandboxes: list[Sandbox] = []
    rows = []
    while len(sandboxes) < max_n:
        creates = []
        for _ in range(min(step, max_n - len(sandboxes))):
            t = time.perf_counter()
            sbx = Sandbox.create("base", timeout=3600)
            creates.append((time.perf_counter() - t) * 1e3)
            assert sbx.commands.run("echo hi").stdout.strip() == "hi"
            sandboxes.append(sbx)
        time.sleep(10)  # let refills and page-ins settle before reading memory
        used = before_mem - mem_available_mib()
        all_qemus = qemu_pids()
        mine = [v for v in (pss_mib(p) for p in sandbox_pids(data_dir)) if v is not None]
        rows.append((len(sandboxes), used, used / len(sandboxes), statistics.median(mine) if mine else 0.0,
                     max(mine) if mine else 0.0, len(all_qemus), statistics.median(creates), api_bench.pct(creates, 0.99)))
        print(f"{len(sandboxes)} sandboxes: host {used:.0f} MiB, QEMU PSS median {rows[-1][3]:.0f} MiB", flush=True)

    answered = 0
    for sbx in sandboxes:
        if sbx.commands.run("true").exit_code == 0:
            answered += 1
    for sbx in sandboxes:
        sbx.kill()

    print("\n## vmon bench density (official Python SDK, idle `base` sandboxes)\n")
    print(f"machine: {api_bench.machine()}; server {os.environ['E2B_API_URL']}\n")
    print("| sandboxes | host memory used | per sandbox | QEMU PSS median | QEMU PSS max | QEMU processes | "
          "create median | create p99 |")
    print("|---|---|---|---|---|---|---|---|")
    for n, used, per, med, mx, procs, c50, c99 in rows:
        print(f"| {n} | {used:.0f} MiB | {per:.1f} MiB | {med:.1f} MiB | {mx:.1f} MiB | {procs} | {c50:.0f} ms | "
              f"{c99:.0f} ms |")
    print(f"\n{answered} of {len(sandboxes)} answered a command at the end.")
    if own:
        api_bench.stop_server(own[0])
    if answered != len(sandboxes):
        sys.exit("not every sandbox answered")


if __name__ == "__main__":
    main()
