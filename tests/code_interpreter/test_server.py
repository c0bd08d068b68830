"""The guest's code-interpreter server (crates/image/assets/code_interpreter.py and its package
code_interpreter/) run as a host process: its wire, parsed with the official SDK's own parser,
without any VM. A real envd (the host build, with an access token) runs beside it: the server
asks envd whether a request's token is the sandbox's."""

from __future__ import annotations

import base64
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from e2b_code_interpreter.models import Context, Execution, parse_output

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "crates/image/assets/code_interpreter.py"
TOKEN = "ci-test-token-" + os.urandom(8).hex()
AUTH = {"X-Access-Token": TOKEN}


def _envd_binary() -> Path:
    explicit = os.environ.get("ENVD_BIN")
    if explicit:
        return Path(explicit)
    subprocess.run(["cargo", "build", "-q", "-p", "vmon-envd", "--bin", "envd"], cwd=ROOT, check=True)
    return Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug" / "envd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(port, path, ok):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", path)
            if c.getresponse().status == ok:
                return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def _start_envd(token, *extra):
    port = _free_port()
    proc = subprocess.Popen(
        [str(_envd_binary()), "--addr", f"127.0.0.1:{port}", "--access-token", token, *extra],
        env=dict(os.environ, RUST_LOG="warn"),
        stdout=subprocess.DEVNULL,
    )
    assert _wait_http(port, "/health", 204), "envd did not come up"
    return proc, port


@pytest.fixture(scope="module")
def envd():
    proc, port = _start_envd(TOKEN)
    yield port
    proc.terminate()
    proc.wait(10)


def _start_server(home, envd_port, **env_extra):
    port = _free_port()
    env = dict(os.environ, HOME=str(home), VMON_CI_ENVD=f"http://127.0.0.1:{envd_port}", **env_extra)
    # ipykernel does not capture fd 1 and 2 (a subprocess's output) under pytest.
    env.pop("PYTEST_CURRENT_TEST", None)
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=home,
        stderr=subprocess.PIPE,
        text=True,
        # Started as a shell without job control starts a background job (CI's own runs):
        # SIGINT ignored, which every process it starts inherits unless it sets a handler. The
        # interrupt tests must pass either way; this way is the one that once failed them.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                break
        except OSError:
            pass
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.1)
    return proc, port


def _stop_server(proc):
    # Kernels and workers run in sessions of their own: end them with the server, or every
    # run leaves its kernels behind on the machine.
    _kill_descendants(proc.pid)
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory, envd):
    home = tmp_path_factory.mktemp("home")
    proc, port = _start_server(home, envd)
    yield port, home
    _stop_server(proc)


def _kill_descendants(pid: int) -> None:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                # pid (comm) state ppid ...: comm may hold spaces, so split after its ')'.
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    todo, found = [pid], []
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    for c in found:
        try:
            os.kill(c, signal.SIGKILL)
        except ProcessLookupError:
            pass


def request(port, method, path, body=None, timeout=30):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = json.dumps(body).encode() if body is not None else None
    c.request(method, path, body=data, headers={"Content-Type": "application/json", **AUTH})
    r = c.getresponse()
    return r.status, r.read().decode()


