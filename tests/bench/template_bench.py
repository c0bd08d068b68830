"""`vmon bench template`: template builds through the official Template SDK, as a user sees them.

Measures, with new names each run: a build of the base plus one RUN step, a cached rebuild
(nothing changed), a rebuild whose last step changed, and create -> first command latency from
the custom template against the same from `base`, in the same run; prints medians and p99 with
the machine. Against a running server when E2B_API_URL / E2B_API_KEY / E2B_SANDBOX_URL are set;
otherwise it starts its own `vmon up` (as `vmon bench api` does).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import machine, row, start_server, strip_ansi  # noqa: E402


def main() -> None:
    own = None
    if not os.environ.get("E2B_API_URL"):
        proc, exports, data = start_server()
        os.environ.update(exports)
        own = (proc, data)
    from e2b import Sandbox, Template  # after the environment is set

    runs = int(os.environ.get("VMON_BENCH_RUNS", "3"))
    creates = int(os.environ.get("VMON_BENCH_CREATES", "10"))
    if own:
        log = own[1] / "vmon-up.log"
        deadline = time.monotonic() + 1800
        while 'template ready alias="code-interpreter-v1"' not in strip_ansi(log.read_text()):
            if time.monotonic() > deadline:
                sys.exit(f"code-interpreter-v1 was not built; see {log}")
            time.sleep(1)
        time.sleep(5)

    def build(t, name: str) -> float:
        t0 = time.perf_counter()
        Template.build(t, name)
        return (time.perf_counter() - t0) * 1e3

    first, cached, last_changed = [], [], []
    step_alone = []
    name = ""
    for i in range(runs):
        name = f"bench-{secrets.token_hex(4)}"
        marker = secrets.token_hex(4)
        one = Template().from_base_image().run_cmd(f"echo {marker} > /home/user/m.txt && sleep 1")
        first.append(build(one, name))
        cached.append(build(one, name))
        changed = (
            Template().from_base_image()
            .run_cmd(f"echo {marker} > /home/user/m.txt && sleep 1")
            .run_cmd(f"echo changed-{i} > /home/user/n.txt")
        )
        build(changed, name)  # the two-step chain, so that the next build changes its last step
        changed2 = (
            Template().from_base_image()
            .run_cmd(f"echo {marker} > /home/user/m.txt && sleep 1")
            .run_cmd(f"echo changed-again-{i} > /home/user/n.txt")
        )
        last_changed.append(build(changed2, name))
        sbx = Sandbox.create("base", timeout=120)
        t0 = time.perf_counter()
        sbx.commands.run(f"echo changed-again-{i} > /home/user/n.txt")
        step_alone.append((time.perf_counter() - t0) * 1e3)
        sbx.kill()

    def create_first_command(template: str) -> float:
        t0 = time.perf_counter()
        sbx = Sandbox.create(template, timeout=120)
        sbx.commands.run("true")
        dt = (time.perf_counter() - t0) * 1e3
        sbx.kill()
        return dt

    create_first_command(name)  # its pool
    time.sleep(3)
    base_c, custom_c = [], []
    for _ in range(creates):
        base_c.append(create_first_command("base"))
        time.sleep(1)
        custom_c.append(create_first_command(name))
        time.sleep(1)

    print("## vmon bench template (official Python SDK)\n")
    print(f"machine: {machine()}; server {os.environ['E2B_API_URL']}\n")
    print("| what | median | p99 | n |\n|---|---|---|---|")
    row("build: base + one RUN step", first)
    row("cached rebuild (nothing changed)", cached)
    row("rebuild, last step changed", last_changed)
    row("  that step run alone in a sandbox", step_alone)
    row("create + first command from base", base_c)
    row("create + first command from the custom template", custom_c)
    if own:
        proc = own[0]
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
