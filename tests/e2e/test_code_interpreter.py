"""The official `e2b-code-interpreter` SDK against `vmon up`: the default template
`code-interpreter-v1` (built in the background after `base`), the server on port 49999 through
the proxy, its IPython kernels (rich results, charts, magics, `!pip install`, interrupt,
restart), contexts, R contexts (IRkernel), JavaScript cells with imports and top-level
`await`, TypeScript cells, Java's refusal, and a context's
state across pause + connect and in a fork child.

One sandbox for the whole module, to keep VM time small; the tests run in file order and the
last one pauses it.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import time
import zipfile

import httpx
import pytest
from e2b_code_interpreter import Sandbox
from e2b_code_interpreter.charts import BarChart

# The first create may wait for the template's build (20–40 s under TCG, more on a loaded host).
FIRST_CREATE_TIMEOUT = 1800


@pytest.fixture(scope="module")
def sbx(vmon):
    made = []
    s = Sandbox.create(timeout=900, request_timeout=FIRST_CREATE_TIMEOUT)
    made.append(s)
    yield s
    for x in made:
        try:
            x.kill()
        except Exception:
            pass


def test_default_template_and_value(sbx):
    assert sbx.get_info().template_id  # resolved from "code-interpreter-v1"
    ex = sbx.run_code("x = 41")
    assert ex.error is None and ex.results == []
    ex = sbx.run_code("x + 1")
    assert ex.text == "42"
    assert ex.results[0].is_main_result
    assert isinstance(ex.execution_count, int)


def test_a_new_sandbox_shows_no_trace_of_the_pools_warm_cell(sbx):
    # A sandbox claimed from the pool ran an uncounted cell during its warm-up (the template's
    # warm request): its first cell is still number 1 and `_` is still empty. (`sbx` first, so
    # the pool has refilled by now.)
    s = Sandbox.create(timeout=120)
    try:
        ex = s.run_code("repr(_)")
        assert ex.error is None, ex.error
        assert ex.execution_count == 1 and ex.text == "''", ex
        ex = s.run_code("40 + 2")
        assert ex.execution_count == 2 and ex.text == "42", ex
    finally:
        s.kill()


# Reads, as root in the guest, the CPU time (in ticks of 1/100 s) each of `user`'s processes
# used over 2 s: the code interpreter's server, its kernel and its Node.js worker.
USER_CPU_OVER_2S = r"""
import json, os, pwd, time
uid = pwd.getpwnam("user").pw_uid
def ticks():
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            if os.stat("/proc/" + p).st_uid != uid:
                continue
            stat = open("/proc/%s/stat" % p).read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[p] = (stat[stat.index("(") + 1:stat.rindex(")")], int(fields[11]) + int(fields[12]))
    return out