def execute(port, code, on_stdout=None, on_stderr=None, auth=None, **kw):
    """Runs a cell; returns (Execution parsed by the SDK, raw lines)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"code": code, "context_id": None, "language": None, "env_vars": None}
    body.update(kw)
    c.request("POST", "/execute", body=json.dumps(body),
              headers={"Content-Type": "application/json", **(auth or AUTH)})
    r = c.getresponse()
    assert r.status == 200, r.read()
    ex = Execution()
    lines = []
    while True:
        line = r.readline()
        if not line:
            break
        line = line.decode().rstrip("\n")
        assert line, "empty line in the stream"
        lines.append(json.loads(line))
        parse_output(ex, line, on_stdout=on_stdout, on_stderr=on_stderr)
    return ex, lines


def test_health(server):
    port, _ = server
    assert request(port, "GET", "/health")[0] == 200


def test_value_of_last_expression(server):
    port, _ = server
    ex, lines = execute(port, "x = 41")
    assert ex.results == [] and ex.error is None
    ex, _ = execute(port, "x + 1")
    assert ex.text == "42"
    assert ex.results[0].is_main_result
    ex, _ = execute(port, "'s'")
    assert ex.text == "s"  # a string's repr without its quotes, as E2B's server gives it
    ex, _ = execute(port, "y = 2\ny * 3")
    assert ex.text == "6"
    ex, _ = execute(port, "None")
    assert ex.results == []
    assert isinstance(ex.execution_count, int)


def test_stdout_stderr(server):
    port, _ = server
    ex, lines = execute(port, "print('hi')\nimport sys; print('oops', file=sys.stderr)")
    assert ex.logs.stdout == ["hi\n"]
    assert ex.logs.stderr == ["oops\n"]
    assert all(isinstance(l["timestamp"], int) for l in lines if l["type"] in ("stdout", "stderr"))
    ex, _ = execute(port, "import os; os.system('echo from-a-subprocess')")
    assert ex.logs.stdout == ["from-a-subprocess\n"]
    ex, _ = execute(port, "print('no newline', end='')")
    assert "".join(ex.logs.stdout) == "no newline"


def test_stdout_streams_while_running(server):
    port, _ = server
    seen = []

    def on_stdout(msg):
        seen.append((time.monotonic(), msg.line))

    t0 = time.monotonic()
    ex, _ = execute(port, "import time\nprint('first')\ntime.sleep(1.5)\nprint('second')", on_stdout=on_stdout)
    assert [l for _, l in seen] == ["first\n", "second\n"]
    assert seen[0][0] - t0 < 1.2, "first line arrived only at the end"
    assert ex.logs.stdout == ["first\n", "second\n"]


def test_errors(server):
    port, _ = server
    ex, _ = execute(port, "survivor = 41")
    assert ex.error is None
    ex, _ = execute(port, "1/0")
    assert ex.error.name == "ZeroDivisionError"
    assert ex.error.value == "division by zero"
    # No frame of the server's: its files are the entry and the package `code_interpreter/`.
    assert "1/0" in ex.error.traceback and "code_interpreter" not in ex.error.traceback
    ex, _ = execute(port, "def f():\n    raise ValueError('bad')\nprint('before')\nf()")
    assert ex.error.name == "ValueError" and ex.error.value == "bad"
    assert ex.logs.stdout == ["before\n"]
    ex, _ = execute(port, "1/")
    assert ex.error.name == "SyntaxError"
    ex, _ = execute(port, "raise SystemExit(3)")
    assert ex.error.name == "SystemExit"
    ex, _ = execute(port, "survivor + 1")  # the context survived all of that
    assert ex.error is None and ex.text == "42"


def test_a_cell_after_an_error_runs(server):
    """A failed cell never spoils the next: each runs whole, at once after the error."""
    port, _ = server
    for i in range(10):
        ex, _ = execute(port, "print('before'); 1/0")
        assert ex.error is not None and ex.error.name == "ZeroDivisionError"
        ex, _ = execute(port, f"print('after {i}'); {i} * 2")
        assert ex.error is None, ex.error
        assert "".join(ex.logs.stdout) == f"after {i}\n" and ex.text == str(i * 2)
        # A failing cell's env_vars are taken back too, at once.
        ex, _ = execute(port, "1/0", env_vars={"VMON_AFTER_ERR": str(i)})
        assert ex.error is not None
        ex, _ = execute(port, "import os; os.environ.get('VMON_AFTER_ERR', 'unset')")
        assert ex.text == "unset", ex


def test_env_vars_are_per_cell(server):
    port, _ = server
    ex, _ = execute(port, "import os; os.environ.get('VMON_T')", env_vars={"VMON_T": "v"})
    assert ex.text == "v"
    ex, _ = execute(port, "os.environ.get('VMON_T')")
    assert ex.results == []


def test_top_level_await(server):
    port, _ = server
    ex, _ = execute(port, "import asyncio\nawait asyncio.sleep(0.01)\n7")
    assert ex.text == "7", ex.error


def test_rich_result(server):
    port, _ = server
    ex, _ = execute(port, "class H:\n    def _repr_html_(self): return '<b>x</b>'\nH()")
    assert ex.results[0].html == "<b>x</b>"


def test_contexts(server):
    port, home = server
    status, body = request(port, "POST", "/contexts", {"language": "python", "cwd": str(home / "sub")})
    assert status == 200, body
    ctx = Context.from_json(json.loads(body))
    assert ctx.cwd == str(home / "sub") and ctx.language == "python"
    execute(port, "z = 'default'")
    ex, _ = execute(port, "z = 'mine'\nimport os; os.getcwd()", context_id=ctx.id)
    assert ex.text == str(home / "sub")
    ex, _ = execute(port, "z")
    assert ex.text == "default"
    ex, _ = execute(port, "x", context_id=ctx.id)
    assert ex.error.name == "NameError"
    ids = [c["id"] for c in json.loads(request(port, "GET", "/contexts")[1])]
    assert ctx.id in ids
    assert request(port, "POST", f"/contexts/{ctx.id}/restart")[0] == 200
    ex, _ = execute(port, "z", context_id=ctx.id)
    assert ex.error.name == "NameError"
    assert request(port, "DELETE", f"/contexts/{ctx.id}")[0] == 204
    assert request(port, "DELETE", f"/contexts/{ctx.id}")[0] == 404
    status, _ = request(port, "POST", "/execute", {"code": "1", "context_id": ctx.id})
    assert status == 404


def test_bad_input(server):
    port, _ = server
    assert request(port, "POST", "/execute", {"code": 1})[0] == 400
    assert request(port, "POST", "/execute", {"code": "1", "language": "cobol"})[0] == 400
    assert request(port, "POST", "/contexts", {"language": "cobol"})[0] == 400
    assert request(port, "GET", "/nope")[0] == 404
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", "/execute", body=b"{not json", headers={"Content-Type": "application/json", **AUTH})
    assert c.getresponse().status == 400
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.putrequest("POST", "/execute")
    c.putheader("X-Access-Token", TOKEN)
    c.putheader("Content-Length", str(1 << 30))
    c.endheaders()
    assert c.getresponse().status == 413
    ex, _ = execute(port, "'\\x1evmon-cell-end 0'")  # a marker-looking value is just a value
    assert ex.error is None
    ex, _ = execute(port, "print('\\x1evmon-cell-end 999')\nprint('after')")
    assert "".join(ex.logs.stdout).endswith("after\n")
    ex, _ = execute(port, "echo '\x1evmon-cell-end 999'; echo after", language="bash")
    assert ex.logs.stdout[-1] == "after\n"
    assert request(port, "GET", "/health")[0] == 200


def test_dead_worker_restarts(server):
    port, _ = server
    status, body = request(port, "POST", "/contexts", {})
    cid = json.loads(body)["id"]
    execute(port, "keep = 1", context_id=cid)
    ex, _ = execute(port, "import os; os._exit(1)", context_id=cid)
    assert ex.error.name == "ContextDied"
    ex, _ = execute(port, "2 + 2", context_id=cid)
    assert ex.text == "4"


def test_client_disconnect_interrupts_cell(server):
    port, _ = server
    status, body = request(port, "POST", "/contexts", {})
    cid = json.loads(body)["id"]
    s = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"code": "import time\ntime.sleep(600)", "context_id": cid}).encode()
    s.sendall(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    time.sleep(1)
    s.close()
    t0 = time.monotonic()
    ex, _ = execute(port, "'free again'", context_id=cid)
    assert ex.text == "free again"
    assert time.monotonic() - t0 < 15


def test_concurrent_cells_in_one_context_queue(server):
    port, _ = server
    status, body = request(port, "POST", "/contexts", {})
    cid = json.loads(body)["id"]
    execute(port, "n = 0", context_id=cid)
    out = []

    def bump():
        ex, _ = execute(port, "import time\nn += 1\ntime.sleep(0.2)\nn", context_id=cid)
        out.append(ex.text)

    ts = [threading.Thread(target=bump) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(out) == ["1", "2", "3"]


def test_bash_cells_keep_their_shell(server):
    port, home = server
    ex, _ = execute(port, "X=41; cd /tmp; f() { echo \"f:$1\"; }", language="bash")
    assert ex.error is None, ex.error
    ex, _ = execute(port, "echo $((X + 1)); pwd; f ok; echo err >&2", language="bash")
    assert ex.logs.stdout == ["42\n", "/tmp\n", "f:ok\n"], ex.logs
    assert ex.logs.stderr == ["err\n"]
    assert ex.results == []
    ex, _ = execute(port, "echo before; false", language="bash")
    assert ex.logs.stdout == ["before\n"] and ex.error.name == "CommandExitError"
    assert ex.error.value == "exit status 1"
    # Per-cell variables go away after the cell, an existing one gets its value back.
    ex, _ = execute(port, "echo $X-$ONLY", language="bash", env_vars={"X": "cell", "ONLY": "here"})
    assert ex.logs.stdout == ["cell-here\n"]
    ex, _ = execute(port, "echo \"$X-${ONLY-unset}\"", language="bash")
    assert ex.logs.stdout == ["41-unset\n"]
    # A cell that reads stdin gets end of input, not the next cell.
    ex, _ = execute(port, "cat; echo done", language="bash")
    assert ex.logs.stdout == ["done\n"]
    # Python's default context is another process.
    ex, _ = execute(port, "import os; os.getcwd()")
    assert ex.text != "'/tmp'"
    status, body = request(port, "POST", "/contexts", {"language": "bash", "cwd": str(home)})
    assert status == 200 and json.loads(body)["language"] == "bash"
    ctx = json.loads(body)["id"]
    ex, _ = execute(port, "pwd; echo ${X-none}", context_id=ctx)
    assert ex.logs.stdout == [f"{home}\n", "none\n"]


def _leave_mid_cell(port, code):
    """Starts a bash cell and leaves (a 2 s read timeout, then the connection closes)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    body = {"code": code, "language": "bash"}
    c.request("POST", "/execute", body=json.dumps(body), headers={"Content-Type": "application/json", **AUTH})
    r = c.getresponse()
    with pytest.raises(TimeoutError):
        r.read()
    c.close()


