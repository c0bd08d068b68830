"""The login shell every SDK command runs in (`bash -l -c <cmd>`, a PTY's `bash -i -l`): the
environment it gives users must be Debian's, though vmon's `/etc/profile` and
`/etc/profile.d/vmon-cpu.sh` start no process (see docs/architecture.md, "The guest's login
shell")."""

from __future__ import annotations

from e2b import PtySize

# Debian's own profile, as the base-files package ships it (vmon's /etc/profile replaces it).
DEBIAN_PATH = "env -i /bin/sh -c '. /usr/share/base-files/profile >/dev/null 2>&1; printf %s \"$PATH\"'"


def _env(sbx, cmd: str, user: str, **kw) -> dict[str, str]:
    out = sbx.commands.run(cmd, user=user, **kw).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _expected_coretype(sbx) -> str | None:
    """What the guest's CPU needs, read from its /proc/cpuinfo here: Prescott when the first
    `flags` line has no ssse3 (TCG's qemu64), else nothing (OpenBLAS chooses)."""
    cpuinfo = sbx.commands.run("cat /proc/cpuinfo").stdout
    flags = next(line for line in cpuinfo.splitlines() if line.startswith("flags"))
    return None if "ssse3" in flags.split(":", 1)[1].split() else "Prescott"


def test_login_shell_environment_is_debians(new_sandbox):
    sbx = new_sandbox()
    coretype = _expected_coretype(sbx)
    for user, home in (("user", "/home/user"), ("root", "/root")):
        debian = sbx.commands.run(DEBIAN_PATH, user=user).stdout
        assert debian.startswith("/usr/local/"), debian
        env = _env(sbx, "env", user)
        assert env["PATH"] == debian, (user, env["PATH"], debian)
        assert env["HOME"] == home and env["USER"] == user
        assert env.get("OPENBLAS_CORETYPE") == coretype, (user, env.get("OPENBLAS_CORETYPE"))
        # sh reads /etc/profile too (dash has no $EUID: it asks `id -u`).
        env = _env(sbx, "sh -l -c env", user)
        assert env["PATH"] == debian, (user, "sh", env["PATH"])
        assert env.get("OPENBLAS_CORETYPE") == coretype, (user, "sh")
        # Nothing of the profile's own is left behind in the shell.
        names = sbx.commands.run("compgen -v", user=user).stdout.split()
        assert not [n for n in names if n.startswith("vmon") or n == "i"], names
    # A value the user sets wins over the CPU's.
    env = _env(sbx, "env", "user", envs={"OPENBLAS_CORETYPE": "Haswell"})
    assert env["OPENBLAS_CORETYPE"] == "Haswell"
    # The user's ~/.profile still runs after /etc/profile: it puts ~/.local/bin first once it
    # exists.
    sbx.commands.run("mkdir -p ~/.local/bin", user="user")
    path = _env(sbx, "env", "user")["PATH"]
    assert path.split(":")[0] == "/home/user/.local/bin", path


def test_login_bash_starts_no_id(new_sandbox):
    """Debian's `/etc/profile` asks `id -u` (a process); vmon's takes bash's $EUID. An `id`
    earlier on the PATH the shell starts with records every call."""
    sbx = new_sandbox()
    sbx.files.write("/usr/local/bin/id", '#!/bin/sh\necho "$0" >> /tmp/id-calls\nexec /usr/bin/id "$@"\n', user="root")
    sbx.commands.run("chmod 755 /usr/local/bin/id && : > /tmp/id-calls && chmod 666 /tmp/id-calls", user="root")
    for user in ("user", "root"):
        assert sbx.commands.run("id -un", user=user).stdout.strip() == user
        assert sbx.commands.run("echo ok", user=user).stdout == "ok\n"
    # The `id -un` commands above ran /usr/local/bin/id themselves (once each); the login
    # shells ran none.
    assert sbx.files.read("/tmp/id-calls").count("\n") == 2
    # The wrapper does catch the profile's call where there is one: sh (dash) has no $EUID.
    sbx.commands.run("sh -l -c true", user="user")
    assert sbx.files.read("/tmp/id-calls").count("\n") == 3


def test_root_terminal_still_gets_mesg_n(new_sandbox):
    """root's ~/.profile runs `mesg n` only on a terminal now (elsewhere it failed anyway): a
    root PTY's terminal loses group write (620 -> 600) as on Debian."""
    sbx = new_sandbox()
    out = bytearray()
    term = sbx.pty.create(PtySize(rows=24, cols=200), user="root")
    sbx.pty.send_stdin(term.pid, b"echo MODE=$(stat -c %a $(tty)); exit\n")
    term.wait(on_pty=lambda data: out.extend(data))
    assert b"MODE=600" in out, bytes(out)
    # A terminal as `user` (whose ~/.profile has no mesg) keeps its mode.
    out.clear()
    term = sbx.pty.create(PtySize(rows=24, cols=200), user="user")
    sbx.pty.send_stdin(term.pid, b"echo MODE=$(stat -c %a $(tty)); exit\n")
    term.wait(on_pty=lambda data: out.extend(data))
    assert b"MODE=620" in out, bytes(out)
