"""Every dashboard query and every rule against a real Prometheus (Debian's 2.42) on loopback.

Prometheus scrapes our own exporters — ``ControllerMetrics``, a router agent's
``RouterMetrics`` and two simulated vLLM workers (prefill, decode) — served in the text
format like ``pdctl sim serve`` does, with the scrape jobs and ``role`` labels of
deploy/prometheus/prometheus.yml and the rules of rules.yml loaded. Then every panel query
must succeed *and return series* (names and labels match what is really stored), and every
rule must evaluate without error. The full check against the live simulated cluster and the
daemon is the end-to-end integration test's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from controller.loop.metrics import ControllerMetrics
from controller.rollout.agent_metrics import RouterMetrics
from controller.router.metrics import RouterHttpMetrics
from controller.sim.sglang_metrics import SglangView, use_sglang_buckets
from controller.sim.vllm_metrics import WorkerMetrics
from tests.conftest import require
from tests.dashboards.test_dashboards import build, committed, exprs
from tests.support.processes import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RULES = Path(__file__).parents[2] / "deploy" / "prometheus" / "rules.yml"
PROMETHEUS = shutil.which("prometheus")


def serve(registry: CollectorRegistry) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)  # text format, like the sim
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def exporters() -> dict[str, tuple[str | None, CollectorRegistry]]:
    """job -> (role label, registry), each with some activity recorded."""
    ctl = CollectorRegistry()
    m = ControllerMetrics(ctl)
    m.observe_cycle("ok", 0.2, now=time.time())
    m.observe_job("observe", 0.1)
    m.observe_push("router-0", "ok", 0.003)
    m.observe_push("router-0", "failed", 2.0)
    m.set_router_versions("router-0", desired=2, acked=1)
    m.set_drift("ks", "context_tokens", statistic=0.3, threshold=0.2)
    m.drift_event("workload")
    m.guardrail_decision("approved", "better", now=time.time())
    m.set_predicted_goodput(0.8, 0.9)
    m.policy_changed(2)
    m.set_leader(True)
    m.set_recommendation("prefill", 3, 0.7, 2, False)
    m.set_recommendation("decode", 1, 0.4, 1, True)
    m.recommended(now=time.time())

    router = CollectorRegistry()
    r = RouterMetrics(router)
    for route, ctx, io, slo, ttft, tpot in [
        ("DECODE_LOCAL", "1024", "1", "met", 0.2, 0.02),
        ("PREFILL_NODE", "4096", "0.25", "ttft_miss", 3.0, 0.05),
    ]:
        r.count_request(route, ctx, io, slo)
        r.observe_ttft(route, ctx, ttft)
        r.observe_tpot(route, ctx, tpot)
    r.context_tokens.observe(2000)
    r.io_ratio.observe(0.5)
    h = RouterHttpMetrics(router)  # pdctl router serve's own families, same registry
    h.routes.labels("DECODE_LOCAL").inc()
    h.fallbacks.labels("prefill_5xx").inc()
    h.decode_failures.labels("connect", "true").inc()
    h.client_disconnects.labels("decode").inc()
    h.overhead.observe(0.0012)
    h.responses.labels("/v1/chat/completions", "200").inc()

    workers = {}
    sglang = {}
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        w = WorkerMetrics(model_name="m", kv_role=kv_role, num_gpu_blocks=100, block_size=16,
                          max_model_len=4096)
        workers[role] = w.registry
        sg = WorkerMetrics(model_name="m", kv_role=kv_role, num_gpu_blocks=100, block_size=16,
                           max_model_len=4096)
        use_sglang_buckets(sg)
        sglang[role] = SglangView(sg, tp_size=2).registry  # ranks repeat the scheduler's
    return {
        "pd-controller": (None, ctl),
        "pd-router": ("router", router),
        "pd-prefill": ("prefill", workers["prefill"]),
        "pd-decode": ("decode", workers["decode"]),
        "pd-prefill-sglang": ("prefill", sglang["prefill"]),
        "pd-decode-sglang": ("decode", sglang["decode"]),
    }


class Prometheus:
    def __init__(self, tmp: Path, jobs: dict[str, tuple[str | None, int]]) -> None:
        assert PROMETHEUS is not None
        self.url = f"http://127.0.0.1:{free_port()}"
        scrape_configs = []
        for job, (role, port) in jobs.items():
            group: dict[str, Any] = {"targets": [f"127.0.0.1:{port}"]}
            if role:
                group["labels"] = {"role": role}
            scrape_configs.append({"job_name": job, "static_configs": [group]})
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                       "scrape_timeout": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": scrape_configs,
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = tmp / "prometheus.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp / 'data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}",
                 "--storage.tsdb.retention.time=1h", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT,
            )

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(self.url + path + query, timeout=5) as resp:
            return json.loads(resp.read())

    def wait(self, what: str, check: Any, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                if check():
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{what} within {timeout_s} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    require("prometheus", PROMETHEUS is not None, "apt-get install prometheus")
    servers = {job: (role, serve(reg)) for job, (role, reg) in exporters().items()}
    prom = Prometheus(
        tmp_path_factory.mktemp("prom"),
        {job: (role, s.server_address[1]) for job, (role, s) in servers.items()},
    )
    try:
        prom.wait("ready", lambda: urllib.request.urlopen(prom.url + "/-/ready", timeout=1))
        # Three scrapes of every target: enough samples for rate() over a 10 s range.
        prom.wait("4 targets with 3 samples each", lambda: len(
            prom.get("/api/v1/query", query="count_over_time(up[10s]) >= 3")["data"]["result"]
        ) == len(servers))
        yield prom
    finally:
        prom.stop()
        for _, s in servers.values():
            s.shutdown()


def test_every_panel_query_returns_series(prometheus: Prometheus) -> None:
    empty, failed = [], []
    for name, doc in committed().items():
        for panel in build.panels(doc):
            for expr in exprs({"panels": [panel]}):
                # Grafana's $__rate_interval is at least 4 scrape intervals.
                live = expr.replace("$__rate_interval", "10s")
                answer = prometheus.get("/api/v1/query", query=live)
                if answer["status"] != "success":
                    failed.append(f"{name} / {panel['title']}: {answer}")
                elif not answer["data"]["result"]:
                    empty.append(f"{name} / {panel['title']}: {live}")
    assert not failed
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_every_rule_evaluates_cleanly(prometheus: Prometheus) -> None:
    defined = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]

    def all_evaluated() -> bool:
        groups = prometheus.get("/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return len(rules) == len(defined) and all(r.get("lastEvaluation", "").startswith("2")
                                                  and r["health"] != "unknown" for r in rules)

    prometheus.wait("every rule evaluated", all_evaluated)
    groups = prometheus.get("/api/v1/rules")["data"]["groups"]
    bad = {r["name"]: r.get("lastError") for g in groups for r in g["rules"] if r["health"] != "ok"}
    assert not bad
    # The controller fixture says router-0 runs version 1 but should run 2: pending, not yet
    # firing (for: 10m); nothing else that needs minutes can be active.
    alerts = prometheus.get("/api/v1/alerts")["data"]["alerts"]
    assert {(a["labels"]["alertname"], a["state"]) for a in alerts} >= {
        ("PdRouterBehindDesiredVersion", "pending")
    }
    # Recording rules produce the per-route goodput of the two requests (1 met, 1 missed).
    def recorded() -> list[Any]:
        q = "route:pdrouter_goodput:ratio_rate5m"
        return list(prometheus.get("/api/v1/query", query=q)["data"]["result"])

    prometheus.wait("goodput recorded", lambda: len(recorded()) == 2)
    by_route = {s["metric"]["route"]: s["value"][1] for s in recorded()}
    # Counters did not move between scrapes: rate 0 / 0 (NaN), but one series per route.
    assert set(by_route) == {"DECODE_LOCAL", "PREFILL_NODE"}


def test_the_adapter_query_serves_each_hpa_its_role(prometheus: Prometheus) -> None:
    """deploy/kubernetes/prometheus-adapter.yaml's metricsQuery, rendered for each HPA's
    selector as the adapter does, against the controller's real exposition."""
    from tests.deploy.test_autoscaling import adapter_config, hpas, render

    (rule,) = adapter_config()["externalRules"]
    served = prometheus.get("/api/v1/series", **{"match[]": rule["seriesQuery"]})["data"]
    assert {s["role"] for s in served} == {"prefill", "decode"}
    values = {}
    for doc in hpas():
        selector = doc["spec"]["metrics"][0]["external"]["metric"]["selector"]["matchLabels"]
        answer = prometheus.get("/api/v1/query", query=render(rule["metricsQuery"], selector))
        (sample,) = answer["data"]["result"]  # the HPA sums what comes back: exactly one
        values[sample["metric"]["role"]] = float(sample["value"][1])
    assert values == {"prefill": 3.0, "decode": 1.0}  # what exporters() recommended
