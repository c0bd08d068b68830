"""`vmon bench desktop`: desktop sandboxes through the official `e2b-desktop` SDK, as a user sees
them: create to first screenshot (the SDK's create runs its Xvfb/xfce4 commands, restored here
from the template's snapshot), screenshot latency, input to a visible change (a key typed
into a terminal until a screenshot differs), and pause/resume of a desktop with Firefox open (to
the window answering again). Prints medians and p99 with the machine. Against a running server
when E2B_API_URL / E2B_API_KEY / E2B_SANDBOX_URL are set; otherwise it starts its own `vmon up`.
The first create builds the `desktop` template when it is not built (timed, not counted).
"""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import bench_server, machine, row, timed  # noqa: E402


def main() -> None:
    with bench_server():
        measure()


def wait(what: str, f, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = f()
        if r:
            return r
        time.sleep(interval)
    sys.exit(f"timed out waiting for {what}")


def measure() -> None:
    from e2b import CommandExitException
    from e2b_desktop import Sandbox as Desktop  # after the environment is set
    from PIL import Image

    def windows(d, application: str) -> list[str]:
        # xdotool's search exits 1 when nothing matches, which the SDK raises.
        try:
            return [w for w in d.get_application_windows(application) if w]
        except CommandExitException:
            return []

    runs = int(os.environ.get("VMON_BENCH_RUNS", "5"))
    shots = int(os.environ.get("VMON_BENCH_SHOTS", "10"))

    def pixels(d) -> bytes:
        return Image.open(io.BytesIO(bytes(d.screenshot()))).convert("RGB").tobytes()

    def create_and_shoot():
        d = Desktop.create(timeout=900)
        d.screenshot()
        return d

    build: list[float] = []
    timed(build, lambda: Desktop.create(timeout=600, request_timeout=3600).kill())

    create_shot, shot, visible, pause, resume = [], [], [], [], []
    for _ in range(runs):
        d = timed(create_shot, create_and_shoot)
        try:
            for _ in range(shots):
                timed(shot, d.screenshot)
            # Input to a visible change: a key typed into a terminal until a screenshot shows it.
            d.launch("xfce4-terminal")
            term = wait("the terminal", lambda: windows(d, "xfce4-terminal"), 120)
            d.commands.run(f"xdotool windowactivate --sync {term[0]}")
            time.sleep(2)
            before = pixels(d)
            t0 = time.perf_counter()
            d.press("x")
            wait("the key on the screen", lambda: pixels(d) != before, 30, interval=0)
            visible.append((time.perf_counter() - t0) * 1e3)
            d.commands.run("pkill -f xfce4-terminal || true")
            # Pause/resume with Firefox open on a page.
            d.files.write("/home/user/p.html", "<title>bench page</title><h1>bench</h1>")
            d.open("/home/user/p.html")
            wait(
                "Firefox's window",
                lambda: any("bench page" in d.get_window_title(w) for w in windows(d, "firefox")),
                300,
                interval=1,
            )
            timed(pause, d.pause)
            timed(resume, lambda: (d.connect(timeout=900), windows(d, "firefox")))
        finally:
            d.kill()

    print("## vmon bench desktop (official e2b-desktop SDK)\n")
    load = os.getloadavg()
    print(f"machine: {machine()}; load at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; "
          f"server {os.environ['E2B_API_URL']}; first create (the template's build when not built) "
          f"{build[0] / 1e3:.0f} s\n")
    print("| what | median | p99 | n |\n|---|---|---|---|")
    row("create to first screenshot", create_shot)
    row("screenshot", shot)
    row("input to a visible change (key to a differing screenshot)", visible)
    row("pause (Firefox open)", pause)
    row("resume to the first window query", resume)


if __name__ == "__main__":
    main()
