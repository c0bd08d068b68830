"""The code-interpreter server's languages beyond Python (crates/image/assets/code_interpreter.py
and its package code_interpreter/) run as a host process, as in test_server.py, its messages
parsed with the official SDK's own parser: each R context is a real IRkernel (Debian's
r-base-core and r-cran-irkernel, whose kernelspec `ir` jupyter_client finds); a TypeScript
context is the JavaScript worker with each cell's types stripped by esbuild (Debian's); Java
stays refused with the reason. JavaScript cells take static ESM imports and top-level `await`
(E2B's `test_default_kernels.py`), and a default JavaScript context is listed from the start, as
on E2B."""

from __future__ import annotations

import json
import threading
import time

from e2b_code_interpreter.models import Context

# The server and envd fixtures, and the request helpers, are test_server.py's.
from test_server import envd, execute, request, server  # noqa: F401

# An R kernel starts in a few seconds here; a loaded host takes longer.
START = 120


def new_r_context(port, language="r"):
    status, body = request(port, "POST", "/contexts", {"language": language}, timeout=START)
    assert status == 200, body
    ctx = Context.from_json(json.loads(body))
    assert ctx.language == "r"
    return ctx.id


def test_r_values_and_state(server):
    port, home = server
    cid = new_r_context(port)
    ex, lines = execute(port, "x <- 41; x + 1", context_id=cid)
    assert ex.error is None, ex.error
    # IRkernel shows a value as `display_data` (not `execute_result`): a result, not the main one.
    assert [r.text for r in ex.results] == ["[1] 42"]
    assert ex.results[0].html == "42" and not ex.results[0].is_main_result
    assert isinstance(ex.execution_count, int)
    first = ex.execution_count
    ex, _ = execute(port, "x * 2", context_id=cid)
    assert ex.results[0].text == "[1] 82"
    assert ex.execution_count == first + 1
    ex, _ = execute(port, '"s"', context_id=cid)
    assert ex.results[0].text == '[1] "s"'  # R's own print, quotes and all
    ex, _ = execute(port, "invisible(3)", context_id=cid)
    assert ex.results == [] and ex.error is None
    ex, _ = execute(port, "getwd()", context_id=cid)
    assert ex.results[0].text == '[1] "%s"' % home


def test_r_stdout_and_stderr(server):
    port, _ = server
    cid = new_r_context(port, language="R")
    ex, _ = execute(port, 'print("hi")', context_id=cid)
    assert ex.logs.stdout == ['[1] "hi"\n'] and ex.results == []
    ex, _ = execute(port, 'cat("a\\n"); message("to stderr")', context_id=cid)
    assert ex.logs.stdout == ["a\n"]
    assert "".join(ex.logs.stderr).startswith("to stderr\n")
    # As in Jupyter, a subprocess's output is R's to capture (`intern = TRUE`).
    ex, _ = execute(port, 'system("echo from-a-subprocess", intern = TRUE)', context_id=cid)
    assert ex.results[0].text == '[1] "from-a-subprocess"'


def test_r_errors(server):
    port, _ = server
    cid = new_r_context(port)
    execute(port, "kept <- 7", context_id=cid)
    ex, _ = execute(port, 'f <- function() stop("boom"); cat("before\\n"); f()', context_id=cid)
    assert ex.error.name == "ERROR"
    assert "boom" in ex.error.value
    assert "Traceback" in ex.error.traceback and 'stop("boom")' in ex.error.traceback
    assert ex.logs.stdout == ["before\n"]
    ex, _ = execute(port, "undefined_thing", context_id=cid)
    assert "object 'undefined_thing' not found" in ex.error.value
    ex, _ = execute(port, "x <- ", context_id=cid)
    assert "unexpected end of input" in ex.error.value
    ex, _ = execute(port, "kept", context_id=cid)  # the kernel survived all of that
    assert ex.error is None and ex.results[0].text == "[1] 7"


def test_r_rich_results(server):
    port, _ = server
    cid = new_r_context(port)
    ex, _ = execute(port, 'data.frame(a = 1:2, b = c("x", "y"))', context_id=cid)
    r = ex.results[0]
    assert "<table" in r.html and "| a" in r.markdown and "tabular" in r.latex
    ex, _ = execute(port, "plot(1:10)", context_id=cid)
    assert ex.error is None, ex.error
    assert any(r.png for r in ex.results), [r.formats() for r in ex.results]


def test_r_env_vars_are_per_cell(server):
    port, _ = server
    cid = new_r_context(port)
    value = 'bar é "q"\n\\'
    ex, _ = execute(port, "Sys.getenv('FOO')", context_id=cid, env_vars={"FOO": value})
    assert ex.error is None, ex.error
    assert ex.results[0].text == "[1] %s" % json.dumps(value, ensure_ascii=False)
    ex, _ = execute(port, "Sys.getenv('FOO', unset = 'default')", context_id=cid)
    assert ex.results[0].text == '[1] "default"'
    execute(port, "Sys.setenv(KEEP = 'mine')", context_id=cid)
    ex, _ = execute(port, "Sys.getenv('KEEP')", context_id=cid, env_vars={"KEEP": "cell"})
    assert ex.results[0].text == '[1] "cell"'
    ex, _ = execute(port, "Sys.getenv('KEEP')", context_id=cid)
    assert ex.results[0].text == '[1] "mine"'


