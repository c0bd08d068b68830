"""Schemathesis hooks for test_openapi.py (loaded through SCHEMATHESIS_HOOKS): every error
vmon answers is E2B's `{code, message}`, its code the response's status (a string on the
volume content plane, as E2B's spec has it)."""

from __future__ import annotations

import schemathesis


@schemathesis.check
def error_is_code_and_message(ctx, response, case):
    if response.status_code < 400:
        return None
    try:
        body = response.json()
    except Exception as e:  # noqa: BLE001 - any parse failure is the finding
        raise AssertionError(
            f"{response.status_code} error body is not JSON: {response.content[:200]!r} ({e})"
        ) from None
    if not isinstance(body, dict) or not isinstance(body.get("message"), str) or "code" not in body:
        raise AssertionError(f"{response.status_code} error body is not {{code, message}}: {body!r}")
    if "/volumecontent/" in case.path:
        # E2B's volume content spec: the code is a string.
        if not isinstance(body["code"], str):
            raise AssertionError(f"a volume content error code must be a string: {body!r}")
        return None
    if body["code"] != response.status_code:
        raise AssertionError(f"error code {body['code']} differs from the status {response.status_code}")
    return None