def test_a_bash_cell_is_interrupted_when_its_client_leaves(server):
    port, _ = server
    execute(port, "KEEP=yes", language="bash")
    _leave_mid_cell(port, "sleep 60; echo late")
    t0 = time.monotonic()
    ex, _ = execute(port, "echo $KEEP", language="bash")
    assert ex.logs.stdout == ["yes\n"], ex.logs  # the shell and its state outlived the interrupt
    assert time.monotonic() - t0 < 30


def test_a_bash_cell_deaf_to_the_first_interrupt_is_interrupted_again(server):
    """The server repeats SIGINT until the cell ends, so a cell that missed the first one (here
    it ignores SIGINT for 4 s; on a loaded machine a SIGINT can land before the command starts)
    is stopped without killing its shell, whose state outlives it."""
    port, _ = server
    execute(port, "KEPT=still", language="bash")
    _leave_mid_cell(port, "trap '' INT; sleep 4; trap : INT; sleep 60; echo late")
    ex, _ = execute(port, "echo $KEPT", language="bash")
    assert ex.logs.stdout == ["still\n"], ex.logs


def test_js_cells(server):
    port, home = server
    ex, _ = execute(port, "var n = 41; const f = (x) => x * 2; console.log('hi'); n + 1", language="js")
    assert ex.error is None, ex.error
    assert ex.text == "42" and ex.results[0].is_main_result
    assert ex.logs.stdout == ["hi\n"]
    ex, _ = execute(port, "f(n)", language="js")
    assert ex.text == "82"
    ex, _ = execute(port, "({a: [1, 2], s: 'x'})", language="javascript")
    assert ex.text == "{ a: [ 1, 2 ], s: 'x' }"
    ex, _ = execute(port, "await new Promise((r) => setTimeout(() => r(7), 50))", language="js")
    assert ex.error is None, ex.error
    ex, _ = execute(port, "Promise.resolve(5)", language="js")
    assert ex.text == "5"
    ex, _ = execute(port, "null.x", language="js")
    assert ex.error.name == "TypeError" and "null" in ex.error.value
    ex, _ = execute(port, "require('path').join('a', 'b')", language="js")
    assert ex.text == "a/b"
    ex, _ = execute(port, "process.env.ONLY", language="js", env_vars={"ONLY": "here"})
    assert ex.text == "here"
    ex, _ = execute(port, "process.env.ONLY", language="js")
    assert ex.results == []
    ex, _ = execute(port, "console.error('e'); undefined", language="js")
    assert ex.logs.stderr == ["e\n"] and ex.results == []