def test_r_by_language_gets_a_default_context(server):
    port, _ = server
    ex, _ = execute(port, "dflt <- 'r'", language="r")
    assert ex.error is None, ex.error
    ex, _ = execute(port, "dflt", language="r")
    assert ex.results[0].text == '[1] "r"'
    ex, _ = execute(port, "dflt = 'py'")  # the Python default context is another kernel
    ex, _ = execute(port, "dflt", language="R")
    assert ex.results[0].text == '[1] "r"'


def test_r_interrupt_keeps_state_and_restart_clears_it(server):
    port, _ = server
    cid = new_r_context(port)
    execute(port, "before <- 'kept'", context_id=cid)
    out = {}

    def run():
        out["ex"], _ = execute(port, "repeat {}", context_id=cid)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(2)
    assert request(port, "POST", f"/contexts/{cid}/interrupt")[0] == 204
    t.join(30)
    assert not t.is_alive()
    ex, _ = execute(port, "before", context_id=cid)
    assert ex.results[0].text == '[1] "kept"', (ex.results, ex.error)
    assert request(port, "POST", f"/contexts/{cid}/restart", timeout=START)[0] == 200
    ex, _ = execute(port, "before", context_id=cid)
    assert "object 'before' not found" in ex.error.value
    assert any(c["id"] == cid and c["language"] == "r" for c in json.loads(request(port, "GET", "/contexts")[1]))
    assert request(port, "DELETE", f"/contexts/{cid}")[0] == 204


def test_java_is_refused_with_the_reason(server):
    port, _ = server
    for path, body in (("/contexts", {"language": "java"}), ("/execute", {"code": "1", "language": "Java"})):
        status, text = request(port, "POST", path, body)
        assert status == 400, (path, status, text)
        assert "Java contexts are not available" in text and "no Java Jupyter kernel" in text, text


def test_typescript_cells(server):
    port, _ = server
    status, body = request(port, "POST", "/contexts", {"language": "typescript"})
    assert status == 200, body
    ctx = Context.from_json(json.loads(body))
    assert ctx.language == "typescript"  # E2B's name for it
    code = (
        "interface P { name: string; n: number }\n"
        "enum Color { Red, Green }\n"
        "const twice = <T,>(x: T): T[] => [x, x];\n"
        "let p: P = { name: 'a', n: 41 };\n"
        "console.log(twice<string>(p.name).join(''));\n"
        "p.n + 1 + (Color.Green as number) - 1"
    )
    ex, _ = execute(port, code, context_id=ctx.id)
    assert ex.error is None, ex.error
    assert ex.text == "42" and ex.results[0].is_main_result
    assert ex.logs.stdout == ["aa\n"]
    ex, _ = execute(port, "p.name as string", context_id=ctx.id)  # state across cells
    assert ex.text == "a"  # a string's value without its quotes, as in a JavaScript context
    ex, _ = execute(port, "const v: number = await Promise.resolve(5); console.log(v)", context_id=ctx.id)
    assert ex.error is None and ex.logs.stdout == ["5\n"], ex.error
    ex, _ = execute(port, "let bad: = 1", context_id=ctx.id)
    assert ex.error.name == "SyntaxError" and "Unexpected" in ex.error.value, ex.error
    ex, _ = execute(port, "(null as any).x", context_id=ctx.id)
    assert ex.error.name == "TypeError"
    # Types are stripped, not checked (as Node.js's own type stripping).
    ex, _ = execute(port, "const s: number = 'not a number' as any; typeof s", language="ts")
    assert ex.text == "string"
    ex, _ = execute(port, "typeof s", language="ts")  # the default TypeScript context keeps it
    assert ex.text == "string"
    ex, _ = execute(port, "typeof s", language="js")  # the JavaScript one is another process
    assert ex.text == "undefined"


def test_js_cells_take_esm_imports_and_top_level_await(server):
    port, _ = server
    ex, _ = execute(port, "\n    import { readFileSync } from 'fs'\n    console.log(typeof readFileSync)\n",
                    language="js")
    assert ex.error is None and ex.logs.stdout == ["function\n"], (ex.error, ex.logs)
    ex, _ = execute(port, "import * as path from 'path'\nimport os, { cpus as c } from 'os'\n"
                    "[path.sep, typeof os.cpus, typeof c]", language="js")
    assert ex.error is None and ex.text == "[ '/', 'function', 'function' ]", (ex.error, ex.text)
    # The same imports again (a cell run twice) are no redeclaration.
    ex, _ = execute(port, "import { readFileSync } from 'fs'\nreadFileSync.name", language="js")
    assert ex.text == "readFileSync", ex.error
    ex, _ = execute(port, "\n    await Promise.resolve('Hello World!')\n    ", language="js")
    assert ex.error is None and ex.text == "Hello World!", (ex.error, ex.text)
    # A declaration next to an `await` outlives its cell; a rejection is the cell's error.
    ex, _ = execute(port, "const got = await Promise.resolve(41)", language="js")
    assert ex.error is None, ex.error
    ex, _ = execute(port, "got + 1", language="js")
    assert ex.text == "42", ex.error
    ex, _ = execute(port, "await Promise.reject(new Error('no'))", language="js")
    assert ex.error.name == "Error" and ex.error.value == "no", ex.error
    ex, _ = execute(port, "1 + 1", language="js")
    assert ex.text == "2", ex.error


def test_a_default_javascript_context_is_listed(server):
    port, _ = server
    status, body = request(port, "GET", "/contexts")
    assert status == 200, body
    langs = sorted(c["language"] for c in json.loads(body))
    assert "python" in langs and "javascript" in langs, langs
