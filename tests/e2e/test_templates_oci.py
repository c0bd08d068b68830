"""Templates built `from_image(...)` out of a real OCI registry: Debian's `docker-registry`,
started here on a free loopback port with its own storage (and, for the login tests, htpasswd
auth), holding an image these tests make themselves without Docker: a tiny rootfs of static
busybox and static bash with a marker file, packed with `umoci` and pushed with `skopeo`. The
image has no glibc, no `ip`, no kernel modules and no `user`, so the build must bring all of
them."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from e2b import BuildException, Template

MARKER = "only-in-the-oci-test-image"
# Busybox applets the image leaves out: `ip` so the build's own `ip` is what configures the
# network, and the login shell's name (static bash is /bin/bash).
LEFT_OUT = {"ip", "bash", "busybox"}


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _logs():
    lines: list[str] = []

    def on(entry) -> None:
        lines.append(entry.message)

    return lines, on


def _run(*args: str, cwd: Path | None = None) -> None:
    subprocess.run(list(args), cwd=cwd, check=True, capture_output=True, timeout=600)


def _rootfs(d: Path) -> Path:
    """The image's tree: static bash, static busybox and its applets, root's account, a marker."""
    root = d / "rootfs"
    (root / "bin").mkdir(parents=True)
    (root / "etc").mkdir()
    shutil.copy("/usr/bin/bash-static", root / "bin" / "bash")
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    applets = subprocess.run(["/bin/busybox", "--list"], check=True, capture_output=True, text=True).stdout
    for a in applets.split():
        if a not in LEFT_OUT:
            (root / "bin" / a).symlink_to("busybox")
    (root / "usr").mkdir()
    (root / "usr" / "bin").symlink_to("../bin")
    (root / "sbin").symlink_to("bin")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    (root / "etc" / "oci-marker").write_text(MARKER + "\n")
    return root


def _oci_layout(d: Path) -> Path:
    """An OCI layout holding the image as `img:1` (umoci, no Docker)."""
    return _pack(d, _rootfs(d))


def _hostile_layout(d: Path, canary: Path) -> Path:
    """The test image with `/etc/passwd` a chain of 41 links (one past the kernel's budget)
    that ends at `canary`, a file of the host: the build must not write it."""
    root = _rootfs(d)
    etc = root / "etc"
    (etc / "passwd").unlink()
    for i in range(40):
        (etc / f"c{i}").symlink_to(f"c{i + 1}")
    (etc / "c40").symlink_to(canary)
    (etc / "passwd").symlink_to("/etc/c0")
    return _pack(d, root)


def _pack(d: Path, root: Path) -> Path:
    layout = d / "layout"
    bundle = d / "bundle"
    _run("umoci", "init", "--layout", str(layout))
    _run("umoci", "new", "--image", f"{layout}:1")
    _run("umoci", "unpack", "--image", f"{layout}:1", str(bundle))
    _run("cp", "-a", f"{root}/.", str(bundle / "rootfs"))
    _run("umoci", "repack", "--image", f"{layout}:1", str(bundle))
    _run("umoci", "config", "--image", f"{layout}:1", "--config.cmd", "/bin/bash")
    return layout


class Registry:
    def __init__(self, d: Path, auth: tuple[str, str] | None):
        self.port = _free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.auth = auth
        d.mkdir(parents=True)
        config = [
            "version: 0.1",
            "log:",
            "  level: warn",
            "storage:",
            "  filesystem:",
            f"    rootdirectory: {d / 'storage'}",
            "http:",
            f"  addr: {self.host}",
        ]
        if auth:
            htpasswd = subprocess.run(
                ["htpasswd", "-Bbn", auth[0], auth[1]], check=True, capture_output=True, text=True
            ).stdout
            (d / "htpasswd").write_text(htpasswd)
            config += ["auth:", "  htpasswd:", "    realm: vmon-test", f"    path: {d / 'htpasswd'}"]
        (d / "config.yml").write_text("\n".join(config) + "\n")
        self.log = open(d / "registry.log", "w")
        self.proc = subprocess.Popen(
            ["docker-registry", "serve", str(d / "config.yml")], stdout=self.log, stderr=self.log
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2)
                break
            except urllib.error.HTTPError:
                break  # 401: up, and asking for a login
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"docker-registry did not start; see {d / 'registry.log'}")
                time.sleep(0.2)

    def push(self, layout: Path, repo: str) -> str:
        ref = f"{self.host}/{repo}"
        creds = ["--dest-creds", f"{self.auth[0]}:{self.auth[1]}"] if self.auth else []
        _run("skopeo", "copy", "--dest-tls-verify=false", *creds, f"oci:{layout}:1", f"docker://{ref}")
        return ref

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> Path:
    return _oci_layout(tmp_path_factory.mktemp("oci-image"))


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    r = Registry(tmp_path_factory.mktemp("registry") / "open", None)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def private_registry(tmp_path_factory):
    r = Registry(tmp_path_factory.mktemp("registry") / "private", ("tester", secrets.token_hex(8)))
    yield r
    r.stop()


def test_a_template_from_a_registry_image_runs_that_image(vmon, new_sandbox, registry, layout):
    ref = registry.push(layout, "test/img:1")
    name = _name("oci")
    t = (
        Template()
        .from_image(ref)
        .run_cmd("echo built-in-the-image > /home/user/built.txt && id -u > /home/user/uid.txt")
    )
    lines, on_logs = _logs()
    Template.build(t, name, on_build_logs=on_logs)
    assert any(m.startswith(f"Pulling {ref} (sha256:") for m in lines), lines

    sbx = new_sandbox(name, timeout=300)
    run = sbx.commands.run
    # The image's own file, in a tree that is not vmon's Debian base.
    assert run("cat /etc/oci-marker").stdout == MARKER + "\n"
    assert sbx.files.read("/etc/oci-marker") == MARKER + "\n"
    assert run("test -e /etc/debian_version || echo not-debian").stdout == "not-debian\n"
    # The build's step ran as `user` (uid 1000), and so do sandbox commands.
    assert run("cat /home/user/built.txt").stdout == "built-in-the-image\n"
    assert run("cat /home/user/uid.txt").stdout == "1000\n"
    assert run("whoami").stdout == "user\n"
    assert run("whoami", user="root").stdout == "root\n"
    # The booted kernel's modules came with it.
    assert run("ls /lib/modules/$(uname -r)/modules.dep").exit_code == 0

    # The same image again: its first layer is the cached one (keyed on the digest).
    lines, on_logs = _logs()
    Template.build(t, name, on_build_logs=on_logs)
    assert any(m.startswith(f"CACHED {ref} (sha256:") or m == "CACHED the finished template" for m in lines), lines

    # A Dockerfile's FROM is the same image (its first layer cached by now).
    dockerfile = _name("oci-dockerfile")
    t = Template().from_dockerfile(f"FROM {ref}\nRUN mkdir -p /opt && echo from-dockerfile > /opt/df.txt\n")
    lines, on_logs = _logs()
    Template.build(t, dockerfile, on_build_logs=on_logs)
    assert any(m.startswith(f"CACHED {ref} (sha256:") for m in lines), lines
    sbx = new_sandbox(dockerfile, timeout=300)
    assert sbx.commands.run("cat /opt/df.txt /etc/oci-marker").stdout == f"from-dockerfile\n{MARKER}\n"


def test_a_private_registry_takes_its_login_and_refuses_a_wrong_one(vmon, new_sandbox, private_registry, layout):
    ref = private_registry.push(layout, "test/private:1")
    user, password = private_registry.auth
    with pytest.raises(BuildException) as e:
        Template.build(Template().from_image(ref, username=user, password="wrong-" + password), _name("oci-bad-login"))
    msg = str(e.value)
    assert private_registry.host in msg and "refused the credentials" in msg, msg
    assert password not in msg

    with pytest.raises(BuildException) as e:
        Template.build(Template().from_image(ref), _name("oci-no-login"))
    assert private_registry.host in str(e.value) and "needs credentials" in str(e.value), e.value

    name = _name("oci-login")
    Template.build(Template().from_image(ref, username=user, password=password).run_cmd("true"), name)
    sbx = new_sandbox(name, timeout=300)
    assert sbx.commands.run("cat /etc/oci-marker").stdout == MARKER + "\n"


def test_an_unreachable_registry_or_unknown_image_fails_the_build_at_its_base(vmon, registry, layout):
    dead = f"127.0.0.1:{_free_port()}"
    with pytest.raises(BuildException) as e:
        Template.build(Template().from_image(f"{dead}/test/img:1"), _name("oci-unreachable"))
    assert f"the registry {dead} cannot be reached" in str(e.value), e.value

    registry.push(layout, "test/img:1")
    with pytest.raises(BuildException) as e:
        Template.build(Template().from_image(f"{registry.host}/test/never-pushed:1"), _name("oci-unknown"))
    assert f"the registry {registry.host} has no image" in str(e.value), e.value


def test_an_image_whose_links_lead_to_the_host_fails_cleanly_and_touches_nothing(vmon, registry, tmp_path):
    canary_dir = tmp_path / "canary"
    canary_dir.mkdir()
    canary = canary_dir / "passwd"
    canary.write_text("canary\n")
    before = canary.stat()
    ref = registry.push(_hostile_layout(tmp_path / "img", canary), "test/hostile:1")
    with pytest.raises(BuildException) as e:
        Template.build(Template().from_image(ref), _name("oci-hostile"))
    assert "/etc/passwd goes through more than 40 symbolic links" in str(e.value), e.value
    after = canary.stat()
    assert canary.read_text() == "canary\n"
    assert (after.st_mode, after.st_uid, after.st_gid, after.st_mtime_ns) == (
        before.st_mode,
        before.st_uid,
        before.st_gid,
        before.st_mtime_ns,
    )
    assert [p.name for p in canary_dir.iterdir()] == ["passwd"]
