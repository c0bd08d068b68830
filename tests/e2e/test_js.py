"""The JS SDK (npm `e2b`, pinned in js/package.json) against the same server."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

JS = Path(__file__).parent / "js"


def test_js_sdk_smoke(vmon):
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node/npm not installed")
    if not (JS / "node_modules" / "e2b").exists():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=JS, check=True, timeout=600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_API_URL=vmon.api_url, E2B_SANDBOX_URL=vmon.sandbox_url, E2B_API_KEY=vmon.api_key)
    r = subprocess.run(["node", "smoke.mjs"], cwd=JS, env=env, capture_output=True, text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: kill" in r.stdout


def test_js_sdk_volumes_and_secrets(vmon):
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node/npm not installed")
    if not (JS / "node_modules" / "e2b").exists():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=JS, check=True, timeout=600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_API_URL=vmon.api_url, E2B_SANDBOX_URL=vmon.sandbox_url, E2B_API_KEY=vmon.api_key,
               E2B_VOLUME_API_URL=vmon.api_url)
    r = subprocess.run(["node", "volumes.mjs"], cwd=JS, env=env, capture_output=True, text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: done" in r.stdout
