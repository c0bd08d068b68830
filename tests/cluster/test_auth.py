"""The cluster's parts authenticate each other (issue 38): etcd takes only TLS clients with a
certificate of the cluster's CA, and a node entry forged in etcd (the hole: an attacker's
`rpc_url` got the cluster-wide node token) reaches no api replica's trust: plain http, a
self-signed certificate and a certificate of the cluster's CA naming another node all get no
request, so never the token, while the cluster keeps working. And a guest allowed everywhere
(`allowOut: 0.0.0.0/0`) reaches none of the cluster's etcd, PostgreSQL, S3 store or node RPC,
while the same probe reaches a server the test runs beyond the host."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from e2b import Sandbox

from conftest import DIR, PORT, wait_for


class Recorder:
    """A listener on 127.0.0.1 that keeps every byte it is sent: plain TCP, or TLS with the
    given certificate (then it keeps what arrives after a handshake the client completed)."""

    def __init__(self, cert: Path | None = None, key: Path | None = None):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(32)
        self.port = self.sock.getsockname()[1]
        self.ctx = None
        if cert:
            self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.ctx.load_cert_chain(str(cert), str(key))
        self.connections = 0
        self.handshakes = 0
        self.data = b""
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c: socket.socket):
        c.settimeout(5)
        try:
            if self.ctx:
                c = self.ctx.wrap_socket(c, server_side=True)
                self.handshakes += 1
            while chunk := c.recv(65536):
                self.data += chunk
        except (OSError, ssl.SSLError):
            pass
        finally:
            c.close()

    def close(self):
        self.sock.close()


def _etcd_key(node_id: str) -> str:
    return base64.b64encode(f"/vmon/k/nodes/{node_id}".encode()).decode()


def _real_entry(cluster) -> dict:
    got = cluster.etcd(1, "/v3/kv/range", {"key": _etcd_key("node1")})
    return json.loads(base64.b64decode(got["kvs"][0]["value"]))


def _forge(cluster, node_id: str, rpc_url: str) -> None:
    """Writes nodes/<id> as an attacker with etcd access would: a node looking emptier than
    any real one, so placement prefers it."""
    entry = _real_entry(cluster)
    entry.update(
        id=node_id,
        rpc_url=rpc_url,
        host=f"host-{node_id}",
        ingress_url=None,
        free_slots=10_000,
        free_memory_mb=10_000_000,
        free_disk_mb=10_000_000,
        memory_mb=10_000_000,
        vcpus=512,
        running=0,
    )
    value = base64.b64encode(json.dumps(entry).encode()).decode()
    cluster.etcd(1, "/v3/kv/put", {"key": _etcd_key(node_id), "value": value})


def _unforge(cluster, node_id: str) -> None:
    cluster.etcd(1, "/v3/kv/deleterange", {"key": _etcd_key(node_id)})


def _self_signed(d: Path, names: str) -> tuple[Path, Path]:
    cert, key = d / "self.pem", d / "self.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-days", "2", "-subj", "/CN=forged", "-addext", f"subjectAltName={names}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


def _of_the_cluster_ca(cluster, d: Path, *names: str) -> tuple[Path, Path]:
    out = d / "stolen"
    subprocess.run(
        [cluster.env["VMON_BIN"], "cert", "issue", "--dir", str(DIR / "tls"), "--out", str(out), *names],
        check=True, capture_output=True, timeout=60,
    )
    return Path(f"{out}.pem"), Path(f"{out}.key")


def test_etcd_takes_only_tls_clients_with_a_certificate_of_the_cluster_ca(cluster):
    status = cluster.etcd_status(1)
    assert "leader" in status, status
    # Verified against the CA but with no client certificate: turned away.
    with pytest.raises((OSError, ssl.SSLError)):
        cluster.etcd(1, "/v3/kv/range", {"key": _etcd_key("node1")}, client_cert=False)
    # Plain http to the client port gets no answer.
    with socket.create_connection(("127.0.0.1", PORT + 31), timeout=5) as s:
        s.sendall(b"POST /v3/maintenance/status HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        s.settimeout(5)
        try:
            answer = s.recv(4096)
        except OSError:
            answer = b""
        assert b'"leader"' not in answer, answer
    # A client certificate of another CA: turned away too.
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = _self_signed(Path(tmp), "IP:127.0.0.1")
        ctx = ssl.create_default_context(cafile=str(cluster.ca))
        ctx.load_cert_chain(str(cert), str(key))
        with pytest.raises((OSError, ssl.SSLError)):
            with socket.create_connection(("127.0.0.1", PORT + 31), timeout=5) as raw:
                with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                    s.sendall(b"POST /v3/maintenance/status HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
                    if not s.recv(4096):
                        raise OSError("closed")


def test_a_forged_node_entry_gets_no_token_and_the_cluster_keeps_working(cluster):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        plain = Recorder()
        self_signed = Recorder(*_self_signed(d, "DNS:forged2.node.vmon,IP:127.0.0.1"))
        # What a compromised node2 (or a leaked node2 key) would hold: the cluster CA's word
        # for node2, not for the id the forged entry claims.
        stolen = Recorder(*_of_the_cluster_ca(cluster, d, "127.0.0.1", "localhost", "node2.node.vmon"))
        forged = {
            "forged1": (plain, f"http://127.0.0.1:{plain.port}"),
            "forged2": (self_signed, f"https://127.0.0.1:{self_signed.port}"),
            "forged3": (stolen, f"https://127.0.0.1:{stolen.port}"),
        }
        try:
            for node_id, (_, url) in forged.items():
                _forge(cluster, node_id, url)
            # Creates through both replicas: placement would pick the emptiest node first.
            sandboxes = []
            for api in (cluster.api_a, cluster.api_b, cluster.api_a):
                sbx = Sandbox.create("base", timeout=120, api_url=api)
                sandboxes.append(sbx)
                assert sbx.commands.run("echo works").stdout.strip() == "works"
            nodes = {n["id"] for n in cluster.admin("/admin/nodes")}
            assert nodes == {"node1", "node2"}, nodes
            # A few heartbeats and reconciliation rounds of both replicas.
            time.sleep(8)
            for sbx in sandboxes:
                sbx.kill()
        finally:
            for node_id in forged:
                _unforge(cluster, node_id)
            for r, _ in forged.values():
                r.close()
    token = cluster.token.encode()
    for node_id, (r, _) in forged.items():
        assert token not in r.data, node_id
        assert b"authorization" not in r.data.lower(), (node_id, r.data[:200])
    # http: never dialled. TLS: the replicas may try a handshake, which they abort.
    assert plain.connections == 0, plain.connections
    assert self_signed.handshakes == 0 and stolen.handshakes == 0, (self_signed.handshakes, stolen.handshakes)
    assert stolen.data == b"" and self_signed.data == b""


# --- a guest allowed everywhere reaches none of the cluster's services -----------------------

NS = "vmt-cl-beyond"
HOST_IF = "vmt-cl0"
# The upper half of TEST-NET-3 (the e2e suite's namespace uses the lower one).
PUBLIC, PUBLIC_HOST = "203.0.113.202", "203.0.113.201"


def _sh(script: str) -> None:
    subprocess.run(["sh", "-e", "-c", script], check=True, capture_output=True)


@pytest.fixture
def beyond():
    """A server in a network namespace of the test's, at a public address: what the guest's
    probe must reach, so that a blocked probe means blocked and not broken."""
    _sh(f"ip netns del {NS} 2>/dev/null || true; ip link del {HOST_IF} 2>/dev/null || true")
    _sh(
        f"""ip netns add {NS}
