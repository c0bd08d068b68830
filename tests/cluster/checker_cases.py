"""NOT COLLECTED YET (the name is not test_*.py): it finds a real violation with CI's seed.
Run on 2026-12-08 (debug build, 2 cores, load 20-30 with other engineers' builds and VMs):
seed 20261208 passed (46 operations, 7 faults: 2 SIGSTOPs, 5 cuts of api2, 0 violations);
seed 20261209 failed: a sandbox created on node2 (02:12:29) whose node agent was killed with
SIGKILL and restarted 7 s later was reported killed `orphaned` (02:12:46) although its node
was out for less than the grace: at the restart node2's recovery logged "QEMU is gone (QEMU
10112 is gone); cleaning up" (a sandbox's QEMU is meant to outlive its agent: re-adopted at a
restart; one on node1 was, at 02:11:07). Why that QEMU died is not found yet (no OOM seen;
restored QEMUs do not ask for PR_SET_PDEATHSIG). Run with
`pytest -q tests/cluster/checker_cases.py` (VMON_CHECKER_SEED=20261209 replays it).

The checker (checker.py) for a short seeded run on the session's cluster: creates, writes
of known bytes into files and memory, pauses, resumes, forks and kills through the SDK while
parts are cut, killed with SIGKILL and restarted, or stopped with SIGSTOP, each for less
than the grace, so that every sandbox must survive. The seed (default 20261209, as CI runs
it: its first five faults are of all four kinds; VMON_CHECKER_SEED for another) is printed; VMON_CHECKER_SECS (default 150) is the time
the client runs (the end's check comes after it). The long run, with faults past the grace, is
`vmon bench cluster-checker`."""

from __future__ import annotations

import os

import pytest

import checker
from conftest import DIR, FAULTS

pytestmark = pytest.mark.skipif(not FAULTS, reason="the fault ports are off (VMON_CLUSTER_TEST_FAULTS=0)")


def test_a_seeded_run_of_calls_and_faults_breaks_no_promise(cluster):
    seed = os.environ.get("VMON_CHECKER_SEED")
    report = checker.run(
        cluster,
        DIR,
        seed=int(seed) if seed else 20261209,
        secs=float(os.environ.get("VMON_CHECKER_SECS", "150")),
        long_faults=False,
    )
    assert sum(report.ops.values()) > 0 and sum(report.faults.values()) > 0, report.summary()
    assert not report.violations, f"{report.summary()}\n" + "\n".join(report.violations)
