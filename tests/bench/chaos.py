"""`vmon bench chaos`: a stream of lifecycle calls through the official SDK while `vmon up`
is killed with SIGKILL at random instants; after every restart the platform must agree with
what the SDK was told.

Each round runs random creates, pauses, resumes (connect), forks, snapshots and kills on a
few sandboxes of one team, and a timer kills `vmon up` (SIGKILL, its QEMUs live on) at a
random instant; in about a third of the rounds a running sandbox's QEMU dies with it (that
sandbox must then be gone with a `killed` event). The call in flight is then uncertain: its sandbox may be in either state, a
create or fork may have made sandboxes nobody was told of. After the restart:

- every sandbox the SDK was told exists is listed, in a state it may be in, and a running one
  still holds the token written into it when it was created;
- every sandbox the SDK was told is killed is gone, and every known sandbox that is gone has
  a `killed` event;
- no sandbox is listed that no call could have made;
- every build record's artifacts are on disk, no pause build is kept beyond the paused and
  running sandboxes that may name one, and every build on disk (pause, checkpoint, template)
  is named by a record (a sandbox's build or owned build, a live template's or snapshot's
  tag, a cached layer) or is the memory basis of a running sandbox (the node refuses to
  delete those);
- at the end every paused sandbox resumes with its token, and the team's limit admits exactly
  as many more sandboxes as it has free (the admission counter equals the running count).

VMON_CHAOS_KILLS (default 20) kills; VMON_CHAOS_SEED (default: random) fixes the calls and
the instants and is printed for a replay. Starts its own server like `soak.py` (built binary
from $CARGO_TARGET_DIR/$VMON_BENCH_PROFILE, default release). Exits non-zero on the first
round with a violation, after printing them all.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import machine  # noqa: E402
from soak import Server  # noqa: E402

LIMIT = 4
RUNNING, PAUSED, GONE = "running", "paused", "gone"


@dataclass
class Known:
    """What the SDK was told of one sandbox: the states it may be in now."""

    may_be: set[str]
    token: str | None = None
    notes: list[str] = field(default_factory=list)


class Chaos:
    def __init__(self, seed: int, kills: int) -> None:
        self.rng = random.Random(seed)
        self.kills = kills
        self.server = Server()
        self.known: dict[str, Known] = {}
        self.strays_allowed = 0  # sandboxes an interrupted create or fork may have made
        self.violations: list[str] = []
        self.ops: dict[str, int] = {}
        self.interrupted: dict[str, int] = {}
        self.qemu_kills = 0
        self.key = ""

    # --- the server and the team ---------------------------------------------------------

    def start(self) -> None:
        self.server.start()
        if not self.key:
            self.key = self.server_cmd("team", "create", "chaos", "--max-concurrent", str(LIMIT)).strip()
        os.environ["E2B_API_KEY"] = self.key

    def server_cmd(self, *args: str) -> str:
        out = subprocess.run([str(self.server.binary), *args], env=self.server.env, check=True,
                             capture_output=True, text=True, timeout=120)
        return out.stdout

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=os.environ["E2B_API_URL"], headers={"X-API-Key": self.key},
                            timeout=300)

    def server_lives(self) -> bool:
        """Whether `vmon up` still runs a second after a call failed (a SIGKILL just sent
        takes a moment to show)."""
        proc = self.server.proc
        if proc is None:
            return False
        try:
            proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return True
        return False

    def qemu_of(self, sid: str) -> int | None:
        """The pid of the QEMU running sandbox `sid`, from its run directory."""
        for state in self.server.data.glob("**/sandbox.json"):
            try:
                if json.loads(state.read_text()).get("id") != sid:
                    continue
                for pidfile in (state.parent / "qemu" / "qemu.pid", state.parent / "qemu.pid"):
                    if pidfile.exists():
                        return int(pidfile.read_text().strip())
            except (OSError, ValueError):
                continue
        return None

    def kill_qemu_and_server(self) -> None:
        """The timer's instant: now and then a running sandbox's QEMU dies with the server."""
        running = self.in_state(RUNNING)
        if running and self.rng.random() < 0.3:
            sid = self.rng.choice(running)
            pid = self.qemu_of(sid)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                    # A pause racing the kill may have committed; running it cannot be.
                    self.known[sid].may_be = {GONE, PAUSED}
                    self.qemu_kills += 1
                except ProcessLookupError:
                    pass
        self.kill_server()

    def kill_server(self) -> None:
        proc = self.server.proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)

    # --- the calls -----------------------------------------------------------------------

    def in_state(self, state: str) -> list[str]:
        return sorted(i for i, k in self.known.items() if k.may_be == {state})

    def live_count(self) -> int:
        return sum(1 for k in self.known.values() if RUNNING in k.may_be)

    def pick_op(self) -> tuple[str, str | None]:
        running, paused = self.in_state(RUNNING), self.in_state(PAUSED)
        choices: list[tuple[str, str | None]] = []
        if self.live_count() < LIMIT - 1:
            choices += [("create", None)] * 3
            choices += [("fork", i) for i in running]
        choices += [("pause", i) for i in running] * 2
        choices += [("resume", i) for i in paused] * 2
        choices += [("snapshot", i) for i in running[:1]]
        choices += [("kill", i) for i in running + paused]
        return self.rng.choice(choices) if choices else ("create", None)

    def run_op(self, op: str, sid: str | None) -> None:
        from e2b import Sandbox

        self.ops[op] = self.ops.get(op, 0) + 1
        if op == "create":
            self.strays_allowed += 1
            sbx = Sandbox.create("base", timeout=900)
            self.strays_allowed -= 1
            k = self.known[sbx.sandbox_id] = Known({RUNNING})
            token = f"{self.rng.getrandbits(64):016x}"
            sbx.files.write("/home/user/mark", token)
            k.token = token
        elif op == "pause":
            assert sid is not None
            self.known[sid].may_be = {RUNNING, PAUSED}
            Sandbox.connect(sid, timeout=900).pause()
            self.known[sid].may_be = {PAUSED}
        elif op == "resume":
            assert sid is not None
            self.known[sid].may_be = {RUNNING, PAUSED}
            Sandbox.connect(sid, timeout=900)
            self.known[sid].may_be = {RUNNING}
        elif op == "kill":
            assert sid is not None
            k = self.known[sid]
            k.may_be = k.may_be | {GONE}
            with self.api() as c:
                r = c.delete(f"/sandboxes/{sid}")
            if r.status_code not in (204, 404):
                raise RuntimeError(f"kill answered {r.status_code}: {r.text}")
            k.may_be = {GONE}
        elif op == "fork":
            assert sid is not None
            self.strays_allowed += 1
            with self.api() as c:
                r = c.post(f"/sandboxes/{sid}/fork", json={"count": 1, "timeout": 900})
            if r.status_code != 201 and r.status_code != 200:
                raise RuntimeError(f"fork answered {r.status_code}: {r.text}")
            self.strays_allowed -= 1
            for child in r.json():
                if child.get("sandbox"):
                    self.known[child["sandbox"]["sandboxID"]] = Known({RUNNING}, self.known[sid].token)
        elif op == "snapshot":
            assert sid is not None
            with self.api() as c:
                r = c.post(f"/sandboxes/{sid}/snapshots", json={})
            if r.status_code not in (200, 201):
                raise RuntimeError(f"snapshot answered {r.status_code}: {r.text}")

    # --- the invariants ------------------------------------------------------------------

    def violation(self, what: str) -> None:
        print(f"VIOLATION {what}", flush=True)
        self.violations.append(what)

    def listed(self) -> dict[str, str]:
        with self.api() as c:
            r = c.get("/v2/sandboxes", params={"state": "running,paused", "limit": 1000})
        r.raise_for_status()
        return {s["sandboxID"]: s["state"] for s in r.json()}

    def check(self, final: bool = False) -> None:
        from e2b import Sandbox

        listed = self.listed()
        for sid, state in listed.items():
            if sid not in self.known:
                if self.strays_allowed > 0:
                    # An interrupted create or fork made it: from now on it is known.
                    self.strays_allowed -= 1
                    self.known[sid] = Known({state}, notes=["made by an interrupted call"])
                else:
                    self.violation(f"{sid} is listed ({state}) but no call made it")
        self.strays_allowed = 0
        running = {i for i, state in listed.items() if state == RUNNING}
        # Running ones first: at the end each paused one is resumed, read and paused again,
        # and a team at its limit first pauses a running one it has read.
        for sid, k in sorted(self.known.items(), key=lambda e: listed.get(e[0]) != RUNNING):
            now = listed.get(sid, GONE)
            if now not in k.may_be:
                self.violation(f"{sid} is {now}; the SDK was told {sorted(k.may_be)}")
            k.may_be = {now}
            if now == GONE:
                if GONE not in k.notes:
                    k.notes.append(GONE)
                    with self.api() as c:
                        r = c.get(f"/events/sandboxes/{sid}", params={"limit": 100})
                    types = [e.get("type") for e in r.json()] if r.status_code == 200 else []
                    if "sandbox.lifecycle.killed" not in types:
                        self.violation(f"{sid} is gone without a killed event ({types})")
                continue
            if k.token is not None and (now == RUNNING or final):
                try:
                    if now == PAUSED and len(running) >= LIMIT:
                        self.pause_one_of(running)
                    sbx = Sandbox.connect(sid, timeout=900)
                    k.may_be = {RUNNING}
                    got = sbx.files.read("/home/user/mark")
                    if now == PAUSED:
                        # Paused again once read: the team's limit would refuse the resume
                        # of the next paused one with a 429 while this one runs.
                        k.may_be = {RUNNING, PAUSED}
                        sbx.pause()
                        k.may_be = {PAUSED}
                except Exception as e:  # noqa: BLE001 - any failure is the finding
                    self.violation(f"{sid} ({now}) does not answer: {e!r}")
                    continue
                if got != k.token:
                    self.violation(f"{sid} ({now}) holds {got!r}, not its token {k.token!r}")
        self.known = {i: k for i, k in self.known.items() if k.may_be != {GONE}}
        self.check_disk()
        if final:
            self.check_admission()

    def pause_one_of(self, running: set[str]) -> None:
        """Makes room under the team's limit for the final check of a paused sandbox."""
        sid = sorted(i for i in running if i in self.known)[0]
        self.known[sid].may_be = {RUNNING, PAUSED}
        with self.api() as c:
            r = c.post(f"/sandboxes/{sid}/pause")
        if r.status_code != 204:
            raise RuntimeError(f"pausing {sid} to make room answered {r.status_code}: {r.text}")
        self.known[sid].may_be = {PAUSED}
        running.discard(sid)

    def check_disk(self) -> None:
        artifacts = self.server.data / "artifacts"
        records = self.build_records()
        for r in records:
            names = [r.get("mem_base"), r.get("devstate"), r.get("disk"), *r.get("layers", []),
                     *r.get("disk_chain", [])]
            for n in names:
                if n and not (artifacts / n).exists():
                    self.violation(f"build {r.get('id')} names {n}, which is not on disk")
        pauses = [r for r in records if r.get("paused_from")]
        may_name = sum(1 for k in self.known.values() if k.may_be & {RUNNING, PAUSED})
        if len(pauses) > may_name:
            self.violation(f"{len(pauses)} pause builds kept for {may_name} sandboxes")
        # No build without a record naming it. The names are read before and after the
        # listing, so a transition that commits meanwhile is seen either way; one still
        # unnamed is given a moment, as the reaper may be between its node call and its commit.
        unnamed = self.unnamed_builds()
        if unnamed:
            time.sleep(2)
            unnamed &= self.unnamed_builds()
        for b in sorted(unnamed):
            self.violation(f"build {b} is on disk but no record names it")

    def build_records(self) -> list[dict]:
        builds = self.server.data / "builds"
        records = []
        for f in sorted(builds.glob("*.json")) if builds.exists() else []:
            try:
                records.append(json.loads(f.read_text()))
            except FileNotFoundError:
                continue  # deleted meanwhile
            except (OSError, ValueError) as e:
                self.violation(f"build record {f.name} unreadable: {e}")
        return records

    def named_builds(self) -> set[str]:
        """Every build the api's records name, read from its SQLite store: sandboxes (their
        build, their paused build, the build they own), live templates' and snapshots' tags,
        the template layer cache."""
        named: set[str] = set()
        db = sqlite3.connect(f"file:{self.server.data / 'vmon.db'}?mode=ro", uri=True, timeout=30)
        try:
            for build, paused, extra in db.execute(
                    "SELECT build_id, paused_build_id, extra FROM sandboxes"):
                named.update(b for b in (build, paused, json.loads(extra).get("owned_build")) if b)
            named.update(b for (b,) in db.execute(
                "SELECT g.build_id FROM template_tags g JOIN templates t ON t.id = g.template_id "
                "WHERE t.deleted_at IS NULL"))
            named.update(json.loads(doc)["build_id"] for (doc,) in db.execute(
                "SELECT doc FROM template_layers"))
        finally:
            db.close()
        return named

    def bases_in_use(self) -> set[str]:
        """The builds running sandboxes' memory stands on (from their `sandbox.json`)."""
        out: set[str] = set()
        for state in self.server.data.glob("sandboxes/*/*/sandbox.json"):
            try:
                ram = json.loads(state.read_text()).get("ram", {})
            except (OSError, ValueError):
                continue
            if ram.get("kind") == "private" and ram.get("basis"):
                out.add(ram["basis"])
        return out

    def unnamed_builds(self) -> set[str]:
        before = self.named_builds()
        on_disk = {r["id"] for r in self.build_records() if r.get("id")}
        after = self.named_builds()
        return on_disk - before - after - self.bases_in_use()

    def check_admission(self) -> None:
        from e2b import Sandbox

        running = sum(1 for k in self.known.values() if k.may_be == {RUNNING})
        extra = []
        try:
            for _ in range(LIMIT - running):
                extra.append(Sandbox.create("base", timeout=300))
        except Exception as e:  # noqa: BLE001
            self.violation(f"{running} running of {LIMIT}: create {len(extra) + 1} refused: {e!r}")
        else:
            with self.api() as c:
                r = c.post("/sandboxes", json={"templateID": "base", "timeout": 60})
            if r.status_code != 429:
                self.violation(f"a create past the limit answered {r.status_code}, not 429")
                if r.status_code in (200, 201):
                    Sandbox.connect(r.json()["sandboxID"]).kill()
        for s in extra:
            s.kill()

    # --- the run -------------------------------------------------------------------------

    def fault_round(self, point: str, want: str, op: str = "pause") -> None:
        """A crash at a named fault point (`crates/faults`, armed `abort`) of a pause, fork or
        snapshot, then a restart: the sandbox must be `want` and hold its token, and (as after every restart)
        no build may be left that no record names: a fork's or snapshot's checkpoint build
        made before the crash is collected by the restart."""
        from e2b import Sandbox

        sbx = Sandbox.create("base", timeout=900)
        token = f"{self.rng.getrandbits(64):016x}"
        sbx.files.write("/home/user/mark", token)
        self.known[sbx.sandbox_id] = Known({RUNNING, PAUSED} if op == "pause" else {RUNNING}, token)
        self.server.stop()
        faults = self.server.data / "faults"
        shutil.rmtree(faults, ignore_errors=True)
        faults.mkdir()
        (faults / point).write_text("abort\n")
        self.server.env["VMON_FAULT_DIR"] = str(faults)
        self.start()
        try:
            if op == "pause":
                sbx.pause()
            else:
                with self.api() as c:
                    path = "fork" if op == "fork" else "snapshots"
                    body = {"count": 1, "timeout": 900} if op == "fork" else {}
                    c.post(f"/sandboxes/{sbx.sandbox_id}/{path}", json=body)
            self.violation(f"{point}: the {op} answered although the server aborted")
        except Exception:  # noqa: BLE001 - the server aborts mid-call
            pass
        assert self.server.proc is not None
        self.server.proc.wait(timeout=120)
        self.server.proc = None
        del self.server.env["VMON_FAULT_DIR"]
        shutil.rmtree(faults, ignore_errors=True)
        self.start()
        now = self.listed().get(sbx.sandbox_id, GONE)
        if now != want:
            self.violation(f"{point}: after the restart the sandbox is {now}, not {want}")
        self.check()
        print(f"fault {point} ({op}): {now} after the restart", flush=True)

    def round(self, n: int) -> None:
        delay = self.rng.uniform(0.5, 8.0)
        timer = threading.Timer(delay, self.kill_qemu_and_server)
        timer.start()
        deadline = time.monotonic() + delay + 600
        while self.server.proc is not None and self.server.proc.poll() is None:
            op, sid = self.pick_op()
            try:
                self.run_op(op, sid)
            except Exception as e:  # noqa: BLE001 - the kill lands mid-call
                if self.server_lives():
                    if time.monotonic() > deadline:
                        self.violation(f"round {n}: the server never died")
                        break
                    # An error while the server lives: a refusal (a 409 of a pause that raced
                    # nothing, a 429) is fine; the states stay uncertain until the check.
                    print(f"round {n}: {op} failed while the server runs: {e!r}", flush=True)
                    time.sleep(0.2)
                    continue
                self.interrupted[op] = self.interrupted.get(op, 0) + 1
                break
        timer.cancel()
        self.kill_server()
        if self.server.proc is not None:
            self.server.proc.wait(timeout=60)
            self.server.proc = None
        self.start()
        self.check()
        print(f"round {n}/{self.kills}: killed after {delay:.1f} s; {len(self.known)} sandboxes; "
              f"violations so far {len(self.violations)}", flush=True)


