"""The api fuzzed from its own OpenAPI document (`GET /openapi.json`) with schemathesis, against
`vmon up`, on a bounded budget: no 5xx, every status, content type, header and body as the
document says, every error `{code, message}` (openapi_checks.py), and operations that take a
credential refuse requests without one.

Operations that start a VM (`POST /sandboxes`, `POST /v2/sandboxes`) are left out: a generated
body naming a real template would start a QEMU guest under TCG that outlives the run. Every other
operation is fuzzed, those on a sandbox with generated ids (they answer 404 quickly).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
# Per-operation examples and the whole run's time; both well inside the CI job's budget.
MAX_EXAMPLES = int(os.environ.get("VMON_OPENAPI_MAX_EXAMPLES", "25"))
MAX_TIME = int(os.environ.get("VMON_OPENAPI_MAX_TIME", "90"))
# Operations that start a VM: see the module docstring.
EXCLUDED = ["create_legacy", "create_v2"]


def _admin_token(vmon) -> str | None:
    data_dir = vmon.env.get("VMON_DATA_DIR")
    if not data_dir:
        return None
    path = Path(data_dir) / "admin-token"
    return path.read_text().strip() if path.exists() else None


def test_the_document_is_served_and_names_every_credential(vmon):
    doc = httpx.get(f"{vmon.api_url}/openapi.json", timeout=30).json()
    assert doc["openapi"].startswith("3.1")
    schemes = doc["components"]["securitySchemes"]
    assert schemes["ApiKeyAuth"]["name"] == "X-API-Key"
    assert schemes["AdminToken"]["name"] == "X-Admin-Token"
    for path, method in [("/v2/sandboxes", "post"), ("/sandboxes/{sandboxID}/pause", "post"),
                         ("/admin/teams", "post"), ("/events/webhooks", "post"),
                         ("/sandboxes/{sandboxID}/metrics", "get")]:
        assert method in doc["paths"][path], (method, path)
    # The exclusions below name real operations (a renamed handler must not un-exclude one).
    ids = {op["operationId"] for item in doc["paths"].values() for op in item.values()}
    assert set(EXCLUDED) <= ids, set(EXCLUDED) - ids
    page = httpx.get(f"{vmon.api_url}/docs", timeout=30)
    assert page.status_code == 200 and "/docs/docs.js" in page.text


def test_schemathesis_finds_nothing(vmon, tmp_path):
    st = Path(sys.executable).parent / "st"
    cmd = [
        str(st), "run", f"{vmon.api_url}/openapi.json",
        "--url", vmon.api_url,
        "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
                    "response_headers_conformance,response_schema_conformance,ignored_auth,"
                    "negative_data_rejection,unsupported_method",
        "--max-examples", str(MAX_EXAMPLES),
        "--max-time", str(MAX_TIME),
        "--phases", "examples,coverage,fuzzing",
        "--request-timeout", "20",
        # One worker: under two, hypothesis describing its filters in threads trips CPython
        # 3.11's ast ("AST constructor recursion depth mismatch") and the run dies.
        "--workers", "1",
        "--seed", os.environ.get("VMON_OPENAPI_SEED", "17"),
        "--no-color",
        "-H", f"X-API-Key: {vmon.api_key}",
    ]
    token = _admin_token(vmon)
    if token:
        cmd += ["-H", f"X-Admin-Token: {token}"]
    for operation_id in EXCLUDED:
        cmd += ["--exclude-operation-id", operation_id]
    env = dict(os.environ, SCHEMATHESIS_HOOKS="openapi_checks",
               PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=MAX_TIME + 120)
    print(out.stdout[-20000:])
    print(out.stderr[-5000:], file=sys.stderr)
    assert out.returncode == 0, f"schemathesis found problems (exit {out.returncode}):\n{out.stdout[-8000:]}"
