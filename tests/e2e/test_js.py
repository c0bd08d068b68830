"""The JS SDK (npm `e2b`) and the CLI (`@e2b/cli`), pinned in js/package.json, against the same
server."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest

JS = Path(__file__).parent / "js"


def _node_env(vmon) -> dict[str, str]:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.fail("node and npm are needed (scripts/install-test-deps.sh installs them)")
    if not all((JS / "node_modules" / m).exists() for m in ("e2b", "@e2b/cli", "@e2b/desktop")):
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=JS, check=True, timeout=600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_API_URL=vmon.api_url, E2B_SANDBOX_URL=vmon.sandbox_url, E2B_API_KEY=vmon.api_key)
    return env


def test_js_sdk_smoke(vmon):
    env = _node_env(vmon)
    r = subprocess.run(["node", "smoke.mjs"], cwd=JS, env=env, capture_output=True, text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: kill" in r.stdout


def test_js_template_build(vmon):
    env = _node_env(vmon)
    r = subprocess.run(["node", "template.mjs"], cwd=JS, env=env, capture_output=True, text=True, timeout=1200)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: the start command runs in the sandbox" in r.stdout


def test_cli_template_create_list_delete(vmon, tmp_path):
    env = _node_env(vmon)
    cli = str(JS / "node_modules" / ".bin" / "e2b")
    (tmp_path / "e2b.Dockerfile").write_text(
        "FROM e2bdev/base\nRUN echo cli-built > /home/user/cli.txt\nCOPY hello.txt /home/user/hello.txt\n"
    )
    (tmp_path / "hello.txt").write_text("hello from the cli\n")
    name = f"cli-{secrets.token_hex(4)}"

    def e2b(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
        return subprocess.run([cli, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=timeout)

    made = e2b("template", "create", name, timeout=1200)
    assert made.returncode == 0, made.stdout[-4000:] + made.stderr[-4000:]

    from e2b import Sandbox

    sbx = Sandbox.create(name, timeout=120)
    try:
        out = sbx.commands.run("cat /home/user/cli.txt /home/user/hello.txt").stdout
        assert out == "cli-built\nhello from the cli\n", out
    finally:
        sbx.kill()

    listed = e2b("template", "list", "-f", "json")
    assert listed.returncode == 0, listed.stderr
    names = {a for t in json.loads(listed.stdout) for a in t["aliases"]}
    assert name in names and "base" in names, names

    gone = e2b("template", "delete", name, "-y")
    assert gone.returncode == 0, gone.stdout + gone.stderr
    listed = e2b("template", "list", "-f", "json")
    assert name not in {a for t in json.loads(listed.stdout) for a in t["aliases"]}


def test_js_sdk_volumes_and_secrets(vmon):
    env = _node_env(vmon)
    env.update(E2B_VOLUME_API_URL=vmon.api_url)
    r = subprocess.run(["node", "volumes.mjs"], cwd=JS, env=env, capture_output=True, text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: done" in r.stdout
