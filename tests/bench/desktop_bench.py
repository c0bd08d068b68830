"""`vmon bench desktop`: desktop sandboxes through the official `e2b-desktop` SDK, as a user sees
them: create to first screenshot (the SDK's create runs its Xvfb/xfce4 commands, restored here
from the template's snapshot), screenshot latency, input to a visible change (a key typed
into a terminal until a screenshot differs), and pause/resume of a desktop with Firefox open (to
the window answering again). Prints medians and p99 with the machine. Against a running server
when E2B_API_URL / E2B_API_KEY / E2B_SANDBOX_URL are set; otherwise it starts its own `vmon up`.
The first create builds the `desktop` template (not counted).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import machine, row, start_server  # noqa: E402


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    own = None
    if not os.environ.get("E2B_API_URL"):
        proc, exports, data = start_server()
        os.environ.update(exports)
        own = (proc, data)
    from e2b_desktop import Sandbox as Desktop  # after the environment is set
    from PIL import Image

    runs = int(os.environ.get("VMON_BENCH_RUNS", "5"))
    shots = int(os.environ.get("VMON_BENCH_SHOTS", "10"))

    t0 = time.perf_counter()
    Desktop.create(timeout=600, request_timeout=3600).kill()
    build_s = ms(t0) / 1e3

    create_shot, shot, visible, pause, resume = [], [], [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        d = Desktop.create(timeout=900)
        d.screenshot()
        create_shot.append(ms(t0))
        try:
            for _ in range(shots):
                t0 = time.perf_counter()
                d.screenshot()
                shot.append(ms(t0))
            # Input to a visible change: a key typed into a terminal until a screenshot shows it.
            d.launch("xfce4-terminal")
            for _ in range(120):
                if [w for w in d.get_application_windows("xfce4-terminal") if w]:
                    break
                time.sleep(0.5)
            time.sleep(2)
            before = list(Image.open(io.BytesIO(bytes(d.screenshot()))).convert("RGB").getdata())
            t0 = time.perf_counter()
            d.press("x")
            while time.perf_counter() - t0 < 30:
                now = list(Image.open(io.BytesIO(bytes(d.screenshot()))).convert("RGB").getdata())
                if now != before:
                    break
            visible.append(ms(t0))
            d.commands.run("pkill -f xfce4-terminal || true")
            # Pause/resume with Firefox open on a page.
            d.files.write("/home/user/p.html", "<title>bench page</title><h1>bench</h1>")
            d.open("/home/user/p.html")
            for _ in range(300):
                wins = [w for w in d.get_application_windows("firefox") if w]
                if any("bench page" in d.get_window_title(w) for w in wins):
                    break
                time.sleep(1)
            t0 = time.perf_counter()
            d.pause()
            pause.append(ms(t0))
            t0 = time.perf_counter()
            d.connect(timeout=900)
            d.get_application_windows("firefox")
            resume.append(ms(t0))
        finally:
            d.kill()

    print("## vmon bench desktop (official e2b-desktop SDK)\n")
    print(f"machine: {machine()}; server {os.environ['E2B_API_URL']}; template build {build_s:.0f} s\n")
    print("| what | median | p99 | n |\n|---|---|---|---|")
    row("create to first screenshot", create_shot)
    row("screenshot", shot)
    row("input to a visible change", visible)
    row("pause (Firefox open)", pause)
    row("resume to the first window query", resume)
    if own:
        proc = own[0]
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
