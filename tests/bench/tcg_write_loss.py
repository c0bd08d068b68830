"""Does a QEMU's own live migration lose guest writes under TCG?

    python3 tests/bench/tcg_write_loss.py [--qemu BINARY] [--runs N]

QEMU before 9.0 clears its migration dirty bitmap without re-arming the vCPUs' TLB entries
(fixed upstream by "physmem: Fix migration dirty bitmap coherency with TCG memory access"),
so a page the guest keeps writing through a cached TLB entry after a bitmap sync is never
marked dirty again and never re-sent: the target resumes with a stale copy. vmon repairs this
after every live migration (`crates/node/src/node/migrate_check.rs`); this script shows
whether a given QEMU needs it, without vmon, in a few seconds per run.

The guest is a 30-byte boot sector that stores a rising counter into the first dword of each
of 144 pages (0x10000-0x9FFFF) in an endless loop, interrupts off. Source and target map their
RAM from files of their own (`memory-backend-file,share=on`), the source migrates to the
target over a UNIX socket (`max-bandwidth` low enough for a few rounds while the guest
writes), and once QEMU says `completed` (both guests stopped: the source after its last
round, the target never started) the two files are compared page by page. Any page that
differs is a write the migration lost. Prints each run's lost pages and the rounds QEMU made.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAM_MIB = 32
PAGE = 4096

# org 0x7c00, real mode:
#   cli; xor eax,eax
#   start: mov bx,0x1000
#   loop:  mov es,bx; mov [es:0],eax; inc eax; add bx,0x100; cmp bx,0xa000; jb loop
#          jmp start
BOOT = bytes.fromhex(
    "fa" "6631c0"
    "bb0010"
    "8ec3" "2666a30000" "6640" "81c30001" "81fb00a0" "72ed"
    "ebe8"
)


def boot_sector() -> bytes:
    return BOOT + bytes(510 - len(BOOT)) + b"\x55\xaa"


class Qmp:
    def __init__(self, path: Path, timeout: float = 30):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.s = socket.socket(socket.AF_UNIX)
                self.s.connect(str(path))
                break
            except OSError:
                self.s.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.f = self.s.makefile("rwb")
        json.loads(self.f.readline())
        self.call("qmp_capabilities")

    def call(self, cmd: str, **args):
        self.f.write(json.dumps({"execute": cmd, "arguments": args}).encode() + b"\n")
        self.f.flush()
        while True:
            r = json.loads(self.f.readline())
            if "return" in r:
                return r["return"]
            if "error" in r:
                raise RuntimeError(f"{cmd}: {r['error']}")


def start(qemu: str, d: Path, name: str, extra: list[str]) -> tuple[subprocess.Popen, Qmp]:
    mem = d / f"{name}.mem"
    mem.unlink(missing_ok=True)
    args = [
        qemu, "-machine", "pc,memory-backend=ram0", "-accel", "tcg", "-cpu", "qemu64",
        "-m", f"{RAM_MIB}M",
        "-object", f"memory-backend-file,id=ram0,size={RAM_MIB}M,mem-path={mem},share=on",
        "-nodefaults", "-no-user-config", "-display", "none",
        "-drive", f"file={d / 'boot.img'},format=raw,if=ide",
        "-qmp", f"unix:{d / name}.qmp,server=on,wait=off", *extra,
    ]
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=open(d / f"{name}.err", "wb"))
    return p, Qmp(d / f"{name}.qmp")


def one_run(qemu: str, d: Path) -> tuple[int, int, int]:
    """(pages that differ, pages the guest writes, dirty-sync rounds)."""
    src_p, src = start(qemu, d, "src", [])
    dst_p, dst = start(qemu, d, "dst", ["-S", "-incoming", f"unix:{d / 'mig.sock'}"])
    try:
        # Let the guest boot from the disk and write for a while.
        time.sleep(3)
        # Slow enough that the writes span several rounds; the loop dirties 144 pages.
        src.call("migrate-set-parameters", **{"max-bandwidth": 32 << 20, "downtime-limit": 300})
        src.call("migrate", uri=f"unix:{d / 'mig.sock'}")
        deadline = time.monotonic() + 120
        while True:
            st = src.call("query-migrate")
            if st.get("status") == "completed":
                break
            if st.get("status") in ("failed", "cancelled") or time.monotonic() > deadline:
                raise RuntimeError(f"migration {st}")
            time.sleep(0.05)
        while dst.call("query-migrate").get("status") != "completed":
            time.sleep(0.05)
        rounds = st.get("ram", {}).get("dirty-sync-count", 0)
        a = (d / "src.mem").read_bytes()
        b = (d / "dst.mem").read_bytes()
        differ = sum(1 for i in range(0, len(a), PAGE) if a[i:i + PAGE] != b[i:i + PAGE])
        written = sum(1 for pg in range(0x10, 0xA0) if a[pg * PAGE:pg * PAGE + 4] != bytes(4))
        return differ, written, rounds
    finally:
        for p in (src_p, dst_p):
            p.kill()
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qemu", default=os.environ.get("VMON_QEMU", "/usr/bin/qemu-system-x86_64"))
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    version = subprocess.run([a.qemu, "--version"], capture_output=True, text=True).stdout
    print(f"{version.splitlines()[0]}; load {os.getloadavg()[0]:.1f}")
    lost_runs = 0
    with tempfile.TemporaryDirectory(prefix="vmon-write-loss-") as t:
        d = Path(t)
        (d / "boot.img").write_bytes(boot_sector())
        for i in range(a.runs):
            differ, written, rounds = one_run(a.qemu, d)
            lost_runs += differ > 0
            print(f"run {i + 1}: {differ} pages differ of {written} the guest writes; {rounds} dirty syncs")
            if written < 100:
                print("the guest did not run its loop (boot failed?)", file=sys.stderr)
                return 2
    print(f"{lost_runs} of {a.runs} migrations lost writes")
    return 1 if lost_runs else 0


if __name__ == "__main__":
    sys.exit(main())
