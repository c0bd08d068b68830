"""Volumes with the official SDK against `vmon up`: the content API (`E2B_VOLUME_API_URL`, which
`vmon up` prints), `Sandbox.create(volume_mounts=...)` into real guests over virtio-fs,
sharing between sandboxes at once and over time, pause/resume, destroy, and who may touch
what. Token expiry is `crates/api/tests/volumes.rs`'s (it needs a token minted in the past).
"""

from __future__ import annotations

import uuid

import pytest
from e2b import Sandbox, SandboxState, Volume
from e2b.exceptions import (
    AuthenticationException,
    VolumeException,
    VolumeNotFoundException,
    VolumePathNotFoundException,
)


def _name() -> str:
    return f"vol-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def volumes(vmon):
    """Destroys what a test created, even when it fails."""
    made: list[Volume] = []

    def make(name: str | None = None, **opts) -> Volume:
        vol = Volume.create(name or _name(), **opts)
        made.append((vol, opts))
        return vol

    yield make
    for vol, opts in made:
        try:
            Volume.destroy(vol.volume_id, **opts)
        except Exception:
            pass


def test_content_written_before_shows_in_a_mount_and_guest_writes_outlive_the_sandbox(new_sandbox, volumes):
    vol = volumes()
    vol.write_file("/hello.txt", "from the content api")
    vol.make_dir("/nested/dir", force=True)
    vol.write_file("/nested/dir/bytes.bin", bytes(range(256)))

    a = new_sandbox(volume_mounts={"/mnt/data": vol})
    assert a.commands.run("cat /mnt/data/hello.txt").stdout == "from the content api"
    assert a.commands.run("sha256sum < /mnt/data/nested/dir/bytes.bin").stdout.split()[0] == (
        "40aff2e9d2d8922e47afd4648e6967497158785fbd1da870e7110266bf944880"
    )
    a.commands.run("echo from sandbox A > /mnt/data/a.txt && mkdir -p /mnt/data/made/in/a")
    # A write is visible to the content plane when the guest's call has returned.
    assert vol.read_file("/a.txt") == "from sandbox A\n"
    assert vol.get_info("/made/in/a").type.value == "directory"
    info = a.get_info()
    assert info.volume_mounts == [{"name": vol.name, "path": "/mnt/data"}]
    a.kill()

    # Mounted by name this time, at another path, in a new sandbox.
    b = new_sandbox(volume_mounts={"/data": vol.name})
    out = b.commands.run("cat /data/hello.txt /data/a.txt").stdout
    assert out == "from the content apifrom sandbox A\n"
    b.commands.run("echo from B >> /data/a.txt")
    assert vol.read_file("/a.txt") == "from sandbox A\nfrom B\n"
    names = sorted(e.name for e in vol.list("/"))
    assert names == ["a.txt", "hello.txt", "made", "nested"]


def test_two_sandboxes_mounting_at_once_see_each_others_writes(new_sandbox, volumes):
    vol = volumes()
    a = new_sandbox(volume_mounts={"/shared": vol})
    b = new_sandbox(volume_mounts={"/shared": vol})
    a.commands.run("echo one > /shared/log")
    assert b.commands.run("cat /shared/log").stdout == "one\n"
    b.commands.run("echo two >> /shared/log")
    assert a.commands.run("cat /shared/log").stdout == "one\ntwo\n"
    b.commands.run("rm /shared/log")
    assert a.commands.run("test -e /shared/log && echo present || echo gone").stdout == "gone\n"
    assert not vol.exists("/log")


def test_pause_and_resume_keep_the_mount_and_its_files(new_sandbox, volumes):
    vol = volumes()
    sbx = new_sandbox(volume_mounts={"/mnt/v": vol}, timeout=600)
    sbx.commands.run("echo before pause > /mnt/v/p.txt && echo on disk > /home/user/d.txt")
    assert sbx.pause() is True
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
    vol.write_file("/while-paused.txt", "written while paused")
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
    out = resumed.commands.run("cat /mnt/v/p.txt /mnt/v/while-paused.txt /home/user/d.txt").stdout
    assert out == "before pause\nwritten while pausedon disk\n"


