"""Custom templates through the official Template SDK (`e2b.Template`) against `vmon up`: a
build with every step type, a create from it that sees the files and the running start
command, names and tags, a failing step, the layer cache, and the bad input the API must
refuse."""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request

import pytest
from e2b import BuildException, Sandbox, Template, wait_for_port


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def _logs():
    lines: list[str] = []

    def on(entry) -> None:
        lines.append(entry.message)

    return lines, on


def _api(vmon, method: str, path: str, body=None, key: str | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{vmon.api_url}{path}", data=data, method=method)
    req.add_header("X-API-Key", key or vmon.api_key)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw) if raw else None


def test_a_template_with_every_step_kind_serves_its_sandboxes(vmon, new_sandbox, tmp_path):
    (tmp_path / "hello.txt").write_text("hello from the context\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_text("a\n")
    (tmp_path / "dir" / "b.txt").write_text("b\n")
    name = _name("every-step")
    t = (
        Template(file_context_path=str(tmp_path))
        .from_base_image()
        .run_cmd("echo built > /home/user/built.txt")
        .copy("hello.txt", "/home/user/hello.txt")
        .copy("dir", "/opt/dir/", user="root", mode=0o755)
        .set_envs({"GREETING": "hi there"})
        .run_cmd("echo \"$GREETING\" > /home/user/env.txt")
        .set_workdir("/home/user/app")
        .run_cmd("pwd > where.txt && whoami >> where.txt")
        .set_user("root")
        .run_cmd("whoami > /root/who.txt")
        .set_user("user")
        .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000))
    )
    lines, on_logs = _logs()
    info = Template.build(t, name, on_build_logs=on_logs)
    assert info.template_id and info.build_id
    assert any("RUN echo built" in m for m in lines), lines

    sbx = new_sandbox(name, timeout=300)
    run = sbx.commands.run
    assert run("cat /home/user/built.txt").stdout == "built\n"
    assert run("cat /home/user/hello.txt").stdout == "hello from the context\n"
    assert run("cat /opt/dir/a.txt /opt/dir/b.txt").stdout == "a\nb\n"
    assert run("stat -c '%U %a' /opt/dir/a.txt").stdout.strip() == "root 755"
    assert run("stat -c '%U' /home/user/hello.txt").stdout.strip() == "user"
    assert run("cat /home/user/env.txt").stdout == "hi there\n"
    assert run("cat /home/user/app/where.txt").stdout == "/home/user/app\nuser\n"
    assert run("cat /root/who.txt", user="root").stdout == "root\n"
    # The start command was snapshotted running: the server answers at once.
    page = run("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/")
    assert page.stdout.strip() == "200"

    assert Template.exists(name)
    assert not Template.exists(_name("never-built"))


def test_tags_name_builds_and_sandboxes_start_from_them(vmon, new_sandbox):
    name = _name("tagged")
    t = Template().from_base_image().run_cmd("echo one > /home/user/v.txt")
    Template.build(t, f"{name}:v1")
    tags = {x.tag for x in Template.get_tags(name)}
    assert tags == {"v1"}, tags
    assigned = Template.assign_tags(f"{name}:v1", ["stable", "prod"])
    assert set(assigned.tags) == {"stable", "prod"}
    assert {x.tag for x in Template.get_tags(name)} == {"v1", "stable", "prod"}
    sbx = new_sandbox(f"{name}:stable", timeout=120)
    assert sbx.commands.run("cat /home/user/v.txt").stdout == "one\n"
    Template.remove_tags(name, ["prod"])
    assert {x.tag for x in Template.get_tags(name)} == {"v1", "stable"}


