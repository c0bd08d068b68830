"""`GET /sandboxes/{id}/health`: a sandbox's resumes and where its state is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .idle import IdlePolicy


@dataclass(frozen=True)
class LastResume:
    #: `restore` (memory from the paused build), `parked` (its kept QEMU continued) or
    #: `cold_boot` (booted from the disk: processes were lost).
    kind: str
    duration_ms: int
    at: str
    #: `connect` or `traffic` (the proxy's auto-resume).
    trigger: str


@dataclass(frozen=True)
class Health:
    sandbox_id: str
    state: str
    #: Resumes that kept the sandbox's memory.
    resume_generation: int
    #: The last resume was a cold boot.
    kernel_state_lost: bool
    last_resume: Optional[LastResume]
    #: `running`, `parked`, `disk`, `object_store` or `unknown`.
    state_location: str
    in_object_store: bool
    idle: Optional[IdlePolicy]
    idle_suspended: bool
    suspended_until: Optional[str]
    idle_seconds: Optional[int]

    @classmethod
    def from_json(cls, d: dict) -> "Health":
        last = d.get("lastResume")
        return cls(
            sandbox_id=d["sandboxID"],
            state=d["state"],
            resume_generation=int(d["resumeGeneration"]),
            kernel_state_lost=bool(d["kernelStateLost"]),
            last_resume=LastResume(
                kind=last["kind"],
                duration_ms=int(last["durationMs"]),
                at=last["at"],
                trigger=last["trigger"],
            )
            if last
            else None,
            state_location=d["stateLocation"],
            in_object_store=bool(d.get("inObjectStore", False)),
            idle=IdlePolicy.from_json(d.get("vmonIdle")),
            idle_suspended=bool(d.get("idleSuspended", False)),
            suspended_until=d.get("suspendedUntil"),
            idle_seconds=d.get("idleSeconds"),
        )