def test_execute_demands_the_sandbox_token(server, tmp_path):
    port, _ = server
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('x')"

    def call(method, path, body, headers):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        data = json.dumps(body).encode() if body is not None else None
        c.request(method, path, body=data, headers={"Content-Type": "application/json", **headers})
        r = c.getresponse()
        return r.status, r.read()

    bad = ({"X-Access-Token": "wrong"}, {"X-Access-Token": TOKEN + "x"}, {"X-Access-Token": "x" * 10000})
    for headers in ({}, *bad):
        status, body = call("POST", "/execute", {"code": code}, headers)
        assert status == 401, (headers.keys(), status)
        assert json.loads(body)["code"] == 401
    # The context endpoints run no code and the SDK sends them no token; a wrong one is refused.
    for headers in bad:
        for method, path, body in (
            ("POST", "/contexts", {"language": "python"}),
            ("GET", "/contexts", None),
            ("DELETE", "/contexts/whatever", None),
        ):
            assert call(method, path, body, headers)[0] == 401, (method, path)
    assert call("GET", "/contexts", None, {})[0] == 200
    assert not marker.exists(), "a request without the token ran code"
    assert call("GET", "/health", None, {})[0] == 200, "health needs no token (the template's ready check)"
    ex, _ = execute(port, code)
    assert ex.error is None and marker.read_text() == "x", "the right token runs the cell"


