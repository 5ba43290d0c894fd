"""``[http] processes = 2``: two worker processes on one port; a policy push is acknowledged
only once both run it; metrics are both processes' merged; the applied policy survives a
restart of the whole instance."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from controller.policy import Policy, Route, dumps
from tests.support.processes import PDCTL, REPO, free_port
from tests.support.router import RouterProc, engines, metric, router_serve, router_toml

pytestmark = pytest.mark.integration


def push(r: RouterProc, tmp: Path, policy: Policy) -> subprocess.CompletedProcess[str]:
    path = tmp / f"v{policy.version}.json"
    path.write_text(dumps(policy))
    return subprocess.run([*PDCTL, "push", str(path), "-r", r.grpc, "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def later_turn_routes(r: RouterProc, n: int) -> list[str]:
    routes = []
    with httpx.Client(timeout=10) as c:  # a fresh connection per request: both processes
        for i in range(n):
            msgs = [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "more " * 20}]
            resp = c.post(r.url + "/v1/chat/completions", headers={"Connection": "close"},
                          json={"model": "m", "messages": msgs, "max_tokens": 2})
            assert resp.status_code == 200
            routes.append(resp.headers["x-pdrouter-route"])
    return routes


def test_two_processes_ack_a_push_only_when_both_run_it(tmp_path: Path) -> None:
    state = tmp_path / "policy.json"
    with engines("p0", "d0") as (p, d):
        metrics_port = free_port()
        toml = router_toml([p.url], [d.url], http_port=free_port(), grpc_port=free_port(),
                           http_extra=f'processes = 2\nmetrics_listen = '
                                      f'"127.0.0.1:{metrics_port}"\n',
                           grpc_extra=f'state_file = "{state}"\n')
        with router_serve(toml, tmp_path) as r:
            assert len(r.worker_pids()) == 2
            assert later_turn_routes(r, 4) == ["PREFILL_NODE"] * 4  # no policy yet
            ok = push(r, tmp_path, Policy.uniform(4, Route.DECODE_LOCAL))
            assert ok.returncode == 0, ok.stdout + ok.stderr
            assert later_turn_routes(r, 30) == ["DECODE_LOCAL"] * 30
            merged = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
            assert metric(merged, "pdrouter_requests_total") == 34
            assert metric(r.metrics(), "pdrouter_requests_total") == 34
            assert metric(merged, "pdrouter_policy_version") == 4
            # A paused process cannot run v5: the push is not acknowledged.
            paused = r.worker_pids()[1]
            os.kill(paused, signal.SIGSTOP)
            try:
                refused = push(r, tmp_path, Policy.uniform(5, Route.PREFILL_NODE))
            finally:
                os.kill(paused, signal.SIGCONT)
            assert refused.returncode != 0
            again = push(r, tmp_path, Policy.uniform(5, Route.PREFILL_NODE))
            assert again.returncode == 0, again.stdout + again.stderr
            assert later_turn_routes(r, 20) == ["PREFILL_NODE"] * 20
        with router_serve(toml, tmp_path) as r2:  # restarted: both processes run v5
            assert "policy: v5" in r2.line
            assert later_turn_routes(r2, 10) == ["PREFILL_NODE"] * 10
