"""Text from outside that a backend or a terminal cannot take (issue 39, class 2).

1. Every column written from outside text (operators' `--who`/`--reason`, router errors,
   outcomes, policy reasons, lease holders), on SQLite and the real PostgreSQL: NUL, lone
   surrogates, terminal escapes, bidi controls, 10,000 characters, a 300-character name.
   Every write succeeds and both backends read back the same text: ``store_text``'s.
2. A real `pdctl run` on PostgreSQL whose router refuses every update with a message
   holding NUL and terminal escapes; an operator decision through the real
   `pdctl fallback prefill --wait` with an escape sequence in its reason. Every cycle's
   write succeeds, `--wait` reports the outcome, and `pdctl history`, `pdctl status` print
   no raw control character.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from controller.policy import Policy, Route
from controller.rollout.agent import ApplyOutcome, ApplyResult, RouterAgent
from controller.store import Store
from controller.store.types import MAX_TEXT_CHARS, store_text
from tests.faults.harness import Routers
from tests.support.daemon import write_config
from tests.support.postgres import fresh_schema
from tests.support.processes import PDCTL, REPO, free_port, http_get, start_daemon, wait_for

pytestmark = [pytest.mark.integration]

ESC = "\x1b[2J\x1b[31m"  # clear the screen, turn red
HOSTILE = "refused\x00 by\x1b[2J router\ud800 \u202eevil\x07" + "x" * 10_000
NAME = "ops\x00\x1b]0;title\x07" + "n" * 300


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'history.db'}"
    else:
        with fresh_schema() as url:
            yield url


def _no_raw_controls(text: str) -> None:
    bad = [c for c in text if (ord(c) < 0x20 and c not in "\n") or 0x7f <= ord(c) <= 0x9f
           or c in "\u202e\u2066"]
    assert not bad, (bad[:5], text[-500:])


def test_every_outside_string_is_stored_the_same_on_both_backends(store_url: str) -> None:
    store = Store(store_url)
    store.upgrade()
    at = datetime.now(UTC)
    policy = Policy.uniform(1, Route.PREFILL_NODE)
    from controller.policy import dumps

    store.add_policy(1, policy.checksum, dumps(policy), "approved", HOSTILE)
    store.record_router_error("r1", HOSTILE, at=at)
    store.add_push("r1", 1, "failed", 0.1, HOSTILE, at=at)
    rid = store.add_request("pause", {"what": "approvals", "note": HOSTILE}, NAME, HOSTILE)
    store.claim_next_request(NAME, at=at)
    store.finish_request(rid, HOSTILE, ok=True, at=at)
    assert store.try_acquire_lease(NAME, 30.0, at) is not None
    want_text, want_name = store_text(HOSTILE), store_text(NAME, 255)
    assert len(want_text) == MAX_TEXT_CHARS and len(want_name) == 255
    assert "\x00" not in want_text and "\\x00" in want_text and "\\ud800" in want_text
    p = store.policy(1)
    assert p is not None and p.reason == want_text
    [r] = store.routers()
    assert r.last_error == want_text
    [push] = store.pushes()
    assert push.error == want_text
    req = store.request(rid)
    assert req is not None
    assert (req.who, req.reason, req.outcome, req.claimed_by) == (
        want_name, want_text, want_text, want_name)
    assert req.args["note"] == HOSTILE  # JSON keeps it exactly (escaped inside the JSON)
    lease = store.lease()
    assert lease is not None and lease.holder == want_name
    store.close()


class Refuses(RouterAgent):
    """Refuses every update with a message no backend or terminal should take raw."""

    def apply(self, policy: Policy, *, rollback: bool = False) -> ApplyResult:
        # (protobuf strings are UTF-8: a router cannot send a lone surrogate)
        return ApplyResult(ApplyOutcome.INVALID, 0, "", HOSTILE.replace("\ud800", "")[:300])


def _pdctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PDCTL, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


async def test_a_router_and_an_operator_with_hostile_text_on_postgresql(tmp_path: Path) -> None:
    routers = Routers(tmp_path, 2, agent_factory=lambda **kw: (
        Refuses if kw["router_id"] == "router-1" else RouterAgent)(**kw))
    await routers.start()
    with fresh_schema() as url:
        store = Store(url)
        store.upgrade()
        listen = f"127.0.0.1:{free_port()}"
        config = write_config(tmp_path / "c.toml", listen, url, {
            "routers": {"targets": routers.addresses},
            "controller": {"interval_s": 0.5, "lease_ttl_s": 3, "shutdown_timeout_s": 5},
            "rollout": {"push_deadline_s": 2, "max_attempts": 1,
                        "unacked_hold_initial_s": 0.5, "unacked_hold_max_s": 1},
        })
        log = tmp_path / "run.log"
        proc = start_daemon(config, log)
        try:
            await asyncio.to_thread(wait_for, "/healthz", lambda: (r := http_get(
                f"http://{listen}/healthz")) is not None and r.status_code == 200, 60, log)
            done = await asyncio.to_thread(
                _pdctl, "fallback", "prefill", "--wait", "--timeout", "30", "--reason",
                f"fire drill {ESC}\u202e", "--who", f"ops{ESC}", "--url", url)
            assert done.returncode == 0, done.stdout + done.stderr
            assert ": done" in done.stdout
            _no_raw_controls(done.stdout)
            await asyncio.to_thread(wait_for, "the refusal recorded", lambda: any(
                p.error and "\\x00" in p.error for p in store.pushes()), 30, log)
            await asyncio.sleep(2.0)  # a few more cycles, each writing the refusal
            outputs = await asyncio.to_thread(lambda: [
                _pdctl("history", family, "--url", url) for family in
                ("pushes", "requests", "policies")] + [_pdctl("status", "--url", url)])
            assert proc.poll() is None
        finally:
            proc.terminate()
            await asyncio.to_thread(proc.wait, 20)
            await routers.close()
        text = log.read_text(errors="replace")
        assert "cycle failed" not in text and "DataError" not in text, text[-3000:]
        for out in outputs:
            assert out.returncode == 0, out.stderr
            _no_raw_controls(out.stdout)
        joined = "".join(o.stdout for o in outputs)
        assert "\\x1b" in joined  # shown, escaped
        store.close()