def test_a_token_rotated_by_init_is_refused_on_the_next_cell(tmp_path):
    """The server keeps a token envd accepted (and the sandbox's envs) until envd's init marker
    changes: an `/init` (a resume, a fork's child) that sets another token makes the old one a
    401 on its very next cell, and the new one runs with the new envs."""
    old, new = "rot-old-" + os.urandom(8).hex(), "rot-new-" + os.urandom(8).hex()
    init_marker = tmp_path / "envd-init"
    envd_proc, envd_port = _start_envd(old, "--init-marker", str(init_marker))
    home = tmp_path / "home"
    home.mkdir()
    server_proc, port = _start_server(home, envd_port, VMON_CI_ENVD_INIT_MARKER=str(init_marker))
    try:
        def init(token, body):
            c = http.client.HTTPConnection("127.0.0.1", envd_port, timeout=30)
            c.request("POST", "/init", body=json.dumps(body),
                      headers={"Content-Type": "application/json", "X-Access-Token": token})
            r = c.getresponse()
            return r.status, r.read()

        def status(token):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            c.request("POST", "/execute", body=json.dumps({"code": "1"}),
                      headers={"Content-Type": "application/json", "X-Access-Token": token})
            r = c.getresponse()
            r.read()
            return r.status

        assert not init_marker.exists()  # written by `/init` only
        assert init(old, {"accessToken": old, "envVars": {"VMON_ROT": "first"}})[0] == 204
        first = init_marker.read_text()
        assert oct(init_marker.stat().st_mode & 0o777) == "0o644"
        for _ in range(2):  # asked once, then kept
            ex, _ = execute(port, "import os; os.environ.get('VMON_ROT')", auth={"X-Access-Token": old})
            assert ex.error is None and ex.text == "first", ex
        assert init(old, {"accessToken": new, "envVars": {"VMON_ROT": "second"}})[0] == 204
        assert init_marker.read_text() != first
        assert status(old) == 401, "the rotated-out token still ran a cell"
        ex, _ = execute(port, "import os; os.environ.get('VMON_ROT')", auth={"X-Access-Token": new})
        assert ex.error is None, ex
        assert status("wrong") == 401 and status(old) == 401
    finally:
        _stop_server(server_proc)
        envd_proc.terminate()
        envd_proc.wait(10)


