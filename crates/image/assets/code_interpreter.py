#!/usr/bin/env python3
"""vmon's code-interpreter server: the HTTP API the `e2b-code-interpreter` SDK speaks, on
port 49999. Python contexts are IPython kernels (Debian's `python3-ipykernel`, driven over
ZeroMQ with `jupyter_client`'s message session); bash and JavaScript (Node.js) contexts are
worker processes of this server. Everything else is the Python standard library.

A Python context is one kernel process (its own session, so an interrupt or a kill reaches
what the cell started). The server sends `execute_request` on the kernel's shell socket and
maps what comes back on iopub to the SDK's messages: `stream` to `stdout`/`stderr`,
`execute_result` (main) and `display_data` to `result` with every MIME type the SDK reads,
`error` to `error`, `execute_input` to `number_of_executions`; the cell ends at the kernel's
`idle` for it. This file is also loaded inside each kernel (as the module `_vmon_kernel`) to
register what E2B's kernels add to IPython: `e2b/chart` (structured data of a matplotlib
figure), `e2b/data` (a DataFrame's columns) and JSON for plain lists and dicts.

Each bash or JavaScript context is a worker process (bash: this file run with `--worker`)
whose fd 1 and 2 are pipes read by the server; results and errors come back on a separate
pipe as JSON lines. After a cell the worker writes a marker line to fd 1 and 2 and then
`done` on the result pipe; the server ends the stream when it has all three, so no output is
lost or attributed to the next cell.

`POST /execute` demands the sandbox's envd access token in `X-Access-Token`, which the official
SDK sends: the server asks envd (on this guest's loopback) whether the token is the current
one, so a token rotated at claim or resume is honoured at once. A request without it is
answered 401 and runs nothing. The context endpoints run no code and the SDK sends them no
token; a token they do carry must be the right one.

Endpoints: `GET /health`; `POST /execute` {code, context_id, language, env_vars} streaming
newline-delimited JSON (`stdout`, `stderr`, `result`, `error`, `number_of_executions`);
`POST /contexts` {language, cwd}; `GET /contexts`; `DELETE /contexts/{id}`;
`POST /contexts/{id}/restart`; `POST /contexts/{id}/interrupt`.
"""

import json
import math
import os
import pwd
import queue
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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
LANGUAGES = {"python": "python", "python3": "python", "py": "python", "r": "r", "bash": "bash",
             "sh": "bash", "shell": "bash", "js": "js", "javascript": "js", "node": "js",
             "ts": "ts", "typescript": "ts"}
# Languages the SDK names that this guest has no kernel for: refused with the reason.
UNAVAILABLE = {
    "java": "Java contexts are not available: the guest image has no Java Jupyter kernel (Debian "
            "packages none, and the image is made from Debian's packages only); use python, r, ts, "
            "js or bash",
}
# What a TypeScript context needs besides Node.js: the cells' types are stripped with it.
ESBUILD = "esbuild"
NO_ESBUILD = ("TypeScript contexts are not available: no esbuild on this machine to strip the "
              "types (use language='js')")
BASH_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Imported ahead by the default context's kernel, so a template snapshot holds them loaded.
PRELOAD = ("numpy", "pandas", "matplotlib.pyplot")
# A DataFrame larger than this many cells gets no `e2b/data` (its HTML still comes).
MAX_DATA_CELLS = 200_000
KERNEL_START_TIMEOUT = 600
# A cell's client left (or the cell was interrupted) and the kernel did not stop within this
# many seconds: it is killed and the context starts a new one.
INTERRUPT_GRACE = 10
# The kernel sends a cell's last outputs and its `idle` right after its reply: if `idle` has
# not come this long after the reply, it was lost and the cell is over.
IDLE_AFTER_REPLY = 5


def now_ns():
    return time.time_ns()


def default_cwd():
    home = os.path.expanduser("~")
    return home if os.path.isdir(home) else "/"




# --------------------------------------------------------------------------------------------
# Inside a kernel: what E2B's kernels add to IPython (this file loaded as `_vmon_kernel`)
# --------------------------------------------------------------------------------------------

_saved_env = []


def push_env(env):
    """Sets a cell's `env_vars` in the kernel, remembering what they replace."""
    saved = {}
    for k, v in env.items():
        if isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v:
            saved[k] = os.environ.get(k)
            os.environ[k] = v
    _saved_env.append(saved)


