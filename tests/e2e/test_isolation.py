"""Isolation, black-box, with the official SDK against `vmon up`: two teams' sandboxes, probed
from inside a guest. Every packet goes to an address this test controls: the other guests'
slot addresses, the host ends of the slots' veths (where the api and proxy of this machine
would answer if they listened there, and a port this test binds on every host address), and
servers this test binds in a network namespace of its own standing in for the world beyond the
host. Nothing is sent off this machine."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import threading

import pytest
from e2b import Sandbox, SandboxException

from conftest import DATA_DIR

NS = "vmt-e2e-beyond"
HOST_IF = "vmt-e2e0"
PUBLIC, PUBLIC_HOST = "203.0.113.12", "203.0.113.11"
PRIVATE, PRIVATE_HOST = "10.231.78.2", "10.231.78.1"


def sh(script: str) -> None:
    subprocess.run(["sh", "-e", "-c", script], check=True, capture_output=True)


class Listener:
    """Counts the connections it accepts, bound on `ip` on the host or, with `netns`, by a
    small server started inside that namespace."""

    SERVER = (
        "import socket,sys\n"
        "s=socket.socket();s.bind((sys.argv[1],0));s.listen(16)\n"
        "print(s.getsockname()[1],flush=True)\n"
        "while True:\n"
        "    c,_=s.accept();print('+',flush=True);c.close()\n"
    )

    def __init__(self, ip: str, netns: str | None = None):
        self.hits = 0
        self.proc = None
        self.sock = None
        if netns:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", netns, "python3", "-c", self.SERVER, ip],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert self.proc.stdout is not None
            self.port = int(self.proc.stdout.readline())
            threading.Thread(target=self._count_lines, daemon=True).start()
        else:
            self.sock = socket.socket()
            self.sock.bind((ip, 0))
            self.sock.listen(16)
            self.port = self.sock.getsockname()[1]
            threading.Thread(target=self._accept, daemon=True).start()

    def _count_lines(self):
        assert self.proc is not None and self.proc.stdout is not None
        for _ in self.proc.stdout:
            self.hits += 1

    def _accept(self):
        assert self.sock is not None
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            c.close()

    def close(self):
        if self.proc:
            self.proc.kill()
            self.proc.wait()
        if self.sock:
            self.sock.close()


@pytest.fixture(scope="module")
def beyond():
    sh(f"ip netns del {NS} 2>/dev/null || true; ip link del {HOST_IF} 2>/dev/null || true")
    sh(
        f"""ip netns add {NS}