def test_a_failing_step_fails_the_build_with_its_output(vmon):
    name = _name("failing")
    t = (
        Template()
        .from_base_image()
        .run_cmd("echo fine")
        .run_cmd("echo the-step-said-this; echo on-stderr >&2; exit 3")
    )
    lines, on_logs = _logs()
    with pytest.raises(BuildException) as e:
        Template.build(t, name, on_build_logs=on_logs)
    assert "exit code 3" in str(e.value), e.value
    assert "step 2" in str(e.value), e.value
    assert any("the-step-said-this" in m for m in lines), lines
    assert any("on-stderr" in m for m in lines), lines
    # Nothing was published under the name.
    with pytest.raises(Exception):
        Sandbox.create(name, timeout=30)


def test_a_rebuild_reuses_the_layers_it_has(vmon, new_sandbox):
    name = _name("cached")
    # The cache is the team's: a marker of this run's keeps earlier runs' layers out of it.
    marker = secrets.token_hex(4)
    first = (
        Template().from_base_image()
        .run_cmd(f"echo 1 > /home/user/one.txt # {marker}")
        .run_cmd("echo 2 > /home/user/two.txt")
    )
    lines, on_logs = _logs()
    Template.build(first, name, on_build_logs=on_logs)
    assert not any(m.startswith("CACHED") for m in lines), lines

    lines, on_logs = _logs()
    Template.build(first, name, on_build_logs=on_logs)
    assert "CACHED the finished template" in lines, lines

    changed = (
        Template().from_base_image()
        .run_cmd(f"echo 1 > /home/user/one.txt # {marker}")
        .run_cmd("echo 3 > /home/user/two.txt")
    )
    lines, on_logs = _logs()
    Template.build(changed, name, on_build_logs=on_logs)
    assert any(m.startswith("CACHED [1/2]") for m in lines), lines
    assert any(m.startswith("[2/2] RUN echo 3") for m in lines), lines
    sbx = new_sandbox(name, timeout=120)
    assert sbx.commands.run("cat /home/user/one.txt /home/user/two.txt").stdout == "1\n3\n"

    lines, on_logs = _logs()
    Template.build(changed, name, on_build_logs=on_logs, skip_cache=True)
    assert not any(m.startswith("CACHED") for m in lines), lines


def test_bad_template_input_is_refused_and_leaves_nothing(vmon):
    name = _name("bad")
    status, req = _api(vmon, "POST", "/v3/templates", {"name": name})
    assert status == 202, req
    assert set(req) == {"templateID", "buildID", "public", "names", "tags", "aliases"}
    tid, bid = req["templateID"], req["buildID"]

    status, err = _api(vmon, "POST", f"/v2/templates/{tid}/builds/{bid}",
                       {"steps": [{"type": "FROB", "args": [], "force": False}], "force": False})
    assert status == 400 and "unknown step type" in err["message"], err
    status, err = _api(vmon, "POST", f"/v2/templates/{tid}/builds/{bid}", {
        "steps": [{"type": "COPY", "args": ["x", "/x", "", ""], "filesHash": secrets.token_hex(32),
                   "force": False}],
        "force": False})
    assert status == 400 and "never uploaded" in err["message"], err
    # The refused triggers left the build waiting, with nothing published.
    status, st = _api(vmon, "GET", f"/templates/{tid}/builds/{bid}/status?logsOffset=0&limit=100")
    assert status == 200 and st["status"] == "waiting" and "reason" not in st, st

    files_hash = secrets.token_hex(32)
    status, files = _api(vmon, "GET", f"/templates/{tid}/files/{files_hash}")
    assert status == 201 and files["present"] is False, files
    url = files["url"]
    forged = url.replace("signature=", "signature=00")
    req = urllib.request.Request(forged, data=b"x", method="PUT")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401
    req = urllib.request.Request(url, data=b"not really a tar", method="PUT")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 201
    status, files = _api(vmon, "GET", f"/templates/{tid}/files/{files_hash}")
    assert status == 201 and files == {"present": True}, files

    # Names in another team's namespace, and another team's builds.
    status, err = _api(vmon, "POST", "/v3/templates", {"name": f"some-other-team/{name}"})
    assert status == 403, err
    status, err = _api(vmon, "POST", "/v3/templates", {"name": "base"})
    assert status == 409, err
    status, err = _api(vmon, "POST", "/templates", {"alias": name, "dockerfile": "FROM x"})
    assert status == 400 and "Template SDK" in err["message"], err
    status, _ = _api(vmon, "GET", f"/templates/{tid}/builds/{'0' * 8}-0000-4000-8000-{'0' * 12}/status")
    assert status == 404


