"""vmon's thin clients (`clients/python`, `clients/js`) on top of the official SDKs, against the
session's `vmon up`: idle policy on create, resume, health, fork of a paused sandbox, the
admin verbs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DATA_DIR, REPO

try:
    import vmon_client  # installed: pip install ./clients/python
except ImportError:  # a checkout: the package's source
    sys.path.insert(0, str(REPO / "clients" / "python" / "src"))
    import vmon_client

from e2b.exceptions import InvalidArgumentException

JS = Path(__file__).parent / "js"


def _admin(vmon) -> vmon_client.Admin:
    if os.environ.get("VMON_E2E_EXTERNAL") == "1":
        if not os.environ.get("VMON_DATA_DIR") and not os.environ.get("VMON_ADMIN_TOKEN"):
            pytest.skip("the admin verbs need the server's data dir (VMON_DATA_DIR)")
        return vmon_client.Admin(api_url=vmon.api_url)
    return vmon_client.Admin(api_url=vmon.api_url, data_dir=str(DATA_DIR))


def test_python_client(vmon):
    from vmon_client import IdlePolicy, Sandbox

    made: list = []
    try:
        sbx = Sandbox.create(timeout=300, idle=IdlePolicy(max_idle_seconds=120))
        made.append(sbx)
        assert isinstance(sbx, Sandbox)
        h = sbx.get_health()
        assert h.idle == IdlePolicy(120, True, 180), h
        assert (h.state, h.state_location, h.resume_generation, h.kernel_state_lost) == (
            "running", "running", 0, False)
        with pytest.raises(InvalidArgumentException):
            made.append(Sandbox.create(timeout=300, idle=IdlePolicy(max_idle_seconds=30)))
        with pytest.raises(InvalidArgumentException):
            made.append(Sandbox.create(timeout=100, idle=IdlePolicy(max_idle_seconds=100)))

        sbx.files.write("/home/user/mark.txt", "from the parent")
        sbx.commands.run("sync")
        assert sbx.pause() is True
        # vmon forks a paused sandbox; the source stays paused.
        children = sbx.fork(count=1, timeout=300)
        assert len(children) == 1 and not isinstance(children[0], Exception), children
        child = children[0]
        made.append(child)
        assert child.files.read("/home/user/mark.txt") == "from the parent"
        assert Sandbox.get_health(sbx.sandbox_id).state == "paused"

        again = sbx.resume(timeout=300)
        assert again is sbx
        h = Sandbox.get_health(sbx.sandbox_id)
        assert h.state == "running" and h.resume_generation == 1, h
        assert h.last_resume and h.last_resume.kind in ("restore", "parked"), h
        assert h.last_resume.trigger == "connect"
        assert sbx.commands.run("cat /home/user/mark.txt").stdout == "from the parent"
        # The class form on a running sandbox keeps it running.
        assert Sandbox.resume(sbx.sandbox_id, timeout=300).sandbox_id == sbx.sandbox_id

        off = Sandbox.create(timeout=300, idle=None)
        made.append(off)
        assert off.get_health().idle is None

        admin = _admin(vmon)
        assert sbx.sandbox_id in {s["sandboxID"] for s in admin.list_sandboxes()}
        team = admin.create_team("client-py-team")
        tid = team["team"]["id"]
        assert team["apiKey"].startswith("e2b_")
        assert tid in {t["id"] for t in admin.list_teams()}
        second = admin.create_key(tid)
        keys = admin.list_keys(tid)
        assert {k["id"] for k in keys} >= {team["key"]["id"], second["key"]["id"]}
        admin.revoke_key(second["key"]["id"])
        revoked = {k["id"]: k["revoked"] for k in admin.list_keys(tid)}
        assert revoked[second["key"]["id"]] is True and revoked[team["key"]["id"]] is False
        # The new team's key works with the SDK.
        assert Sandbox.list(api_key=team["apiKey"]).next_items() == []
    finally:
        for s in made:
            try:
                s.kill()
            except Exception:
                pass


def test_js_client(vmon):
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.fail("node and npm are needed (scripts/install-test-deps.sh installs them)")
    if not (JS / "node_modules" / "e2b").exists():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=JS, check=True, timeout=600)
    # The client is used from the checkout: a link in the test package's node_modules, and
    # --preserve-symlinks so that its `import 'e2b'` resolves to the SDK installed there.
    link = JS / "node_modules" / "vmon-client"
    if not link.is_symlink():
        if link.exists():
            shutil.rmtree(link)
        link.symlink_to(REPO / "clients" / "js")
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_API_URL=vmon.api_url, E2B_SANDBOX_URL=vmon.sandbox_url, E2B_API_KEY=vmon.api_key)
    if os.environ.get("VMON_E2E_EXTERNAL") != "1":
        env["VMON_DATA_DIR"] = str(DATA_DIR)
    r = subprocess.run(["node", "--preserve-symlinks", "vmon_client.mjs"], cwd=JS, env=env,
                       capture_output=True, text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: all" in r.stdout
