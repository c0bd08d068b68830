#!/usr/bin/env python3
"""vmon's code-interpreter server: the HTTP API the `e2b-code-interpreter` SDK speaks, on
port 49999, written against the Python standard library only (the guest has no pip; its
image has Debian's numpy, pandas and matplotlib, which the default context imports ahead and
whose figures come back as PNG results). Contexts run Python, bash or JavaScript (Node.js).

Each context is a worker process (this file run with `--worker`) that keeps a namespace and
runs one cell at a time. The worker's fd 1 and 2 are pipes read by the server, so prints and
subprocess output both stream; results and errors come back on a separate pipe as JSON lines.
After a cell the worker writes a marker line to fd 1 and 2 and then `done` on the result pipe;
the server ends the stream when it has all three, so no output is lost or attributed to the
next cell.

`POST /execute` demands the sandbox's envd access token in `X-Access-Token`, which the official
SDK sends: the server asks envd (on this guest's loopback) whether the token is the current
one, so a token rotated at claim or resume is honoured at once. A request without it is
answered 401 and runs nothing. The context endpoints run no code and the SDK sends them no
token; a token they do carry must be the right one.

Endpoints: `GET /health`; `POST /execute` {code, context_id, language, env_vars} streaming
newline-delimited JSON (`stdout`, `stderr`, `result`, `error`, `number_of_executions`);
`POST /contexts` {language, cwd}; `GET /contexts`; `DELETE /contexts/{id}`;
`POST /contexts/{id}/restart`.
"""

import json
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY = 16 * 1024 * 1024
MAX_CONTROL_LINE = 64 * 1024 * 1024
MAX_TEXT = 8 * 1024 * 1024
READ_CHUNK = 64 * 1024
MARK = b"\x1evmon-cell-end "
LANGUAGES = {"python": "python", "python3": "python", "py": "python", "bash": "bash", "sh": "bash",
             "shell": "bash", "js": "js", "javascript": "js", "node": "js"}
INLINE_BACKEND = "vmon_inline"
BASH_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Imported ahead by the default context (when the image has them).
PRELOAD = ("numpy", "pandas", "matplotlib.pyplot")


def now_ns():
    return time.time_ns()


def default_cwd():
    home = os.path.expanduser("~")
    return home if os.path.isdir(home) else "/"


# --------------------------------------------------------------------------------------------
# Worker (one per context)
# --------------------------------------------------------------------------------------------


def worker_pipes(req_fd, resp_fd):
    """A worker's request pipe, and `send` for JSON lines on its result pipe."""
    requests = os.fdopen(req_fd, "rb", buffering=0)
    responses = os.fdopen(resp_fd, "wb", buffering=0)

    def send(msg):
        responses.write(json.dumps(msg).encode() + b"\n")

    return requests, send


def end_cell(send, count, seq):
    """A worker's last words on a cell: its count, the marker on fd 1 and 2, then `done`."""
    send({"type": "number_of_executions", "execution_count": count})
    marker = MARK + str(seq).encode() + b"\n"
    for fd in (1, 2):
        try:
            os.write(fd, marker)
        except OSError:
            pass
    send({"type": "done", "seq": seq})


