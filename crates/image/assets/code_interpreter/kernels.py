"""Server side of a Python or R context: a Jupyter kernel.

A Python context is one kernel process (its own session, so an interrupt or a kill reaches
what the cell started). The server sends `execute_request` on the kernel's shell socket and
maps what comes back on iopub to the SDK's messages: `stream` to `stdout`/`stderr`,
`execute_result` (main) and `display_data` to `result` with every MIME type the SDK reads,
`error` to `error`, `execute_input` to `number_of_executions`; the cell ends at the kernel's
`idle` for it.

Each IPython kernel loads `kernel_hooks.py` (as the module `_vmon_kernel`), which registers
what E2B's kernels add to IPython. An R context is IRkernel's kernel, driven the same way.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from .common import BadRequest, now_ns, unquoted
from .kernel_hooks import keep_header_dates

MAX_TEXT = 8 * 1024 * 1024
KERNEL_START_TIMEOUT = 600
# A cell's client left (or the cell was interrupted) and the kernel did not stop within this
# many seconds: it is killed and the context starts a new one.
INTERRUPT_GRACE = 10
# The kernel sends a cell's last outputs and its `idle` right after its reply: if `idle` has
# not come this long after the reply, it was lost and the cell is over.
IDLE_AFTER_REPLY = 5
# Loaded inside each IPython kernel, by its path.
KERNEL_HOOKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_hooks.py")


# Jupyter MIME types and the SDK's result fields; the rest of a bundle goes to `extra`.
MIME_FIELDS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown",
    "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf",
    "text/latex": "latex", "application/json": "json", "application/javascript": "javascript",
    "e2b/data": "data", "e2b/chart": "chart",
}


def clip(s):
    if isinstance(s, str) and len(s) > MAX_TEXT:
        return s[:MAX_TEXT] + "\n[truncated]"
    return s


def result_message(bundle, is_main, language="python"):
    """The SDK's `result` for a Jupyter MIME bundle."""
    msg = {"type": "result", "is_main_result": is_main}
    extra = {}
    for mime, value in bundle.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = clip(value)
        elif value or value == 0:
            msg[field] = clip(value)
    if "text" in msg and language == "python":
        msg["text"] = unquoted(msg["text"])
    if extra:
        msg["extra"] = extra
    return msg


def kernel_env():
    env = dict(os.environ)
    # `!pip install` installs for the kernel's interpreter: Debian's python3, whose site is
    # marked externally managed (pip then installs to the user's site, as a user has no
    # other). pip's version check would wait on PyPI, which the guest may not reach.
    env.setdefault("PIP_BREAK_SYSTEM_PACKAGES", "1")
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    return env


def ensure_user_site():
    """The user's site-packages must exist when a kernel starts, or Python leaves it off
    `sys.path` and a `pip install` of the running kernel is importable only after a restart."""
    import site

    try:
        os.makedirs(site.getusersitepackages(), exist_ok=True)
    except OSError:
        pass


class KernelDied(Exception):
    pass


# The Jupyter kernelspec of each kernel language other than Python (whose kernel is this
# server's own interpreter's ipykernel): R is IRkernel, whose Debian package installs `ir` in
# /usr/share/jupyter/kernels.
KERNELSPECS = {"r": ("ir", "R contexts are not available: no IRkernel kernelspec `ir` "
                           "(r-base-core and r-cran-irkernel) on this machine")}


