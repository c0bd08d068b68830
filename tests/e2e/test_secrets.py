"""Secrets with the official SDK against `vmon up`: CRUD by id and name, values never returned,
paging, team scoping. Injection at egress is `test_secrets_egress.py`.
"""

from __future__ import annotations

import json
import urllib.request
import uuid

import pytest
from e2b import Secret
from e2b.exceptions import SecretException, SecretNotFoundException

VALUE = "e2e-secret-value-never-returned"


def _name() -> str:
    return f"sec-e2e-{uuid.uuid4().hex[:10]}"


def test_secret_crud_never_returns_the_value(vmon):
    name = _name()
    info = Secret.create(name, VALUE, metadata={"env": "test"})
    try:
        assert info.secret_id.startswith("sec_")
        assert (info.name, info.version, info.metadata) == (name, 1, {"env": "test"})
        assert Secret.exists(name) and Secret.exists(info.secret_id)
        got = Secret.get_info(name.upper())
        assert got.secret_id == info.secret_id
        updated = Secret.update(info.secret_id, "new-value")
        assert (updated.version, updated.metadata) == (2, {"env": "test"})
        with pytest.raises(SecretException, match="409"):
            Secret.create(name, "again")

        # No response carries the value: read the raw JSON the SDK parses.
        req = urllib.request.Request(
            f"{vmon.api_url}/secrets/{info.secret_id}", headers={"X-API-Key": vmon.api_key}
        )
        with urllib.request.urlopen(req) as r:
            raw = r.read().decode()
            assert r.headers["Cache-Control"] == "no-store"
        assert VALUE not in raw and "new-value" not in raw
        assert set(json.loads(raw)) == {"secretID", "name", "currentVersion", "metadata", "createdAt", "updatedAt"}

        other = vmon.create_team(f"secrets-{uuid.uuid4().hex[:6]}")
        assert Secret.exists(name, api_key=other) is False
        with pytest.raises(SecretNotFoundException):
            Secret.get_info(info.secret_id, api_key=other)
        assert Secret.destroy(info.secret_id, api_key=other) is False
    finally:
        assert Secret.destroy(name) is True
    assert Secret.exists(name) is False
    assert Secret.destroy(name) is False


def test_secret_list_pages(vmon):
    names = sorted(_name() for _ in range(3))
    made = [Secret.create(n, "v") for n in names]
    try:
        seen = []
        pages = Secret.list(limit=2)
        while pages.has_next:
            seen.extend(s.name for s in pages.next_items())
        # Oldest first; two made in the same millisecond order by id: compare as a set.
        mine = [n for n in seen if n in names]
        assert sorted(mine) == names and len(mine) == len(set(mine))
    finally:
        for s in made:
            Secret.destroy(s.secret_id)
