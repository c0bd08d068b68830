"""The slow-guest suite (issue 38): guests whose servers accept and never answer, or stop
mid-body, cost only their own sandbox's slots, and one client cannot hold every slot.

A real guest runs the servers; the proxy is a real `vmon proxy` of the session's api with
short caps and timeouts of its own (the session's `vmon up` keeps the defaults), reached from
several loopback addresses so that each is a client of its own."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest
from e2b import Sandbox

from conftest import wait_for

HEADER_SECS = 4
IDLE_SECS = 3
PER_SANDBOX = 2
PER_CLIENT = 3
ENVD_PORT = 49983
GUEST_PORT = 8000

# Both guests run it. /stuck reads the request and never answers; /stall sends headers and one chunk, then
# nothing; /slow answers after 1.5 s with a chunk a second; anything else is `ok`.
GUEST_SERVER = r"""
import socket, threading, time

def handle(c):
    data = b""
    while b"\r\n\r\n" not in data:
        d = c.recv(4096)
        if not d:
            return
        data += d
    path = data.split(b" ")[1]
    if path == b"/stuck":
        time.sleep(3600)
    elif path == b"/stall":
        c.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nfirst;\r\n")
        time.sleep(3600)
    elif path == b"/slow":
        time.sleep(1.5)
        c.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(4):
            time.sleep(1)
            chunk = b"p%d;" % i
            c.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        c.sendall(b"0\r\n\r\n")
    else:
        c.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
    c.close()

s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8000))
s.listen(64)
while True:
    c, _ = s.accept()
    threading.Thread(target=handle, args=(c,), daemon=True).start()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def limited_proxy(vmon, tmp_path):
    """A `vmon proxy` of the session's api with short caps and timeouts; yields its address."""
    port = _free_port()
    env = dict(
        vmon.env,
        VMON_PROXY_LISTEN=f"127.0.0.1:{port}",
        VMON_API_URL=vmon.api_url,
        VMON_PROXY_MAX_PER_SANDBOX=str(PER_SANDBOX),
        VMON_PROXY_MAX_PER_CLIENT=str(PER_CLIENT),
        VMON_PROXY_HEADER_TIMEOUT_SECS=str(HEADER_SECS),
        VMON_PROXY_IDLE_BODY_SECS=str(IDLE_SECS),
    )
    log = open(tmp_path / "vmon-proxy.log", "w")
    proc = subprocess.Popen([str(vmon.binary), "proxy"], env=env, stdout=log, stderr=log)
    try:
        def listening():
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0
        wait_for(listening, 60, what="vmon proxy listening")
        yield ("127.0.0.1", port)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _send(proxy, src: str, sandbox_id: str, port: int, path: str) -> socket.socket:
    s = socket.socket()
    s.bind((src, 0))
    s.connect(proxy)
    s.sendall(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nE2b-Sandbox-Id: {sandbox_id}\r\n"
        f"E2b-Sandbox-Port: {port}\r\nConnection: close\r\n\r\n".encode()
    )
    return s


def _read_all(s: socket.socket, wait: float = 30) -> tuple[str, float]:
    """What the proxy sends until it closes, and how long that took."""
    start = time.monotonic()
    s.settimeout(wait)
    out = b""
    try:
        while True:
            d = s.recv(65536)
            if not d:
                break
            out += d
    except (socket.timeout, ConnectionResetError):
        pass
    finally:
        s.close()
    return out.decode(errors="replace"), time.monotonic() - start


def _get(proxy, src, sandbox_id, port, path) -> tuple[str, float]:
    return _read_all(_send(proxy, src, sandbox_id, port, path))


