"""Volumes through the official Python SDK: content-plane write/read MiB/s, in-guest write/read
MiB/s through a virtio-fs mount against the guest's own root disk, the host disk's bandwidth
in the same run, and create latency with one mount against none. Prints a Markdown table.

Against a running server when E2B_API_URL / E2B_API_KEY / E2B_VOLUME_API_URL are set; otherwise
it starts its own `vmon up` (as `api_bench.py` does; `VMON_BENCH_PROFILE=debug` for a debug
build) and stops it at the end. Sizes: `VMON_BENCH_MIB` (default 64).
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import machine, start_server, strip_ansi  # noqa: E402

MIB = int(os.environ.get("VMON_BENCH_MIB", "64"))
CREATES = int(os.environ.get("VMON_BENCH_CREATES", "3"))


def host_disk(dir_: Path) -> tuple[float, float]:
    """MiB/s of writing (with fsync) and reading back MIB MiB in `dir_`."""
    path = dir_ / f"bench-{uuid.uuid4().hex}.bin"
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(MIB):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    t1 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass
    t2 = time.perf_counter()
    path.unlink()
    return MIB / (t1 - t0), MIB / (t2 - t1)


def guest_dd(sbx, path: str) -> tuple[float, float]:
    """MiB/s of `dd` writing (conv=fsync) then reading MIB MiB at `path` in the guest."""

    def rate(cmd: str) -> float:
        t0 = time.perf_counter()
        out = sbx.commands.run(cmd, user="root", timeout=600)
        wall = time.perf_counter() - t0
        # dd's own figure (bytes / its elapsed seconds) excludes the command round trip.
        m = re.search(r"(\d+) bytes .* copied, ([0-9.]+) s", out.stderr)
        secs = float(m.group(2)) if m else wall
        return MIB / secs

    w = rate(f"dd if=/dev/zero of={path} bs=1M count={MIB} conv=fsync")
    sbx.commands.run("sync; echo 3 > /proc/sys/vm/drop_caches", user="root")
    r = rate(f"dd if={path} of=/dev/null bs=1M")
    sbx.commands.run(f"rm -f {path}", user="root")
    return w, r


def stop_leftover_vms(data: Path) -> None:
    """QEMU outlives its node by design (re-adoption); the ones our own server started go."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"qemu-system-x86_64") and any(str(data).encode() + b"/" in a for a in cmd):
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def main() -> None:
    own = None
    data = None
    if not os.environ.get("E2B_API_URL"):
        proc, exports, data = start_server()
        os.environ.update(exports)
        own = proc
        # Its own server builds code-interpreter-v1 after `base`: a TCG cold boot that would
        # share the two cores with everything measured here.
        log = data / "vmon-up.log"
        deadline = time.monotonic() + 1800
        while 'template ready alias="code-interpreter-v1"' not in strip_ansi(log.read_text()):
            if time.monotonic() > deadline:
                sys.exit(f"code-interpreter-v1 was not built; see {log}")
            time.sleep(2)
    from e2b import Sandbox, Volume

    vol = Volume.create(f"bench-{uuid.uuid4().hex[:8]}")
    try:
        payload = os.urandom(MIB << 20)
        t0 = time.perf_counter()
        vol.write_file("/content.bin", payload)
        t1 = time.perf_counter()
        got = vol.read_file("/content.bin", format="bytes")
        t2 = time.perf_counter()
        assert got == payload
        api_w, api_r = MIB / (t1 - t0), MIB / (t2 - t1)
        vol.remove("/content.bin")

        volumes_dir = (data / "volumes") if data else Path(os.environ.get("VMON_VOLUMES_DIR", "/var/lib/vmon/volumes"))
        disk_w, disk_r = host_disk(volumes_dir if volumes_dir.is_dir() else Path("/var/tmp"))

        plain, mounted = [], []
        for _ in range(CREATES):
            t0 = time.perf_counter()
            s = Sandbox.create(timeout=600)
            s.commands.run("true")
            plain.append(time.perf_counter() - t0)
            s.kill()
            t0 = time.perf_counter()
            s = Sandbox.create(timeout=600, volume_mounts={"/mnt/v": vol})
            s.commands.run("true")
            mounted.append(time.perf_counter() - t0)
            s.kill()

        sbx = Sandbox.create(timeout=900, volume_mounts={"/mnt/v": vol})
        try:
            mount_w, mount_r = guest_dd(sbx, "/mnt/v/guest.bin")
            root_w, root_r = guest_dd(sbx, "/home/user/guest.bin")
        finally:
            sbx.kill()
    finally:
        Volume.destroy(vol.volume_id)
        if own:
            os.killpg(own.pid, signal.SIGTERM)
            own.wait(timeout=60)
            stop_leftover_vms(data)

    print(f"Machine: {machine()}; {MIB} MiB per transfer")
    print()
    print("| what | write MiB/s | read MiB/s |")
    print("|---|---|---|")
    print(f"| host disk of the volumes dir (Python, fsync) | {disk_w:.0f} | {disk_r:.0f} |")
    print(f"| content plane (SDK write_file / read_file) | {api_w:.1f} | {api_r:.1f} |")
    print(f"| in the guest through the mount (dd, conv=fsync) | {mount_w:.1f} | {mount_r:.1f} |")
    print(f"| in the guest on its root disk (dd, conv=fsync) | {root_w:.1f} | {root_r:.1f} |")
    print()
    print("| create → first command | median | runs |")
    print("|---|---|---|")
    print(f"| no mount (memory restore) | {statistics.median(plain):.2f} s | {len(plain)} |")
    print(f"| one volume mounted (cold boot) | {statistics.median(mounted):.2f} s | {len(mounted)} |")


if __name__ == "__main__":
    main()
