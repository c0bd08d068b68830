"""Puts the tables of a `tests/bench/qemu_ab.sh` run side by side:

    python3 tests/bench/qemu_ab_table.py OUT-DIR

One row per measurement (the bench's own row names), one column per run in the order they
ran (a-1, b-1, a-2, b-2, ...), each cell the run's median; then the median of A's and of B's
medians and B/A. The load average before and after each run is printed under the table.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

ROW = re.compile(r"^\| (?P<name>[^|]+?) \| (?P<median>[0-9.]+) (?P<unit>\S+) \|")


def runs(out: Path) -> list[tuple[str, Path]]:
    found = []
    for f in out.glob("[ab]-*.txt"):
        side, rnd = f.stem.split("-")
        found.append((int(rnd), side, f))
    return [(f"{side}-{rnd}", f) for rnd, side, f in sorted(found)]


def main() -> None:
    out = Path(sys.argv[1])
    order = runs(out)
    table: dict[str, dict[str, tuple[float, str]]] = {}
    loads = []
    for name, f in order:
        for line in f.read_text().splitlines():
            m = ROW.match(line)
            if m:
                table.setdefault(m["name"], {})[name] = (float(m["median"]), m["unit"])
            elif line.startswith("load "):
                loads.append(f"{name} {line}")
    cols = [n for n, _ in order]
    print("| measurement | " + " | ".join(cols) + " | A (7.2) | B (10.0) | B/A |")
    print("|---|" + "---|" * (len(cols) + 3))
    for row, cells in table.items():
        unit = next(iter(cells.values()))[1]
        a = [v for k, (v, _) in cells.items() if k.startswith("a")]
        b = [v for k, (v, _) in cells.items() if k.startswith("b")]
        ma = statistics.median(a) if a else float("nan")
        mb = statistics.median(b) if b else float("nan")
        ratio = f"{mb / ma:.2f}" if a and b and ma else "-"
        vals = " | ".join(f"{cells[c][0]:.1f}" if c in cells else "-" for c in cols)
        print(f"| {row} ({unit}) | {vals} | {ma:.1f} | {mb:.1f} | {ratio} |")
    print()
    for line in loads:
        print(f"- {line}")


if __name__ == "__main__":
    main()
