"""Behaviour E2B's own SDK tests expect (docs/compatibility.md), checked with tests of our own
through the official SDK: a command stream to a killed sandbox ends, an overwrite clears stale
metadata, a watcher sees create, chmod and write for a new file, `started_after` is inclusive,
and the base image has `python`; the proxy's not-found answer and a write's missing directories
are as on E2B, and a signed upload takes a `file` part without a filename. A template build
keeps its files when a snapshot is deleted meanwhile (found running E2B's JS suite)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import httpx

from e2b import FilesystemEventType, Sandbox, SandboxQuery, Template

from conftest import wait_for


def test_a_command_stream_ends_when_its_sandbox_is_killed(new_sandbox):
    sbx = new_sandbox(timeout=300)
    outcome: dict[str, object] = {}

    def run():
        t0 = time.monotonic()
        try:
            sbx.commands.run("sleep 600", timeout=0, request_timeout=900)
            outcome["result"] = "returned"
        except Exception as e:  # the SDK raises; which exception is its business
            outcome["result"] = e
        outcome["secs"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_for(lambda: any("sleep 600" in " ".join([p.cmd, *p.args]) for p in sbx.commands.list()), 60,
             what="the command running")
    Sandbox.kill(sbx.sandbox_id)
    t.join(60)
    assert not t.is_alive(), "the command stream hung after the kill"
    assert isinstance(outcome.get("result"), Exception), outcome
    assert outcome["secs"] < 90, outcome


def test_an_overwrite_clears_stale_metadata(new_sandbox):
    sbx = new_sandbox()
    sbx.files.write("/home/user/md.txt", "first", metadata={"author": "mish"})
    assert sbx.files.get_info("/home/user/md.txt").metadata == {"author": "mish"}
    info = sbx.files.write("/home/user/md.txt", "second")
    assert not info.metadata
    assert sbx.files.get_info("/home/user/md.txt").metadata is None
    assert sbx.files.read("/home/user/md.txt") == "second"


def test_a_watcher_sees_create_chmod_write_for_a_written_file(new_sandbox):
    sbx = new_sandbox()
    sbx.files.make_dir("/home/user/watched")
    handle = sbx.files.watch_dir("/home/user/watched")
    try:
        sbx.files.write("/home/user/watched/new.txt", "content")
        events = wait_for(lambda: (e := handle.get_new_events()) and e, 30, what="events")
        types = [e.type for e in events if e.name == "new.txt"]
        assert types == [FilesystemEventType.CREATE, FilesystemEventType.CHMOD, FilesystemEventType.WRITE], types
    finally:
        handle.stop()


def test_started_after_includes_the_sandbox_that_started_then(new_sandbox):
    tag = f"compat-{time.monotonic_ns()}"
    sbx = new_sandbox(metadata={"tag": tag})
    started = sbx.get_info().started_at
    listed = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}, started_after=started)).next_items()
    assert sbx.sandbox_id in [s.sandbox_id for s in listed]
    later = Sandbox.list(
        query=SandboxQuery(metadata={"tag": tag}, started_after=started + timedelta(seconds=1))
    ).next_items()
    assert sbx.sandbox_id not in [s.sandbox_id for s in later]


def test_the_base_image_has_python(new_sandbox):
    sbx = new_sandbox()
    for cmd in ["python --version", "python3 --version"]:
        r = sbx.commands.run(cmd)
        assert (r.stdout + r.stderr).startswith("Python 3"), (cmd, r)


def test_the_proxy_answers_for_a_killed_sandbox_as_e2b_does(vmon, new_sandbox):
    """E2B's JS suite (`sandbox/host.test.ts`) compares the whole message: `The sandbox was not
    found`, with the id in `sandboxId` and the status in `code`."""
    sbx = new_sandbox()
    hdr = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "3000"}
    sbx.kill()
    r = httpx.get(f"{vmon.sandbox_url}/", headers=hdr, timeout=30)
    assert r.status_code == 502, r.text
    body = r.json()
    assert body["message"] == "The sandbox was not found", body
    assert body["sandboxId"] == sbx.sandbox_id and body["code"] == 502, body


def test_a_write_creates_missing_directories_for_the_user(new_sandbox):
    """E2B's JS suite (`files/write.test.ts`) writes `/0/...` as the default user: the missing
    directories are made and given to that user, as E2B's envd does."""
    sbx = new_sandbox()
    sbx.files.write("/compat-new/sub/f.txt", "made")
    assert sbx.files.read("/compat-new/sub/f.txt") == "made"
    owners = sbx.commands.run("stat -c %U /compat-new /compat-new/sub /compat-new/sub/f.txt").stdout.split()
    assert owners == ["user", "user", "user"], owners


def test_a_signed_upload_takes_a_file_part_without_a_filename(new_sandbox):
    """E2B's JS suite (`files/signing.test.ts`) uploads `FormData.append('file', 'text')`: a
    part named `file` with no filename, its destination in the `path` parameter."""
    sbx = new_sandbox(secure=True)
    url = sbx.upload_url("nameless.txt", use_signature_expiration=60)
    boundary = "compat-boundary"
    body = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\n"
        f"file content\r\n--{boundary}--\r\n"
    ).encode()
    r = httpx.post(url, content=body, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert [(e["name"], e["path"]) for e in r.json()] == [("nameless.txt", "/home/user/nameless.txt")], r.text
    assert sbx.files.read("/home/user/nameless.txt") == "file content"


def test_a_template_build_keeps_its_files_when_a_snapshot_is_deleted_meanwhile(new_sandbox):
    """Deleting a snapshot sweeps the node's unnamed artifacts. E2B's JS suite deletes
    snapshots while `vmon up` builds `code-interpreter-v1`; the build's VM (booted for the
    template, not a sandbox) lost its disk and RAM files to that sweep and the build failed
    (`artifact ram-….mem … is missing`). Here the delete comes while a template boots its base
    VM (a size no cached layer has, so the node boots one)."""
    src = new_sandbox()
    snap = src.create_snapshot()
    src.kill()
    deleted: list[bool] = []

    def on_logs(entry) -> None:
        if "Booting the base image" in entry.message and not deleted:
            deleted.append(Sandbox.delete_snapshot(snap.snapshot_id))

    name = f"compat-sweep-{time.monotonic_ns()}"
    t = Template().from_base_image().run_cmd("echo kept > /home/user/kept.txt")
    Template.build(t, name, cpu_count=1, memory_mb=768, skip_cache=True, on_build_logs=on_logs)
    assert deleted == [True], deleted
    sbx = new_sandbox(name)
    assert sbx.commands.run("cat /home/user/kept.txt").stdout == "kept\n"