def kernelspec_argv(language, connection_file):
    """The command line of `language`'s kernel from its kernelspec (as jupyter_client finds
    it), or BadRequest saying what is missing."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    name, missing = KERNELSPECS[language]
    try:
        spec = KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel:
        raise BadRequest(400, missing)
    if not spec.argv or shutil.which(spec.argv[0]) is None:
        raise BadRequest(400, missing)
    return [a.replace("{connection_file}", connection_file)
            .replace("{resource_dir}", spec.resource_dir) for a in spec.argv], dict(spec.env or {})


def r_string(s):
    """An R string literal for `s` (JSON's escapes are R's; `s` has no NUL)."""
    return json.dumps(s, ensure_ascii=False)


def r_env_list(env):
    """An R named list of strings for a mapping of environment variables."""
    return "list(%s)" % ", ".join("%s = %s" % (r_string(k), r_string(v)) for k, v in env.items())


def settable_env(env):
    """The entries of `env` that can be environment variables."""
    out = {}
    for k, v in (env or {}).items():
        if isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v:
            try:
                (k + v).encode("utf-8")
            except UnicodeEncodeError:
                continue
            out[k] = v
    return out


# What an R kernel runs for a cell's `env_vars`: the earlier values are kept in an option
# (not in the user's global environment) and given back after the cell.
R_PUSH_ENV = ("local({ new <- %s; old <- as.list(Sys.getenv(names(new), unset = NA, names = TRUE)); "
              "options(vmon.saved_env = c(list(old), getOption('vmon.saved_env'))); "
              "do.call(Sys.setenv, new) })")
R_POP_ENV = ("local({ s <- getOption('vmon.saved_env'); if (length(s)) { "
             "options(vmon.saved_env = s[-1]); old <- s[[1]]; for (k in names(old)) "
             "if (is.na(old[[k]])) Sys.unsetenv(k) else do.call(Sys.setenv, old[k]) } })")


class Kernel:
    """A Jupyter kernel process (IPython, or the kernelspec's for another language) and this
    server's sockets to it (shell and iopub, signed with the kernel's key). Used under its
    context's lock: ZeroMQ sockets are not shared between threads at once."""

    def __init__(self, cwd, preload=False, language="python"):
        import zmq
        from jupyter_client.connect import write_connection_file
        from jupyter_client.session import Session

        keep_header_dates()
        self.language = language
        self.dir = tempfile.mkdtemp(prefix="vmon-kernel-")
        path = os.path.join(self.dir, "kernel.json")
        env = kernel_env()
        if language == "python":
            ensure_user_site()
            argv = [sys.executable, "-m", "ipykernel_launcher", "-f", path,
                    "--InteractiveShell.colors=NoColor",
                    "--HistoryManager.hist_file=:memory:",
                    "--PlainTextFormatter.max_seq_length=0",
                    # ipykernel sleeps 0.5 ms after each cell so that iopub is out before the
                    # reply; a TCG guest's timer makes that several ms, and this server waits
                    # for iopub's `idle` anyway.
                    "--IPythonKernel._execute_sleep=0",
                    "--IPKernelApp.log_level=ERROR"]
        else:
            try:
                argv, spec_env = kernelspec_argv(language, path)
            except BadRequest:
                shutil.rmtree(self.dir, ignore_errors=True)
                raise
            env.update(spec_env)
        key = uuid.uuid4().hex.encode()
        _, info = write_connection_file(path, ip="127.0.0.1", key=key)
        self.session = Session(key=key, username="vmon")
        self.proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            close_fds=True, start_new_session=True)
        ctx = zmq.Context.instance()
        self.shell = ctx.socket(zmq.DEALER)
        self.iopub = ctx.socket(zmq.SUB)
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        # Queued here rather than dropped by the kernel's PUB socket while a slow client
        # holds a cell's stream back: a dropped `idle` would leave the cell unfinished.
        self.iopub.setsockopt(zmq.RCVHWM, 0)
        for sock, port in ((self.shell, info["shell_port"]), (self.iopub, info["iopub_port"])):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect("tcp://127.0.0.1:%d" % port)
        self.poller = zmq.Poller()
        self.poller.register(self.shell, zmq.POLLIN)
        self.poller.register(self.iopub, zmq.POLLIN)
        self.fresh = True  # nothing run yet: the sandbox's envs still to set
        self._wait_ready(KERNEL_START_TIMEOUT)
        if language != "python":
            return
        self.run_quiet("exec(%r, {'__name__': '_vmon_setup'})" % (
            "import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('_vmon_kernel', %r)\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "sys.modules['_vmon_kernel'] = module\n"
            "spec.loader.exec_module(module)\n"
            "module.install_kernel_hooks(%r)\n" % (KERNEL_HOOKS, preload)))
        if preload:
            # A cell with a value, not counted, then its traces cleared: the first code paths
            # of a cell (IPython's, the formatters') run now, so a template's snapshot holds
            # them warm.
            self.run_quiet("1 + 1", silent=False)
            self.run_quiet("get_ipython().displayhook.flush()")

    def alive(self):
        return self.proc.poll() is None

    def set_envs(self, envs):
        """Sets the sandbox's environment variables in the kernel."""
        envs = settable_env(envs)
        if not envs:
            return
        if self.language == "r":
            self.run_quiet("do.call(Sys.setenv, %s)" % r_env_list(envs))
        else:
            self.run_quiet("__import__('os').environ.update(%r)" % (envs,))

    def push_env(self, env):
        """Sets a cell's `env_vars`, keeping the values they replace for `pop_env`."""
        if self.language == "r":
            self.run_quiet(R_PUSH_ENV % r_env_list(settable_env(env)))
        else:
            self.run_quiet("__import__('_vmon_kernel').push_env(%r)" % (env,))

    def pop_env(self):
        if self.language == "r":
            self.run_quiet(R_POP_ENV)
        else:
            self.run_quiet("__import__('_vmon_kernel').pop_env()")

    def send(self, msg_type, content):
        return self.session.send(self.shell, msg_type, content)["header"]["msg_id"]

    def recv(self, timeout):
        """The next message on shell or iopub within `timeout` seconds: (channel, message),
        or (None, None)."""
        for sock, _ in self.poller.poll(int(timeout * 1000)):
            frames = sock.recv_multipart()
            _, parts = self.session.feed_identities(frames)
            try:
                msg = self.session.deserialize(parts)
            except ValueError:  # badly signed: not from our kernel
                continue
            return ("shell" if sock is self.shell else "iopub"), msg
        return None, None

    def _wait_ready(self, timeout):
        # The kernel is ready when it answers on shell and iopub reaches us: a SUB socket
        # joins late, and a cell's first outputs must not be lost.
        deadline = time.monotonic() + timeout
        shell_ok = iopub_ok = False
        while not (shell_ok and iopub_ok):
            if not self.alive():
                status = self.proc.poll()
                self.stop()
                raise KernelDied("the kernel exited while starting (status %s)" % status)
            if time.monotonic() > deadline:
                self.stop()
                raise KernelDied("the kernel did not start in %d s" % timeout)
            self.send("kernel_info_request", {})
            until = time.monotonic() + 1
            while time.monotonic() < until and not (shell_ok and iopub_ok):
                channel, msg = self.recv(0.2)
                if channel == "shell":
                    shell_ok = True
                elif channel == "iopub":
                    iopub_ok = True
        # Answers to the repeated requests are dropped by parent id later.

    def run_quiet(self, code, timeout=120, silent=True):
        """Runs internal code (no history, no count; its output is nobody's); raises
        KernelDied if the kernel dies or does not answer."""
        msg_id = self.send("execute_request", {
            "code": code, "silent": silent, "store_history": False, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": False})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            channel, msg = self.recv(0.5)
            if channel is None:
                if not self.alive():
                    raise KernelDied("the kernel exited")
                continue
            if channel == "shell" and msg["parent_header"].get("msg_id") == msg_id:
                content = msg["content"]
                if content.get("status") == "error":
                    sys.stderr.write("kernel setup failed: %s: %s\n" % (
                        content.get("ename"), content.get("evalue")))
                return
        raise KernelDied("the kernel did not answer in %d s" % timeout)

    def interrupt(self):
        # SIGINT to the kernel's session, as Jupyter does: the cell and what it started.
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
        except OSError:
            pass

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass

    def stop(self):
        self.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for sock in (self.shell, self.iopub):
            try:
                sock.close(linger=0)
            except Exception:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


class KernelContext:
    """A Python or R context: one Jupyter kernel, one cell at a time."""

    def __init__(self, cid, cwd, preload=False, language="python"):
        self.id = cid
        self.language = language
        self.cwd = cwd
        self.preload = preload
        self.lock = threading.Lock()  # one cell at a time
        self.kernel = Kernel(cwd, preload, language)
        self.running = None  # the kernel a cell runs in, for interrupt

    def info(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def restart(self):
        # A running cell sees its kernel die and ends (its client gets an error), freeing the
        # lock; the sockets are closed by the thread holding it.
        self.kernel.kill()
        with self.lock:
            self.kernel.stop()
            self.kernel = Kernel(self.cwd, language=self.language)

    def interrupt(self):
        k = self.running
        if k is not None:
            k.interrupt()

    def close(self):
        self.kernel.kill()
        with self.lock:
            self.kernel.stop()

    def _kernel(self):
        if not self.kernel.alive():
            self.kernel.stop()
            self.kernel = Kernel(self.cwd, language=self.language)
        return self.kernel

    def execute(self, code, env_vars, emit, disconnected, sandbox_envs=None):
        with self.lock:
            k = self.kernel
            try:
                k = self._kernel()
                if k.fresh and sandbox_envs:
                    k.set_envs(sandbox_envs)
                k.fresh = False
                if env_vars:
                    k.push_env(env_vars)
                self.running = k
                try:
                    self._run_cell(k, code, emit, disconnected)
                finally:
                    self.running = None
                if env_vars and k.alive():
                    k.pop_env()
            except KernelDied as e:
                code_ = k.proc.poll()
                k.stop()
                emit({"type": "error", "name": "ContextDied",
                      "value": "the context's kernel exited (%s: %s); its state is lost and it "
                               "restarts on the next cell" % (code_, e), "traceback": ""})

    def warm(self):
        """Runs a cell with a value through the path a user's cell takes, uncounted and with
        its traces cleared, while no user cell has run in this kernel (the restore pool's
        warm-up: the first cell of a sandbox then finds that path translated). Never waits: a
        busy, dead or used kernel is left alone. True when the cell ran."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            k = self.kernel
            if self.language != "python" or not k.fresh or not k.alive():
                return False
            try:
                self._run_cell(k, "1 + 1", lambda _msg: True, lambda: False,
                               store_history=False)
                k.run_quiet("get_ipython().displayhook.flush()", timeout=30)
            except KernelDied:
                k.stop()
                return False
            return True
        finally:
            self.lock.release()

    def _run_cell(self, k, code, emit, disconnected, store_history=True):
        msg_id = k.send("execute_request", {
            "code": code, "silent": False, "store_history": store_history, "user_expressions": {},
            # Cells never queue here (one at a time, under the lock), so there is nothing for
            # stop_on_error to spare; with it, ipykernel aborts whatever request reaches it in
            # the moment after a failed cell (the env restore, or the next cell).
            "allow_stdin": False, "stop_on_error": False})
        idle = replied = errored = False
        gone = False
        interrupted_at = replied_at = None
        while not (idle and replied):
            channel, msg = k.recv(0.5)
            if replied_at and time.monotonic() - replied_at > IDLE_AFTER_REPLY:
                break  # the reply came and the kernel is not busy for us any more
            if channel is None:
                if not gone and disconnected():
                    gone = True
                if gone and interrupted_at is None:
                    k.interrupt()
                    interrupted_at = time.monotonic()
                if interrupted_at and time.monotonic() - interrupted_at > INTERRUPT_GRACE:
                    raise KernelDied("it did not stop on an interrupt and was killed")
                if not k.alive():
                    raise KernelDied("exit status %s" % k.proc.poll())
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue  # an earlier request's, or output of a thread between cells
            kind, content = msg["msg_type"], msg["content"]
            out = None
            if channel == "shell":
                if kind == "execute_reply":
                    replied = True
                    replied_at = time.monotonic()
                    status = content.get("status")
                    if status == "error" and not errored:
                        errored = True
                        out = {"type": "error", "name": content.get("ename", ""),
                               "value": clip(content.get("evalue", "")),
                               "traceback": clip("\n".join(content.get("traceback", [])))}
                    elif status in ("aborted", "abort"):
                        out = {"type": "error", "name": "ExecutionAborted",
                               "value": "Execution was aborted", "traceback": ""}
            elif kind == "status":
                idle = content.get("execution_state") == "idle"
            elif kind == "execute_input":
                out = {"type": "number_of_executions", "execution_count": content.get("execution_count")}
            elif kind == "stream":
                name = "stderr" if content.get("name") == "stderr" else "stdout"
                out = {"type": name, "text": clip(content.get("text", "")), "timestamp": now_ns()}
            elif kind in ("execute_result", "display_data"):
                out = result_message(content.get("data") or {}, kind == "execute_result",
                                     k.language)
            elif kind == "error" and not errored:
                errored = True
                out = {"type": "error", "name": content.get("ename", ""),
                       "value": clip(content.get("evalue", "")),
                       "traceback": clip("\n".join(content.get("traceback", [])))}
            if out is not None and not gone:
                gone = not emit(out)
