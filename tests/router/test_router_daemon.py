"""The daemon, the router and the simulated workers together, as real processes:
``pdctl sim serve --workers-only --write-config`` → ``pdctl router serve`` on the written
router config → ``pdctl run`` on the written daemon config. Multi-turn traffic through the
router; the policy the daemon learns and pushes changes the share of later turns the router
runs decode-local, and the router's counts match the workers' own counters within 1 %."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.processes import (
    free_port_base,
    sim_serve,
    start_daemon,
    stop_daemon,
    write_scenario,
)
from tests.support.router import metric, router_serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEADLINE_S = 240.0  # bounded: the daemon must have pushed a policy by then
AFTER_POLICY = 60  # later turns to run under the daemon's policy


class Traffic:
    """Conversations of three turns through the router, from one thread."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.later: list[tuple[int, str]] = []  # (policy version, route) of turns >= 2
        self.stop = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        conv = 0
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                conv += 1
                msgs = [{"role": "system", "content": f"conversation {conv}"}]
                for turn in range(3):
                    msgs.append({"role": "user", "content": f"turn {turn} " + "tell me " * 60})
                    r = c.post(self.url + "/v1/chat/completions", json={
                        "model": self.model, "messages": msgs, "max_tokens": 32})
                    if r.status_code != 200:
                        self.errors.append(r.text)
                        return
                    msgs.append({"role": "assistant",
                                 "content": r.json()["choices"][0]["message"]["content"]})
                    if turn:
                        self.later.append((int(r.headers["x-pdrouter-policy"]),
                                           r.headers["x-pdrouter-route"]))


def test_a_learned_policy_changes_the_decode_local_share(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path / "s.toml", "serve-test", 5,
                              extra="[controller]\ninterval_s = 2\n")
    cfg = tmp_path / "pdctl.toml"
    log = tmp_path / "run.log"
    with sim_serve(scenario, "--workers-only", "--port-base", str(free_port_base()),
                   "--write-config", str(cfg)) as (addresses, _):
        router_toml = Path(addresses["configs"]["router"]).read_text()
        with router_serve(router_toml + "\n[timeouts]\nhealth_s = 5.0\n", tmp_path) as r:
            traffic = Traffic(r.url, addresses["model"])
            thread = threading.Thread(target=traffic.run, daemon=True)
            thread.start()
            daemon = start_daemon(cfg, log)
            try:
                deadline = time.monotonic() + DEADLINE_S
                while time.monotonic() < deadline and not traffic.errors:
                    if sum(1 for v, _ in traffic.later if v > 0) >= AFTER_POLICY:
                        break
                    time.sleep(0.5)
            finally:
                traffic.stop.set()
                thread.join(60)
                code = stop_daemon(daemon, 20)
            assert not traffic.errors, traffic.errors[:1]
            assert code == 0
            before = [route for v, route in traffic.later if v == 0]
            after = [route for v, route in traffic.later if v > 0]
            assert len(after) >= AFTER_POLICY, log.read_text()[-3000:]
            assert before and all(route == "PREFILL_NODE" for route in before)  # no policy
            assert after.count("DECODE_LOCAL") > 0, after
            text = r.metrics()
            workers = addresses["workers"]
            done = sum(metric(httpx.get(w["metrics"], timeout=10).text,
                              "vllm:request_success_total")
                       for w in workers if w["role"] == "decode")
            generated = sum(metric(httpx.get(w["metrics"], timeout=10).text,
                                   "vllm:generation_tokens_total")
                            for w in workers if w["role"] == "decode")
            assert abs(metric(text, "pdrouter_requests_total") - done) <= 0.01 * done
            assert abs(metric(text, "pdrouter_completion_tokens_total") - generated) \
                <= 0.01 * generated