def test_slow_guests_cost_only_their_own_slots(new_sandbox, limited_proxy):
    a = new_sandbox("base", timeout=600)
    b = new_sandbox("base", timeout=600)
    proxy = limited_proxy
    for sbx in (a, b):
        sbx.files.write("/tmp/slowguest.py", GUEST_SERVER)
        sbx.commands.run("python3 /tmp/slowguest.py >/tmp/slowguest.log 2>&1", background=True)
        wait_for(lambda: _get(proxy, "127.0.0.9", sbx.sandbox_id, GUEST_PORT, "/ok")[0].endswith("ok"),
                 60, what="the guest's server through the limited proxy")

    # Two requests that are never answered hold a's two slots.
    stuck = [_send(proxy, "127.0.0.2", a.sandbox_id, GUEST_PORT, "/stuck") for _ in range(PER_SANDBOX)]
    time.sleep(1)
    r, took = _get(proxy, "127.0.0.3", a.sandbox_id, GUEST_PORT, "/ok")
    assert r.startswith("HTTP/1.1 503") and '"code":503' in r, r
    assert took < 2, f"refused after {took:.1f} s"
    # b's envd is answered promptly meanwhile.
    r, took = _get(proxy, "127.0.0.3", b.sandbox_id, ENVD_PORT, "/health")
    assert r.startswith("HTTP/1.1 2"), r
    assert took < 5, f"b answered after {took:.1f} s"
    # The stuck requests end at the header timeout with a 504, and a's slots come back.
    for s in stuck:
        r, took = _read_all(s)
        assert r.startswith("HTTP/1.1 504") and '"code":504' in r, r
        assert took < HEADER_SECS + 5, f"504 after {took:.1f} s"
    r, _ = _get(proxy, "127.0.0.3", a.sandbox_id, GUEST_PORT, "/ok")
    assert r.startswith("HTTP/1.1 200") and r.endswith("ok"), r

    # A body that stops is cut off after the idle-body timeout (no chunked end).
    r, took = _get(proxy, "127.0.0.3", a.sandbox_id, GUEST_PORT, "/stall")
    assert r.startswith("HTTP/1.1 200") and "first;" in r, r
    assert not r.endswith("0\r\n\r\n"), r
    assert IDLE_SECS - 0.5 <= took < IDLE_SECS + 10, f"cut after {took:.1f} s"
    # A slow but steady one arrives whole.
    r, took = _get(proxy, "127.0.0.3", a.sandbox_id, GUEST_PORT, "/slow")
    assert r.startswith("HTTP/1.1 200") and "p0;" in r and "p3;" in r and r.endswith("0\r\n\r\n"), r

    # One client holding its cap (two on a, one on b) gets 429 for b, which has a slot left;
    # another client gets that slot.
    held = [_send(proxy, "127.0.0.4", a.sandbox_id, GUEST_PORT, "/stuck") for _ in range(PER_SANDBOX)]
    held.append(_send(proxy, "127.0.0.4", b.sandbox_id, GUEST_PORT, "/stuck"))
    time.sleep(0.5)
    r, took = _get(proxy, "127.0.0.4", b.sandbox_id, ENVD_PORT, "/health")
    assert r.startswith("HTTP/1.1 429") and '"code":429' in r, r
    assert took < 2, f"refused after {took:.1f} s"
    r, _ = _get(proxy, "127.0.0.5", b.sandbox_id, ENVD_PORT, "/health")
    assert r.startswith("HTTP/1.1 2"), r
    for s in held:
        r, _ = _read_all(s)
        assert r.startswith("HTTP/1.1 504"), r


def test_a_quiet_command_outlives_the_idle_body_timeout(new_sandbox, limited_proxy):
    """envd's command stream is silent while `sleep` runs: the proxy asks envd for keepalives
    within its idle-body timeout, so the stream is never taken for a stalled guest."""
    sbx = new_sandbox("base", timeout=600)
    host, port = limited_proxy
    via = Sandbox.connect(sbx.sandbox_id, sandbox_url=f"http://{host}:{port}")
    r = via.commands.run(f"sleep {IDLE_SECS * 3}; echo done", timeout=120)
    assert r.stdout.strip() == "done"