ip link add {HOST_IF} type veth peer name eth0 netns {NS}
ip addr add {PUBLIC_HOST}/24 dev {HOST_IF}
ip addr add {PRIVATE_HOST}/24 dev {HOST_IF}
ip link set {HOST_IF} up
ip -n {NS} link set lo up
ip -n {NS} addr add {PUBLIC}/24 dev eth0
ip -n {NS} addr add {PRIVATE}/24 dev eth0
ip -n {NS} link set eth0 up"""
    )
    public, private = Listener(PUBLIC, NS), Listener(PRIVATE, NS)
    yield public, private
    public.close()
    private.close()
    sh(f"ip netns del {NS} 2>/dev/null || true; ip link del {HOST_IF} 2>/dev/null || true")


def slot_address(sandbox_id: str) -> str:
    """The address the host reaches a sandbox's guest at, from the node's own state."""
    states = sorted((DATA_DIR / "sandboxes" / sandbox_id).glob("*/sandbox.json"), key=lambda p: p.stat().st_mtime)
    assert states, f"no node state for {sandbox_id}"
    slot = json.loads(states[-1].read_text())["slot"]
    block = int((DATA_DIR / "slot-block").read_text().strip())
    base = int(ipaddress.IPv4Address("169.254.128.0")) + (block * 512 + slot) * 4
    return str(ipaddress.IPv4Address(base + 2))


def probe(sbx: Sandbox, targets: list[tuple[str, int]]) -> list[str]:
    cmd = " ".join(
        f"(timeout 3 bash -c 'echo x > /dev/tcp/{ip}/{port}' 2>/dev/null && echo {ip}:{port}=reached || echo {ip}:{port}=blocked) &"
        for ip, port in targets
    ) + " wait"
    out = sbx.commands.run(cmd, user="root", timeout=60).stdout
    got = dict(line.split("=", 1) for line in out.split())
    return [got[f"{ip}:{port}"] for ip, port in targets]


def connects_as(uid: int | None, ip: str, port: int) -> bool:
    """Whether a TCP connection from this host to ip:port opens within 5 s, made by a process
    running as `uid` (None: this one, root)."""
    code = f"import socket; socket.create_connection(({ip!r}, {port}), timeout=5).close()"
    extra = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    return subprocess.run(["python3", "-c", code], capture_output=True, **extra).returncode == 0


def host_end(addr: str) -> str:
    return str(ipaddress.IPv4Address(int(ipaddress.IPv4Address(addr)) - 1))


pytestmark = pytest.mark.skipif(
    os.environ.get("VMON_E2E_EXTERNAL") == "1",
    reason="reads the node's state in the data dir of the server the tests start",
)


def test_a_guest_reaches_nothing_of_another_team_or_the_host(vmon, beyond):
    public, private = beyond
    other_key = vmon.create_team(f"iso-{os.urandom(3).hex()}")
    a = Sandbox.create(timeout=300)
    b = Sandbox.create(timeout=300, api_key=other_key)
    try:
        b.commands.run("python3 -m http.server 8000 >/dev/null 2>&1", background=True)
        b.commands.run("for i in $(seq 50); do (echo > /dev/tcp/127.0.0.1/8000) 2>/dev/null && break; sleep 0.2; done")
        a_addr, b_addr = slot_address(a.sandbox_id), slot_address(b.sandbox_id)
        assert a_addr != b_addr
        # A port on every host address, and the api and proxy ports at the veth ends.
        everywhere = Listener("0.0.0.0")
        api_port = int(vmon.api_url.rsplit(":", 1)[1])
        proxy_port = int(vmon.sandbox_url.rsplit(":", 1)[1])
        targets = [
            (PUBLIC, public.port),
            (b_addr, 8000),
            (b_addr, 49983),
            (b_addr, 49999),
            (host_end(b_addr), everywhere.port),
            (host_end(a_addr), everywhere.port),
            (host_end(a_addr), api_port),
            (host_end(a_addr), proxy_port),
            (PUBLIC_HOST, everywhere.port),
            (PRIVATE, private.port),
        ]
        got = probe(a, targets)
        assert got == ["reached"] + ["blocked"] * (len(targets) - 1), list(zip(targets, got))
        assert public.hits >= 1
        assert everywhere.hits == 0 and private.hits == 0
        # B's server is there: its own guest reaches it.
        assert b.commands.run("(echo > /dev/tcp/127.0.0.1/8000) && echo up").stdout.strip() == "up"
        # From the host, only vmon (root) opens connections to a guest: another local user
        # reaches neither its server nor envd (the SDK's calls above went through the proxy).
        nobody = 65534
        got = [connects_as(None, b_addr, 8000), connects_as(nobody, b_addr, 8000), connects_as(nobody, b_addr, 49983)]
        assert got == [True, False, False], "(root to the server, nobody to the server, nobody to envd)"
        everywhere.close()
    finally:
        a.kill()
        b.kill()


def test_allow_out_opens_what_it_names_and_nothing_else(vmon, beyond):
    public, private = beyond
    # A private address the operator's private_allow (conftest: 10.231.78.2/32) does not list
    # is refused before anything starts.
    for entry in ["10.231.78.3", "192.168.0.0/16"]:
        with pytest.raises(SandboxException, match="private_allow"):
            Sandbox.create(timeout=300, network={"allow_out": [entry]})
    closed = Sandbox.create(timeout=300, allow_internet_access=False, network={"allow_out": [PRIVATE]})
    try:
        before = private.hits
        got = probe(closed, [(PRIVATE, private.port), (PUBLIC, public.port), (PRIVATE_HOST, 22)])
        assert got == ["reached", "blocked", "blocked"]
        assert private.hits > before
    finally:
        closed.kill()