a = ticks()
time.sleep(2)
b = ticks()
print(json.dumps({p: [b[p][0], b[p][1] - a[p][1]] for p in b if p in a}))
"""


def test_a_new_sandbox_is_idle(vmon):
    """Nothing the template's build started is still starting in a sandbox made from its
    snapshot: the server answered (and the snapshot was taken) only once its default contexts,
    the kernel and Node.js, had started. A Node.js caught mid-start used to spend a sandbox's
    first ~8 s of CPU finishing it, and every cell waited behind it."""
    s = Sandbox.create(timeout=120, request_timeout=FIRST_CREATE_TIMEOUT)
    try:
        s.files.write("/tmp/user_cpu.py", USER_CPU_OVER_2S)
        r = s.commands.run("python3 /tmp/user_cpu.py", user="root", timeout=120)
        used = json.loads(r.stdout)
        assert any(name == "node" for name, _ in used.values()), used  # the default JS context
        busy = {pid: v for pid, v in used.items() if v[1] >= 50}
        assert not busy, "processes busy for 0.5 s or more of 2 s in a new sandbox: %s" % busy
    finally:
        s.kill()


def test_stdout_streams_to_callback(sbx):
    seen = []
    t0 = time.monotonic()
    ex = sbx.run_code(
        "import sys, time\nprint('hi')\nprint('warn', file=sys.stderr)\ntime.sleep(3)\nprint('bye')",
        on_stdout=lambda m: seen.append((time.monotonic() - t0, m.line)),
    )
    assert [line for _, line in seen] == ["hi\n", "bye\n"]
    assert seen[1][0] - seen[0][0] > 1.5, f"stdout was not streamed: {seen}"
    assert ex.logs.stdout == ["hi\n", "bye\n"]
    assert ex.logs.stderr == ["warn\n"]


def test_error(sbx):
    ex = sbx.run_code("1/0")
    assert ex.error.name == "ZeroDivisionError"
    assert ex.error.value == "division by zero"
    assert "1/0" in ex.error.traceback
    errors = []
    sbx.run_code("raise KeyError('k')", on_error=errors.append)
    assert errors[0].name == "KeyError"
    ex = sbx.run_code("x")  # the context is still there
    assert ex.text == "41"


def test_charts_and_dataframes(sbx):
    # The documented data-analysis use: a matplotlib chart comes back as a PNG result after the
    # cell's own value; a pandas DataFrame as HTML; numpy's BLAS runs on the guest's CPU.
    ex = sbx.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [4, 1, 9])\n"
        "plt.title('vmon')\n"
        "plt.show()"
    )
    assert ex.error is None, ex.error
    figs = [r for r in ex.results if r.png]
    assert len(figs) == 1 and not figs[0].is_main_result, ex.results
    assert base64.b64decode(figs[0].png)[:8] == b"\x89PNG\r\n\x1a\n"
    assert figs[0].text.startswith("<Figure size")
    ex = sbx.run_code("plt.figure(); plt.bar([1, 2], [3, 4])")
    assert [bool(r.png) for r in ex.results] == [False, True], ex.results
    assert ex.results[0].is_main_result and "BarContainer" in ex.results[0].text
    assert sbx.run_code("plt.get_fignums()").text == "[]"  # shown figures are closed
    ex = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
    assert ex.error is None and "<table" in ex.results[0].html, ex.results
    ex = sbx.run_code("import numpy as np\nfloat(np.dot(np.ones((64, 64)), np.ones((64, 64))).sum())")
    assert ex.text == "262144.0", (ex.text, ex.error)
    out = sbx.commands.run("python3 -c 'import numpy as n; print(n.dot(n.ones((8, 8)), n.ones((8, 8))).sum())'")
    assert out.stdout.strip() == "512.0"


def test_bash_cells(sbx):
    ex = sbx.run_code("N=6; cd /tmp", language="bash")
    assert ex.error is None, ex.error
    ex = sbx.run_code("echo $((N * 7)) $(pwd)", language="bash")
    assert ex.logs.stdout == ["42 /tmp\n"], ex.logs
    ctx = sbx.create_code_context(language="bash")
    assert ctx.language == "bash"
    ex = sbx.run_code("echo ${N-none}", context=ctx)
    assert ex.logs.stdout == ["none\n"]
    sbx.remove_code_context(ctx)


def test_js_cells(sbx):
    ex = sbx.run_code("const xs = [1, 2, 3]; xs.map((x) => x * 2)", language="js")
    assert ex.error is None, ex.error
    assert ex.text == "[ 2, 4, 6 ]"
    ex = sbx.run_code("console.log(xs.length); xs.reduce((a, b) => a + b)", language="js")
    assert ex.logs.stdout == ["3\n"] and ex.text == "6"
    ex = sbx.run_code("undefinedThing.x", language="js")
    assert ex.error.name == "ReferenceError"


def test_js_cells_take_esm_imports_and_top_level_await(sbx):
    """E2B's code-interpreter suite (`test_default_kernels.py`): a static `import` in a cell,
    and a cell whose value is an awaited promise; the default JavaScript context is listed."""
    ex = sbx.run_code("import { readFileSync } from 'fs'\nimport * as path from 'path'\n"
                      "console.log(typeof readFileSync, path.sep)", language="js")
    assert ex.error is None and ex.logs.stdout == ["function /\n"], (ex.error, ex.logs)
    ex = sbx.run_code("await Promise.resolve('Hello World!')", language="js")
    assert ex.error is None and ex.text == "Hello World!", (ex.error, ex.text)
    ex = sbx.run_code("const later = await Promise.resolve(41)", language="js")
    assert ex.error is None, ex.error
    assert sbx.run_code("later + 1", language="js").text == "42"
    assert "javascript" in [c.language for c in sbx.list_code_contexts()]


def test_second_context_is_isolated(sbx):
    ctx = sbx.create_code_context()
    assert ctx.language == "python" and ctx.cwd == "/home/user"
    sbx.run_code("y = 'ctx'", context=ctx)
    ex = sbx.run_code("y", context=ctx)
    assert ex.text == "ctx"
    ex = sbx.run_code("y")
    assert ex.error.name == "NameError"
    ex = sbx.run_code("x", context=ctx)
    assert ex.error.name == "NameError"
    ex = sbx.run_code("import os; (os.getuid(), os.getcwd())", context=ctx)
    assert ex.text == "(1000, '/home/user')"
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]


def test_private_traffic_sends_the_token(vmon):
    s = Sandbox.create(timeout=120, network={"allow_public_traffic": False})
    try:
        assert s.traffic_access_token
        assert s.run_code("6 * 7").text == "42"
        r = httpx.post(
            f"{s._jupyter_url}/execute",
            json={"code": "1"},
            headers={"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "49999"},
        )
        assert r.status_code in (401, 403), r.text
    finally:
        s.kill()


def test_execute_without_the_envd_token_is_401_and_runs_nothing(sbx):
    url = f"{sbx._jupyter_url}/execute"
    route = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
    code = "open('/tmp/ran-without-token', 'w').write('x')"
    for extra in ({}, {"X-Access-Token": "not-the-token"}):
        r = httpx.post(url, json={"code": code}, headers={**route, **extra}, timeout=60)
        assert r.status_code == 401, r.text
    assert not sbx.files.exists("/tmp/ran-without-token")
    # The SDK sends the sandbox's token, and the same cell runs.
    assert sbx.run_code(code).error is None
    assert sbx.files.read("/tmp/ran-without-token") == "x"


def _wheel(name: str, version: str, files: dict[str, str]) -> bytes:
    """A pure-Python wheel with the given modules (what `pip wheel` makes, without pip)."""
    dist = f"{name}-{version}.dist-info"
    entries = dict(files)
    entries[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    entries[f"{dist}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: vmon-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, text in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    entries[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, text in entries.items():
            z.writestr(path, text)
    return buf.getvalue()


def test_pip_install_of_an_uploaded_wheel(sbx):
    # The guest may not reach PyPI: the wheel comes from here, as a user uploads one.
    path = "/home/user/vmon_wheel_demo-1.0-py3-none-any.whl"
    sbx.files.write(path, _wheel("vmon_wheel_demo", "1.0", {"vmon_wheel_demo/__init__.py": "ANSWER = 42\n"}))
    ex = sbx.run_code(f"!pip install --no-index {path}", timeout=300)
    assert ex.error is None, ex.error
    assert "Successfully installed vmon-wheel-demo-1.0" in "".join(ex.logs.stdout), ex.logs
    ex = sbx.run_code("import vmon_wheel_demo, sys\nvmon_wheel_demo.ANSWER, vmon_wheel_demo.__file__.startswith('/home/user/.local')")
    assert ex.text == "(42, True)", (ex.text, ex.error)


def test_rich_results_and_dataframes(sbx):
    ex = sbx.run_code(
        "import pandas as pd\n"
        "from IPython.display import display, Markdown, Latex\n"
        "df = pd.DataFrame({'city': ['Oslo', 'Lima'], 'temp': [3.5, 19.0]})\n"
        "display(df)\n"
        "display(Markdown('**bold**'))\n"
        "Latex(r'$\\alpha$')"
    )
    assert ex.error is None, ex.error
    table, md, latex = ex.results
    assert "<table" in table.html and "Oslo" in table.html and not table.is_main_result
    assert table.data == {"city": ["Oslo", "Lima"], "temp": [3.5, 19.0]}
    assert md.markdown == "**bold**"
    assert latex.latex == "$\\alpha$" and latex.is_main_result
    ex = sbx.run_code("{'a': [1, 2]}")
    assert ex.results[0].json == {"a": [1, 2]}


def test_bar_chart_has_its_elements(sbx):
    ex = sbx.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.bar(['apples', 'pears'], [3, 5], label='fruit')\n"
        "plt.title('Basket')\nplt.xlabel('kind')\nplt.ylabel('count [pcs]')\n"
        "plt.show()"
    )
    assert ex.error is None, ex.error
    (fig,) = ex.results
    assert base64.b64decode(fig.png)[:4] == b"\x89PNG"  # the PNG stays alongside
    chart = fig.chart
    assert isinstance(chart, BarChart)
    assert (chart.title, chart.x_label, chart.y_label, chart.y_unit) == ("Basket", "kind", "count [pcs]", "pcs")
    assert [(e.label, e.value, e.group) for e in chart.elements] == [("apples", 3, "fruit"), ("pears", 5, "fruit")]


def test_magics(sbx):
    ex = sbx.run_code("%%time\nsum(range(10**5))")
    assert ex.error is None and ex.text == "4999950000"
    assert "Wall time" in "".join(ex.logs.stdout), ex.logs
    ex = sbx.run_code("%cd /tmp")
    assert ex.logs.stdout == ["/tmp\n"]
    ex = sbx.run_code("%env VMON_MAGIC=1\nimport os; os.getcwd(), os.environ['VMON_MAGIC']")
    assert ex.text == "('/tmp', '1')"
    sbx.run_code("%cd /home/user")


def test_error_traceback_names_the_cell(sbx):
    ex = sbx.run_code("def inner():\n    return {}['missing']\ninner()")
    assert ex.error.name == "KeyError" and ex.error.value == "'missing'"
    tb = ex.error.traceback
    assert "inner()" in tb and "return {}['missing']" in tb and "\x1b[" not in tb, tb


def test_interrupt_keeps_state_and_restart_clears_it(sbx):
    from e2b import TimeoutException

    ctx = sbx.create_code_context()
    sbx.run_code("before = 'kept'", context=ctx)
    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.run_code("while True: pass", context=ctx, timeout=5)  # the SDK leaves; the cell is interrupted
    ex = sbx.run_code("before", context=ctx, timeout=60)
    assert ex.text == "kept", (ex.text, ex.error)
    assert time.monotonic() - t0 < 40
    # The server's interrupt endpoint stops a cell the same way.
    url = f"{sbx._jupyter_url}/contexts/{ctx.id}/interrupt"
    route = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
    import threading

    out = {}
    runner = threading.Thread(target=lambda: out.setdefault("ex", sbx.run_code("import time\nwhile True: time.sleep(0.1)", context=ctx)))
    runner.start()
    time.sleep(3)
    assert httpx.post(url, headers=route, timeout=30).status_code == 204
    runner.join(60)
    assert out["ex"].error.name == "KeyboardInterrupt"
    assert sbx.run_code("before", context=ctx).text == "kept"
    sbx.restart_code_context(ctx)
    ex = sbx.run_code("before", context=ctx)
    assert ex.error.name == "NameError"
    sbx.remove_code_context(ctx)


def test_r_contexts_run_on_irkernel(sbx):
    from e2b import SandboxException

    # An R kernel's first start in a sandbox pays R's start-up under TCG.
    ctx = sbx.create_code_context(language="r", request_timeout=600)
    assert ctx.language == "r"
    ex = sbx.run_code("x <- 41; x + 1", context=ctx)
    assert ex.error is None, ex.error
    # IRkernel shows a value as display data: a result (not the main one) with R's print.
    assert [r.text for r in ex.results] == ["[1] 42"]
    ex = sbx.run_code("x * 2", context=ctx)
    assert ex.results[0].text == "[1] 82"
    ex = sbx.run_code('print("hi")', context=ctx)
    assert ex.logs.stdout == ['[1] "hi"\n'] and ex.results == []
    ex = sbx.run_code('f <- function() stop("boom"); f()', context=ctx)
    assert ex.error.name == "ERROR" and "boom" in ex.error.value
    assert 'stop("boom")' in ex.error.traceback, ex.error.traceback
    ex = sbx.run_code("x", context=ctx)  # the kernel kept its state through the error
    assert ex.results[0].text == "[1] 41"
    assert sbx.run_code("x").text == "41"  # the Python context's own x
    # By language, with a cell's envs, in the default R context (as E2B's own tests use it).
    ex = sbx.run_code("Sys.getenv('FOO')", language="r", envs={"FOO": "bar"}, timeout=600)
    assert ex.results[0].text == '[1] "bar"', (ex.results, ex.error)
    ex = sbx.run_code("Sys.getenv('FOO', unset = 'default')", language="r")
    assert ex.results[0].text == '[1] "default"'
    sbx.remove_code_context(ctx)
    with pytest.raises(SandboxException) as e:
        sbx.run_code("x", context=ctx)
    assert "not found" in str(e.value)


def test_typescript_cells_have_their_types_stripped(sbx):
    ex = sbx.run_code("interface P { n: number }\nconst p: P = { n: 41 };\np.n + 1", language="ts")
    assert ex.error is None, ex.error
    assert ex.text == "42"
    ex = sbx.run_code("let bad: = 1", language="typescript")
    assert ex.error.name == "SyntaxError"
    assert sbx.run_code("p.n as number", language="ts").text == "41"


def test_java_is_refused_with_the_reason(sbx):
    from e2b import SandboxException

    reason = "Java contexts are not available: the guest image has no Java Jupyter kernel"
    with pytest.raises(SandboxException) as e:
        sbx.create_code_context(language="java")
    assert "400" in str(e.value) and reason in str(e.value), e.value
    with pytest.raises(SandboxException) as e:
        sbx.run_code('System.out.println("hi")', language="java")
    assert "400" in str(e.value) and reason in str(e.value), e.value


def test_a_cwd_the_user_cannot_enter_is_a_400(sbx):
    from e2b import SandboxException

    with pytest.raises(SandboxException) as e:
        sbx.create_code_context(cwd="/root")
    assert "400" in str(e.value) and "permission denied (contexts run as user)" in str(e.value)
    ctx = sbx.create_code_context(cwd="/tmp/ctx-dir")
    assert ctx.cwd == "/tmp/ctx-dir"
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text.strip("'") == "/tmp/ctx-dir"


def test_sandbox_envs_reach_the_kernel(vmon):
    with Sandbox.create(timeout=120, envs={"VMON_FROM_CREATE": "yes"}) as s:
        ex = s.run_code("import os; os.environ.get('VMON_FROM_CREATE')")
        assert ex.text == "yes", (ex.text, ex.error)
        ex = s.run_code("os.environ['VMON_PER_CELL']", envs={"VMON_PER_CELL": "cell"})
        assert ex.text == "cell"
        assert s.run_code("os.environ.get('VMON_PER_CELL')").results == []
        # An R kernel gets them too; a cell's envs override the sandbox's for that cell only.
        ex = s.run_code("Sys.getenv('VMON_FROM_CREATE')", language="r", timeout=600)
        assert ex.results[0].text == '[1] "yes"', (ex.results, ex.error)
        ex = s.run_code("Sys.getenv('VMON_FROM_CREATE')", language="r", envs={"VMON_FROM_CREATE": "cell"})
        assert ex.results[0].text == '[1] "cell"'
        ex = s.run_code("Sys.getenv('VMON_FROM_CREATE')", language="r")
        assert ex.results[0].text == '[1] "yes"'


def test_state_survives_pause_and_connect(sbx):
    sbx.run_code("kept = [1, 2, 3]\nimport os; pid = os.getpid()")
    assert sbx.pause() is True
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
    ex = resumed.run_code("kept, pid == os.getpid()")
    assert ex.text == "([1, 2, 3], True)"
    ex = resumed.run_code("x + 1")
    assert ex.text == "42"
    # A fork child has the kernel's state and goes its own way.
    (child,) = resumed.fork(count=1, timeout=600)
    assert not isinstance(child, Exception), child
    try:
        ex = child.run_code("kept.append(4); kept")
        assert ex.text == "[1, 2, 3, 4]", (ex.text, ex.error)
        assert resumed.run_code("kept").text == "[1, 2, 3]"
    finally:
        child.kill()
