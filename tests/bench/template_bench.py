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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import bench_server, machine, row, timed  # noqa: E402


def main() -> None:
    with bench_server():
        measure()


def measure() -> None:
    from e2b import Sandbox, Template  # after the environment is set

    runs = int(os.environ.get("VMON_BENCH_RUNS", "3"))
    creates = int(os.environ.get("VMON_BENCH_CREATES", "10"))

    first, cached, last_changed = [], [], []
    step_alone = []
    name = ""
    for i in range(runs):
        name = f"bench-{secrets.token_hex(4)}"
        marker = secrets.token_hex(4)
        one = Template().from_base_image().run_cmd(f"echo {marker} > /home/user/m.txt && sleep 1")
        timed(first, Template.build, one, name)
        timed(cached, Template.build, one, name)
        changed = (
            Template().from_base_image()
            .run_cmd(f"echo {marker} > /home/user/m.txt && sleep 1")
            .run_cmd(f"echo changed-{i} > /home/user/n.txt")
        )
        Template.build(changed, name)  # the two-step chain, so that the next build changes its last step
        changed2 = (
            Template().from_base_image()
            .run_cmd(f"echo {marker} > /home/user/m.txt && sleep 1")
            .run_cmd(f"echo changed-again-{i} > /home/user/n.txt")
        )
        timed(last_changed, Template.build, changed2, name)
        sbx = Sandbox.create("base", timeout=120)
        timed(step_alone, sbx.commands.run, f"echo changed-again-{i} > /home/user/n.txt")
        sbx.kill()

    def create_first_command(template: str) -> None:
        sbx = Sandbox.create(template, timeout=120)
        sbx.commands.run("true")
        sbx.kill()

    create_first_command(name)  # its pool
    time.sleep(3)
    base_c, custom_c = [], []
    for _ in range(creates):
        timed(base_c, create_first_command, "base")
        time.sleep(1)
        timed(custom_c, create_first_command, name)
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


if __name__ == "__main__":
    main()
