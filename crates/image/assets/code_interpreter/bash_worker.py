"""A bash context's worker process: `workers.Worker` runs this file as a script, its arguments
the fds of its request pipe and of its result pipe. Run by path, outside the package, it
imports only the standard library; `workers.py` imports its `MARK`.
"""

import json
import os
import re
import signal
import subprocess
import sys

# What a worker writes to fd 1 and 2 after a cell, before its sequence number (the JavaScript
# worker, `js_worker.JS_WORKER`, has it too).
MARK = b"\x1evmon-cell-end "
BASH_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


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
    # A SIGINT this worker was started ignoring (anything started in the background by a shell
    # without job control) would stay ignored in bash, which can then neither trap it nor let
    # its commands die of it: a handler of ours here is the default again in bash.
    signal.signal(signal.SIGINT, lambda signum, frame: None)
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


if __name__ == "__main__":
    bash_worker_main(int(sys.argv[1]), int(sys.argv[2]))
