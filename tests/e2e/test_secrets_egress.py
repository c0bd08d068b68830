"""Secret injection at egress with the official SDK against `vmon up`: a sandbox whose
`network.rules` fill a header with `Secret.fill(name)` for a host that is also in `allowOut`
sends its HTTPS requests to that host through the node's egress proxy, which sets the header
with the secret's current value. The receiver is an HTTPS server this test runs in a network
namespace of its own, on a TEST-NET-2 address, with a certificate signed by the e2e CA (the
node trusts that CA through `VMON_EGRESS_CA_FILE`, see conftest.py); its name resolves on the
host through an /etc/hosts line this module adds and removes. Nothing is sent off this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest
from e2b import Sandbox, Secret
from e2b.exceptions import SandboxException

from conftest import DATA_DIR

NS = "vmt-e2e-egress"
HOST_IF = "vmt-e2e-eg0"
SERVER_IP, HOST_IP = "198.51.100.42", "198.51.100.41"
HOST = f"echo-{os.getpid()}.vmon-e2e.test"
HOSTS_LINE = f"{SERVER_IP} {HOST} # vmon e2e egress"
VALUE = f"egress-value-{uuid.uuid4().hex}"

pytestmark = pytest.mark.skipif(
    os.environ.get("VMON_E2E_EXTERNAL") == "1",
    reason="needs the e2e CA the server the tests start trusts",
)

# Answers every request with its headers as JSON.
ECHO = r"""
import http.server, json, ssl, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
s = http.server.ThreadingHTTPServer((sys.argv[1], 443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[2], sys.argv[3])
s.socket = ctx.wrap_socket(s.socket, server_side=True)
print("ready", flush=True)
s.serve_forever()
"""


def sh(script: str) -> None:
    subprocess.run(["sh", "-e", "-c", script], check=True, capture_output=True)


def leaf_for(name: str) -> tuple[Path, Path]:
    """A certificate for `name` signed by the e2e CA conftest made (webhook-tls/ca.pem)."""
    d = DATA_DIR / "webhook-tls"
    run = lambda *a: subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True)  # noqa: E731
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", *ec, "-keyout", "echo.key", "-out", "echo.csr", "-subj", f"/CN={name}")
    (d / "echo.ext").write_text(
        f"subjectAltName=DNS:{name}\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n"
    )
    run("x509", "-req", "-in", "echo.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "echo.pem", "-days", "2", "-extfile", "echo.ext")
    return d / "echo.pem", d / "echo.key"


def _hosts(add: bool) -> None:
    lines = [ln for ln in Path("/etc/hosts").read_text().splitlines() if ln != HOSTS_LINE]
    if add:
        lines.append(HOSTS_LINE)
    Path("/etc/hosts").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def echo(vmon):
    sh(f"ip netns del {NS} 2>/dev/null || true; ip link del {HOST_IF} 2>/dev/null || true")
    sh(
        f"""ip netns add {NS}
ip link add {HOST_IF} type veth peer name eth0 netns {NS}
ip addr add {HOST_IP}/30 dev {HOST_IF}
ip link set {HOST_IF} up
ip -n {NS} link set lo up
ip -n {NS} addr add {SERVER_IP}/30 dev eth0
ip -n {NS} link set eth0 up
ip -n {NS} route add default via {HOST_IP}"""
    )
    cert, key = leaf_for(HOST)
    proc = subprocess.Popen(
        ["ip", "netns", "exec", NS, "python3", "-c", ECHO, SERVER_IP, str(cert), str(key)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    _hosts(True)
    yield
    _hosts(False)
    proc.kill()
    proc.wait()
    sh(f"ip netns del {NS} 2>/dev/null || true; ip link del {HOST_IF} 2>/dev/null || true")


def rules(header_value: str) -> dict:
    return {"allow_out": [HOST], "rules": {HOST: [{"transform": {"headers": {"Authorization": header_value}}}]}}


def fetch(sbx: Sandbox, insecure: bool = False) -> dict:
    """The headers the receiver saw for a `curl https://HOST/` from inside the guest."""
    k = "-k " if insecure else ""
    r = sbx.commands.run(
        f"curl -sS --max-time 20 {k}--resolve {HOST}:443:{SERVER_IP} -H 'Authorization: guest-sent' https://{HOST}/",
        timeout=60,
    )
    return json.loads(r.stdout)


def test_the_secret_is_injected_and_the_guest_never_holds_it(vmon, echo):
    name = f"egress-{uuid.uuid4().hex[:8]}"
    Secret.create(name, VALUE)
    sbx = Sandbox.create(timeout=300, network=rules(f"Bearer {Secret.fill(name)}"))
    try:
        # The guest trusts the node's egress CA (curl verifies without -k).
        got = fetch(sbx)
        assert got["authorization"] == f"Bearer {VALUE}", got
        assert got["host"] == HOST
        # Nothing in the guest holds the value: no environment, no file we can think of.
        # (The pattern is assembled by the shell so that it is in no file or environment.)
        half = len(VALUE) // 2
        probe = (
            f"a={VALUE[:half]}; b={VALUE[half:]}; "
            'env | grep -cF "$a$b"; '
            'cat /proc/[0-9]*/environ 2>/dev/null | tr "\\0" "\\n" | grep -cF "$a$b"; '
            'grep -rlF "$a$b" /etc /home /root /tmp /var/tmp /var/log /usr/local /run /opt 2>/dev/null | wc -l'
        )
        out = sbx.commands.run(probe + " || true", user="root", timeout=120).stdout.split()
        assert out == ["0", "0", "0"], out
        # An updated value is what the next request carries.
        Secret.update(name, VALUE + "-v2")
        assert fetch(sbx)["authorization"] == f"Bearer {VALUE}-v2"
    finally:
        sbx.kill()
        Secret.destroy(name)


def test_a_sandbox_without_the_rule_is_not_intercepted(vmon, echo):
    sbx = Sandbox.create(timeout=300, network={"allow_out": [HOST]})
    try:
        # Not intercepted: the guest talks to the receiver itself (whose CA it does not know,
        # hence -k) and the header is the one it sent.
        got = fetch(sbx, insecure=True)
        assert got["authorization"] == "guest-sent", got
    finally:
        sbx.kill()


def test_unknown_secrets_and_hosts_outside_allow_out_are_400(vmon, echo):
    with pytest.raises(SandboxException, match="unknown secret"):
        Sandbox.create(network=rules(f"Bearer {Secret.fill('no-such-secret-' + uuid.uuid4().hex[:6])}"))
    name = f"egress-{uuid.uuid4().hex[:8]}"
    Secret.create(name, VALUE)
    try:
        network = rules(Secret.fill(name))
        network["allow_out"] = ["other.vmon-e2e.test"]
        with pytest.raises(SandboxException, match="allowOut"):
            Sandbox.create(network=network)
    finally:
        Secret.destroy(name)


def test_injection_survives_pause_and_resume(vmon, echo):
    """A resume (a memory restore) starts the listener again and puts the CA back if needed."""
    name = f"egress-{uuid.uuid4().hex[:8]}"
    Secret.create(name, VALUE)
    sbx = Sandbox.create(timeout=300, network=rules(f"Token {Secret.fill(name)}"))
    try:
        assert fetch(sbx)["authorization"] == f"Token {VALUE}"
        sbx.pause()
        Secret.update(name, VALUE + "-after-resume")
        sbx = Sandbox.connect(sbx.sandbox_id)
        assert fetch(sbx)["authorization"] == f"Token {VALUE}-after-resume"
    finally:
        sbx.kill()
        Secret.destroy(name)
