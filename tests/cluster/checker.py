"""A checker of the cluster under faults, in the manner of a linearizability checker: a client
drives creates, writes of known bytes into files and into a process's memory, pauses,
resumes, forks and kills through the official Python SDK (forks through the REST call the SDK
lacks), spread over both api replicas, while a second thread injects faults at random: a
part cut from etcd and PostgreSQL (`scripts/cluster.sh cut`), kill -9 of a node agent and its
restart, SIGSTOP of a node agent and SIGCONT. Everything is drawn from one seed, printed
first; the two threads' timing is not replayed exactly, the choices are.

What the client was told is kept per sandbox: the states it may be in (a call that failed
leaves both the old and the new state possible), the files and memory tokens whose write
was acknowledged, and the transitions answered 2xx (and those whose call failed: each may or
may not have happened). The checker fails on:

- a sandbox running on two nodes at once: a live QEMU for it under both nodes' data dirs
  (looked at in /proc after every call and at the end, not asked of the nodes);
- a sandbox gone that nobody killed, unless its node was out past the grace
  (`VMON_NODE_GRACE_SECS`) while it ran there and it was reported killed `orphaned`;
- a sandbox in a state no answer allows, or listed though no call could have made it;
- an acknowledged write (file or memory) missing when the sandbox is read back at the end
  (a paused one is resumed for it);
- a 2xx transition not recorded in the sandbox's events, or recorded more often than the
  calls that may have made it (created once, paused, resumed, checkpointed by forks, killed
  at most once).

`run(cluster, seed, secs, long_faults)` returns a `Report`; checker_cases.py runs it briefly
(not yet collected: see its docstring), `vmon bench cluster-checker` (tests/bench/cluster_checker.py) for long.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

RUNNING, PAUSED, GONE = "running", "paused", "gone"
EV = "sandbox.lifecycle."
# Sandboxes alive at once (each a 512 MiB guest under TCG on a shared machine).
LIVE_MAX = 3


@dataclass
class Known:
    """What the client was told of one sandbox."""

    may_be: set[str]
    files: dict[str, str] = field(default_factory=dict)
    mems: list[str] = field(default_factory=list)
    acked: Counter = field(default_factory=Counter)
    uncertain: Counter = field(default_factory=Counter)
    # Its node was out past the grace while it may have run there: an orphan kill is allowed.
    orphan_ok: bool = False
    fork_child: bool = False


@dataclass
class Report:
    seed: int
    secs: float = 0.0
    ops: Counter = field(default_factory=Counter)
    failed_ops: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    sandboxes: int = 0

    def summary(self) -> str:
        return (
            f"seed {self.seed}: {sum(self.ops.values())} operations {dict(self.ops)} "
            f"({sum(self.failed_ops.values())} failed: {dict(self.failed_ops)}), "
            f"{sum(self.faults.values())} faults {dict(self.faults)}, {self.sandboxes} sandboxes, "
            f"{len(self.violations)} violations in {self.secs:.0f} s"
        )


# --- looking at processes --------------------------------------------------------------------


def _qemu_words() -> set[str]:
    """Every word of the command line of every live process."""
    words: set[str] = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            state = (p / "stat").read_text().split(")")[1].split()[0]
            if state == "Z":
                continue
            raw = (p / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if b"qemu" in raw:
            words.update(w.decode(errors="replace") for w in raw.split(b"\0"))
    return words


def vm_nodes(cluster_dir: Path) -> dict[str, set[int]]:
    """For each sandbox with a live QEMU, the nodes (1, 2) whose data dir started it."""
    words = _qemu_words()
    out: dict[str, set[int]] = {}
    for i in (1, 2):
        for f in (cluster_dir / f"node{i}" / "sandboxes").glob("*/*/sandbox.json"):
            try:
                tag = "vmon-" + json.loads(f.read_text())["qemu_tag"]
            except (OSError, ValueError, KeyError):
                continue
            if tag in words:
                out.setdefault(f.parent.parent.name, set()).add(i)
    return out


# --- the checker -----------------------------------------------------------------------------


class Checker:
    def __init__(self, cluster, cluster_dir: Path, seed: int, secs: float, long_faults: bool, grace: int):
        self.c = cluster
        self.dir = cluster_dir
        self.rng = random.Random(seed)
        self.fault_rng = random.Random(seed ^ 0x5EED)
        self.secs = secs
        self.long_faults = long_faults
        self.grace = grace
        self.report = Report(seed)
        self.known: dict[str, Known] = {}
        self.strays = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        # Node index -> when its current outage began (cut, stop or kill), for the orphan rule.
        self.out_since: dict[int, float] = {}

    # --- the client ----------------------------------------------------------------------

    def api(self) -> str:
        return self.rng.choice([self.c.api_a, self.c.api_b])

    def http(self, api: str) -> httpx.Client:
        return httpx.Client(
            base_url=api, headers={"X-API-Key": self.c.api_key}, timeout=120, verify=self.c.ssl_context() or True
        )

    def in_state(self, state: str) -> list[str]:
        with self.lock:
            return sorted(i for i, k in self.known.items() if k.may_be == {state})

    def live(self) -> int:
        with self.lock:
            return sum(1 for k in self.known.values() if RUNNING in k.may_be)

    def pick(self) -> tuple[str, str | None]:
        running, paused = self.in_state(RUNNING), self.in_state(PAUSED)
        choices: list[tuple[str, str | None]] = []
        if self.live() < LIVE_MAX:
            choices += [("create", None)] * 2
            choices += [("fork", i) for i in running]
        choices += [("write_file", i) for i in running] * 3
        choices += [("write_mem", i) for i in running] * 2
        choices += [("pause", i) for i in running] * 2
        choices += [("resume", i) for i in paused] * 2
        choices += [("kill", i) for i in running + paused]
        return self.rng.choice(choices) if choices else ("create", None)

    def token(self) -> str:
        return f"{self.rng.getrandbits(64):016x}"

    def op(self, name: str, sid: str | None) -> None:
        from e2b import Sandbox

        api = self.api()
        k = self.known.get(sid) if sid else None
        self.report.ops[name] += 1
        if name == "create":
            self.strays += 1
            sbx = Sandbox.create("base", timeout=3600, api_url=api)
            self.strays -= 1
            with self.lock:
                self.known[sbx.sandbox_id] = Known({RUNNING}, acked=Counter(created=1))
        elif name == "write_file":
            path, tok = f"/home/user/w-{self.token()}", self.token()
            Sandbox.connect(sid, timeout=3600, api_url=api).files.write(path, tok)
            k.files[path] = tok
        elif name == "write_mem":
            tok = self.token()
            sbx = Sandbox.connect(sid, timeout=3600, api_url=api)
            sbx.commands.run(f"nohup bash -c 'exec -a vmonmem-{tok} sleep 1000000' >/dev/null 2>&1 &")
            # Acknowledged once the process is seen holding the bytes.
            seen = sbx.commands.run(f"cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' | grep -c '^vmonmem-{tok}$' || true")
            if seen.stdout.strip() not in ("", "0"):
                k.mems.append(tok)
        elif name == "pause":
            k.may_be = {RUNNING, PAUSED}
            k.uncertain["paused"] += 1
            Sandbox.connect(sid, timeout=3600, api_url=api).pause()
            k.uncertain["paused"] -= 1
            k.acked["paused"] += 1
            k.may_be = {PAUSED}
        elif name == "resume":
            k.may_be = {RUNNING, PAUSED}
            k.uncertain["resumed"] += 1
            Sandbox.connect(sid, timeout=3600, api_url=api)
            k.uncertain["resumed"] -= 1
            k.acked["resumed"] += 1
            k.may_be = {RUNNING}
        elif name == "kill":
            k.may_be = k.may_be | {GONE}
            k.uncertain["killed"] += 1
            found = Sandbox.kill(sid, api_url=api)
            k.uncertain["killed"] -= 1
            if found:
                k.acked["killed"] += 1
            else:
                # 404: it was gone already, which the end's check judges.
                print(f"  kill {sid}: not found", flush=True)
            k.may_be = {GONE}
        elif name == "fork":
            self.strays += 1
            k.uncertain["checkpointed"] += 1
            with self.http(api) as h:
                r = h.post(f"/sandboxes/{sid}/fork", json={"count": 1, "timeout": 3600})
            if r.status_code not in (200, 201):
                raise RuntimeError(f"fork answered {r.status_code}: {r.text[:200]}")
            k.uncertain["checkpointed"] -= 1
            k.acked["checkpointed"] += 1
            self.strays -= 1
            for child in r.json():
                if child.get("sandbox"):
                    cid = child["sandbox"]["sandboxID"]
                    with self.lock:
                        self.known[cid] = Known(
                            {RUNNING}, dict(k.files), list(k.mems), Counter(created=1), fork_child=True
                        )

    def settle(self) -> None:
        """Looks up the sandboxes whose last call failed (each may be in one of two states),
        so that later calls can use them again; a state outside the two is a violation."""
        with self.lock:
            unsure = [i for i, k in self.known.items() if len(k.may_be) > 1]
        for sid in unsure:
            try:
                with self.http(self.c.api_a) as h:
                    r = h.get(f"/sandboxes/{sid}")
            except httpx.HTTPError:
                return
            if r.status_code == 404:
                now = GONE
            elif r.status_code == 200:
                now = r.json().get("state")
            else:
                return
            k = self.known[sid]
            if now not in k.may_be and not (now == GONE and k.orphan_ok):
                self.violation(f"{sid} is {now}; the answers allow {sorted(k.may_be)}")
            k.may_be = {now}

    def two_nodes(self, when: str) -> None:
        for sid, nodes in vm_nodes(self.dir).items():
            if len(nodes) > 1:
                self.violation(f"{sid} runs on nodes {sorted(nodes)} at once ({when})")

    def violation(self, what: str) -> None:
        print(f"VIOLATION {what}", flush=True)
        self.report.violations.append(what)

    def client(self) -> None:
        end = time.monotonic() + self.secs
        while time.monotonic() < end:
            name, sid = self.pick()
            try:
                self.op(name, sid)
                print(f"  {name} {sid or ''}: ok", flush=True)
            except Exception as e:  # a fault under the call: its outcome is uncertain
                self.report.failed_ops[name] += 1
                print(f"  {name} {sid or ''}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                time.sleep(1)
            self.two_nodes(f"after {name}")
            self.settle()

    # --- the faults ----------------------------------------------------------------------

    def node_of_each(self) -> dict[str, set[int]]:
        return vm_nodes(self.dir)

    def mark_out(self, i: int) -> None:
        self.out_since.setdefault(i, time.monotonic())

    def mark_back(self, i: int) -> None:
        """Node i's outage ends: if it outlasted the grace, its sandboxes may be orphaned."""
        since = self.out_since.pop(i, None)
        if since is None:
            return
        # The lease outlives the fault by up to a TTL; the leader counts the grace from when
        # it saw the node gone: past grace from the fault's start may orphan.
        if time.monotonic() - since >= self.grace:
            on = {sid for sid, nodes in self.node_of_each().items() if i in nodes} | self.ran_on.get(i, set())
            with self.lock:
                for sid in on:
                    if sid in self.known:
                        self.known[sid].orphan_ok = True

    def wait_back(self, i: int) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                members = [n["id"] for n in self.c.admin("/admin/nodes")]
                if f"node{i}" in members and self.c.node_alive(i):
                    return
            except OSError:
                pass
            time.sleep(1)
        self.violation(f"node{i} was not back in the registry 120 s after its fault ended")

    def fault(self) -> None:
        r = self.fault_rng
        kind = r.choice(["cut_node", "cut_api", "kill9", "stop"])
        longest = self.grace + 25 if self.long_faults and r.random() < 0.25 else 15
        secs = r.randint(4, longest)
        i = r.choice([1, 2])
        # The sandboxes that may run there now (for the orphan rule).
        self.ran_on = {i: {sid for sid, nodes in self.node_of_each().items() if i in nodes}}
        if kind == "cut_api":
            part = f"api{i}"
            print(f"FAULT cut {part} for {secs}s", flush=True)
            self.c.script("cut", part, str(secs + 30))
            try:
                self.stop.wait(secs)
            finally:
                self.c.script("heal", part)
        elif kind == "cut_node":
            print(f"FAULT cut node{i} for {secs}s", flush=True)
            self.mark_out(i)
            self.c.script("cut", f"node{i}", str(secs + 30))
            try:
                self.stop.wait(secs)
            finally:
                self.c.script("heal", f"node{i}")
            self.wait_back(i)
            self.mark_back(i)
        elif kind == "kill9":
            secs = min(secs, 8)
            print(f"FAULT kill -9 node{i}, restarted after {secs}s", flush=True)
            self.mark_out(i)
            self.c.kill_process(f"node{i}")
            self.stop.wait(secs)
            self.c.start(f"node{i}")
            self.wait_back(i)
            self.mark_back(i)
        else:
            pid = self.c.pid(f"node{i}")
            if not pid:
                return
            print(f"FAULT SIGSTOP node{i} for {secs}s", flush=True)
            self.mark_out(i)
            os.kill(pid, signal.SIGSTOP)
            try:
                self.stop.wait(secs)
            finally:
                os.kill(pid, signal.SIGCONT)
            self.wait_back(i)
            self.mark_back(i)
        self.report.faults[kind] += 1

    def faults(self) -> None:
        while not self.stop.wait(self.fault_rng.uniform(5, 20)):
            try:
                self.fault()
            except Exception as e:
                self.violation(f"a fault could not be injected or undone: {type(e).__name__}: {e}")
                return

    # --- the end -------------------------------------------------------------------------

    def listed(self) -> dict[str, str]:
        with self.http(self.c.api_a) as h:
            r = h.get("/v2/sandboxes", params={"state": "running,paused", "limit": 1000})
        r.raise_for_status()
        return {s["sandboxID"]: s["state"] for s in r.json()}

    def events(self, sid: str) -> list[dict]:
        out: list[dict] = []
        with self.http(self.c.api_a) as h:
            while True:
                r = h.get(
                    f"/events/sandboxes/{sid}", params={"limit": 100, "offset": len(out), "orderAsc": "true"}
                )
                r.raise_for_status()
                page = r.json()
                out.extend(page)
                if len(page) < 100:
                    return out

    def check_events(self, sid: str, k: Known, now: str) -> None:
        evs = self.events(sid)
        got = Counter(e["type"].removeprefix(EV) for e in evs)
        for kind in ("created", "paused", "resumed", "checkpointed", "killed"):
            lo, hi = k.acked[kind], k.acked[kind] + k.uncertain[kind]
            if kind == "created":
                lo, hi = 1, 1
            if kind == "killed":
                if now == GONE:
                    lo, hi = 1, 1
                else:
                    lo, hi = 0, 0
            if not lo <= got[kind] <= hi:
                self.violation(f"{sid}: {got[kind]} {kind} events, {lo}..{hi} expected (told: {dict(k.acked)}, uncertain: {dict(k.uncertain)})")
        if now == GONE and k.acked["killed"] == 0:
            reasons = [(e.get("eventData") or {}).get("kill_reason") for e in evs if e["type"] == EV + "killed"]
            if not (k.orphan_ok and reasons == ["orphaned"]) and k.uncertain["killed"] == 0:
                self.violation(f"{sid} is gone though nobody killed it (kill reasons {reasons}, orphan allowed: {k.orphan_ok})")

    def read_back(self, sid: str, k: Known) -> None:
        from e2b import Sandbox

        sbx = Sandbox.connect(sid, timeout=600)
        for path, tok in k.files.items():
            try:
                got = sbx.files.read(path)
            except Exception as e:
                got = f"<{type(e).__name__}>"
            if got != tok:
                self.violation(f"{sid}: acknowledged write of {path} reads {got!r}, not {tok!r}")
        if k.mems:
            out = sbx.commands.run("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' | grep '^vmonmem-' || true").stdout
            held = {w.removeprefix("vmonmem-") for w in out.split()}
            for tok in k.mems:
                if tok not in held:
                    self.violation(f"{sid}: the process holding {tok} in memory is gone")

    def final(self) -> None:
        from e2b import Sandbox

        for i in (1, 2):
            self.wait_back(i)
        time.sleep(8)  # a leader round or two
        self.two_nodes("at the end")
        listed = self.listed()
        for sid, state in listed.items():
            if sid not in self.known:
                if self.strays > 0:
                    self.strays -= 1
                    self.known[sid] = Known({state}, acked=Counter(created=1))
                else:
                    self.violation(f"{sid} is listed ({state}) but no call made it")
        for sid, k in sorted(self.known.items()):
            now = listed.get(sid, GONE)
            if now not in k.may_be and not (now == GONE and k.orphan_ok):
                self.violation(f"{sid} is {now}; the answers allow {sorted(k.may_be)}")
            self.check_events(sid, k, now)
        for sid, k in sorted(self.known.items()):
            if listed.get(sid, GONE) == GONE:
                continue
            try:
                self.read_back(sid, k)
            except Exception as e:
                self.violation(f"{sid} ({listed[sid]}) could not be read back: {type(e).__name__}: {str(e)[:200]}")
            try:
                Sandbox.kill(sid)
            except Exception as e:
                print(f"  cleanup kill {sid}: {e}", flush=True)

    def base_stored(self) -> None:
        """Waits (up to 10 min) for the base template to be in the object store: before, a
        node that holds it alone being down makes every create a 503, which is right but
        tests nothing else."""
        with self.http(self.c.api_a) as h:
            templates = h.get("/templates").json()
        base = next(t for t in templates if "base" in (t.get("aliases") or []))["buildID"]
        deadline = time.monotonic() + 600
        while not self.c.stored(base) and time.monotonic() < deadline:
            time.sleep(2)

    def run(self) -> Report:
        print(f"checker seed {self.report.seed} ({self.secs:.0f} s, long faults: {self.long_faults})", flush=True)
        self.base_stored()
        t0 = time.monotonic()
        self.ran_on: dict[int, set[str]] = {}
        faults = threading.Thread(target=self.faults, daemon=True)
        faults.start()
        try:
            self.client()
        finally:
            self.stop.set()
            faults.join(timeout=300)
        self.final()
        self.report.sandboxes = len(self.known)
        self.report.secs = time.monotonic() - t0
        print(self.report.summary(), flush=True)
        return self.report


def run(cluster, cluster_dir: Path, seed: int | None = None, secs: float = 180, long_faults: bool = False) -> Report:
    seed = seed if seed is not None else random.SystemRandom().getrandbits(32)
    grace = int(os.environ.get("VMON_NODE_GRACE_SECS", "20"))
    return Checker(cluster, cluster_dir, seed, secs, long_faults, grace).run()
