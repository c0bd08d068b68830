"""vmon's features beyond E2B, on top of the official `e2b` SDK.

`vmon_client.Sandbox` is `e2b.Sandbox` with `resume()`, `get_health()` and an `idle=` policy on
`create()`; `vmon_client.Admin` drives the operator routes (teams, API keys, sandboxes). Every
other call is the official SDK's, unchanged.
"""

from .admin import Admin
from .health import Health, LastResume
from .idle import IdlePolicy
from .sandbox import Sandbox

__all__ = ["Admin", "Health", "IdlePolicy", "LastResume", "Sandbox"]
