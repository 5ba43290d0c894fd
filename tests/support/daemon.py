"""What the tests that run `pdctl run` as a real process share: its config file, an operator
decision through the real CLI (also one whose push a slow router holds), and the store's view
of which routers run a version."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from controller.store import Store
from tests.faults.harness import Routers, SlowAgent
from tests.support.processes import PDCTL, REPO


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    # Strings and lists of strings: JSON's notation is TOML's for these.
    return json.dumps(value)


def write_config(
    path: Path, listen: str, store_url: str, sections: Mapping[str, Mapping[str, Any]]
) -> Path:
    """Write a `pdctl run` config listening on ``listen`` with its store at ``store_url``,
    plus ``sections`` (``{"controller": {"interval_s": 0.5}}``: ``[controller]``,
    ``interval_s = 0.5``; a key whose value is None is left out, so the default holds)."""
    tables = {"metrics": {"listen": listen}, "store": {"url": store_url}, **sections}
    lines = []
    for table, keys in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {_toml_value(v)}" for key, v in keys.items() if v is not None]
    path.write_text("\n".join(lines) + "\n")
    return path


def operator_decision(store_url: str, reason: str) -> None:
    """`pdctl fallback prefill`: an operator decision the leader turns into a new version."""
    done = subprocess.run(
        [
            *PDCTL,
            "fallback",
            "prefill",
            "--reason",
            reason,
            "--who",
            "fault-test",
            "--url",
            store_url,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def acked_everywhere(store: Store, version: int, routers: list[str]) -> bool:
    """Every one of ``routers`` is meant to run ``version`` and has acknowledged it."""
    acked = {r.router_id: r.acked_version for r in store.routers()}
    desired = store.desired_versions()
    return all(desired.get(r) == version and acked.get(r) == version for r in routers)


async def decide_with_push_held(
    routers: Routers, slow_address: str, store_url: str, version: int
) -> list[str]:
    """Make decision ``version`` while the :class:`SlowAgent` at ``slow_address`` holds its
    push (until its ``release`` is set); return the other routers, once they run ``version``
    (they are pushed in the same pass) or after 10 s."""
    slow = routers.agent(slow_address)
    assert isinstance(slow, SlowAgent)
    slow.slow_applies, slow.delay_s = 1, 60.0  # held until released
    # The routers are served by the caller's event loop: every blocking wait runs in a thread.
    await asyncio.to_thread(operator_decision, store_url, f"decision {version}")
    assert await asyncio.to_thread(slow.entered.wait, 30), "the push never reached it"
    fast = [a for a in routers.addresses if a != slow_address]
    for _ in range(100):
        if all(routers.versions()[a] == version for a in fast):
            break
        await asyncio.sleep(0.1)
    return fast
