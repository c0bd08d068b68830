"""Idle auto-suspend (seed 004's IdlePolicy) as a create passes it to vmon."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

PREFIX = "vmon.idle."


@dataclass(frozen=True)
class IdlePolicy:
    """Suspend (a memory pause) after `max_idle_seconds` without traffic through vmon's
    proxy; the next request resumes it when `auto_resume`; a suspended sandbox ends after
    `suspended_duration_seconds` (0 ends it instead of suspending; `None`: the timeout minus
    `max_idle_seconds`)."""

    max_idle_seconds: int = 300
    auto_resume: bool = True
    suspended_duration_seconds: Optional[int] = None

    def to_metadata(self) -> Dict[str, str]:
        """The `vmon.idle.*` metadata keys the server reads (what the official SDK can send)."""
        out = {
            PREFIX + "max_idle_seconds": str(self.max_idle_seconds),
            PREFIX + "auto_resume": "true" if self.auto_resume else "false",
        }
        if self.suspended_duration_seconds is not None:
            out[PREFIX + "suspended_duration_seconds"] = str(self.suspended_duration_seconds)
        return out

    @staticmethod
    def off_metadata() -> Dict[str, str]:
        """Metadata that turns auto-suspend off even when the team has a default."""
        return {PREFIX + "max_idle_seconds": "off"}

    @classmethod
    def from_json(cls, d: Optional[dict]) -> Optional["IdlePolicy"]:
        if not d:
            return None
        return cls(
            max_idle_seconds=int(d["maxIdleSeconds"]),
            auto_resume=bool(d["autoResume"]),
            suspended_duration_seconds=int(d["suspendedDurationSeconds"]),
        )
