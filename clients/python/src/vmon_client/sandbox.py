"""`e2b.Sandbox` plus vmon's lifecycle features: an idle policy on create, `resume()`,
`get_health()`. A fork of a paused sandbox is the SDK's own `fork()`: vmon allows it."""

from __future__ import annotations

import functools
from typing import Dict, Optional

from e2b import ConnectionConfig
from e2b import Sandbox as _E2BSandbox
from e2b.exceptions import InvalidArgumentException, SandboxException

from ._http import api_call
from .health import Health
from .idle import PREFIX, IdlePolicy

_UNSET = object()


class _either:
    """A method callable on an instance (`sbx.get_health()`) or on the class with a sandbox
    id first (`Sandbox.get_health(sandbox_id)`), as the official SDK's class variants are."""

    def __init__(self, on_instance, on_class):
        self.on_instance = on_instance
        self.on_class = on_class

    def __get__(self, obj, cls):
        if obj is None:
            return functools.partial(self.on_class, cls)
        return functools.partial(self.on_instance, obj)


def _config(**opts) -> ConnectionConfig:
    return ConnectionConfig(**opts)


def _health_of(cls, sandbox_id: str, **opts) -> Health:
    r = api_call(_config(**opts), "GET", f"/sandboxes/{sandbox_id}/health")
    return Health.from_json(r.json())


def _health_self(self, **opts) -> Health:
    config = self.connection_config if not opts else _config(**opts)
    r = api_call(config, "GET", f"/sandboxes/{self.sandbox_id}/health")
    return Health.from_json(r.json())


def _resume_of(cls, sandbox_id: str, timeout: Optional[int] = None, **opts):
    return cls.connect(sandbox_id, timeout=timeout, **opts)


def _resume_self(self, timeout: Optional[int] = None, **opts):
    self.connect(timeout=timeout, **opts)
    return self


class Sandbox(_E2BSandbox):
    """The official SDK's sandbox with vmon's additions."""

    @classmethod
    def create(cls, template: Optional[str] = None, *args, idle=_UNSET, metadata: Optional[Dict[str, str]] = None, **kwargs):
        """`e2b.Sandbox.create`, plus `idle`: an :class:`IdlePolicy`, `None` for no
        auto-suspend (even when the team has a default), or omitted for the team's default.
        The policy travels as `vmon.idle.*` metadata keys, which the server validates (400,
        `InvalidArgumentException`, when a value is invalid or the window does not fit
        before the timeout)."""
        md = {k: v for k, v in (metadata or {}).items()}
        if idle is None:
            md.update(IdlePolicy.off_metadata())
        elif idle is not _UNSET:
            if not isinstance(idle, IdlePolicy):
                raise TypeError("idle must be an IdlePolicy or None")
            md = {k: v for k, v in md.items() if not k.startswith(PREFIX)}
            md.update(idle.to_metadata())
        try:
            return super().create(template, *args, metadata=md or metadata, **kwargs)
        except SandboxException as e:
            # The SDK reports a create's 400 as a plain SandboxException; an invalid request
            # (an idle policy among them) is this.
            if getattr(e, "status_code", None) == 400 and not isinstance(e, InvalidArgumentException):
                raise InvalidArgumentException(str(e)) from e
            raise

    #: Resume a paused sandbox (memory restored); a running one keeps running. Returns the
    #: sandbox. `Sandbox.resume(sandbox_id)` does it from anywhere.
    resume = _either(_resume_self, _resume_of)

    #: The sandbox's :class:`Health` (`GET /sandboxes/{id}/health`).
    get_health = _either(_health_self, _health_of)