def test_warm_runs_an_uncounted_cell_only_in_an_unused_kernel(tmp_path, envd):
    """`POST /warm` (the restore pool's warm-up) runs a cell through the default kernel only
    while no user cell has run in it, demands the token as `/execute` does, and leaves nothing
    a user could see: the first cell after it is still number 1, and `_` is still empty."""
    home = tmp_path / "home"
    home.mkdir()
    proc, port = _start_server(home, envd)
    try:
        def warm(headers):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            c.request("POST", "/warm", body=b"{}", headers={"Content-Type": "application/json", **headers})
            r = c.getresponse()
            return r.status, r.read()

        for headers in ({}, {"X-Access-Token": "wrong"}):
            assert warm(headers)[0] == 401, headers
        for _ in range(2):
            status, body = warm(AUTH)
            assert status == 200 and json.loads(body) == {"warmed": True}, (status, body)
        ex, _ = execute(port, "repr(_)")
        assert ex.error is None and ex.execution_count == 1, ex
        assert ex.text == "''", ex.text
        # A used kernel is left alone: the count goes on from the user's cells.
        status, body = warm(AUTH)
        assert status == 200 and json.loads(body) == {"warmed": False}, (status, body)
        ex, _ = execute(port, "40 + 2")
        assert ex.error is None and ex.execution_count == 2 and ex.text == "42", ex
    finally:
        _stop_server(proc)


def new_context(port, **body):
    status, text = request(port, "POST", "/contexts", body, timeout=120)
    assert status == 200, text
    return json.loads(text)["id"]


def test_a_python_context_is_an_ipython_kernel(server):
    port, _ = server
    cid = new_context(port)
    ex, lines = execute(port, "get_ipython().__class__.__name__", context_id=cid)
    assert ex.text == "ZMQInteractiveShell"
    counts = [l["execution_count"] for l in lines if l["type"] == "number_of_executions"]
    assert counts == [1]
    ex, _ = execute(port, "'again'", context_id=cid)
    assert ex.execution_count == 2
    ex, _ = execute(port, "1/0", context_id=cid)
    assert "Cell In[3], line 1" in ex.error.traceback or "Cell In [3], line 1" in ex.error.traceback
    assert "\x1b[" not in ex.error.traceback  # no terminal colours


