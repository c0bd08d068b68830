"""https on the sandbox proxy (issue 23, items 1 and 2): `vmon up` serves TLS on the proxy's
port with a local CA it creates and prints how to trust; then `https://{get_host(port)}` opens,
the SDK works with only E2B_API_URL and E2B_API_KEY (host-routed `https://49983-<id>.<domain>`
for envd, as on E2B), and signed file URLs open in any client, with or without
E2B_SANDBOX_URL."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from conftest import wait_for


def _print_env(vmon) -> dict[str, str]:
    out = vmon.vmon("up", "--print-env", "--wait-secs", "60")
    env = {}
    for line in out.splitlines():
        if line.startswith("export ") and "=" in line:
            k, v = line[len("export "):].split("=", 1)
            env[k] = v
    return env


@pytest.fixture(scope="module")
def trust(vmon):
    """The exports `vmon up` prints for the CA, applied to this process before the SDK builds
    its (cached) TLS transport."""
    env = _print_env(vmon)
    for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"):
        assert k in env, f"vmon up does not print {k}: {env}"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: env[k] for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")})
    yield env
    for k, v in saved.items():
        if k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"):
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def no_sandbox_url(monkeypatch, trust):
    """The SDK as E2B documents it: E2B_API_URL and E2B_API_KEY only."""
    monkeypatch.delenv("E2B_SANDBOX_URL", raising=False)
    monkeypatch.delenv("E2B_DEBUG", raising=False)


def test_the_local_ca_and_its_trust_files(vmon, trust):
    data = Path(vmon.env["VMON_DATA_DIR"])
    ca, key = data / "tls" / "ca.pem", data / "tls" / "ca.key"
    assert Path(trust["NODE_EXTRA_CA_CERTS"]) == ca
    assert ca.read_text().startswith("-----BEGIN CERTIFICATE-----")
    assert key.stat().st_mode & 0o777 == 0o600
    bundle = Path(trust["SSL_CERT_FILE"]).read_text()
    # SSL_CERT_FILE replaces the system bundle: the file holds the system's CAs and vmon's.
    system = Path("/etc/ssl/certs/ca-certificates.crt")
    if system.exists():
        assert bundle.startswith(system.read_text()[:2000])
        assert bundle.count("BEGIN CERTIFICATE") > 10
    assert bundle.rstrip().endswith(ca.read_text().rstrip())


def test_tls_and_plain_http_on_the_proxy_port(vmon, trust):
    proxy = httpx.URL(vmon.sandbox_url)
    port = proxy.port
    host = f"49983-inosuchsandbox0000000.localhost:{port}"
    plain = httpx.get(f"http://{host}/health", timeout=10)
    secure = httpx.get(f"https://{host}/health", timeout=10, verify=ssl.create_default_context(cafile=trust["NODE_EXTRA_CA_CERTS"]))
    for r in (plain, secure):
        assert r.status_code == 502 and "was not found" in r.json()["message"], r.text
    # Without the CA the certificate is refused (nothing is trusted by accident).
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"https://{host}/health", timeout=10, verify=ssl.create_default_context(cafile=str(Path("/etc/ssl/certs/ca-certificates.crt"))))


def test_https_get_host_reaches_a_server_in_the_sandbox(new_sandbox, trust):
    sbx = new_sandbox()
    sbx.files.write("/home/user/site/hello.txt", "served over https")
    sbx.commands.run("cd /home/user/site && python3 -m http.server 8000", background=True)
    host = sbx.get_host(8000)

    def served():
        try:
            # httpx trusts SSL_CERT_FILE (the bundle with vmon's CA).
            r = httpx.get(f"https://{host}/hello.txt", timeout=10)
        except httpx.HTTPError:
            return None
        return r if r.status_code == 200 else None

    r = wait_for(served, timeout=60, what="https://{get_host(8000)}")
    assert r.text == "served over https"
    # urllib (OpenSSL's default paths, which honour SSL_CERT_FILE) too.
    with urllib.request.urlopen(f"https://{host}/hello.txt", timeout=10) as resp:
        assert resp.read() == b"served over https"


def test_sdk_without_sandbox_url(vmon, no_sandbox_url, sandboxes):
    sbx = Sandbox.create()
    sandboxes.append(sbx)
    # envd is reached host-routed over TLS, as on E2B.
    assert sbx.envd_api_url.startswith(f"https://49983-{sbx.sandbox_id}.localhost:"), sbx.envd_api_url
    r = sbx.commands.run("echo hello from $(whoami)")
    assert r.exit_code == 0 and r.stdout == "hello from user\n"
    sbx.files.write("/home/user/notes.txt", "written over https")
    assert sbx.files.read("/home/user/notes.txt") == "written over https"
    lines = []
    # A streamed command: output arrives while it runs.
    r = sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.2; done", on_stdout=lines.append)
    assert r.exit_code == 0
    assert "".join(lines).split() == ["1", "2", "3"]
    # Connecting again by id works the same way.
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.files.read("/home/user/notes.txt") == "written over https"


def _signed_urls_open_in_plain_clients(sbx: Sandbox):
    name = f"/home/user/up-{uuid.uuid4().hex[:8]}.txt"
    up = sbx.upload_url(name)
    # A multipart upload, as the SDK's docs say, with nothing but the URL.
    r = httpx.post(up, files={"file": ("f.txt", b"uploaded by url")}, timeout=30)
    assert r.status_code == 200, r.text
    assert sbx.files.read(name) == "uploaded by url"
    down = sbx.download_url(name)
    with urllib.request.urlopen(down, timeout=30) as resp:
        assert resp.read() == b"uploaded by url"
    assert httpx.get(down, timeout=30).content == b"uploaded by url"
    # A signature for another path does not open this one.
    quoted = urllib.parse.quote(name, safe="")
    assert quoted in down
    wrong = down.replace(quoted, urllib.parse.quote(name + "x", safe=""))
    assert httpx.get(wrong, timeout=30).status_code in (400, 401)


def _expired_signature_is_401(sbx: Sandbox):
    sbx.files.write("/home/user/old.txt", "x")
    url = sbx.download_url("/home/user/old.txt", use_signature_expiration=1)
    time.sleep(2.5)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url, timeout=30)
    assert e.value.code == 401
    assert json.loads(e.value.read()) == {"code": 401, "message": "signature is already expired"}


def test_signed_urls_with_sandbox_url(new_sandbox, trust):
    # vmon up's exports include E2B_SANDBOX_URL: the URLs are http://<proxy>/files?... and
    # name no sandbox; the proxy finds it by the signature.
    assert os.environ.get("E2B_SANDBOX_URL")
    sbx = new_sandbox(secure=True)
    assert sbx.download_url("/x").startswith(os.environ["E2B_SANDBOX_URL"])
    _signed_urls_open_in_plain_clients(sbx)
    _expired_signature_is_401(sbx)


def test_signed_urls_without_sandbox_url(vmon, no_sandbox_url, sandboxes):
    sbx = Sandbox.create(secure=True)
    sandboxes.append(sbx)
    assert sbx.download_url("/x").startswith(f"https://49983-{sbx.sandbox_id}.localhost:")
    _signed_urls_open_in_plain_clients(sbx)
    _expired_signature_is_401(sbx)


def test_node_trusts_the_ca(new_sandbox, trust):
    node = subprocess.run(["which", "node"], capture_output=True, text=True).stdout.strip()
    if not node:
        pytest.skip("no node")
    sbx = new_sandbox()
    sbx.files.write("/home/user/site/n.txt", "node over https")
    sbx.commands.run("cd /home/user/site && python3 -m http.server 8001", background=True)
    url = f"https://{sbx.get_host(8001)}/n.txt"
    wait_for(lambda: _ok(url), timeout=60, what="the server")
    script = "fetch(process.argv[1]).then(r => r.text()).then(t => console.log(t), e => { console.error(e.cause || e); process.exit(1); })"
    out = subprocess.run([node, "-e", script, url], env=dict(os.environ), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "node over https"


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False
