"""What a command's shell costs inside a guest: `/bin/true`, `bash -c true`, `bash -l -c true`
(what the SDKs send) and `sh -l -c true`, each started 20 times in a loop in one sandbox, as
`user` and as root, timed in the guest (`date +%s%N`), so the API and the proxy do not count.

Against a running server (E2B_API_URL, E2B_API_KEY, E2B_SANDBOX_URL); `--rounds N` repeats.
Prints one row per shell and user with the machine's load average before the run.
"""

from __future__ import annotations

import argparse
import os

from e2b import Sandbox

SCRIPT = r"""
t() { n=$1; shift; s=$(date +%s%N); i=0
  while [ $i -lt $n ]; do "$@" >/dev/null 2>&1 </dev/null; i=$((i+1)); done
  e=$(date +%s%N); echo "$(( (e-s)/n/1000 )) $*"; }
t 20 /bin/true
t 20 bash -c true
t 20 bash -l -c true
t 20 sh -l -c true
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"load average before: {load}; {os.cpu_count()} cores\n")
    print("| user | shell | per start |\n|---|---|---|")
    sbx = Sandbox.create("base", timeout=600)
    try:
        sbx.files.write("/tmp/login_shell_bench.sh", SCRIPT)
        sbx.commands.run("bash /tmp/login_shell_bench.sh", user="user", timeout=600)  # translate once
        for _ in range(args.rounds):
            for user in ("user", "root"):
                out = sbx.commands.run("bash /tmp/login_shell_bench.sh", user=user, timeout=600).stdout
                for line in out.splitlines():
                    us, what = line.split(" ", 1)
                    print(f"| {user} | `{what}` | {int(us) / 1000:.1f} ms |", flush=True)
    finally:
        sbx.kill()


if __name__ == "__main__":
    main()
