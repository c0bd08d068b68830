"""The Debian package (scripts/package.sh, deploy/): built from the binaries CI has already built,
installed with dpkg into a fresh Debian root, and checked for what it put where: binaries that
run, the units (which `systemd-analyze verify` accepts), the configuration as conffiles, the
service user, the state directories and secrets the postinst makes; then an upgrade in place
keeps an edited conffile and the secrets, and a purge removes what it should and keeps the data.

The fresh root is an overlay over a debootstrapped Debian tree, never written itself: the guest
image's cached debootstrap tree when one is there ($VMON_TEST_DATA_DIR/images/trees), else a
minbase debootstrap made once into $VMON_TEST_DATA_DIR/deploy-root. Needs root (mounts, chroot).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("VMON_TEST_DATA_DIR", "/var/tmp/vmon-ci"))
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", str(REPO / "target")))
UNITS = ["vmon-api", "vmon-node", "vmon-proxy", "vmon-up"]


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("check", True)
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    return subprocess.run(list(args), **kw)


def workspace_version() -> str:
    m = re.search(r'^version = "([^"]+)"', (REPO / "Cargo.toml").read_text(), re.M)
    assert m
    return m.group(1)


def debian_tree() -> Path:
    """A configured Debian tree to lay the fresh root over."""
    trees = sorted(
        (t for t in (DATA / "images" / "trees").glob("*") if (t / ".vmon-complete").exists()),
        key=lambda t: t.stat().st_mtime,
        reverse=True,
    )
    if trees:
        return trees[0]
    suite = run("sh", "-c", ". /etc/os-release && echo $VERSION_CODENAME").stdout.strip() or "bookworm"
    root = DATA / "deploy-root" / suite
    if not (root / ".complete").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.parent.mkdir(parents=True, exist_ok=True)
        run("debootstrap", "--variant=minbase", "--include=ca-certificates", suite, str(root),
            timeout=1800)
        (root / ".complete").touch()
    return root


@pytest.fixture(scope="module")
def deb() -> Path:
    run("cargo", "build", "-p", "vmon", "-p", "vmon-envd", cwd=REPO, capture_output=False)
    out = Path(tempfile.mkdtemp(prefix="vmon-deb-", dir="/var/tmp"))
    try:
        built = run(
            "scripts/package.sh", "--out", str(out), cwd=REPO,
            env={**os.environ, "VMON_DEB_PROFILE": "dev"},
        ).stdout.strip().splitlines()[-1]
        path = Path(built)
        assert path.is_file(), built
        yield path
    finally:
        shutil.rmtree(out, ignore_errors=True)


class Root:
    """An overlay over a Debian tree with /dev and /proc, where dpkg installs."""

    def __init__(self, tree: Path):
        self.tmp = Path(tempfile.mkdtemp(prefix="vmon-root-", dir="/var/tmp"))
        self.upper, self.work, self.path = (self.tmp / n for n in ("upper", "work", "root"))
        for d in (self.upper, self.work, self.path):
            d.mkdir()
        self.mounts: list[Path] = []
        try:
            self._mount("-t", "overlay", "overlay", "-o",
                        f"lowerdir={tree},upperdir={self.upper},workdir={self.work}", str(self.path))
            self._mount("--bind", "/dev", str(self.path / "dev"))
            self._mount("-t", "proc", "proc", str(self.path / "proc"))
        except BaseException:
            self.close()
            raise

    def _mount(self, *args: str) -> None:
        run("mount", *args)
        self.mounts.append(Path(args[-1]))

    def close(self) -> None:
        for m in reversed(self.mounts):
            run("umount", "-l", str(m), check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __truediv__(self, rel: str) -> Path:
        return self.path / rel.lstrip("/")

    def dpkg(self, *args: str) -> subprocess.CompletedProcess:
        return run("dpkg", f"--root={self.path}", *args,
                   env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})

    def chroot(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run("chroot", str(self.path), *args, check=check, timeout=60,
                   env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"})

    def passwd(self, name: str) -> list[str] | None:
        for line in (self / "etc/passwd").read_text().splitlines():
            if line.split(":")[0] == name:
                return line.split(":")
        return None


@pytest.fixture
def root():
    r = Root(debian_tree())
    try:
        yield r
    finally:
        r.close()


def mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_the_package_installs_into_a_fresh_root(deb: Path, root: Root):
    version = workspace_version()
    info = run("dpkg-deb", "--field", str(deb), "Package", "Version", "Depends", "Recommends").stdout
    assert "Package: vmon" in info
    assert f"Version: {version}" in info
    assert "passwd" in info and "libc6" in info, info
    assert "qemu-system-x86" in info, info

    root.dpkg("-i", str(deb))
    status = root.dpkg("-s", "vmon").stdout
    assert "Status: install ok installed" in status, status

    # The binaries: vmon and envd side by side (the node takes `envd` beside its own path),
    # /usr/bin/vmon execing the one there; both run in the fresh root.
    lib = root / "usr/lib/vmon"
    for name in ("vmon", "envd"):
        assert (lib / name).read_bytes()[:4] == b"\x7fELF"
        assert mode(lib / name) == 0o755
    assert "exec /usr/lib/vmon/vmon " in (root / "usr/bin/vmon").read_text()
    assert mode(root / "usr/bin/vmon") == 0o755
    assert root.chroot("/usr/bin/vmon", "--version").stdout.strip() == f"vmon {version}"
    assert root.chroot("/usr/lib/vmon/envd", "--version").stdout.strip()

    # Units, configuration (as conffiles), rules and dashboard, docs.
    for unit in UNITS:
        text = (root / f"lib/systemd/system/{unit}.service").read_text()
        assert "ExecStart=/usr/bin/vmon " in text
    conffiles = root.dpkg("-s", "vmon").stdout
    for f in ("config.toml", "api.env", "node.env", "proxy.env", "up.env"):
        assert f"/etc/vmon/{f}" in conffiles, conffiles
    assert mode(root / "etc/vmon/config.toml") == 0o644
    assert mode(root / "etc/vmon/node.env") == 0o600
    assert (root / "usr/share/vmon/prometheus/rules.yml").is_file()
    assert (root / "usr/share/vmon/grafana/vmon.json").is_file()
    assert (root / "usr/share/doc/vmon/deploy.md").is_file()

    # The postinst: a system user without a login, the state dirs, the shared secrets.
    user = root.passwd("vmon")
    assert user is not None
    uid, gid = int(user[2]), int(user[3])
    assert 0 < uid < 1000 and user[6] == "/usr/sbin/nologin", user
    for d, want_mode, want_uid in [
        ("var/lib/vmon", 0o755, 0),
        ("var/lib/vmon/node", 0o755, 0),
        ("var/lib/vmon/volumes", 0o755, 0),
        ("var/lib/vmon/api", 0o750, uid),
        ("var/lib/vmon/proxy", 0o700, 0),
    ]:
        st = (root / d).stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (want_mode, want_uid), d
    api_token = root / "var/lib/vmon/api/admin-token"
    proxy_token = root / "var/lib/vmon/proxy/admin-token"
    assert re.fullmatch(r"[0-9a-f]{64}", api_token.read_text())
    assert api_token.read_text() == proxy_token.read_text()
    assert (api_token.stat().st_uid, api_token.stat().st_gid, mode(api_token)) == (uid, gid, 0o600)
    assert (proxy_token.stat().st_uid, mode(proxy_token)) == (0, 0o600)
    node_token = root / "etc/vmon/node-token.env"
    assert re.fullmatch(r"VMON_NODE_TOKEN=[0-9a-f]{64}\n", node_token.read_text())
    assert (node_token.stat().st_uid, mode(node_token)) == (0, 0o600)

    # The packaged configuration loads (a parse error would say so before the wait).
    out = root.chroot("env", "VMON_CONFIG=/etc/vmon/config.toml", "/usr/bin/vmon",
                      "--data-dir", "/tmp/cfg", "up", "--print-env", "--wait-secs", "0", check=False)
    assert out.returncode != 0
    assert "no ready vmon up answered at http://127.0.0.1:3000/health" in out.stderr, out.stderr

    # The units as installed, against this host's systemd: the installed /usr/bin and /usr/lib
    # are laid under the host's (whose files win) in a mount namespace of this command only,
    # since verify checks that ExecStart's binary is there.
    unit_files = [str(root / f"lib/systemd/system/{u}.service") for u in UNITS]
    verify = run(
        "unshare", "-m", "--propagation", "private", "sh", "-c",
        f'mount -t overlay overlay -o lowerdir=/usr/bin:{root / "usr/bin"} /usr/bin && '
        f'mount -t overlay overlay -o lowerdir=/usr/lib:{root / "usr/lib"} /usr/lib && '
        'exec systemd-analyze verify "$@"', "verify", *unit_files,
        check=False,
    )
    complaints = [line for line in verify.stderr.splitlines() if "vmon" in line]
    assert verify.returncode == 0 and not complaints, verify.stderr

    # An upgrade in place keeps an edited conffile and every secret.
    config = root / "etc/vmon/config.toml"
    config.write_text(config.read_text() + '\nclient_id = "api-7"\n')
    tokens = (api_token.read_text(), node_token.read_text())
    root.dpkg("-i", str(deb))
    assert 'client_id = "api-7"' in config.read_text()
    assert (api_token.read_text(), node_token.read_text()) == tokens

    # A purge removes the program, the configuration and the node token; the data stays.
    root.dpkg("--purge", "vmon")
    assert not (root / "usr/lib/vmon/vmon").exists()
    assert not (root / "usr/bin/vmon").exists()
    assert not (root / "etc/vmon").exists()
    assert api_token.read_text() == tokens[0]
    assert root.passwd("vmon") is not None
