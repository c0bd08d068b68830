"""What TCG's translation cache costs and buys: run against a `vmon up` started with
`VMON_TCG_TB_MIB=N` (default 32), one server per size. Creates 4 sandboxes 1.5 s apart; in each,
the first command, `commands.run("true")` x10 and a Python command x3; then 30 s idle, each
sandbox's QEMU PSS and the part of it that is the translation cache (its `rwxp` mappings), and
`true` x5 again. Prints one JSON line of medians with the machine.

Needs the server's data dir (`VMON_DATA_DIR`, default /var/lib/vmon) on this machine, to find
each sandbox's QEMU. E2B_API_URL, E2B_API_KEY and E2B_SANDBOX_URL as for the SDK.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import re
import statistics
import subprocess
import time

from e2b import Sandbox

PYTHON_CMD = (
    "python3 -c 'import json, subprocess; print(json.dumps({}))'"
    " && ls -la /usr/bin | wc -l && grep -c . /etc/passwd"
)


def pss(pid: int) -> tuple[float, float]:
    """(PSS, PSS of the rwxp mappings: TCG's code buffer) in MiB."""
    total = code = 0
    perms = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                perms = line.split()[1]
            elif line.startswith("Pss:"):
                kb = int(line.split()[1])
                total += kb
                if perms == "rwxp":
                    code += kb
    return total / 1024, code / 1024


def qemu_pid(data_dir: str, sandbox_id: str) -> int:
    (path,) = glob.glob(f"{data_dir}/sandboxes/{sandbox_id}/*/sandbox.json")
    with open(path) as f:
        tag = json.load(f)["qemu_tag"]
    out = subprocess.run(
        ["pgrep", "-f", f"name vmon-{tag}"], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[0])


def ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def main() -> None:
    data_dir = os.environ.get("VMON_DATA_DIR", "/var/lib/vmon")
    sandboxes, firsts, trues, pythons, after = [], [], [], [], []
    for _ in range(4):
        sb = Sandbox.create(timeout=600)
        sandboxes.append(sb)
        firsts.append(ms(lambda: sb.commands.run("true")))
        trues += [ms(lambda: sb.commands.run("true")) for _ in range(10)]
        pythons += [ms(lambda: sb.commands.run(PYTHON_CMD)) for _ in range(3)]
        time.sleep(1.5)
    time.sleep(30)
    mem = [pss(qemu_pid(data_dir, sb.sandbox_id)) for sb in sandboxes]
    for sb in sandboxes:
        after += [ms(lambda: sb.commands.run("true")) for _ in range(5)]
    for sb in sandboxes:
        sb.kill()
    cpu = next(
        (l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
        platform.machine(),
    )
    print(
        json.dumps(
            {
                "machine": f"{os.cpu_count()} cores, {cpu}",
                "load": os.getloadavg()[0],
                "pss_mib": statistics.median(m[0] for m in mem),
                "code_buffer_mib": statistics.median(m[1] for m in mem),
                "first_command_ms": statistics.median(firsts),
                "true_ms": statistics.median(trues),
                "python_command_ms": statistics.median(pythons),
                "true_after_idle_ms": statistics.median(after),
            }
        )
    )


if __name__ == "__main__":
    main()
