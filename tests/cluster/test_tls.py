"""TLS inside the cluster (`VMON_CLUSTER_TLS=1`): node RPC, the api replicas (and so the admin
token the proxy presents them) and PostgreSQL speak only TLS, with certificates of the
cluster's own CA, and everything else keeps working through them."""

from __future__ import annotations

import base64
import http.client
import os
import socket
import ssl
import subprocess

import certifi
import httpx
import pytest
from e2b import Sandbox

from conftest import DIR, PORT, TLS

pytestmark = pytest.mark.skipif(not TLS, reason="the cluster runs without TLS (VMON_CLUSTER_TEST_TLS=0)")

PSQL = "/usr/lib/postgresql/15/bin/psql"


def _handshake(port: int, ctx: ssl.SSLContext) -> dict:
    """The peer certificate of a verified TLS handshake with 127.0.0.1:port."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            return s.getpeercert()


def _plain_request(port: int, method: str, path: str, headers: dict[str, str]) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body="{}" if method == "POST" else None, headers=headers)
        return conn.getresponse().status
    finally:
        conn.close()


def _public_cas_only() -> ssl.SSLContext:
    """Verifies against the public CAs only (certifi), not the bundle SSL_CERT_FILE names."""
    return ssl.create_default_context(cafile=certifi.where())


def _assert_issued_by_the_cluster_ca(cert: dict) -> None:
    issuer = dict(kv for rdn in cert["issuer"] for kv in rdn)
    assert issuer.get("commonName") == "vmon local CA", cert
    assert ("IP Address", "127.0.0.1") in cert["subjectAltName"], cert


def test_node_rpc_speaks_only_tls_with_the_cluster_certificate(cluster):
    for i in (1, 2):
        port = cluster.node_port(i)
        # Plain HTTP, token and all, gets no answer: the node only speaks TLS.
        with pytest.raises((OSError, http.client.HTTPException)):
            _plain_request(port, "POST", "/v1/list_running", {"authorization": f"Bearer {cluster.token}"})
        _assert_issued_by_the_cluster_ca(_handshake(port, cluster.ssl_context()))
        with pytest.raises(ssl.SSLCertVerificationError):
            _handshake(port, _public_cas_only())
        # Over TLS with the token the node answers.
        assert isinstance(cluster.node_rpc(i, "list_running"), list)
    # Each node advertises its https URL in the registry, which the replicas dial.
    got = cluster.etcd(1, "/v3/kv/range", {"key": base64.b64encode(b"\0").decode(), "range_end": base64.b64encode(b"\0").decode()})
    values = [base64.b64decode(kv.get("value", "")) for kv in got.get("kvs", [])]
    for i in (1, 2):
        want = f'"rpc_url":"https://127.0.0.1:{cluster.node_port(i)}"'.encode()
        assert any(want in v for v in values), f"node{i} does not advertise https"


def test_the_api_speaks_only_tls_and_the_sdk_and_proxy_work_through_it(cluster):
    assert cluster.api_a.startswith("https://") and cluster.api_b.startswith("https://")
    admin_token = (DIR / "api" / "admin-token").read_text().strip()
    for i in (1, 2):
        port = cluster.api_port(i)
        with pytest.raises((OSError, http.client.HTTPException)):
            _plain_request(port, "GET", "/admin/teams", {"x-admin-token": admin_token})
        _assert_issued_by_the_cluster_ca(_handshake(port, cluster.ssl_context()))
        with pytest.raises(ssl.SSLCertVerificationError):
            _handshake(port, _public_cas_only())
    # The admin token over https (verified with the CA the exports name).
    r = httpx.get(f"{cluster.api_b}/admin/teams", headers={"X-Admin-Token": admin_token}, timeout=30)
    assert r.status_code == 200, r.text
    # The SDK through the https api; its commands reach envd through the proxy, which asks the
    # api for the route over https with the admin token.
    sbx = Sandbox.create("base", timeout=120)
    try:
        assert sbx.commands.run("echo over-tls").stdout.strip() == "over-tls"
    finally:
        sbx.kill()


def _psql(host: str, sql: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PSQL, "-h", host, "-p", str(PORT + 40), "-U", "postgres", "-d", "postgres", "-Atc", sql],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_postgres_takes_only_tls_and_the_replicas_use_it(cluster):
    # Every TCP client of PostgreSQL (the api replicas) is on TLS.
    r = _psql(
        str(DIR / "pg"),
        "select s.ssl from pg_stat_activity a join pg_stat_ssl s using (pid) where a.client_addr is not null",
    )
    assert r.returncode == 0, r.stderr
    rows = r.stdout.split()
    assert rows and set(rows) == {"t"}, rows
    # Without TLS a client is turned away; verifying the server against the CA it gets in.
    plain = _psql("127.0.0.1", "select 1", PGSSLMODE="disable")
    assert plain.returncode != 0 and "no encryption" in plain.stderr, plain.stderr
    verified = _psql("127.0.0.1", "select 1", PGSSLMODE="verify-full", PGSSLROOTCERT=str(cluster.ca))
    assert verified.returncode == 0 and verified.stdout.strip() == "1", verified.stderr
