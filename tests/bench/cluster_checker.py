"""`vmon bench cluster-checker`: the cluster checker (tests/cluster/checker.py) for a long run,
with faults past the grace now and then (a node cut or stopped for longer than
VMON_NODE_GRACE_SECS, whose running sandboxes may then be reported killed `orphaned`).

Starts its own local cluster (VMON_BENCH_CLUSTER_DIR, default /var/tmp/vmon-bench-checker;
port VMON_BENCH_CLUSTER_PORT, default 3600; TLS and the fault ports on; a grace of 20 s) with
the built binary ($CARGO_TARGET_DIR/$VMON_BENCH_PROFILE, default release). VMON_CHECKER_SECS
(default 1800) is how long the client runs, VMON_CHECKER_SEED replays a run's choices.
Prints the operations, the faults, the violations and the machine; exits non-zero when a
violation was found.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DIR = Path(os.environ.get("VMON_BENCH_CLUSTER_DIR", "/var/tmp/vmon-bench-checker"))
PORT = int(os.environ.get("VMON_BENCH_CLUSTER_PORT", "3600"))
GRACE = "20"

# conftest reads where the cluster is when it is imported.
os.environ["VMON_CLUSTER_TEST_DIR"] = str(DIR)
os.environ["VMON_CLUSTER_TEST_PORT"] = str(PORT)
os.environ["VMON_CLUSTER_TEST_TLS"] = "1"
os.environ["VMON_NODE_GRACE_SECS"] = GRACE
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "cluster"))
import cluster_up  # noqa: E402
from api_bench import machine  # noqa: E402


def main() -> None:
    env = cluster_up.start(
        DIR, PORT, VMON_CLUSTER_TLS="1", VMON_CLUSTER_FAULTS="1", VMON_NODE_GRACE_SECS=GRACE
    )
    try:
        out = subprocess.run(
            [str(cluster_up.SCRIPT), "env"], env=env, check=True, stdout=subprocess.PIPE, text=True
        ).stdout
        exports = {}
        for line in out.splitlines():
            if line.startswith("export "):
                k, _, v = line.removeprefix("export ").partition("=")
                exports[k] = v
                os.environ[k] = v
        import checker
        import conftest

        cluster = conftest.Cluster(env, exports)
        seed = os.environ.get("VMON_CHECKER_SEED")
        report = checker.run(
            cluster,
            DIR,
            seed=int(seed) if seed else None,
            secs=float(os.environ.get("VMON_CHECKER_SECS", "1800")),
            long_faults=True,
        )
    finally:
        cluster_up.stop(env)
    print()
    print("vmon bench cluster-checker")
    print(f"  machine     {machine()}, load {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")
    print(f"  seed        {report.seed}")
    print(f"  run         {report.secs:.0f} s, {report.sandboxes} sandboxes")
    print(f"  operations  {sum(report.ops.values())} {dict(report.ops)}")
    print(f"  failed      {sum(report.failed_ops.values())} {dict(report.failed_ops)}")
    print(f"  faults      {sum(report.faults.values())} {dict(report.faults)}")
    print(f"  violations  {len(report.violations)}")
    for v in report.violations:
        print(f"    {v}")
    sys.exit(1 if report.violations else 0)


if __name__ == "__main__":
    main()