def main() -> None:
    seed = int(os.environ.get("VMON_CHAOS_SEED") or random.randrange(1 << 32))
    kills = int(os.environ.get("VMON_CHAOS_KILLS", "20"))
    print(f"chaos: seed {seed} (VMON_CHAOS_SEED={seed} replays the calls), {kills} kills", flush=True)
    chaos = Chaos(seed, kills)
    started = time.monotonic()
    done = 0
    try:
        chaos.start()
        # The two crash points of a pause, made to happen: before the node's commit point the
        # pause never happened; after it the restart finishes it.
        chaos.fault_round("pause:captured", RUNNING)
        chaos.fault_round("pause:committed", PAUSED)
        # A fork's and a snapshot's checkpoint made on the node, the crash before the api's
        # record: the source runs on, the build is collected at the restart.
        chaos.fault_round("checkpoint:committed", RUNNING, "fork")
        chaos.fault_round("checkpoint:committed", RUNNING, "snapshot")
        for n in range(1, kills + 1):
            if chaos.violations:
                break
            chaos.round(n)
            done = n
        if not chaos.violations:
            chaos.check(final=True)
    finally:
        chaos.server.stop()
        chaos.server.kill_vms()

    print("\n## vmon bench chaos (official Python SDK, SIGKILL of `vmon up`)\n")
    print(f"machine: {machine()}\n")
    print(f"seed: {seed}; kills: {done} of {kills}; minutes: {(time.monotonic() - started) / 60:.1f}")
    print(f"calls: {dict(sorted(chaos.ops.items()))}")
    print(f"interrupted by a kill: {dict(sorted(chaos.interrupted.items()))}")
    print(f"QEMUs killed with the server: {chaos.qemu_kills}")
    print(f"violations: {len(chaos.violations)}")
    for v in chaos.violations:
        print(f"VIOLATION {v}")
    if chaos.violations or done < kills:
        sys.exit(1)
    shutil.rmtree(chaos.server.data, ignore_errors=True)


if __name__ == "__main__":
    main()