def pop_env():
    """Gives the variables of the last `push_env` their earlier values back."""
    saved = _saved_env.pop() if _saved_env else {}
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def install_kernel_hooks(preload):
    """Registers the `e2b/chart`, `e2b/data` and JSON formatters on this kernel's IPython;
    with `preload`, imports the data stack (names stay unbound)."""
    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter, JSONFormatter
    from traitlets import ObjectName, Unicode

    class ChartFormatter(BaseFormatter):
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict,)

        def __call__(self, obj):
            figure = sys.modules.get("matplotlib.figure")
            if figure is None or not isinstance(obj, figure.Figure):
                return super().__call__(obj)
            try:
                return chart_of_figure(obj)
            except Exception:  # a chart we cannot read still has its PNG
                return None

    class DataFormatter(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict,)

        def __call__(self, obj):
            pandas = sys.modules.get("pandas")
            if pandas is None or not isinstance(obj, pandas.DataFrame):
                return super().__call__(obj)
            if obj.size > MAX_DATA_CELLS:
                return None
            try:
                return plain_json({str(k): v for k, v in obj.to_dict(orient="list").items()})
            except (TypeError, ValueError):
                return None

    class ListJSONFormatter(JSONFormatter):
        # E2B's kernels give lists and dicts an `application/json` (IPython only gives it to
        # objects with `_repr_json_`).
        def __call__(self, obj):
            if isinstance(obj, (list, dict)):
                try:
                    return plain_json(obj)
                except (TypeError, ValueError):
                    pass
            return super().__call__(obj)

    ip = get_ipython()
    skip_empty_flushes()
    formatters = ip.display_formatter.formatters
    formatters["e2b/chart"] = ChartFormatter(parent=ip.display_formatter)
    formatters["e2b/data"] = DataFormatter(parent=ip.display_formatter)
    formatters["application/json"] = ListJSONFormatter(parent=ip.display_formatter)
    if preload:
        for m in PRELOAD:
            try:
                __import__(m)
            except Exception:
                pass
        try:  # a first figure reads the font cache and sets Agg up: not in a user's cell
            plt = sys.modules["matplotlib.pyplot"]
            fig = plt.figure()
            fig.add_subplot().plot([0, 1])
            fig.canvas.draw()
            plt.close(fig)
        except Exception:
            pass


def skip_empty_flushes():
    """ipykernel's `OutStream.flush` waits for a round trip through its iopub thread even with
    nothing buffered, and every result flushes stdout and stderr: under TCG that is most of a
    small cell's time. With an empty buffer there is nothing to wait for (what was flushed
    before is already queued on that thread, ahead of anything sent after)."""
    try:
        from ipykernel.iostream import OutStream
    except ImportError:
        return
    flush = OutStream.flush
    if getattr(flush, "_vmon", False):
        return

    def flush_if_buffered(self):
        buffer = getattr(self, "_buffer", None)
        if buffer is not None and not buffer.tell() and not getattr(self, "_flush_pending", True):
            return None
        return flush(self)

    flush_if_buffered._vmon = True
    OutStream.flush = flush_if_buffered


def plain_json(obj):
    """`obj` as JSON-able Python (numpy scalars and arrays, dates as ISO strings, NaN as null);
    TypeError or ValueError when it is not data."""

    def default(o):
        if hasattr(o, "isoformat"):
            return o.isoformat()
        if hasattr(o, "tolist"):
            return o.tolist()
        raise TypeError("not JSON data: %s" % type(o).__name__)

    def no_nan(o):
        if isinstance(o, float) and o != o:
            return None
        if isinstance(o, list):
            return [no_nan(x) for x in o]
        if isinstance(o, dict):
            return {k: no_nan(v) for k, v in o.items()}
        return o

    return no_nan(json.loads(json.dumps(obj, default=default)))


def round8(v):
    """`v` rounded as E2B's chart extractor rounds measured values (8 - its exponent
    significant digits)."""
    v = float(v)
    if v != v or v in (float("inf"), float("-inf")):
        return None
    if v == 0:
        return 0.0
    exponent = int(math.floor(math.log10(abs(v))))
    return float("%.*g" % (max(1, 8 - exponent), v))


def point_value(v):
    """A data value of a chart as JSON: ISO text for dates, float for numbers, else text."""
    import datetime

    if isinstance(v, (datetime.date, datetime.datetime)):
        return v.isoformat()
    if type(v).__name__ == "datetime64":
        return str(v.astype("datetime64[s]"))
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v) if v == v else None
    return str(v)


