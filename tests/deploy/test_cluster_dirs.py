"""`scripts/cluster.sh` checks its directories before it starts anything: a VMON_CLUSTER_DIR
under a directory other users cannot traverse (root's home, mode 0700) used to die inside
PostgreSQL's initdb with "Permission denied" after installing and building everything."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_cluster_dir_others_cannot_traverse_is_refused_before_anything_starts():
    with tempfile.TemporaryDirectory(prefix="vmon-private-", dir="/var/tmp") as private:
        os.chmod(private, 0o700)
        cluster_dir = Path(private) / "cluster"
        env = {**os.environ, "VMON_CLUSTER_DIR": str(cluster_dir), "VMON_CLUSTER_PORT": "3900"}
        for cmd in (["up", "--detach"], ["start", "pg"]):
            t0 = time.monotonic()
            out = subprocess.run(["scripts/cluster.sh", *cmd], cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode != 0, out
            assert time.monotonic() - t0 < 10, "it checked first, before installing or building"
            assert f"{cluster_dir} is under {private} (mode 700" in out.stderr, out.stderr
            assert "postgres" in out.stderr and f"chmod o+x {private}" in out.stderr, out.stderr
            # Nothing was made or started.
            assert not cluster_dir.exists()

