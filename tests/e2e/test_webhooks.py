"""Signed, ordered lifecycle webhooks for a real sandbox: a local receiver registered through
`POST /events/webhooks` gets create, set_timeout, pause, resume, snapshot and kill, each
signed as the seed's verify() checks it."""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.server
import json
import ssl
import threading
from pathlib import Path

import httpx
from e2b import Sandbox

from conftest import wait_for

SECRET = "e2e-webhook-secret"
LIFECYCLE = [
    "sandbox.lifecycle.created",
    "sandbox.lifecycle.updated",
    "sandbox.lifecycle.paused",
    "sandbox.lifecycle.resumed",
    "sandbox.lifecycle.checkpointed",
    "sandbox.lifecycle.killed",
]


def verify(secret: str, body: bytes, signature: str) -> bool:
    """The seed's receiver check, verbatim in substance."""
    expected = base64.b64encode(hashlib.sha256(secret.encode() + body).digest()).decode().rstrip("=")
    return hmac.compare_digest(expected, signature)


class _Receiver(http.server.BaseHTTPRequestHandler):
    received: list[tuple[dict[str, str], bytes]] = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        self.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_lifecycle_webhooks_arrive_signed_and_in_order(vmon):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    headers = {"X-API-Key": vmon.api_key}
    api = httpx.Client(base_url=vmon.api_url, headers=headers, timeout=120)
    hook = api.post(
        "/events/webhooks",
        json={
            "name": "e2e",
            "url": f"http://127.0.0.1:{server.server_address[1]}/hook",
            "signatureSecret": SECRET,
            "events": LIFECYCLE,
        },
    )
    assert hook.status_code == 201, hook.text
    assert SECRET not in hook.text
    hook_id = hook.json()["id"]
    snapshot_id = None
    try:
        sbx = Sandbox.create(timeout=600)
        sandbox_id = sbx.sandbox_id
        sbx.set_timeout(300)
        assert sbx.pause()
        sbx = Sandbox.connect(sandbox_id, timeout=300)
        snapshot_id = sbx.create_snapshot().snapshot_id
        sbx.kill()

        mine = lambda: [  # noqa: E731
            (h, b) for h, b in _Receiver.received if json.loads(b)["sandbox_id"] == sandbox_id
        ]
        got = wait_for(lambda: len(mine()) >= len(LIFECYCLE) and mine(), 60, what="six deliveries")
        assert [json.loads(b)["type"] for _, b in got] == LIFECYCLE
        for h, b in got:
            assert verify(SECRET, b, h["e2b-signature"]), h
            assert h["e2b-signature-version"] == "v1"
            assert h["e2b-webhook-id"] == hook_id
            assert h["e2b-delivery-id"]
            body = json.loads(b)
            assert body["version"] == "v1"
            assert body["event_category"] == "lifecycle"
            assert body["events_ttl_days"] == 30
        assert json.loads(got[-1][1])["event_data"]["kill_reason"] == "request"

        events = api.get(f"/events/sandboxes/{sandbox_id}", params={"orderAsc": "true", "limit": 50})
        assert events.status_code == 200, events.text
        assert [e["type"] for e in events.json()] == LIFECYCLE
        for path in ["/events/webhooks", f"/events/webhooks/{hook_id}", f"/events/webhooks/{hook_id}/deliveries"]:
            r = api.get(path)
            assert r.status_code == 200 and SECRET not in r.text, path
    finally:
        api.delete(f"/events/webhooks/{hook_id}")
        if snapshot_id:
            Sandbox.delete_snapshot(snapshot_id)
        server.shutdown()
        api.close()


def test_https_webhooks_are_delivered_to_a_receiver_the_configured_ca_signs(vmon):
    tls = Path(vmon.env["VMON_WEBHOOK_CA_FILE"]).parent
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls / "leaf.pem", tls / "leaf.key")
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    api = httpx.Client(base_url=vmon.api_url, headers={"X-API-Key": vmon.api_key}, timeout=120)
    hook = api.post(
        "/events/webhooks",
        json={
            "name": "e2e-tls",
            "url": f"https://127.0.0.1:{server.server_address[1]}/hook",
            "signatureSecret": SECRET,
            "events": ["sandbox.lifecycle.created", "sandbox.lifecycle.killed"],
        },
    )
    assert hook.status_code == 201, hook.text
    hook_id = hook.json()["id"]
    try:
        sbx = Sandbox.create(timeout=120)
        sandbox_id = sbx.sandbox_id
        sbx.kill()
        mine = lambda: [  # noqa: E731
            (h, b) for h, b in _Receiver.received
            if json.loads(b)["sandbox_id"] == sandbox_id and h["e2b-webhook-id"] == hook_id
        ]
        got = wait_for(lambda: len(mine()) >= 2 and mine(), 60, what="two deliveries over https")
        assert [json.loads(b)["type"] for _, b in got] == ["sandbox.lifecycle.created", "sandbox.lifecycle.killed"]
        assert all(verify(SECRET, b, h["e2b-signature"]) for h, b in got)
    finally:
        api.delete(f"/events/webhooks/{hook_id}")
        server.shutdown()
        api.close()


def test_webhooks_to_private_or_link_local_addresses_are_refused(vmon):
    api = httpx.Client(base_url=vmon.api_url, headers={"X-API-Key": vmon.api_key}, timeout=60)
    try:
        for url in ["http://169.254.169.254/latest/meta-data", "http://10.0.0.1/hook", "http://127.0.0.2:9/"]:
            r = api.post("/events/webhooks", json={"name": "x", "url": url, "signatureSecret": SECRET,
                                                    "events": ["sandbox.lifecycle.created"]})
            assert r.status_code == 400, (url, r.text)
            assert r.json()["code"] == 400
    finally:
        api.close()