ip link add {HOST_IF} type veth peer name eth0 netns {NS}
ip addr add {PUBLIC_HOST}/25 dev {HOST_IF}
ip link set {HOST_IF} up
ip -n {NS} link set lo up
ip -n {NS} addr add {PUBLIC}/25 dev eth0
ip -n {NS} link set eth0 up"""
    )
    server = subprocess.Popen(
        ["ip", "netns", "exec", NS, "python3", "-c",
         "import socket\ns=socket.socket();s.bind(('0.0.0.0',8080));s.listen(16)\nprint('up',flush=True)\n"
         "while True:\n    c,_=s.accept();c.close()\n"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None and server.stdout.readline().strip() == "up"
    try:
        yield PUBLIC, 8080
    finally:
        server.kill()
        server.wait()
        _sh(f"ip netns del {NS} 2>/dev/null || true; ip link del {HOST_IF} 2>/dev/null || true")


def _host_addresses() -> list[str]:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], check=True, capture_output=True, text=True).stdout
    addrs = {line.split()[3].split("/")[0] for line in out.splitlines()}
    return sorted(a for a in addrs if a != PUBLIC_HOST)


def _probe(sbx: Sandbox, targets: list[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """From inside the guest, all at once: `reached` or `blocked` per (address, port)."""
    lines = [
        f"(timeout 4 bash -c 'echo > /dev/tcp/{ip}/{port}' 2>/dev/null && echo '{ip} {port} reached' "
        f"|| echo '{ip} {port} blocked') &"
        for ip, port in targets
    ]
    out = sbx.commands.run("\n".join(lines + ["wait"]), timeout=60).stdout
    got = {}
    for line in out.splitlines():
        ip, port, verdict = line.split()
        got[(ip, int(port))] = verdict
    return got


def test_a_guest_allowed_everywhere_reaches_no_cluster_service(cluster, beyond):
    services = {
        "etcd": [PORT + 31, PORT + 32, PORT + 33, PORT + 34, PORT + 35, PORT + 36],
        "postgresql": [PORT + 40],
        "s3": [PORT + 50, PORT + 51, PORT + 52],
        "node rpc": [PORT + 21, PORT + 22],
    }
    sbx = Sandbox.create("base", timeout=300, network={"allow_out": ["0.0.0.0/0"]})
    try:
        gateway = sbx.commands.run("ip route | awk '/^default/ {print $3}'").stdout.strip()
        assert gateway, "the guest has no default route"
        hosts = sorted({gateway, *_host_addresses()})
        targets = [(h, p) for h in hosts for ports in services.values() for p in ports]
        # The probe works: the allowed server beyond the host answers it (the guest's rules
        # may take a moment after the create).
        wait_for(lambda: _probe(sbx, [beyond])[beyond] == "reached", 30, 1, "the guest to reach the server beyond")
        got = _probe(sbx, [beyond, *targets])
        assert got[beyond] == "reached", got
        reached = [t for t in targets if got.get(t) != "blocked"]
        assert not reached, f"a guest reached cluster services: {reached}"
    finally:
        sbx.kill()
