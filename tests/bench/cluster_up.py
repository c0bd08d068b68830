"""A local cluster for the benchmarks (`scripts/cluster.sh up --detach`) with the built binary
($CARGO_TARGET_DIR/$VMON_BENCH_PROFILE, default release) and the shared guest-image cache; its
`E2B_*` exports go into this process's environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from api_bench import REPO

SCRIPT = REPO / "scripts" / "cluster.sh"


def start(directory: Path, port: int, **extra: str) -> dict[str, str]:
    """Starts a fresh cluster in `directory` from `port` on; returns the environment the script
    runs with (for `stop` and `cluster.sh start|kill`)."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    binary = target / os.environ.get("VMON_BENCH_PROFILE", "release") / "vmon"
    if not binary.exists():
        sys.exit(f"{binary} is missing: cargo build --release -p vmon -p vmon-envd")
    cache = Path(os.environ.get("VMON_TEST_DATA_DIR", "/var/tmp/vmon-ci")) / "images"
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(
        VMON_BIN=str(binary),
        VMON_CLUSTER_DIR=str(directory),
        VMON_CLUSTER_PORT=str(port),
        VMON_IMAGES_DIR=str(cache),
        VMON_PREBUILD_CODE_INTERPRETER="0",
        **extra,
    )
    stop(env)
    shutil.rmtree(directory, ignore_errors=True)
    out = subprocess.run(
        [str(SCRIPT), "up", "--detach"], env=env, check=True, stdout=subprocess.PIPE, text=True
    ).stdout
    for line in out.splitlines():
        if line.startswith("export E2B_"):
            k, _, v = line.removeprefix("export ").partition("=")
            os.environ[k] = v
    return env


def stop(env: dict[str, str]) -> None:
    subprocess.run([str(SCRIPT), "down"], env=env, check=False)
