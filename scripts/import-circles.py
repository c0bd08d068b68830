#!/usr/bin/env python3
"""Import circles between the files of a Rust crate, from its `crate::`, `super::` and `self::`
paths (tests excluded). Prints each circle's files and exits 1 when there is one.

    scripts/import-circles.py crates/api crates/control

A file is a node; `a.rs` imports `b.rs` when `a.rs` names a path that resolves to `b.rs` (the
longest module prefix of the path that is a file of the crate). A module's own submodules
(`mod x;` in it) are not counted as its imports: declaring a child is not using it; every
other path is, a child's path to its parent too.
It reads text, not the compiler's resolution: a path spelled through a re-export counts
against the file that re-exports it.
"""

import os
import re
import sys

PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE_GROUP = re.compile(r"\buse\s+(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^;]*)\};", re.S)


def modules(src):
    """Module path (tuple) → file, for every .rs file under src."""
    out = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, src)[:-3].split(os.sep)
            if rel in (["lib"], ["main"]):
                mod = ()
            elif rel[-1] == "mod":
                mod = tuple(rel[:-1])
            else:
                mod = tuple(rel)
            out[mod] = path
    return out


def strip_tests(text):
    """The text before `#[cfg(test)]` (the crate keeps its unit tests at the end of files)."""
    i = text.find("#[cfg(test)]")
    return text if i < 0 else text[:i]


def strip_comments(text):
    return re.sub(r"//[^\n]*", "", text)


def targets(mod, text, mods):
    """The modules `mod`'s text names."""
    found = set()

    def resolve(kind, rest):
        parts = [p for p in rest.split("::") if p]
        if kind == "crate":
            base = ()
        elif kind == "self":
            base = mod
        else:
            base = mod[:-1]
        full = base + tuple(parts)
        for n in range(len(full), -1, -1):
            if full[:n] in mods:
                found.add(full[:n])
                return

    for m in USE_GROUP.finditer(text):
        kind, prefix, group = m.group(1), m.group(2), m.group(3)
        for item in re.split(r"[,{}]", group):
            item = item.strip().split(" as ")[0].strip()
            if item and item != "self":
                resolve(kind, prefix + "::" + item.split("::")[0])
            elif item == "self":
                resolve(kind, prefix)
    for m in PATH.finditer(text):
        resolve(m.group(1), m.group(2))
    found.discard(mod)
    # A module's own children are declared by it, not imported (the parent holding a type
    # whose `impl` blocks are split into its children is how the crate's rooms are built).
    return {t for t in found if not (len(t) == len(mod) + 1 and t[: len(mod)] == mod)}


def circles(graph):
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def main(crates):
    bad = False
    for crate in crates:
        src = os.path.join(crate, "src")
        mods = modules(src)
        graph = {}
        for mod, path in mods.items():
            with open(path, encoding="utf-8") as f:
                text = strip_comments(strip_tests(f.read()))
            graph[mod] = targets(mod, text, mods)
        found = circles(graph)
        name = lambda m: os.path.relpath(mods[m], src)
        if not found:
            print(f"{crate}: {len(mods)} files, no import circle")
        for comp in found:
            bad = True
            print(f"{crate}: circle of {len(comp)} files: " + ", ".join(name(m) for m in comp))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["crates/api", "crates/control"]))
