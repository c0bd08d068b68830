"""Self-keepalive (seed 003): a process in a sandbox extends its own sandbox with its envd
access token. It asks envd, in its own guest, at `$VMON_KEEPALIVE_URL`
(`http://127.0.0.1:49983/keepalive`, `{"timeout": seconds}`); when the sandbox's timeout ends
the node reads the ask and the api extends the sandbox to the ask's end, within the team's
maximum lifetime. The token works for that ask and nothing else of another sandbox: an ask
without it is refused by envd (401)."""

from __future__ import annotations

import json
import time

from e2b import Sandbox

from conftest import wait_for


def ask(sbx: Sandbox, timeout: int, token: str | None) -> tuple[int, str]:
    header = f"-H 'X-Access-Token: {token}'" if token else ""
    r = sbx.commands.run(
        f"curl -s -o /tmp/answer -w '%{{http_code}}' -X POST {header} "
        f"-d '{json.dumps({'timeout': timeout})}' \"$VMON_KEEPALIVE_URL\"; echo; cat /tmp/answer",
        timeout=60,
    )
    code, _, body = r.stdout.partition("\n")
    return int(code), body


def test_a_process_in_the_sandbox_keeps_its_sandbox_alive(new_sandbox):
    sbx = new_sandbox(timeout=600, secure=True)
    token = sbx._envd_access_token
    assert token, "a secure sandbox has an envd access token"
    url = sbx.commands.run("echo $VMON_KEEPALIVE_URL").stdout.strip()
    assert url == "http://127.0.0.1:49983/keepalive"

    # Without the token, or with another, envd refuses the ask.
    code, body = ask(sbx, 300, None)
    assert code == 401, body
    code, body = ask(sbx, 300, "not-" + token)
    assert code == 401, body
    code, body = ask(sbx, 0, token)
    assert code == 400, body

    code, body = ask(sbx, 900, token)
    assert code == 202, body
    # The owner shortens the timeout to 10 s; when it ends, the reaper asks the node, which
    # reads the guest's ask: the sandbox lives on, to about 900 s after the ask.
    sbx.set_timeout(10)
    short_end = Sandbox.get_info(sbx.sandbox_id).end_at
    info = wait_for(
        lambda: (i := Sandbox.get_info(sbx.sandbox_id)).end_at > short_end and i,
        120,
        interval=1,
        what="the sandbox's end moved by its own ask",
    )
    left = (info.end_at - info.started_at).total_seconds()
    assert 850 < left <= 1000, f"end {info.end_at}, started {info.started_at}"
    time.sleep(2)
    assert sbx.is_running()
    assert sbx.commands.run("echo alive").stdout.strip() == "alive"


def test_a_sandbox_whose_guest_did_not_ask_ends_at_its_timeout(new_sandbox):
    sbx = new_sandbox(timeout=15, secure=True)
    wait_for(lambda: not sbx.is_running(), 120, interval=1, what="the timeout to kill it")