def chart_of_figure(fig):
    """The `e2b/chart` of a matplotlib figure (the SDK's `Chart` fields), or None when it
    has no data."""
    axes = fig.get_axes()
    if not axes or not any(ax.has_data() for ax in axes):
        return None
    if len(axes) > 1:
        sup = getattr(fig, "_suptitle", None)
        return {"type": "superchart", "title": (sup.get_text() if sup is not None else "") or None,
                "elements": [chart_of_axes(ax) for ax in axes]}
    return chart_of_axes(axes[0])


def axes_kind(ax):
    """What one Axes draws: line, scatter, bar, pie, box_and_whisker or unknown (E2B's rules:
    by the kinds of artists on it, grid-like lines aside)."""
    from matplotlib.collections import PathCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import PathPatch, Rectangle, Wedge
    from matplotlib.text import Text

    children = getattr(ax, "_children", None)
    if children is None:
        children = list(ax.lines) + list(ax.patches) + list(ax.collections)
    artists = [a for a in children if not isinstance(a, Text)]
    if artists and all(isinstance(a, (Line2D, PathPatch)) for a in artists) and box_shapes(ax)[0]:
        return "box_and_whisker"
    if all(isinstance(a, Line2D) for a in artists):
        return "line"
    artists = [a for a in artists if not (isinstance(a, Line2D) and is_grid_line(a))]
    for kind, cls in (("scatter", PathCollection), ("pie", Wedge), ("bar", Rectangle)):
        if all(isinstance(a, cls) for a in artists):
            return kind
    return "unknown"


def is_grid_line(line):
    x, y = line.get_xdata(), line.get_ydata()
    return len(x) == 2 and len(y) == 2 and (x[0] == x[1] or y[0] == y[1])


def axis_ticks(axis):
    """(tick positions, tick labels) of an axis, labelled by its formatter (no draw needed)."""
    locs = list(axis.get_majorticklocs())
    try:
        labels = [str(s) for s in axis.get_major_formatter().format_ticks(locs)]
    except Exception:
        labels = [t.get_text() for t in axis.get_ticklabels()]
    return locs, labels


def axis_scale(axis):
    import matplotlib.category as mcategory
    import matplotlib.dates as mdates

    converter = getattr(axis, "converter", None)
    dates = tuple(c for c in (getattr(mdates, n, None) for n in
                              ("DateConverter", "ConciseDateConverter", "_SwitchableDateConverter"))
                  if isinstance(c, type))
    if dates and isinstance(converter, dates):
        return "datetime"
    scale = axis.get_scale()
    if scale != "linear":
        return scale
    if isinstance(converter, mcategory.StrCategoryConverter):
        return "categorical"
    return "linear"


def label_at(axis, position):
    """The tick label at `position` on `axis`, else the position as text."""
    locs, labels = axis_ticks(axis)
    for loc, label in zip(locs, labels):
        if abs(loc - position) <= 1e-9 * max(1.0, abs(position)):
            return label
    return "%g" % position


def unit_of(label):
    if not label:
        return None
    m = re.search(r"\s\((.*?)\)|\[(.*?)\]", label)
    return (m.group(1) or m.group(2)) if m else None


def chart_2d(ax, kind, swap=False):
    x_label, y_label = ax.get_xlabel() or None, ax.get_ylabel() or None
    if swap:  # horizontal bars and boxes: x names the categories, as for vertical ones
        x_label, y_label = y_label, x_label
    return {"type": kind, "title": ax.get_title() or None, "elements": [],
            "x_label": x_label, "y_label": y_label, "x_unit": unit_of(x_label),
            "y_unit": unit_of(y_label)}


def chart_of_axes(ax):
    kind = axes_kind(ax)
    if kind == "pie":
        return {"type": "pie", "title": ax.get_title() or None, "elements": [
            {"label": w.get_label(), "angle": round8(abs(w.theta2 - w.theta1)), "radius": float(w.r)}
            for w in ax.patches]}
    if kind == "bar":
        return bar_chart(ax)
    if kind == "box_and_whisker":
        return box_chart(ax)
    if kind not in ("line", "scatter"):
        return {"type": kind, "title": ax.get_title() or None, "elements": []}
    chart = chart_2d(ax, kind)
    for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        locs, labels = axis_ticks(axis)
        scale = axis_scale(axis)
        if scale == "datetime":
            import matplotlib.dates as mdates

            ticks = [mdates.num2date(t).isoformat() for t in locs]
        else:
            ticks = [float(t) for t in locs]
        chart.update({name + "_ticks": ticks, name + "_tick_labels": labels, name + "_scale": scale})
    if kind == "line":
        for line in ax.get_lines():
            if is_grid_line(line):
                continue
            label = line.get_label()
            if label.startswith("_child"):
                label = "Line " + label[len("_child"):]
            points = [[point_value(x), point_value(y)] for x, y in zip(line.get_xdata(), line.get_ydata())]
            chart["elements"].append({"label": label, "points": points})
    else:
        for coll in ax.collections:
            points = [[point_value(x), point_value(y)] for x, y in coll.get_offsets()]
            chart["elements"].append({"label": coll.get_label(), "points": points})
    return chart


