"""``pdctl demo`` as a subprocess: what ``make demo`` runs must work and say what it did."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from controller.cli.demo_cmd import DEMO_ROUTERS, ppd_policy
from controller.policy import Features, Reason, Route, decide


def test_demo_runs_end_to_end_and_exits_0() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from controller.cli import main; main()", "demo"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr + out
    summary = re.search(
        r"demo: (\d+) routers acked v1 then v2; decisions: (\d+) DECODE_LOCAL, (\d+) "
        r"PREFILL_NODE; re-run: no-op \(0 pushes\)",
        out,
    )
    assert summary, out
    n_routers, local, prefill = map(int, summary.groups())
    assert n_routers == DEMO_ROUTERS
    assert local >= 1 and prefill >= 1
    # Every router acknowledged both pushes and was in sync on the re-run.
    assert out.count("applied") >= 2 * DEMO_ROUTERS
    assert out.count("in_sync") == DEMO_ROUTERS
    # The decisions table shows both routes made by the table itself, under v2.
    rows = [line for line in out.splitlines() if "│ v2" in line]
    assert any("DECODE_LOCAL" in r and "table" in r for r in rows)
    assert any("PREFILL_NODE" in r and "table" in r for r in rows)


def test_demo_table_is_a_ppd_table() -> None:
    policy = ppd_policy(2)
    routes = set(policy.table.routes)
    assert routes == {Route.DECODE_LOCAL, Route.PREFILL_NODE}
    # Score sign follows the route, as the PPD decision rule says.
    for route, score in zip(policy.table.routes, policy.table.scores, strict=True):
        assert (score > 0) == (route is Route.DECODE_LOCAL)
    short = decide(policy, Features(2, 500, 50, 200, 2.0), lambda: 1.0)
    long_ = decide(policy, Features(2, 120000, 50, 200, 2.0), lambda: 1.0)
    heavy_append = decide(policy, Features(2, 500, 5000, 100, 2.0), lambda: 1.0)
    assert (short.route, short.reason) == (Route.DECODE_LOCAL, Reason.TABLE)
    assert long_.route is Route.PREFILL_NODE
    assert heavy_append.route is Route.PREFILL_NODE