def test_from_template_and_from_dockerfile(vmon, new_sandbox):
    parent = _name("parent")
    Template.build(Template().from_base_image().run_cmd("echo parent > /home/user/parent.txt"), parent)
    child = _name("child")
    Template.build(
        Template().from_template(parent).run_cmd("cat /home/user/parent.txt > /home/user/child.txt"),
        child,
    )
    sbx = new_sandbox(child, timeout=120)
    assert sbx.commands.run("cat /home/user/child.txt").stdout == "parent\n"

    from_base = _name("from-base")
    Template.build(Template().from_template("base").run_cmd("echo b > /home/user/b.txt"), from_base)
    sbx = new_sandbox(from_base, timeout=120)
    assert sbx.commands.run("cat /home/user/b.txt").stdout == "b\n"

    dockerfile = _name("dockerfile")
    t = Template().from_dockerfile(
        "FROM e2bdev/base\n"
        "ENV GREETING=hello\n"
        "RUN echo \"$GREETING\" > /opt/greeting.txt\n"
        "WORKDIR /srv/app\n"
        "RUN pwd > where.txt && whoami >> where.txt\n"
    )
    Template.build(t, dockerfile)
    sbx = new_sandbox(dockerfile, timeout=120)
    assert sbx.commands.run("cat /opt/greeting.txt").stdout == "hello\n"
    assert sbx.commands.run("cat /srv/app/where.txt").stdout == "/srv/app\nroot\n"


def test_another_team_sees_and_touches_nothing_of_a_template(vmon):
    name = _name("private")
    status, req = _api(vmon, "POST", "/v3/templates", {"name": name})
    assert status == 202, req
    tid, bid, full = req["templateID"], req["buildID"], req["names"][0]
    other = vmon.create_team(f"tpl-{secrets.token_hex(3)}")
    for method, path, body in [
        ("GET", f"/templates/{tid}/builds/{bid}/status", None),
        ("POST", f"/v2/templates/{tid}/builds/{bid}", {"steps": [], "fromImage": "e2bdev/base", "force": False}),
        ("GET", f"/templates/{tid}/files/{'ef' * 32}", None),
        ("GET", f"/templates/{tid}", None),
        ("GET", f"/templates/{tid}/tags", None),
        ("DELETE", f"/templates/{tid}", None),
    ]:
        status, err = _api(vmon, method, path, body, key=other)
        assert status == 404, (method, path, status, err)
        assert set(err) == {"code", "message"}, err
    quoted = urllib.request.quote(full, safe="")
    status, err = _api(vmon, "GET", f"/templates/aliases/{quoted}", key=other)
    assert status == 403, err
    status, listed = _api(vmon, "GET", "/templates", key=other)
    assert status == 200 and tid not in {t["templateID"] for t in listed}
    # Still there for its own team.
    status, st = _api(vmon, "GET", f"/templates/{tid}/builds/{bid}/status")
    assert status == 200 and st["status"] == "waiting", st


def test_a_long_step_streams_its_output_while_it_runs(vmon):
    marker = secrets.token_hex(4)
    t = Template().from_base_image().run_cmd(f"echo first-{marker}; sleep 4; echo second-{marker}")
    entries = []
    Template.build(t, _name("streamed"), on_build_logs=entries.append)
    first = next(e for e in entries if e.message == f"first-{marker}")
    second = next(e for e in entries if e.message == f"second-{marker}")
    # Stamped when the build read them: the first line came out before the step ended.
    assert (second.timestamp - first.timestamp).total_seconds() >= 2, (first, second)
