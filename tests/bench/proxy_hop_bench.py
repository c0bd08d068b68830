"""The proxy's hop to envd, alone: `GET /health` of one sandbox's envd through the proxy with
one kept-alive `httpx` client, 200 requests after 20 to warm up; prints median, p90 and p99.

Starts its own `vmon up` (the built binary, as `api_bench.py` does) unless E2B_API_URL,
E2B_API_KEY and E2B_SANDBOX_URL are set. For an A/B of kept connections to envd, run it with
VMON_PROXY_KEEP_ALIVE=0 (a connection per request) and without.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import api_bench  # noqa: E402

WARM, N = 20, 200


def main() -> None:
    proc = None
    if not os.environ.get("E2B_API_URL"):
        proc, exports, _ = api_bench.start_server()
        os.environ.update(exports)
    import httpx
    from e2b import Sandbox

    try:
        sbx = Sandbox.create("base", timeout=300)
        url = os.environ["E2B_SANDBOX_URL"].rstrip("/") + "/health"
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
        times = []
        with httpx.Client() as c:
            for i in range(WARM + N):
                t = time.perf_counter()
                r = c.get(url, headers=headers)
                if i >= WARM:
                    times.append((time.perf_counter() - t) * 1000)
                if r.status_code not in (200, 204):
                    sys.exit(f"/health answered {r.status_code}: {r.text}")
        sbx.kill()
        times.sort()
        keep = os.environ.get("VMON_PROXY_KEEP_ALIVE", "1")
        print(f"# vmon proxy hop — {api_bench.machine()}")
        print(
            f"VMON_PROXY_KEEP_ALIVE={keep}: GET /health through the proxy: median "
            f"{statistics.median(times):.2f} ms, p90 {times[int(N * 0.9) - 1]:.2f} ms, "
            f"p99 {times[int(N * 0.99) - 1]:.2f} ms (n={N})"
        )
    finally:
        if proc is not None:
            api_bench.stop_server(proc)


if __name__ == "__main__":
    main()