def bar_chart(ax):
    from matplotlib.container import BarContainer

    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    horizontal = bool(bars) and getattr(bars[0], "orientation", None) == "horizontal"
    chart = chart_2d(ax, "bar", swap=horizontal)
    axis = ax.yaxis if horizontal else ax.xaxis
    for container in bars:
        group = container.get_label()
        if group.startswith("_container"):
            group = "Group " + group[len("_container"):]
        for rect in container:
            if horizontal:
                center, value = rect.get_y() + rect.get_height() / 2, rect.get_width()
            else:
                center, value = rect.get_x() + rect.get_width() / 2, rect.get_height()
            chart["elements"].append({"label": label_at(axis, center), "group": group,
                                      "value": round8(value)})
    return chart


def box_shapes(ax):
    """The boxes of a box plot as (first position, last position, q1, q3) along its category
    axis, and whether the plot is horizontal. Boxes are the PathPatches of `patch_artist=True`
    or the closed five-point rectangles matplotlib draws otherwise."""
    import numpy as np

    rects = []
    for patch in ax.patches:
        v = np.asarray(patch.get_path().vertices, dtype=float)
        if len(v):
            rects.append((v[:, 0].min(), v[:, 0].max(), v[:, 1].min(), v[:, 1].max()))
    if not rects:
        for line in ax.get_lines():
            x = np.asarray(line.get_xdata(orig=False), dtype=float)
            y = np.asarray(line.get_ydata(orig=False), dtype=float)
            if (len(x) == 5 and x[0] == x[-1] and y[0] == y[-1] and len(set(x)) == 2
                    and len(set(y)) == 2):
                rects.append((x.min(), x.max(), y.min(), y.max()))
    if not rects:
        return [], False
    # A vertical plot's medians are horizontal lines across its boxes.
    horizontal = True
    for line in ax.get_lines():
        x, y = list(line.get_xdata(orig=False)), list(line.get_ydata(orig=False))
        if len(x) == 2 and y[0] == y[1] and any(
                np.isclose(min(x), r[0]) and np.isclose(max(x), r[1]) for r in rects):
            horizontal = False
            break
    if horizontal:
        return [(r[2], r[3], r[0], r[1]) for r in rects], True
    return rects, False


def box_chart(ax):
    import numpy as np

    boxes, horizontal = box_shapes(ax)
    chart = chart_2d(ax, "box_and_whisker", swap=horizontal)
    axis = ax.yaxis if horizontal else ax.xaxis
    found = [{"lo": None, "hi": None, "median": None, "outliers": []} for _ in boxes]
    for line in ax.get_lines():
        pos = np.asarray(line.get_ydata(orig=False) if horizontal else line.get_xdata(orig=False), dtype=float)
        val = np.asarray(line.get_xdata(orig=False) if horizontal else line.get_ydata(orig=False), dtype=float)
        for (p0, p1, q1, q3), f in zip(boxes, found):
            if not len(pos) or pos.min() < p0 - 1e-9 or pos.max() > p1 + 1e-9:
                continue
            if line.get_linestyle() in ("None", "", " ") and line.get_marker() not in (None, "None", ""):
                f["outliers"] += [round8(v) for v in val]
            elif len(val) == 2 and np.isclose(val[0], val[1]):
                if np.isclose(pos.min(), p0) and np.isclose(pos.max(), p1) and q1 <= val[0] <= q3:
                    f["median"] = round8(val[0])
            elif len(val) == 2 and np.isclose(pos[0], pos[1]):
                if np.isclose(val.max(), q1):
                    f["lo"] = round8(val.min())
                elif np.isclose(val.min(), q3):
                    f["hi"] = round8(val.max())
            break
    for (p0, p1, q1, q3), f in zip(boxes, found):
        chart["elements"].append({
            "label": label_at(axis, (p0 + p1) / 2),
            "min": f["lo"] if f["lo"] is not None else round8(q1),
            "first_quartile": round8(q1),
            "median": f["median"],
            "third_quartile": round8(q3),
            "max": f["hi"] if f["hi"] is not None else round8(q3),
            "outliers": f["outliers"],
        })
    return chart


