"""Docker inside a sandbox, with the official SDK against `vmon up`: the Template SDK recipe of
docs/templates.md (Debian's docker.io, `dockerd` as the start command, so the template's memory
snapshot has it running), then in its sandboxes `docker build` of an image FROM scratch and
`docker import` of a tarball (no registry is reachable), a container serving a published port
through vmon's proxy, pause/resume and fork with the container running, its stop, and the
sandbox's network policy holding for its containers.

The template is built once per session and shared by the tests: apt in a TCG guest, 4-6
minutes on a quiet 2-core machine, 9-13 at load 11-20 (docs/templates.md). Every packet goes to addresses this test controls: a network namespace of its own
standing in for the world beyond the host, and this machine's address on the link to it."""

from __future__ import annotations

import secrets
import shlex
import subprocess
import time

import httpx
import pytest
from e2b import Sandbox, Template

from conftest import wait_for
from test_isolation import Listener

NS = "vmt-e2e-docker"
HOST_IF = "vmt-e2e-dk0"
# A "public" server beyond the host, and this machine's own address next to it: a /29 of
# TEST-NET-2 no other test routes (test_secrets_egress.py uses the /24's .41 and .42).
PUBLIC, HOST_ADDR, PREFIX = "198.51.100.202", "198.51.100.201", 29

# The recipe docs/templates.md shows (busybox-static only gives the tests a static binary to
# put in an image FROM scratch).
RECIPE = (
    Template()
    .from_base_image()
    .apt_install(["docker.io", "busybox-static"], no_install_recommends=True)
    .run_cmd("usermod -aG docker user", user="root")
    .set_user("root")
    .set_start_cmd("dockerd", "docker info")
)

# An image FROM scratch: Debian's static busybox serving /www on 8080.
DOCKERFILE = """FROM scratch
COPY busybox /bin/busybox
COPY www /www
EXPOSE 8080
CMD ["/bin/busybox", "httpd", "-f", "-p", "8080", "-h", "/www"]
"""


def sh(script: str) -> None:
    subprocess.run(["sh", "-e", "-c", script], check=True, capture_output=True)


@pytest.fixture(scope="module")
def docker_template(vmon) -> str:
    name = f"docker-{secrets.token_hex(4)}"
    lines: list[str] = []
    t0 = time.monotonic()
    try:
        Template.build(RECIPE, name, on_build_logs=lambda e: lines.append(e.message))
    except Exception as e:
        raise AssertionError(f"the docker template's build failed: {e}\n" + "\n".join(lines[-40:])) from e
    print(f"docker template built in {time.monotonic() - t0:.0f} s")
    return name


@pytest.fixture(scope="module")
def beyond():
    sh(f"ip netns del {NS} 2>/dev/null || true; ip link del {HOST_IF} 2>/dev/null || true")
    sh(
        f"""ip netns add {NS}
ip link add {HOST_IF} type veth peer name eth0 netns {NS}
ip addr add {HOST_ADDR}/{PREFIX} dev {HOST_IF}
ip link set {HOST_IF} up
ip -n {NS} link set lo up
ip -n {NS} addr add {PUBLIC}/{PREFIX} dev eth0
ip -n {NS} link set eth0 up"""
    )
    public, host = Listener(PUBLIC, NS), Listener(HOST_ADDR)
    yield public, host
    public.close()
    host.close()
    sh(f"ip netns del {NS} 2>/dev/null || true; ip link del {HOST_IF} 2>/dev/null || true")


def run(sbx: Sandbox, cmd: str, timeout: int = 300, user: str = "user") -> str:
    """`cmd`'s stdout; a failure raises with its output."""
    return sbx.commands.run(cmd, user=user, timeout=timeout).stdout


def build_web_image(sbx: Sandbox) -> None:
    sbx.files.write("/home/user/web/Dockerfile", DOCKERFILE)
    sbx.files.write("/home/user/web/www/index.html", "hello from a container\n")
    run(sbx, "cp /bin/busybox /home/user/web/ && docker build -q -t web /home/user/web")


def page(sbx: Sandbox, path: str = "/") -> str | None:
    """The container's page through vmon's proxy, as any client reaches a guest port; None
    while nothing answers there."""
    try:
        r = httpx.get(f"http://{sbx.get_host(8080)}{path}", timeout=30)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def test_a_container_builds_runs_serves_survives_pause_and_fork_and_stops(docker_template, new_sandbox):
    sbx = new_sandbox(docker_template, timeout=1800)
    # dockerd is running from the template's snapshot, and `user` (group docker) may use it.
    assert run(sbx, "docker info --format '{{.Driver}} {{.CgroupVersion}}'").split() == ["overlay2", "2"]

    build_web_image(sbx)
    # `docker import` of a tarball made in the guest.
    out = run(
        sbx,
        "mkdir -p /tmp/root/bin && cp /bin/busybox /tmp/root/bin/ && tar -C /tmp/root -c . | docker import - imported"
        " && docker run --rm imported /bin/busybox echo imported-ok",
    )
    assert out.strip().endswith("imported-ok"), out

    run(sbx, "docker run -d --name web -p 8080:8080 web")
    assert wait_for(lambda: page(sbx), timeout=120, what="the container's page") == "hello from a container\n"

    sbx.pause()
    sbx = Sandbox.connect(sbx.sandbox_id, timeout=1800)
    assert page(sbx) == "hello from a container\n", "after resume"
    assert run(sbx, "docker inspect -f '{{.State.Running}}' web").strip() == "true"

    (child,) = sbx.fork(count=1, timeout=600)
    try:
        assert page(child) == "hello from a container\n", "in the fork's child"
        # The child's container is its own: a change there is not the parent's.
        run(child, "docker exec web /bin/busybox sh -c 'echo child > /www/who.html'")
        assert page(child, "/who.html") == "child\n"
        assert page(sbx, "/who.html") is None
        assert page(sbx) == "hello from a container\n", "the parent after the fork"
    finally:
        child.kill()

    run(sbx, "docker stop -t 1 web")
    assert run(sbx, "docker inspect -f '{{.State.Status}}' web").strip() == "exited"
    assert page(sbx) is None


def probes(targets: list[tuple[str, int]]) -> str:
    """A shell loop (busybox's) printing `reached` or `blocked` per target, in order."""
    return "; ".join(
        f"(nc -w 3 {ip} {port} </dev/null >/dev/null 2>&1 && echo reached || echo blocked)" for ip, port in targets
    )


def test_a_container_reaches_only_what_its_sandbox_may(docker_template, beyond, new_sandbox):
    public, host = beyond
    targets = [(PUBLIC, public.port), (HOST_ADDR, host.port)]
    seen = {}
    for internet in (True, False):
        sbx = new_sandbox(docker_template, timeout=900, allow_internet_access=internet)
        build_web_image(sbx)
        before = public.hits
        in_guest = run(sbx, "busybox sh -c " + shlex.quote(probes(targets))).split()
        in_container = run(sbx, "docker run --rm web /bin/busybox sh -c " + shlex.quote(probes(targets))).split()
        seen[internet] = (in_guest, in_container, public.hits - before)
    # With the internet open, the sandbox and its container reach the server beyond the host
    # (so the container's network works); closed, neither does. This machine's own address is
    # out of reach of both either way.
    assert seen[True][:2] == (["reached", "blocked"], ["reached", "blocked"]), seen
    assert seen[True][2] >= 2, seen
    assert seen[False] == (["blocked", "blocked"], ["blocked", "blocked"], 0), seen
    assert host.hits == 0
