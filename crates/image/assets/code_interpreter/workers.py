"""Server side of a bash or JavaScript context: a worker process.

Each bash or JavaScript context is a worker process (bash: `bash_worker.py`; JavaScript and
TypeScript: Node.js running `js_worker.JS_WORKER`) whose fd 1 and 2 are pipes read by the
server; results and errors come back on a separate pipe as JSON lines. After a cell the worker writes a marker line to fd 1 and 2 and then
`done` on the result pipe; the server ends the stream when it has all three, so no output is
lost or attributed to the next cell.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from .bash_worker import MARK
from .common import now_ns, unquoted
from .js_worker import JS_WORKER

MAX_CONTROL_LINE = 64 * 1024 * 1024
READ_CHUNK = 64 * 1024
# A bash context's worker, run as a script.
BASH_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bash_worker.py")


class WorkerDied(Exception):
    pass


class Worker:
    """A running worker process and the threads that read its pipes into one queue."""

    def __init__(self, cwd, language):
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        env = dict(os.environ)
        if language in ("js", "ts"):
            argv = ["node", "-e", JS_WORKER, "--", language, str(req_r), str(resp_w)]
        else:
            argv = [sys.executable, "-u", BASH_WORKER, str(req_r), str(resp_w)]
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


class Interrupter:
    """Stops the cell of a worker whose client has left: SIGINT at once and again each second
    (one that lands before the cell's command has started, on a loaded machine, ends nothing),
    then, after 10 s, the worker itself (its state is lost; the next cell restarts it)."""

    def __init__(self, worker):
        self.worker = worker
        self.first = self.last = None

    def gave_up(self):
        now = time.monotonic()
        if self.first is None:
            self.first = now
        if now - self.first > 10:
            self.worker.stop()
            return True
        if self.last is None or now - self.last >= 1:
            self.worker.interrupt()
            self.last = now
        return False


class PipeContext:
    """A bash or JavaScript context: one worker process, one cell at a time."""

    def __init__(self, cid, language, cwd):
        self.id = cid
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()  # one cell at a time
        self.seq = 0
        self.worker = Worker(cwd, language)

    def info(self):
        # E2B's names: `js` and `ts` are reported as `javascript` and `typescript`.
        name = {"js": "javascript", "ts": "typescript"}.get(self.language, self.language)
        return {"id": self.id, "language": name, "cwd": self.cwd}

    def restart(self):
        old = self.worker
        old.stop()  # a running cell ends now (its client gets an error), freeing the lock
        with self.lock:
            if self.worker is old or not self.worker.alive():
                self.worker = Worker(self.cwd, self.language)
        self.wait_ready(60)

    def wait_ready(self, timeout):
        """Whether the worker finished starting (its `ready` line) within `timeout` seconds."""
        return self.worker.ready.wait(timeout)

    def interrupt(self):
        self.worker.interrupt()

    def close(self):
        self.worker.stop()

    def execute(self, code, env_vars, emit, disconnected, sandbox_envs=None):
        """Runs one cell; `emit(msg)` gets each output message; `disconnected()` says the client
        is gone (the cell is then interrupted). The sandbox's envs are the cell's defaults."""
        env_vars = dict(sandbox_envs or {}, **(env_vars or {}))
        with self.lock:
            if not self.worker.alive():
                self.worker.stop()
                self.worker = Worker(self.cwd, self.language)
            w = self.worker
            # Output printed between cells (background threads) belongs to no request.
            for _ in range(w.events.qsize()):
                try:
                    kind, _data = w.events.get_nowait()
                except queue.Empty:
                    break
                if kind.endswith("-eof"):  # it died between cells
                    w.stop()
                    self.worker = w = Worker(self.cwd, self.language)
                    break
            self.seq += 1
            seq = self.seq
            try:
                w.requests.write(json.dumps(
                    {"seq": seq, "code": code, "env_vars": env_vars}).encode() + b"\n")
            except OSError:
                w.stop()
                self.worker = Worker(self.cwd, self.language)
                raise WorkerDied("the context's process could not take the cell; it was restarted")
            pending = {"stdout-end", "stderr-end", "done"}
            gone = False
            stopper = Interrupter(w)
            while pending:
                try:
                    kind, data = w.events.get(timeout=0.5)
                except queue.Empty:
                    if not gone and disconnected():
                        gone = True
                    if gone and stopper.gave_up():
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
                        if data.get("type") == "result":
                            data["text"] = unquoted(data.get("text"))
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
                if gone and stopper.gave_up():
                    return
