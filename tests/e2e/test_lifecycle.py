"""Pause/resume (memory, filesystem, reboot), auto-pause, auto-resume by traffic, fork and
snapshots through the official SDK."""

from __future__ import annotations

import os

import httpx
import pytest
from e2b import Sandbox, SandboxState

from conftest import wait_for

# A process whose only state is in RAM: it prints a random token it generated at start.
RAM_SERVER = (
    "python3 -c 'import os,time; t=os.urandom(8).hex(); open(\"/tmp/ram-pid\",\"w\").write(str(os.getpid())); "
    "open(\"/dev/shm/token\",\"w\").write(t); time.sleep(100000)' >/dev/null 2>&1 &"
)


def start_ram_state(sbx: Sandbox) -> tuple[str, str]:
    sbx.commands.run(RAM_SERVER)
    wait_for(lambda: sbx.files.exists("/dev/shm/token"), 60, what="RAM state written")
    pid = sbx.commands.run("cat /tmp/ram-pid").stdout.strip()
    token = sbx.commands.run("cat /dev/shm/token").stdout.strip()
    sbx.files.write("/home/user/on-disk.txt", "disk state")
    sbx.commands.run("sync")
    return pid, token


def process_alive(sbx: Sandbox, pid: str) -> bool:
    return sbx.commands.run(f"kill -0 {pid} 2>/dev/null && echo yes || echo no").stdout.strip() == "yes"


def test_pause_and_connect_keep_ram_state(new_sandbox):
    sbx = new_sandbox(timeout=600)
    pid, token = start_ram_state(sbx)
    assert sbx.pause() is True
    assert sbx.get_info().state == SandboxState.PAUSED
    assert sbx.pause() is False  # already paused: 409 → False
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert resumed.sandbox_id == sbx.sandbox_id
    assert resumed.get_info().state == SandboxState.RUNNING
    assert process_alive(resumed, pid)
    assert resumed.commands.run("cat /dev/shm/token").stdout.strip() == token
    # A second connect to the running sandbox keeps it running.
    again = Sandbox.connect(sbx.sandbox_id, timeout=30)
    assert again.get_info().end_at >= resumed.get_info().end_at


def test_filesystem_pause_keeps_only_the_disk(new_sandbox):
    sbx = new_sandbox(timeout=600)
    pid, _ = start_ram_state(sbx)
    assert sbx.pause(mode="filesystem") is True
    info = Sandbox.get_info(sbx.sandbox_id)
    assert info.state == SandboxState.PAUSED
    resumed = Sandbox.connect(sbx.sandbox_id)
    assert resumed.files.read("/home/user/on-disk.txt") == "disk state"
    assert not resumed.files.exists("/dev/shm/token")


def test_reboot_resume(new_sandbox):
    sbx = new_sandbox(timeout=600)
    pid, _ = start_ram_state(sbx)
    sbx.pause()
    resumed = Sandbox.connect(sbx.sandbox_id, on_resume="reboot")
    assert resumed.files.read("/home/user/on-disk.txt") == "disk state"
    assert not resumed.files.exists("/dev/shm/token")


def test_auto_pause_then_resume(new_sandbox):
    # Long enough for the setup below on a loaded machine: a pause mid-setup cuts its calls.
    sbx = new_sandbox(timeout=20, lifecycle={"on_timeout": "pause"})
    pid, token = start_ram_state(sbx)
    assert sbx.get_info().lifecycle["on_timeout"] == "pause"
    wait_for(
        lambda: Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED,
        180,
        interval=1,
        what="auto-pause",
    )
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=300)
    assert process_alive(resumed, pid)
    assert resumed.commands.run("cat /dev/shm/token").stdout.strip() == token