# --------------------------------------------------------------------------------------------
# Workers of bash and JavaScript contexts
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
# context's cwd. Same pipes and messages as the Python worker. A TypeScript context is the same
# worker with each cell's types stripped first by esbuild (no type checking, as Node.js's own
# type stripping); a cell esbuild cannot parse is a SyntaxError.
JS_WORKER = r"""
'use strict';
const fs = require('fs');
const vm = require('vm');
const util = require('util');
const readline = require('readline');
const { createRequire } = require('module');
const [lang, reqFdArg, respFdArg] = process.argv.slice(-3);
const [reqFd, respFd] = [reqFdArg, respFdArg].map(Number);
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
// Static ESM imports, which a script cannot hold, become `require`s (what Node.js's own
// ESM-to-CommonJS interop gives for built-ins and CommonJS packages); `var`, so a cell can run
// again.
function rewriteImports(code) {
  const q = `(['"][^'"\\n]+['"])`;
  return code
    .replace(new RegExp(`^([ \\t]*)import\\s+\\*\\s+as\\s+([\\w$]+)\\s+from\\s*${q}[ \\t]*;?`, 'gm'),
      '$1var $2 = require($3);')
    .replace(new RegExp(`^([ \\t]*)import\\s+\\{([^}]*)\\}\\s*from\\s*${q}[ \\t]*;?`, 'gm'),
      (m, ws, names, mod) => `${ws}var {${names.replace(/\s+as\s+/g, ': ')}} = require(${mod});`)
    .replace(new RegExp(`^([ \\t]*)import\\s+([\\w$]+)\\s*,\\s*\\{([^}]*)\\}\\s*from\\s*${q}[ \\t]*;?`, 'gm'),
      (m, ws, def, names, mod) =>
        `${ws}var ${def} = require(${mod}), {${names.replace(/\s+as\s+/g, ': ')}} = ${def};`)
    .replace(new RegExp(`^([ \\t]*)import\\s+([\\w$]+)\\s+from\\s*${q}[ \\t]*;?`, 'gm'),
      '$1var $2 = require($3);')
    .replace(new RegExp(`^([ \\t]*)import\\s*${q}[ \\t]*;?`, 'gm'), '$1require($2);');
}
// A cell with top-level `await` runs through Node.js's REPL evaluator (global scope, so its
// declarations outlive the cell; its value is its last expression's, awaited), as a notebook
// kernel's would.
// The REPL hands a cell's error to its domain, not to the eval's callback: a listener there
// ends the cell.
let replServer = null;
let replReject = null;
function replEval(code, filename) {
  if (!replServer) {
    const { PassThrough, Writable } = require('stream');
    replServer = require('repl').start({ input: new PassThrough(),
      output: new Writable({ write(c, e, cb) { cb(); } }),
      terminal: false, useGlobal: true, prompt: '' });
    replServer._domain.on('error', (e) => { if (replReject) replReject(e); });
  }
  return new Promise((resolve, reject) => {
    replReject = reject;
    replServer.eval(code, replServer.context, filename, (e, v) => (e ? reject(e) : resolve(v)));
  }).finally(() => { replReject = null; });
}
function stripTypes(code) {
  const r = require('child_process').spawnSync('esbuild', ['--loader=ts', '--log-level=error'],
    { input: code, encoding: 'utf8', maxBuffer: 1 << 28 });
  if (r.error) throw r.error;
  if (r.status !== 0) {
    const text = String(r.stderr || '').replace(/\x1b\[[0-9;]*m/g, '');
    const first = /\[ERROR\] (.*)/.exec(text);
    const e = new SyntaxError(first ? first[1] : text.trim());
    e.stack = text.trim();
    throw e;
  }
  return r.stdout;
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
    const code = rewriteImports(lang === 'ts' ? stripTypes(req.code || '') : (req.code || ''));
    try {
      value = vm.runInThisContext(code, { filename });
    } catch (e) {
      if (!(e instanceof SyntaxError) || !/await/.test(String(e.message))) throw e;
      value = await replEval(code, filename);
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
# Server side of a bash or JavaScript context: a worker process
# --------------------------------------------------------------------------------------------


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
            argv = [sys.executable, "-u", os.path.abspath(__file__), "--worker", str(req_r),
                    str(resp_w), "bash"]
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
        self.worker.ready.wait(60)

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
                if gone and interrupted_at is None:
                    w.interrupt()
                    interrupted_at = time.monotonic()




# --------------------------------------------------------------------------------------------
# Server side of a Python context: an IPython kernel
# --------------------------------------------------------------------------------------------

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


def unquoted(text):
    """A result's text as E2B's server gives it: a string's repr without its quotes."""
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


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
            "module.install_kernel_hooks(%r)\n" % (os.path.abspath(__file__), preload)))
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

    def _run_cell(self, k, code, emit, disconnected):
        msg_id = k.send("execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True})
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
                    elif status == "abort":
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


class Contexts:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_id = {}
        self.default = {}
        # A default context is made once even when its first cells come together; a kernel
        # start takes seconds, so it is not made under `lock`.
        self.making_default = threading.Lock()

    @staticmethod
    def _make(language, cwd, preload=False):
        cid = str(uuid.uuid4())
        if language in ("python", "r"):
            return KernelContext(cid, cwd, preload, language)
        return PipeContext(cid, language, cwd)

    def create(self, language, cwd):
        ctx = self._make(language, cwd)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx

    def default_for(self, language, preload=False):
        with self.making_default:
            with self.lock:
                cid = self.default.get(language)
                ctx = self.by_id.get(cid) if cid else None
            if ctx is not None:
                return ctx
            ctx = self._make(language, default_cwd(), preload)
            with self.lock:
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
    name = value.strip().lower() if isinstance(value, str) else None
    if name in UNAVAILABLE:
        raise BadRequest(400, UNAVAILABLE[name])
    if name not in LANGUAGES:
        raise BadRequest(400, "unsupported language %r (this server runs python, r, js, ts and "
                         "bash)" % (value,))
    if LANGUAGES[name] == "ts" and shutil.which(ESBUILD) is None:
        raise BadRequest(400, NO_ESBUILD)
    return LANGUAGES[name]


ENVD_URL = os.environ.get("VMON_CI_ENVD", "http://127.0.0.1:49983")
MAX_TOKEN = 4096
# Never through a proxy the environment names: envd is on this machine.
_ENVD = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def sandbox_envs(token):
    """The sandbox's environment variables when envd accepts `token` as its access token
    (`GET /envs` answers 200; a sandbox created without a token answers 200 to anyone, as its
    envd does), else None."""
    if token is not None and len(token) > MAX_TOKEN:
        return None
    headers = {} if token is None else {"X-Access-Token": token}
    req = urllib.request.Request(ENVD_URL + "/envs", headers=headers)
    try:
        with _ENVD.open(req, timeout=10) as r:
            body = r.read(1 << 20)
            if r.status != 200:
                return None
    except (urllib.error.URLError, OSError, ValueError):
        return None
    try:
        envs = json.loads(body or b"{}")
    except ValueError:
        envs = {}
    if not isinstance(envs, dict):
        return {}
    return {k: v for k, v in envs.items() if isinstance(k, str) and isinstance(v, str)}


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
            self.envs = sandbox_envs(token) if needs_token else {}
            if self.envs is None:
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
                if method == "POST" and len(parts) == 3 and parts[2] == "interrupt":
                    self.read_json()
                    ctx = CONTEXTS.get(parts[1])
                    if ctx is None:
                        raise BadRequest(404, "context %s not found" % parts[1])
                    ctx.interrupt()
                    self.send_response(204)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
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
        if not os.access(cwd, os.X_OK):
            # Kernels run as the server's user (not root, as on E2B): say so instead of a
            # kernel that dies entering it.
            raise BadRequest(400, "cwd %s: permission denied (contexts run as %s)"
                             % (cwd, pwd.getpwuid(os.getuid()).pw_name))
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
            ctx.execute(code, env_vars, emit, disconnected, self.envs)
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
    # A warm default kernel, so the first cell (and the template snapshot) has it ready.
    CONTEXTS.default_for("python", preload=True)
    # E2B's server also starts a default JavaScript context (listed by `list_code_contexts`).
    CONTEXTS.default_for("js")
    server = Server((args.host, args.port), Handler)
    sys.stderr.write("code interpreter listening on %s:%d\n" % (args.host, args.port))
    sys.stderr.flush()
    server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker" and sys.argv[4] == "bash":
        bash_worker_main(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