def worker_main(req_fd, resp_fd):
    import ast
    import base64
    import builtins
    import io
    import linecache
    import traceback
    import types

    requests, send = worker_pipes(req_fd, resp_fd)
    # Line-buffered text streams on the pipes: one write per printed line.
    sys.stdout = io.TextIOWrapper(
        os.fdopen(1, "wb", closefd=False), encoding="utf-8",
        errors="backslashreplace", line_buffering=True)
    sys.stderr = io.TextIOWrapper(
        os.fdopen(2, "wb", closefd=False), encoding="utf-8",
        errors="backslashreplace", line_buffering=True)
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    namespace = main.__dict__
    count = 0
    interruptible = [False]

    def on_sigint(signum, frame):
        if interruptible[0]:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)

    def clip(s):
        if isinstance(s, str) and len(s) > MAX_TEXT:
            return s[:MAX_TEXT] + "\n[truncated]"
        return s

    def formats(value):
        out = {"text": clip(safe_repr(value)), "is_main_result": True}
        for attr, key in (("_repr_html_", "html"), ("_repr_markdown_", "markdown"),
                          ("_repr_svg_", "svg"), ("_repr_png_", "png"),
                          ("_repr_jpeg_", "jpeg"), ("_repr_latex_", "latex"),
                          ("_repr_json_", "json"), ("_repr_javascript_", "javascript"),
                          ("_repr_pdf_", "pdf")):
            fn = getattr(type(value), attr, None)
            if fn is None:
                continue
            try:
                data = fn(value)
            except Exception:
                continue
            if isinstance(data, tuple):
                data = data[0]
            if data is None:
                continue
            if isinstance(data, (bytes, bytearray)):
                data = base64.b64encode(bytes(data)).decode()
            if key == "json":
                try:
                    json.dumps(data)
                except (TypeError, ValueError):
                    continue
            out[key] = clip(data)
        return out

    def safe_repr(value):
        try:
            return repr(value)
        except Exception as e:
            return "<repr failed: %s: %s>" % (type(e).__name__, e)

    def error_msg(exc, filename=None):
        # The traceback starts at the cell's first frame (not this file's or asyncio's).
        tb = exc.__traceback__
        t = tb
        while t is not None and t.tb_frame.f_code.co_filename != filename:
            t = t.tb_next
        tb = t if t is not None else tb
        if isinstance(exc, SyntaxError):
            tb = None
        try:
            text = "".join(traceback.format_exception(type(exc), exc, tb))
        except Exception:
            text = "%s: %s\n" % (type(exc).__name__, exc)
        try:
            value = str(exc)
        except Exception:
            value = "<str failed>"
        return {"type": "error", "name": type(exc).__name__, "value": clip(value),
                "traceback": clip(text)}

    def emit_figures():
        # What Jupyter's inline backend does: every open figure becomes a PNG result, then
        # closes. Called by `plt.show()` and after each cell.
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        try:
            nums = plt.get_fignums()
        except Exception:
            return
        for n in nums:
            try:
                fig = plt.figure(n)
                buf = io.BytesIO()
                fig.savefig(buf, format="png", bbox_inches="tight")
                w, h = fig.get_size_inches() * fig.dpi
                text = "<Figure size %dx%d with %d Axes>" % (w, h, len(fig.axes))
            except Exception as e:
                send(error_msg(e))
                continue
            send({"type": "result", "png": base64.b64encode(buf.getvalue()).decode(),
                  "text": text, "is_main_result": False})
        try:
            plt.close("all")
        except Exception:
            pass

    # matplotlib draws with Agg through this backend, whose `show` hands figures to the client.
    # It is made when matplotlib first asks for it, so a worker that never plots never imports
    # matplotlib.
    import importlib.abc
    import importlib.util

    class InlineBackend(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if name != INLINE_BACKEND:
                return None
            return importlib.util.spec_from_loader(name, self)

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            from matplotlib.backend_bases import FigureManagerBase
            from matplotlib.backends.backend_agg import FigureCanvasAgg

            module.FigureCanvas = FigureCanvasAgg
            module.FigureManager = FigureManagerBase
            module.show = lambda *args, **kwargs: emit_figures()

    sys.meta_path.insert(0, InlineBackend())
    os.environ.setdefault("MPLBACKEND", "module://" + INLINE_BACKEND)
    if os.environ.pop("VMON_CI_PRELOAD", None):
        # The default context imports the data stack now, so a template snapshot holds it
        # loaded and a sandbox's first `import pandas` costs nothing. Names stay unbound.
        for m in PRELOAD:
            try:
                __import__(m)
            except Exception:
                pass

    def run_cell(code, filename):
        lines = code.splitlines(True)
        linecache.cache[filename] = (len(code), None, lines, filename)
        flags = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
        try:
            tree = compile(code, filename, "exec", ast.PyCF_ONLY_AST | flags)
        except (SyntaxError, ValueError, OverflowError) as e:
            return error_msg(e), None
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        try:
            body = compile(tree, filename, "exec", flags)
            expr = compile(last, filename, "eval", flags) if last is not None else None
        except (SyntaxError, ValueError, OverflowError) as e:
            return error_msg(e), None
        interruptible[0] = True
        try:
            if body.co_flags & 0x80 or (expr is not None and expr.co_flags & 0x80):
                import asyncio

                async def both():
                    r = eval(body, namespace)
                    if r is not None and hasattr(r, "__await__"):
                        await r
                    if expr is None:
                        return None
                    v = eval(expr, namespace)
                    if hasattr(v, "__await__") and expr.co_flags & 0x80:
                        v = await v
                    return v

                value = asyncio.run(both())
            else:
                exec(body, namespace)
                value = eval(expr, namespace) if expr is not None else None
        except BaseException as e:  # KeyboardInterrupt and SystemExit too: keep the context
            interruptible[0] = False
            return error_msg(e, filename), None
        finally:
            interruptible[0] = False
        return None, value

    send({"type": "ready", "pid": os.getpid()})
    while True:
        line = requests.readline()
        if not line:
            return
        try:
            req = json.loads(line)
        except ValueError:
            continue
        seq = req.get("seq", 0)
        env = req.get("env_vars") or {}
        saved = {}
        for k, v in env.items():
            if isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v:
                saved[k] = os.environ.get(k)
                os.environ[k] = v
        count += 1
        err, value = run_cell(req.get("code", ""), "<cell %d>" % count)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if err is None and value is not None:
            namespace["_"] = value
            try:
                send(dict(formats(value), type="result"))
            except Exception as e:
                send(error_msg(e))
        # After the cell's value, as Jupyter's inline backend shows figures after it.
        emit_figures()
        try:
            sys.stdout.flush()
        except Exception:
            pass
        try:
            sys.stderr.flush()
        except Exception:
            pass
        if err is not None:
            send(err)
        end_cell(send, count, seq)


def bash_worker_main(req_fd, resp_fd):
    """A bash context: one long-lived bash (variables, functions and cwd persist) that sources
    each cell from a file. Its output goes straight to this worker's fd 1 and 2, the server's
    pipes; it reports each cell's exit status on a pipe of its own."""
    import shlex
    import tempfile

    requests, send = worker_pipes(req_fd, resp_fd)
    cmd_r, cmd_w = os.pipe()
    st_r, st_w = os.pipe()
    # Ctrl-C (the server interrupts a cell with SIGINT) ends the running command, not bash.
    # bash runs the pipe as its script, a command at a time as lines arrive.
    proc = subprocess.Popen(
        ["bash", "--noprofile", "--norc", "/dev/fd/%d" % cmd_r],
        stdin=subprocess.DEVNULL, pass_fds=(cmd_r, st_w), close_fds=True, start_new_session=True)
    os.close(cmd_r)
    os.close(st_w)
    commands = os.fdopen(cmd_w, "wb", buffering=0)
    commands.write(b"trap : INT\n")
    status = os.fdopen(st_r, "rb", buffering=0)

    def on_sigint(signum, frame):
        try:
            os.killpg(proc.pid, signal.SIGINT)  # bash and the command it runs
        except OSError:
            pass

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cells = tempfile.mkdtemp(prefix="vmon-bash-")
    count = 0
    send({"type": "ready", "pid": os.getpid()})
    signal.signal(signal.SIGINT, on_sigint)
    while True:
        line = requests.readline()
        if not line:
            proc.terminate()
            return
        try:
            req = json.loads(line)
        except ValueError:
            continue
        seq = req.get("seq", 0)
        count += 1
        env = req.get("env_vars") or {}
        before, after = [], []
        for i, (k, v) in enumerate(sorted(env.items())):
            if not (isinstance(k, str) and isinstance(v, str) and BASH_NAME.match(k) and "\0" not in v):
                continue
            before.append('if [ "${%s+x}" = x ]; then __vmon_v%d=$%s; __vmon_s%d=1; else __vmon_s%d=0; fi; '
                          "export %s=%s" % (k, i, k, i, i, k, shlex.quote(v)))
            after.append('if [ "$__vmon_s%d" = 1 ]; then %s=$__vmon_v%d; else unset %s; fi' % (i, k, i, k))
        path = os.path.join(cells, "cell-%d.sh" % count)
        with open(path, "w") as f:
            f.write(req.get("code", "") + "\n")
        script = "\n".join(before + [". %s" % shlex.quote(path), "__vmon_rc=$?"] + after
                           + ["echo $__vmon_rc >&%d" % st_w, ""])
        # SIGINT stays with this worker while it hands the cell over.
        try:
            commands.write(script.encode())
            rc_line = status.readline()
        except OSError:
            rc_line = b""
        try:
            os.unlink(path)
        except OSError:
            pass
        if not rc_line:
            send({"type": "error", "name": "ContextDied",
                  "value": "bash exited; the context restarts on the next cell", "traceback": ""})
            send({"type": "done", "seq": seq})
            return
        rc = int(rc_line.strip() or b"0")
        if rc != 0:
            send({"type": "error", "name": "CommandExitError", "value": "exit status %d" % rc,
                  "traceback": ""})
        end_cell(send, count, seq)


# A JavaScript context: Node.js, the cells run in one global scope (`vm.runInThisContext`, so a
# cell's value is its completion value); a promise value is awaited; `require` resolves from the
# context's cwd. Same pipes and messages as the Python worker.
JS_WORKER = r"""
'use strict';
const fs = require('fs');
const vm = require('vm');
const util = require('util');
const readline = require('readline');
const { createRequire } = require('module');
const [reqFd, respFd] = process.argv.slice(-2).map(Number);
const MARK = '\x1evmon-cell-end ';
const send = (m) => fs.writeSync(respFd, JSON.stringify(m) + '\n');
globalThis.require = createRequire(process.cwd() + '/');
process.on('SIGINT', () => {});
let count = 0;
function errorMsg(e) {
  if (e instanceof Error || (e && typeof e === 'object' && 'message' in e)) {
    return { type: 'error', name: String(e.name || 'Error'), value: String(e.message),
             traceback: String(e.stack || e) };
  }
  return { type: 'error', name: 'Error', value: util.inspect(e), traceback: '' };
}
async function run(req) {
  count += 1;
  const env = req.env_vars || {};
  const saved = {};
  for (const [k, v] of Object.entries(env)) {
    if (typeof v === 'string' && k && !k.includes('=') && !(k + v).includes('\0')) {
      saved[k] = process.env[k];
      process.env[k] = v;
    }
  }
  const filename = `<cell ${count}>`;
  let value, err = null;
  try {
    try {
      value = vm.runInThisContext(req.code || '', { filename });
    } catch (e) {
      if (!(e instanceof SyntaxError) || !/await/.test(String(e.message))) throw e;
      value = vm.runInThisContext(`(async () => {\n${req.code}\n})()`, { filename });
    }
    if (value && typeof value.then === 'function') value = await value;
  } catch (e) {
    err = errorMsg(e);
  }
  for (const [k, v] of Object.entries(saved)) {
    if (v === undefined) delete process.env[k]; else process.env[k] = v;
  }
  if (!err && value !== undefined) {
    globalThis._ = value;
    const text = typeof value === 'string' ? util.inspect(value) : util.inspect(value, { depth: 4 });
    send({ type: 'result', text, is_main_result: true });
  }
  if (err) send(err);
  send({ type: 'number_of_executions', execution_count: count });
  const marker = MARK + String(req.seq || 0) + '\n';
  for (const fd of [1, 2]) { try { fs.writeSync(fd, marker); } catch (e) {} }
  send({ type: 'done', seq: req.seq || 0 });
}
const lines = readline.createInterface({ input: fs.createReadStream(null, { fd: reqFd }) });
let chain = Promise.resolve();
lines.on('line', (line) => {
  let req;
  try { req = JSON.parse(line); } catch (e) { return; }
  chain = chain.then(() => run(req));
});
lines.on('close', () => chain.then(() => process.exit(0)));
send({ type: 'ready', pid: process.pid });
"""


# --------------------------------------------------------------------------------------------
# Server side of a context
# --------------------------------------------------------------------------------------------


class WorkerDied(Exception):
    pass


class Worker:
    """A running worker process and the threads that read its pipes into one queue."""

    def __init__(self, cwd, preload=False, language="python"):
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        env = dict(os.environ)
        env.pop("VMON_CI_PRELOAD", None)
        if preload:
            env["VMON_CI_PRELOAD"] = "1"
        if language == "js":
            argv = ["node", "-e", JS_WORKER, "--", str(req_r), str(resp_w)]
        else:
            argv = [sys.executable, "-u", os.path.abspath(__file__), "--worker", str(req_r),
                    str(resp_w), language]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(req_r, resp_w), cwd=cwd, close_fds=True, start_new_session=True, env=env)
        os.close(req_r)
        os.close(resp_w)
        self.requests = os.fdopen(req_w, "wb", buffering=0)
        # Bounded: a cell printing faster than its client reads blocks on its pipe.
        self.events = queue.Queue(maxsize=4096)
        self.ready = threading.Event()
        self.threads = [
            threading.Thread(target=self._read_stream, args=("stdout", self.proc.stdout), daemon=True),
            threading.Thread(target=self._read_stream, args=("stderr", self.proc.stderr), daemon=True),
            threading.Thread(target=self._read_control, args=(os.fdopen(resp_r, "rb"),), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _read_stream(self, kind, pipe):
        fd = pipe.fileno()
        buf = b""
        while True:
            try:
                chunk = os.read(fd, READ_CHUNK)
            except OSError:
                chunk = b""
            if not chunk:
                if buf:
                    self.events.put((kind, buf))
                self.events.put((kind + "-eof", None))
                return
            buf = self._split(kind, buf + chunk)

    def _split(self, kind, buf):
        """Queues the complete lines and markers of `buf`; returns what must wait for more."""
        while buf:
            m = buf.find(MARK)
            nl = buf.find(b"\n")
            if m >= 0 and (nl < 0 or m < nl):
                end = buf.find(b"\n", m)
                if end < 0:
                    if m > 0:
                        self.events.put((kind, buf[:m]))
                    rest = buf[m:]
                    if len(rest) > 64:  # not a marker after all
                        self.events.put((kind, rest))
                        return b""
                    return rest
                if m > 0:
                    self.events.put((kind, buf[:m]))
                try:
                    seq = int(buf[m + len(MARK):end].strip())
                except ValueError:
                    seq = -1
                self.events.put((kind + "-end", seq))
                buf = buf[end + 1:]
            elif nl >= 0:
                self.events.put((kind, buf[: nl + 1]))
                buf = buf[nl + 1:]
            else:
                # A partial line: emit it, except a tail that may be the start of a marker.
                p = buf.rfind(MARK[:1])
                if p >= 0 and MARK.startswith(buf[p:]):
                    if p > 0:
                        self.events.put((kind, buf[:p]))
                    return buf[p:]
                self.events.put((kind, buf))
                return b""
        return b""

    def _read_control(self, f):
        while True:
            try:
                line = f.readline(MAX_CONTROL_LINE)
            except (OSError, ValueError):
                line = b""
            if not line:
                self.events.put(("control-eof", None))
                return
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("type") == "ready":
                self.ready.set()
                continue
            self.events.put(("control", msg))

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        """Kills the worker and whatever it started (its own session)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        try:
            self.requests.close()
        except OSError:
            pass

    def interrupt(self):
        if self.alive():
            try:
                self.proc.send_signal(signal.SIGINT)
            except OSError:
                pass


class Context:
    def __init__(self, cid, language, cwd, preload=False):
        self.id = cid
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()  # one cell at a time
        self.seq = 0
        self.worker = Worker(cwd, preload, language)

    def info(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def restart(self):
        old = self.worker
        old.stop()  # a running cell ends now (its client gets an error), freeing the lock
        with self.lock:
            if self.worker is old or not self.worker.alive():
                self.worker = Worker(self.cwd, False, self.language)
        self.worker.ready.wait(60)

    def close(self):
        self.worker.stop()

    def execute(self, code, env_vars, emit, disconnected):
        """Runs one cell; `emit(msg)` gets each output message; `disconnected()` says the client
        is gone (the cell is then interrupted)."""
        with self.lock:
            if not self.worker.alive():
                self.worker.stop()
                self.worker = Worker(self.cwd, False, self.language)
            w = self.worker
            # Output printed between cells (background threads) belongs to no request.
            for _ in range(w.events.qsize()):
                try:
                    kind, _data = w.events.get_nowait()
                except queue.Empty:
                    break
                if kind.endswith("-eof"):  # it died between cells
                    w.stop()
                    self.worker = w = Worker(self.cwd, False, self.language)
                    break
            self.seq += 1
            seq = self.seq
            try:
                w.requests.write(json.dumps(
                    {"seq": seq, "code": code, "env_vars": env_vars}).encode() + b"\n")
            except OSError:
                w.stop()
                self.worker = Worker(self.cwd, False, self.language)
                raise WorkerDied("the context's process could not take the cell; it was restarted")
            pending = {"stdout-end", "stderr-end", "done"}
            interrupted_at = None
            gone = False
            while pending:
                try:
                    kind, data = w.events.get(timeout=0.5)
                except queue.Empty:
                    if not gone and disconnected():
                        gone = True
                        w.interrupt()
                        interrupted_at = time.monotonic()
                    if interrupted_at and time.monotonic() - interrupted_at > 10:
                        w.stop()  # did not stop on SIGINT: kill it; next cell restarts it
                        return
                    if not w.alive() and w.events.empty():
                        kind, data = "control-eof", None
                    else:
                        continue
                if kind in ("stdout", "stderr"):
                    if not gone:
                        gone = not emit({"type": kind, "text": data.decode("utf-8", "backslashreplace"),
                                         "timestamp": now_ns()})
                elif kind in ("stdout-end", "stderr-end"):
                    if data == seq:
                        pending.discard(kind)
                elif kind == "control":
                    if data.get("type") == "done":
                        if data.get("seq") == seq:
                            pending.discard("done")
                    elif not gone:
                        gone = not emit(data)
                elif kind in ("control-eof", "stdout-eof", "stderr-eof"):
                    # The worker died mid-cell (os._exit, a crash, out of memory).
                    code_ = w.proc.poll()
                    w.stop()
                    if not gone:
                        emit({"type": "error", "name": "ContextDied",
                              "value": "the context's process exited (%s); its state is lost and it "
                                       "restarts on the next cell" % (code_,),
                              "traceback": ""})
                    return
                if gone and interrupted_at is None:
                    w.interrupt()
                    interrupted_at = time.monotonic()


class Contexts:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_id = {}
        self.default = {}

    def create(self, language, cwd):
        ctx = Context(str(uuid.uuid4()), language, cwd)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx

    def default_for(self, language, preload=False):
        with self.lock:
            cid = self.default.get(language)
            ctx = self.by_id.get(cid) if cid else None
            if ctx is not None:
                return ctx
            ctx = Context(str(uuid.uuid4()), language, default_cwd(), preload)
            self.by_id[ctx.id] = ctx
            self.default[language] = ctx.id
            return ctx

    def get(self, cid):
        with self.lock:
            return self.by_id.get(cid)

    def remove(self, cid):
        with self.lock:
            ctx = self.by_id.pop(cid, None)
            for lang, d in list(self.default.items()):
                if d == cid:
                    del self.default[lang]
        if ctx is not None:
            ctx.close()
        return ctx is not None

    def list(self):
        with self.lock:
            return [c.info() for c in self.by_id.values()]


CONTEXTS = Contexts()


# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------


class BadRequest(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


def language_of(value):
    if value is None or value == "":
        return "python"
    if not isinstance(value, str) or value.lower() not in LANGUAGES:
        raise BadRequest(400, "unsupported language %r (this server runs python, bash and js)" % (value,))
    return LANGUAGES[value.lower()]


ENVD_URL = os.environ.get("VMON_CI_ENVD", "http://127.0.0.1:49983")
MAX_TOKEN = 4096
# Never through a proxy the environment names: envd is on this machine.
_ENVD = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def token_accepted(token):
    """True when envd accepts `token` as the sandbox's access token (`GET /envs` answers 200;
    a sandbox created without a token answers 200 to anyone, as its envd does)."""
    if token is not None and len(token) > MAX_TOKEN:
        return False
    headers = {} if token is None else {"X-Access-Token": token}
    req = urllib.request.Request(ENVD_URL + "/envs", headers=headers)
    try:
        with _ENVD.open(req, timeout=10) as r:
            r.read(1 << 20)
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "vmon-code-interpreter/1"

    def log_message(self, fmt, *args):
        if os.environ.get("VMON_CI_LOG"):
            sys.stderr.write("%s %s\n" % (self.address_string(), fmt % args))

    # -- helpers --

    def send_json(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_text(self, status, text):
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def read_body(self):
        """Reads the whole body first, so an error answer leaves the connection usable."""
        self.body = b""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise BadRequest(411, "a Content-Length is required")
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise BadRequest(400, "bad Content-Length")
        if n < 0 or n > MAX_BODY:
            self.close_connection = True
            raise BadRequest(413, "request body larger than %d bytes" % MAX_BODY)
        self.body = self.rfile.read(n) if n else b""
        if len(self.body) != n:
            self.close_connection = True
            raise BadRequest(400, "truncated body")

    def read_json(self):
        raw = self.body
        if not raw.strip():
            return {}
        try:
            obj = json.loads(raw)
        except ValueError as e:
            raise BadRequest(400, "invalid JSON: %s" % e)
        if not isinstance(obj, dict):
            raise BadRequest(400, "the body must be a JSON object")
        return obj

    def route(self, method):
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        parts = [p for p in path.split("/") if p]
        try:
            if method == "GET" and parts == ["health"]:
                self.read_body()
                return self.send_json(200, {"status": "ok"})
            token = self.headers.get("X-Access-Token")
            needs_token = parts == ["execute"] or token is not None
            if needs_token and not token_accepted(token):
                # The body is not read: the connection cannot be reused.
                self.close_connection = True
                return self.send_json(401, {"code": 401, "message": "invalid or missing access token"})
            self.read_body()
            if method == "POST" and parts == ["execute"]:
                return self.execute()
            if parts[:1] == ["contexts"]:
                if method == "GET" and len(parts) == 1:
                    self.read_json()
                    return self.send_json(200, CONTEXTS.list())
                if method == "POST" and len(parts) == 1:
                    return self.create_context()
                if method == "DELETE" and len(parts) == 2:
                    self.read_json()
                    if not CONTEXTS.remove(parts[1]):
                        raise BadRequest(404, "context %s not found" % parts[1])
                    self.send_response(204)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                if method == "POST" and len(parts) == 3 and parts[2] == "restart":
                    self.read_json()
                    ctx = CONTEXTS.get(parts[1])
                    if ctx is None:
                        raise BadRequest(404, "context %s not found" % parts[1])
                    ctx.restart()
                    return self.send_json(200, ctx.info())
            raise BadRequest(404, "no route %s %s" % (method, path))
        except BadRequest as e:
            return self.send_text(e.status, e.message)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # never let one request take the server down
            self.close_connection = True
            try:
                self.send_text(500, "internal error: %s: %s" % (type(e).__name__, e))
            except OSError:
                pass

    def do_GET(self):
        self.route("GET")

    def do_POST(self):
        self.route("POST")

    def do_DELETE(self):
        self.route("DELETE")

    def create_context(self):
        req = self.read_json()
        language = language_of(req.get("language"))
        cwd = req.get("cwd") or default_cwd()
        if not isinstance(cwd, str) or "\0" in cwd:
            raise BadRequest(400, "cwd must be a path")
        try:
            os.makedirs(cwd, exist_ok=True)
        except OSError as e:
            raise BadRequest(400, "cwd %s: %s" % (cwd, e.strerror))
        if not os.path.isdir(cwd):
            raise BadRequest(400, "cwd %s is not a directory" % cwd)
        ctx = CONTEXTS.create(language, cwd)
        return self.send_json(200, ctx.info())

    def execute(self):
        req = self.read_json()
        code = req.get("code")
        if not isinstance(code, str):
            raise BadRequest(400, "code must be a string")
        env_vars = req.get("env_vars") or {}
        if not isinstance(env_vars, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()):
            raise BadRequest(400, "env_vars must map strings to strings")
        cid = req.get("context_id")
        if cid:
            if req.get("language"):
                raise BadRequest(400, "give context_id or language, not both")
            ctx = CONTEXTS.get(cid) if isinstance(cid, str) else None
            if ctx is None:
                raise BadRequest(404, "context %s not found" % (cid,))
        else:
            ctx = CONTEXTS.default_for(language_of(req.get("language")))

        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.wfile.flush()
        alive = [True]

        def emit(msg):
            if not alive[0]:
                return False
            data = json.dumps(msg).encode() + b"\n"
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            except OSError:
                alive[0] = False
            return alive[0]

        def disconnected():
            if not alive[0]:
                return True
            try:
                r, _, _ = select.select([self.connection], [], [], 0)
                if r and self.connection.recv(1, socket.MSG_PEEK) == b"":
                    alive[0] = False
            except OSError:
                alive[0] = False
            return not alive[0]

        try:
            ctx.execute(code, env_vars, emit, disconnected)
        except WorkerDied as e:
            emit({"type": "error", "name": "ContextDied", "value": str(e), "traceback": ""})
        except Exception as e:  # the headers are out: report in the stream
            emit({"type": "error", "name": "InternalError",
                  "value": "%s: %s" % (type(e).__name__, e), "traceback": ""})
        if alive[0]:
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                self.close_connection = True
        else:
            self.close_connection = True


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64


def main():
    import argparse

    p = argparse.ArgumentParser(description="vmon code-interpreter server")
    p.add_argument("--host", default=os.environ.get("VMON_CI_HOST", "0.0.0.0"))
    p.add_argument("--port", type=int, default=int(os.environ.get("VMON_CI_PORT", "49999")))
    args = p.parse_args()
    # A warm default context, so the first cell (and the template snapshot) has it ready.
    ctx = CONTEXTS.default_for("python", preload=True)
    ctx.worker.ready.wait(600)
    server = Server((args.host, args.port), Handler)
    sys.stderr.write("code interpreter listening on %s:%d\n" % (args.host, args.port))
    sys.stderr.flush()
    server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        if sys.argv[4] == "bash":
            bash_worker_main(int(sys.argv[2]), int(sys.argv[3]))
        else:
            worker_main(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
