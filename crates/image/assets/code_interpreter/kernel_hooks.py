"""Inside a kernel: what E2B's kernels add to IPython. Each Python context's kernel loads this
file (by its path, as the module `_vmon_kernel`: `kernels.Kernel`) to register `e2b/chart`
(structured data of a matplotlib figure), `e2b/data` (a DataFrame's columns) and JSON for plain
lists and dicts; the server sets a cell's `env_vars` with its `push_env` and `pop_env`.

The server imports only `keep_header_dates` from it (for its own side of the sockets). Loaded by
path, outside the package, it imports only the standard library (and, when called, IPython,
ipykernel and what a figure needs).
"""

import json
import math
import os
import re
import sys

# Imported ahead by the default context's kernel, so a template snapshot holds them loaded.
PRELOAD = ("numpy", "pandas", "matplotlib.pyplot")
# A DataFrame larger than this many cells gets no `e2b/data` (its HTML still comes).
MAX_DATA_CELLS = 200_000


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
    keep_header_dates()
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


def keep_header_dates():
    """jupyter_client turns the `date` of every message's header and parent header into a
    datetime as it reads the message (a regular expression and dateutil's parser per header): a
    tenth of a millisecond natively, ~2 ms a message under TCG, several a cell, and nothing in
    the server or ipykernel reads them. Left as the strings they came as (a reply's parent
    header goes back as it came); the same on the wire. Called in the server and each kernel."""
    try:
        import jupyter_client.session as session
    except ImportError:
        return
    session.extract_dates = lambda obj: obj


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
