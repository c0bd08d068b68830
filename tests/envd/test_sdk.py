"""The official Python SDK (e2b 2.63.0) driving envd directly."""

import os
import threading
import time

import pytest
from e2b import CommandExitException, FileType, PtySize
from e2b.exceptions import SandboxException
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

from conftest import TEST_USER


def test_run_foreground(sbx):
    r = sbx.commands.run("echo out; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo partial; exit 3")
    assert e.value.exit_code == 3
    assert e.value.stdout == "partial\n"


def test_envs_cwd_user(sbx):
    r = sbx.commands.run("echo $FOO; pwd; whoami; echo $HOME", envs={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout == f"bar\n/tmp\n{TEST_USER}\n/home/{TEST_USER}\n"
    r = sbx.commands.run("whoami; pwd", user="root")
    assert r.stdout == "root\n/root\n"


def test_output_streams_while_running(sbx):
    seen = []
    t0 = time.monotonic()
    sbx.commands.run("echo first; sleep 1.5; echo second", on_stdout=lambda s: seen.append((time.monotonic() - t0, s)))
    assert [s for _, s in seen] == ["first\n", "second\n"]
    assert seen[0][0] < 1.0, f"first chunk arrived only after {seen[0][0]:.2f}s"


def test_background_list_kill(sbx):
    h = sbx.commands.run("sleep 60", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert h.kill() is True
    with pytest.raises(CommandExitException) as e:
        h.wait()
    assert e.value.exit_code == -1
    assert sbx.commands.kill(h.pid) is False


def test_stdin(sbx):
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello\n")
    h.send_stdin("again\n")
    sbx.commands.close_stdin(h.pid)
    r = h.wait()
    assert r.stdout == "hello\nagain\n"


def test_connect_to_running_process(sbx):
    h = sbx.commands.run("echo early; sleep 0.5; echo late; sleep 60", background=True)
    time.sleep(1.0)
    h.disconnect()
    again = sbx.commands.connect(h.pid)
    assert again.pid == h.pid
    got = []

    def reader():
        try:
            again.wait(on_stdout=got.append)
        except CommandExitException:
            pass

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.5)
    assert sbx.commands.kill(h.pid)
    t.join(10)
    assert "".join(got) == "early\nlate\n"


def test_timeout_kills(sbx):
    with pytest.raises(Exception):
        sbx.commands.run("sleep 30", timeout=1)
    time.sleep(0.3)
    assert not [p for p in sbx.commands.list() if "sleep 30" in " ".join(p.args)]


def test_files_roundtrip(sbx, user_dir):
    info = sbx.files.write(f"{user_dir}/a.txt", "hello")
    assert info.path == f"{user_dir}/a.txt" and info.name == "a.txt"
    assert sbx.files.read(f"{user_dir}/a.txt") == "hello"
    sbx.files.write(f"{user_dir}/b.bin", b"\x00\x01\x02")
    assert bytes(sbx.files.read(f"{user_dir}/b.bin", format="bytes")) == b"\x00\x01\x02"
    written = sbx.files.write_files([
        {"path": f"{user_dir}/m/one.txt", "data": "1"},
        {"path": f"{user_dir}/m/two.txt", "data": "2"},
    ])
    assert sorted(w.name for w in written) == ["one.txt", "two.txt"]
    entries = sbx.files.list(user_dir)
    assert {(e.name, e.type) for e in entries} == {("a.txt", FileType.FILE), ("b.bin", FileType.FILE), ("m", FileType.DIR)}
    deep = sbx.files.list(user_dir, depth=2)
    assert f"{user_dir}/m/two.txt" in [e.path for e in deep]
    assert sbx.files.exists(f"{user_dir}/a.txt") and not sbx.files.exists(f"{user_dir}/nope")
    info = sbx.files.get_info(f"{user_dir}/a.txt")
    assert (info.size, info.owner, info.permissions) == (5, TEST_USER, "-rw-r--r--")
    assert sbx.files.make_dir(f"{user_dir}/d") is True
    assert sbx.files.make_dir(f"{user_dir}/d") is False
    moved = sbx.files.rename(f"{user_dir}/a.txt", f"{user_dir}/d/a2.txt")
    assert moved.path == f"{user_dir}/d/a2.txt"
    sbx.files.remove(f"{user_dir}/d")
    assert not sbx.files.exists(f"{user_dir}/d")
    sbx.files.write(f"{user_dir}/z.txt", "zipped " * 100, gzip=True)
    assert sbx.files.read(f"{user_dir}/z.txt", gzip=True) == "zipped " * 100
    sbx.files.write(f"{user_dir}/meta.txt", "x", metadata={"team": "infra"})
    assert sbx.files.get_info(f"{user_dir}/meta.txt").metadata == {"team": "infra"}
    with pytest.raises(Exception):
        sbx.files.read(f"{user_dir}/missing.txt")


def test_files_respect_user_permissions(sbx, tmp_path):
    secret = "/tmp/envd-sdk-secret-%d" % os.getpid()
    with open(secret, "w") as f:
        f.write("root only")
    os.chmod(secret, 0o600)
    try:
        with pytest.raises(SandboxException):
            sbx.files.read(secret)
        assert sbx.files.read(secret, user="root") == "root only"
        r = sbx.commands.run(f"cat {secret} || echo denied")
        assert "denied" in r.stdout
    finally:
        os.remove(secret)


def test_watch_dir(sbx, user_dir):
    handle = sbx.files.watch_dir(user_dir)
    try:
        sbx.files.write(f"{user_dir}/w.txt", "1")
        sbx.files.rename(f"{user_dir}/w.txt", f"{user_dir}/w2.txt")
        sbx.files.remove(f"{user_dir}/w2.txt")
        events = []
        deadline = time.time() + 5
        while time.time() < deadline and FilesystemEventType.REMOVE not in [e.type for e in events]:
            events += handle.get_new_events()
            time.sleep(0.1)
        kinds = [(e.type, e.name) for e in events]
        assert (FilesystemEventType.CREATE, "w.txt") in kinds
        assert (FilesystemEventType.WRITE, "w.txt") in kinds
        assert (FilesystemEventType.RENAME, "w.txt") in kinds
        assert (FilesystemEventType.REMOVE, "w2.txt") in kinds
    finally:
        handle.stop()


def test_pty(sbx):
    h = sbx.pty.create(PtySize(rows=24, cols=80), envs={"PS1": "$ "})
    try:
        out = bytearray()

        def until(needle: bytes, timeout: float = 10):
            deadline = time.time() + timeout
            for _, _, pty in h:
                if pty:
                    out.extend(pty)
                if needle in out or time.time() > deadline:
                    return needle in out
            return needle in out

        sbx.pty.send_stdin(h.pid, b"stty size; echo mark$((1+1))\n")
        assert until(b"mark2"), out
        assert b"24 80" in out
        sbx.pty.resize(h.pid, PtySize(rows=40, cols=120))
        sbx.pty.send_stdin(h.pid, b"stty size\n")
        assert until(b"40 120"), out
    finally:
        sbx.pty.kill(h.pid)
