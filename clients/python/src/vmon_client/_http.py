"""The few REST calls the official SDK has no method for, made with its own settings."""

from __future__ import annotations

from typing import Any, Optional

import httpx
from e2b import ConnectionConfig
from e2b.exceptions import (
    AuthenticationException,
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
)


def raise_for(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    try:
        message = r.json().get("message", r.text)
    except ValueError:
        message = r.text
    if r.status_code == 400:
        raise InvalidArgumentException(message)
    if r.status_code in (401, 403):
        raise AuthenticationException(message)
    if r.status_code == 404:
        raise NotFoundException(message)
    raise SandboxException(f"{r.status_code}: {message}")


def api_call(
    config: ConnectionConfig,
    method: str,
    path: str,
    json: Optional[Any] = None,
    headers: Optional[dict] = None,
) -> httpx.Response:
    h = {**(config.headers or {}), **(headers or {})}
    if config.api_key and "X-Admin-Token" not in h:
        h["X-API-Key"] = config.api_key
    with httpx.Client(base_url=config.api_url, timeout=config.request_timeout or 60) as c:
        r = c.request(method, path, json=json, headers=h)
    raise_for(r)
    return r