def test_every_mime_type_the_sdk_reads(server):
    port, _ = server
    cid = new_context(port)
    ex, _ = execute(port, "\n".join([
        "from IPython.display import *",
        "import base64",
        "PNG = base64.b64decode('iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==')",
        "display(HTML('<b>h</b>'))",
        "display(Markdown('**m**'))",
        "display(SVG('<svg xmlns=\"http://www.w3.org/2000/svg\"/>'))",
        "display(Image(PNG, format='png'))",
        "display(Image(b'\\xff\\xd8\\xff\\xe0fakejpeg', format='jpeg'))",
        "display(Latex('$x^2$'))",
        "display(JSON({'k': [1, 2]}))",
        "display(Javascript('console.log(1)'))",
        "display({'application/pdf': base64.b64encode(b'%PDF-1.4').decode(), 'text/plain': 'pdf'}, raw=True)",
        "display({'application/x-vmon': 'other', 'text/plain': 'x'}, raw=True)",
        "{'main': True}",
    ]), context_id=cid)
    assert ex.error is None, ex.error
    r = ex.results
    assert [x.is_main_result for x in r] == [False] * 10 + [True]
    assert r[0].html == "<b>h</b>"
    assert r[1].markdown == "**m**"
    assert r[2].svg.startswith("<svg")
    assert base64.b64decode(r[3].png)[:4] == b"\x89PNG"
    assert base64.b64decode(r[4].jpeg)[:3] == b"\xff\xd8\xff"
    assert r[5].latex == "$x^2$"
    assert r[6].json == {"k": [1, 2]}
    assert r[7].javascript == "console.log(1)"
    assert base64.b64decode(r[8].pdf) == b"%PDF-1.4"
    assert r[9].extra == {"application/x-vmon": "other"}
    assert r[10].json == {"main": True} and r[10].text == "{'main': True}"


def test_dataframes_come_as_html_and_data(server):
    port, _ = server
    ex, _ = execute(port, "import pandas as pd\ndf = pd.DataFrame({'a': [1, 2], 'b': [0.5, None]})\ndisplay(df)\ndf")
    assert ex.error is None, ex.error
    shown, main = ex.results
    assert not shown.is_main_result and main.is_main_result
    for r in (shown, main):
        assert "<table" in r.html
        assert r.data == {"a": [1, 2], "b": [0.5, None]}


def test_magics(server):
    port, home = server
    cid = new_context(port, cwd=str(home))
    (home / "magic").mkdir(exist_ok=True)
    ex, _ = execute(port, "%cd magic", context_id=cid)
    assert ex.error is None and ex.logs.stdout == [f"{home / 'magic'}\n"]
    ex, _ = execute(port, "import os; os.getcwd()", context_id=cid)
    assert ex.text == str(home / "magic")
    ex, _ = execute(port, "%env VMON_MAGIC=yes", context_id=cid)
    assert ex.logs.stdout == ["env: VMON_MAGIC=yes\n"]
    ex, _ = execute(port, "!echo $VMON_MAGIC from a shell", context_id=cid)
    # IPython runs `!` commands on a pty (as in Jupyter): lines end in \r\n.
    assert ex.logs.stdout == ["yes from a shell\r\n"]
    ex, _ = execute(port, "%%time\nsum(range(1000))", context_id=cid)
    assert ex.text == "499500"
    assert "Wall time" in "".join(ex.logs.stdout)
    ex, _ = execute(port, "%timeit -n 3 -r 2 sum(range(100))", context_id=cid)
    assert "per loop" in "".join(ex.logs.stdout), ex.logs
    ex, _ = execute(port, "files = !ls\nfiles", context_id=cid)
    assert ex.error is None


def chart_of(port, code, cid=None):
    ex, _ = execute(port, "import matplotlib.pyplot as plt\n" + code + "\nplt.show()", context_id=cid)
    assert ex.error is None, ex.error
    figs = [r for r in ex.results if r.png]
    assert len(figs) == 1, ex.results
    assert base64.b64decode(figs[0].png)[:4] == b"\x89PNG"
    return figs[0].chart