def test_auto_resume_by_traffic(new_sandbox, vmon):
    sbx = new_sandbox(timeout=20, lifecycle={"on_timeout": "pause", "auto_resume": True})
    pid, token = start_ram_state(sbx)
    info = sbx.get_info()
    assert info.lifecycle["auto_resume"] is True
    wait_for(
        lambda: Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED,
        180,
        interval=1,
        what="auto-pause",
    )
    # Traffic through the proxy (the SDK's own envd call) resumes it.
    assert sbx.commands.run("cat /dev/shm/token").stdout.strip() == token
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.RUNNING
    assert process_alive(sbx, pid)


def test_paused_without_auto_resume_stays_paused(new_sandbox, vmon):
    sbx = new_sandbox(timeout=600)
    sbx.pause()
    with httpx.Client(base_url=vmon.sandbox_url, timeout=60) as c:
        r = c.get("/health", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"})
    assert r.status_code == 502
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED


def test_fork_children_share_then_diverge(new_sandbox, sandboxes):
    parent = new_sandbox(timeout=600, metadata={"role": "parent"})
    pid, token = start_ram_state(parent)
    children = parent.fork(count=2, timeout=600)
    assert len(children) == 2
    for c in children:
        assert not isinstance(c, Exception), c
        sandboxes.append(c)
    ids = {c.sandbox_id for c in children}
    assert parent.sandbox_id not in ids and len(ids) == 2
    assert parent.get_info().state == SandboxState.RUNNING
    for c in children:
        assert c.files.read("/home/user/on-disk.txt") == "disk state"
        assert c.commands.run("cat /dev/shm/token").stdout.strip() == token
        assert process_alive(c, pid)
        assert c.get_info().metadata.get("role") == "parent"
    children[0].files.write("/home/user/on-disk.txt", "child 0")
    assert children[1].files.read("/home/user/on-disk.txt") == "disk state"
    assert parent.files.read("/home/user/on-disk.txt") == "disk state"
    parent.files.write("/home/user/parent-only.txt", "p")
    assert not children[0].files.exists("/home/user/parent-only.txt")


def test_a_paused_sandbox_forks_and_stays_paused(new_sandbox, sandboxes):
    # vmon only: E2B answers a fork of a paused sandbox with 409.
    parent = new_sandbox(timeout=600)
    pid, token = start_ram_state(parent)
    assert parent.pause()
    children = parent.fork(count=1, timeout=600)
    assert len(children) == 1 and not isinstance(children[0], Exception), children
    child = children[0]
    sandboxes.append(child)
    # The child starts from the paused state: memory (the process and its token) and disk.
    assert child.commands.run("cat /dev/shm/token").stdout.strip() == token
    assert process_alive(child, pid)
    assert child.files.read("/home/user/on-disk.txt") == "disk state"
    assert Sandbox.get_info(parent.sandbox_id).state == SandboxState.PAUSED
    child.kill()
    # The source resumes from its own, untouched pause.
    resumed = Sandbox.connect(parent.sandbox_id, timeout=600)
    assert resumed.commands.run("cat /dev/shm/token").stdout.strip() == token
    assert process_alive(resumed, pid)


def test_snapshot_outlives_its_source(new_sandbox):
    src = new_sandbox(timeout=600)
    src.files.write("/home/user/snap.txt", "from the snapshot")
    src.commands.run("sync")
    name = f"e2e-snap-{os.urandom(3).hex()}:v1"
    info = src.create_snapshot(name)
    assert info.snapshot_id.endswith(name)
    assert info.names and info.names[0].endswith(name)
    # The source keeps running.
    assert src.get_info().state == SandboxState.RUNNING
    listed = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=src.sandbox_id).next_items()]
    assert info.snapshot_id in listed
    src.kill()

    clone = new_sandbox(info.snapshot_id)
    assert clone.files.read("/home/user/snap.txt") == "from the snapshot"

    assert Sandbox.delete_snapshot(info.snapshot_id) is True
    assert Sandbox.delete_snapshot(info.snapshot_id) is False
    with pytest.raises(Exception):
        Sandbox.create(info.snapshot_id)