def test_a_missing_volume_or_a_bad_path_is_a_400(vmon, volumes):
    from e2b.exceptions import SandboxException

    with pytest.raises(SandboxException, match="volume 'no-such-volume' not found"):
        Sandbox.create(volume_mounts={"/mnt/x": "no-such-volume"})
    vol = volumes()
    with pytest.raises(SandboxException, match="must be absolute"):
        Sandbox.create(volume_mounts={"relative": vol})


def test_destroyed_volumes_are_404_and_other_teams_never_see_them(vmon, volumes):
    vol = volumes()
    vol.write_file("/secret.txt", "team A's")
    assert vol.exists("/secret.txt")
    assert not vol.exists("/nope.txt")
    with pytest.raises(VolumePathNotFoundException):
        vol.read_file("/nope.txt")

    other_key = vmon.create_team(f"volumes-{uuid.uuid4().hex[:6]}")
    with pytest.raises(VolumeNotFoundException):
        Volume.connect(vol.volume_id, api_key=other_key)
    assert Volume.destroy(vol.volume_id, api_key=other_key) is False
    assert vol.volume_id not in [v.volume_id for v in Volume.list(api_key=other_key)]
    # The same name is free in the other team.
    theirs = volumes(vol.name, api_key=other_key)
    # Their token on our volume: for them it does not exist, on every content call.
    stolen = Volume(vol.volume_id, vol.name, token=theirs.token)
    with pytest.raises(VolumeNotFoundException):
        Volume.connect(vol.volume_id, api_key=other_key)
    for call in (
        lambda: stolen.list("/"),
        lambda: stolen.read_file("/secret.txt"),
        lambda: stolen.get_info("/secret.txt"),
        lambda: stolen.remove("/secret.txt"),
        lambda: stolen.write_file("/x.txt", "x"),
        lambda: stolen.make_dir("/d"),
        lambda: stolen.update_metadata("/secret.txt", mode=0o777),
    ):
        with pytest.raises((VolumePathNotFoundException, VolumeException)) as e:
            call()
        assert "404" in str(e.value) or isinstance(e.value, VolumePathNotFoundException)
    assert stolen.exists("/secret.txt") is False
    assert vol.read_file("/secret.txt") == "team A's"

    # A token of volume Y is refused on X, even within the team.
    y = volumes()
    crossed = Volume(vol.volume_id, vol.name, token=y.token)
    with pytest.raises(AuthenticationException):
        crossed.list("/")

    assert Volume.destroy(vol.volume_id) is True
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(vol.volume_id)
    assert Volume.destroy(vol.volume_id) is False
    with pytest.raises((VolumeNotFoundException, VolumePathNotFoundException, VolumeException)):
        vol.read_file("/secret.txt")


def test_the_sdk_file_api_round_trips(volumes):
    vol = volumes()
    stat = vol.write_file("/f.txt", "abc", mode=0o640)
    assert (stat.name, stat.size, stat.mode, stat.type.value) == ("f.txt", 3, 0o640, "file")
    assert vol.read_file("/f.txt", format="bytes") == b"abc"
    assert b"".join(vol.read_file("/f.txt", format="stream")) == b"abc"
    with pytest.raises(VolumeException, match="409"):
        vol.write_file("/f.txt", "again")
    vol.write_file("/f.txt", "again", force=True)
    assert vol.read_file("/f.txt") == "again"
    changed = vol.update_metadata("/f.txt", mode=0o600, uid=1000, gid=1000)
    assert (changed.mode, changed.uid, changed.gid) == (0o600, 1000, 1000)
    vol.make_dir("/a/b/c", force=True)
    deep = [e.path for e in vol.list("/", depth=3)]
    assert deep == ["/a", "/a/b", "/a/b/c", "/f.txt"]
    vol.remove("/a")
    assert [e.path for e in vol.list("/")] == ["/f.txt"]
    again = Volume.connect(vol.volume_id)
    assert again.token and again.name == vol.name
    assert again.read_file("/f.txt") == "again"
    assert vol.name in [v.name for v in Volume.list()]