def test_charts(server):
    from e2b_code_interpreter.charts import (BarChart, BoxAndWhiskerChart, LineChart, PieChart,
                                             ScatterChart, SuperChart)

    port, _ = server
    c = chart_of(port, "plt.plot([1, 2, 3], [4, 1, 9], label='up')\nplt.title('T')\n"
                       "plt.xlabel('time (s)')\nplt.ylabel('v [m]')\nplt.yscale('log')")
    assert isinstance(c, LineChart) and c.title == "T"
    assert (c.x_label, c.x_unit, c.y_label, c.y_unit) == ("time (s)", "s", "v [m]", "m")
    assert c.x_scale.value == "linear" and c.y_scale.value == "log"
    assert [(e.label, e.points) for e in c.elements] == [("up", [(1, 4), (2, 1), (3, 9)])]
    assert len(c.x_ticks) == len(c.x_tick_labels) > 0
    c = chart_of(port, "plt.bar(['a', 'b', 'c'], [3, 1, 2], label='g')")
    assert isinstance(c, BarChart)
    assert [(e.label, e.value, e.group) for e in c.elements] == [("a", 3, "g"), ("b", 1, "g"), ("c", 2, "g")]
    c = chart_of(port, "plt.barh(['x', 'y'], [5, 6])\nplt.xlabel('amount')\nplt.ylabel('name')")
    assert [(e.label, e.value) for e in c.elements] == [("x", 5), ("y", 6)]
    assert (c.x_label, c.y_label) == ("name", "amount")
    c = chart_of(port, "plt.scatter([1, 2], [3, 4])\nplt.scatter([5], [6])")
    assert isinstance(c, ScatterChart) and [e.points for e in c.elements] == [[(1, 3), (2, 4)], [(5, 6)]]
    c = chart_of(port, "plt.pie([1, 1, 2], labels=['p', 'q', 'r'])")
    assert isinstance(c, PieChart)
    assert [(e.label, round(e.angle)) for e in c.elements] == [("p", 90), ("q", 90), ("r", 180)]
    for extra in ("", ", patch_artist=True", ", vert=False"):
        c = chart_of(port, f"plt.boxplot([[1, 2, 3, 4, 5, 20], [2, 3, 4, 5, 6]], labels=['A', 'B']{extra})")
        assert isinstance(c, BoxAndWhiskerChart), extra
        a, b = c.elements
        assert (a.label, a.min, a.first_quartile, a.median, a.third_quartile, a.max, a.outliers) == (
            "A", 1, 2.25, 3.5, 4.75, 5, [20]), extra
        assert (b.label, b.min, b.median, b.max, b.outliers) == ("B", 2, 4, 6, []), extra
    c = chart_of(port, "fig, (l, r) = plt.subplots(1, 2)\nl.plot([1, 2])\nr.bar([1, 2], [3, 4])\nfig.suptitle('S')")
    assert isinstance(c, SuperChart) and c.title == "S"
    assert [type(e) for e in c.elements] == [LineChart, BarChart]
    c = chart_of(port, "plt.figure().add_subplot()")  # axes without data: no chart
    assert c is None


def test_interrupt_keeps_the_kernel_state(server):
    port, _ = server
    cid = new_context(port)
    execute(port, "kept = 'yes'", context_id=cid)
    out = {}

    def run():
        out["ex"], _ = execute(port, "while True: pass", context_id=cid)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(2)
    assert request(port, "POST", f"/contexts/{cid}/interrupt")[0] == 204
    t.join(30)
    assert not t.is_alive()
    assert out["ex"].error.name == "KeyboardInterrupt"
    ex, _ = execute(port, "kept", context_id=cid)
    assert ex.text == "yes"
    assert request(port, "POST", "/contexts/nope/interrupt")[0] == 404
    # A restart gives a fresh namespace.
    assert request(port, "POST", f"/contexts/{cid}/restart", timeout=120)[0] == 200
    ex, _ = execute(port, "kept", context_id=cid)
    assert ex.error.name == "NameError"
    assert ex.execution_count == 1


def test_languages_without_a_kernel_are_refused_with_the_reason(server):
    port, _ = server
    for language, word in (("java", "Java"),):
        status, text = request(port, "POST", "/contexts", {"language": language})
        assert status == 400 and word in text, (language, status, text)
        status, text = request(port, "POST", "/execute", {"code": "1", "language": language})
        assert status == 400 and word in text, (language, status, text)
