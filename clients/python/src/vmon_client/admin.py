"""vmon's operator routes (`/admin`, `X-Admin-Token`): teams, API keys, every team's
sandboxes. The token is `<data dir>/admin-token` of the server (`vmon up` writes it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional

import httpx

from ._http import raise_for


class Admin:
    def __init__(
        self,
        api_url: Optional[str] = None,
        admin_token: Optional[str] = None,
        data_dir: Optional[str] = None,
        request_timeout: float = 60.0,
    ):
        self.api_url = (api_url or os.environ.get("E2B_API_URL") or "http://127.0.0.1:3000").rstrip("/")
        if admin_token is None:
            admin_token = os.environ.get("VMON_ADMIN_TOKEN")
        if admin_token is None:
            d = Path(data_dir or os.environ.get("VMON_DATA_DIR", "/var/lib/vmon"))
            admin_token = (d / "admin-token").read_text().strip()
        self._token = admin_token
        self._timeout = request_timeout

    def _call(self, method: str, path: str, json: Optional[Any] = None) -> httpx.Response:
        with httpx.Client(base_url=self.api_url, timeout=self._timeout) as c:
            r = c.request(method, path, json=json, headers={"X-Admin-Token": self._token})
        raise_for(r)
        return r

    def create_team(self, name: str, slug: Optional[str] = None, limits: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
        """A team and its first API key: `{"team": {...}, "apiKey": "e2b_...", "key": {...}}`
        (the key's only appearance)."""
        body: Dict[str, Any] = {"name": name}
        if slug is not None:
            body["slug"] = slug
        if limits is not None:
            body["limits"] = limits
        return self._call("POST", "/admin/teams", body).json()

    def list_teams(self) -> List[Dict[str, Any]]:
        return self._call("GET", "/admin/teams").json()

    def create_key(self, team_id: str) -> Dict[str, Any]:
        return self._call("POST", f"/admin/teams/{team_id}/keys").json()

    def list_keys(self, team_id: Optional[str] = None) -> List[Dict[str, Any]]:
        path = "/admin/keys" + (f"?team={team_id}" if team_id else "")
        return self._call("GET", path).json()

    def revoke_key(self, key_id: str) -> None:
        self._call("DELETE", f"/admin/keys/{key_id}")

    def list_sandboxes(self) -> List[Dict[str, Any]]:
        return self._call("GET", "/admin/sandboxes").json()

    def kill_sandbox(self, sandbox_id: str) -> None:
        self._call("DELETE", f"/admin/sandboxes/{sandbox_id}")
