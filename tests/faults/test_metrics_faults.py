"""Prometheus misbehaving under PrometheusSource: slow, empty, NaN and stale answers from a
scripted Prometheus HTTP API on 127.0.0.1 (a real HTTP server speaking the query API).

Expected: a slow or failing Prometheus is a TransientError (the cycle skips with a reason,
nothing is calibrated); a target Prometheus does not know or could not scrape is a
per-target failure saying why; empty or NaN answers become missing values, never zeros.
(Worker-side garbage, HTML, counter resets and vanished families are covered by
``tests/observe/test_snapshot_sources.py`` and the fuzzing in ``tests/fuzz``.)
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from controller.core.window import FailureKind
from controller.errors import TransientError
from controller.observe.prometheus import (
    BASELINE_TIMES_QUERY,
    SERIES_LABEL,
    UP_SERIES_QUERY,
    UP_TIMES_QUERY,
    PrometheusClient,
    PrometheusSource,
    PrometheusUnavailable,
)
from controller.observe.source import Target

TARGETS = [Target("127.0.0.1:9101", "prefill"), Target("127.0.0.1:9201", "decode"),
           Target("127.0.0.1:9301", "router")]
END = 1_800_000_000.0


class _Prometheus(BaseHTTPRequestHandler):
    up: ClassVar[dict[str, str]] = {}  # instance -> "1" / "0"
    age: ClassVar[dict[str, float]] = {}  # instance -> its newest sample's age (s; default 1)
    jobs: ClassVar[dict[str, list[str]]] = {}  # instance -> the jobs scraping it (default pd)
    marker: ClassVar[bool] = False  # data rows include vLLM's marker family (engine found)
    baseline_age: ClassVar[float | None] = None  # at the start edge (None: as ``age``)
    data_value: ClassVar[str | None] = None  # None: data queries answer no rows
    last_error: ClassVar[dict[str, str]] = {}
    roles: ClassVar[dict[str, str]] = {}  # instance -> its ``role`` target label
    delay: ClassVar[threading.Event | None] = None
    unavailable: ClassVar[bool] = False  # every request answers 503

    def do_GET(self) -> None:
        parsed = urllib.parse.urlparse(self.path)
        if _Prometheus.delay is not None:
            _Prometheus.delay.wait(5)  # slower than the client's timeout
        if _Prometheus.unavailable:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if parsed.path == "/api/v1/targets":
            active = [{"labels": {"instance": i, **({"role": _Prometheus.roles[i]}
                                                    if i in _Prometheus.roles else {})},
                       "lastError": e, "health": "down"}
                      for i, e in _Prometheus.last_error.items()]
            self._json({"status": "success", "data": {"activeTargets": active}})
            return
        args = urllib.parse.parse_qs(parsed.query)
        query = args.get("query", [""])[0]
        at = float(args.get("time", [str(END)])[0])

        def sampled(i: str, baseline: bool = False) -> str:  # the newest sample's time
            age = _Prometheus.baseline_age if baseline else None
            return str(at - (age if age is not None else _Prometheus.age.get(i, 1.0)))

        if query in (UP_SERIES_QUERY, UP_TIMES_QUERY):
            rows = [{"metric": {"instance": i, "job": job},
                     "value": [at, v if query == UP_SERIES_QUERY else sampled(i)]}
                    for i, v in _Prometheus.up.items()
                    for job in _Prometheus.jobs.get(i, ["pd"])]
        elif query == BASELINE_TIMES_QUERY:
            rows = [{"metric": {"instance": i}, "value": [at, sampled(i, baseline=True)]}
                    for i in _Prometheus.up]
        elif _Prometheus.data_value is None:
            rows = []
        else:
            names = ["vllm:num_requests_running"] + (
                ["vllm:kv_cache_usage_perc"] if _Prometheus.marker else [])
            rows = [{"metric": {"instance": t.name, SERIES_LABEL: name},
                     "value": [END, _Prometheus.data_value]} for t in TARGETS for name in names]
        self._json({"status": "success", "data": {"resultType": "vector", "result": rows}})

    def do_POST(self) -> None:
        self.do_GET()

    def _json(self, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A slow answer finds the client gone (it timed out, which is the point of that
        # test): its hang-up is expected, not an error to print over the test run.
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)


@pytest.fixture
def prometheus() -> Iterator[str]:
    _Prometheus.up, _Prometheus.data_value, _Prometheus.last_error = {}, None, {}
    _Prometheus.age, _Prometheus.jobs, _Prometheus.marker = {}, {}, False
    _Prometheus.baseline_age = None
    _Prometheus.delay = None
    _Prometheus.roles, _Prometheus.unavailable = {}, False
    server = _Server(("127.0.0.1", 0), _Prometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        if _Prometheus.delay is not None:
            _Prometheus.delay.set()
        server.shutdown()
        server.server_close()


def source(url: str, timeout_s: float = 2.0) -> PrometheusSource:
    return PrometheusSource(PrometheusClient(url, timeout_s=timeout_s, retries=0), TARGETS)


async def one_window(url: str) -> Any:
    """The default source's window over the 30 s before END, the source closed after."""
    src = source(url)
    try:
        return await src.window(END - 30, END)
    finally:
        await src.aclose()


def numbers(value: Any) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [n for k, v in value.items() if k not in ("start", "end", "interval_s")
                for n in numbers(v)]
    if isinstance(value, list | tuple):
        return [n for v in value for n in numbers(v)]
    return []


async def test_slow_prometheus_is_a_transient_error_not_an_empty_window(prometheus: str) -> None:
    _Prometheus.delay = threading.Event()
    src = source(prometheus, timeout_s=0.3)
    try:
        with pytest.raises(PrometheusUnavailable) as caught:
            await src.window(END - 30, END)
        assert isinstance(caught.value, TransientError)
    finally:
        _Prometheus.delay.set()
        await src.aclose()


async def test_empty_answers_name_every_target_and_invent_nothing(prometheus: str) -> None:
    window = await one_window(prometheus)
    assert {f.target: f.kind for f in window.failures} == dict.fromkeys(
        (t.name for t in TARGETS), FailureKind.UNREACHABLE)
    assert all("not among Prometheus' scrape targets" in f.message for f in window.failures)
    assert window.workers == () and window.outcomes == ()


async def test_stale_target_reports_prometheus_last_scrape_error(prometheus: str) -> None:
    _Prometheus.up = {TARGETS[0].name: "0", TARGETS[1].name: "1", TARGETS[2].name: "1"}
    _Prometheus.last_error = {TARGETS[0].name: "context deadline exceeded"}
    window = await one_window(prometheus)
    stale = [f for f in window.failures if f.target == TARGETS[0].name]
    assert len(stale) == 1 and stale[0].kind == FailureKind.UNREACHABLE
    assert "context deadline exceeded" in stale[0].message
    assert all(w.worker != TARGETS[0].name for w in window.workers)


@pytest.mark.parametrize("value", ["NaN", None])
async def test_nan_or_missing_data_is_never_turned_into_zeros(
    prometheus: str, value: str | None
) -> None:
    _Prometheus.up = dict.fromkeys((t.name for t in TARGETS), "1")
    _Prometheus.data_value = value
    window = await one_window(prometheus)
    body = window.to_dict()
    assert all(math.isfinite(n) for n in numbers(body))
    # Workers and routers whose families are all missing or NaN are failures that say so,
    # not zeros (a router with none answered with no traffic before).
    assert {f.target: f.kind for f in window.failures} == {
        t.name: FailureKind.MISSING_FAMILY for t in TARGETS}
    assert window.workers == () and window.outcomes == ()


async def test_old_samples_are_stale_not_a_live_window(prometheus: str) -> None:
    """An instant query answers with a sample up to 5 minutes old: with Prometheus down,
    behind or scraping less often than the window, windows of 0 requests and then one with
    the whole gap's traffic were stored as live (12x the rate in one 3 s window)."""
    _Prometheus.up = dict.fromkeys((t.name for t in TARGETS), "1")
    _Prometheus.data_value = "4"
    _Prometheus.marker = True
    _Prometheus.age = {TARGETS[0].name: 45.0}  # no sample within the 30 s window
    window = await one_window(prometheus)
    kinds = {f.target: f.kind for f in window.failures}
    assert kinds[TARGETS[0].name] == FailureKind.STALE
    assert "45 s old" in next(f.message for f in window.failures if f.kind == FailureKind.STALE)
    assert TARGETS[0].name not in {w.worker for w in window.workers}
    assert TARGETS[1].name in {w.worker for w in window.workers}  # fresh: still read


async def test_a_start_edge_from_before_a_gap_gives_gauges_only(prometheus: str) -> None:
    """Edges mode: the start edge resolved to a sample from before an outage, so the diff
    held the outage's traffic. The window keeps the gauges and says there is no baseline."""
    from controller.observe.prometheus import PrometheusClient, PrometheusSource

    _Prometheus.up = dict.fromkeys((t.name for t in TARGETS), "1")
    _Prometheus.data_value = "4"
    _Prometheus.marker = True
    _Prometheus.age = dict.fromkeys((t.name for t in TARGETS), 1.0)
    src = PrometheusSource(PrometheusClient(prometheus, timeout_s=2.0, retries=0), TARGETS,
                           mode="edges")
    try:
        fresh = await src.window(END - 30, END)
        _Prometheus.baseline_age = 40.0  # Prometheus was down: the start edge is 40 s old
        gap = await src.window(END - 3, END)
    finally:
        await src.aclose()
    assert not [f for f in fresh.failures if f.kind == FailureKind.NO_BASELINE]
    assert {f.target for f in gap.failures if f.kind == FailureKind.NO_BASELINE} >= {
        TARGETS[0].name, TARGETS[1].name}


async def test_a_target_two_jobs_scrape_is_refused_not_counted_twice(prometheus: str) -> None:
    _Prometheus.up = dict.fromkeys((t.name for t in TARGETS), "1")
    _Prometheus.data_value = "4"
    _Prometheus.marker = True
    _Prometheus.jobs = {TARGETS[0].name: ["pd", "kubernetes-pods"]}
    window = await one_window(prometheus)
    dup = [f for f in window.failures if f.target == TARGETS[0].name]
    assert [f.kind for f in dup] == ["duplicate_series"]
    assert "kubernetes-pods, pd" in dup[0].message


async def test_a_job_whose_series_froze_does_not_answer_for_a_target_that_is_down(
        prometheus: str) -> None:
    """After a relabel the old job's series stay frozen (no staleness markers) at up 1; the
    new job says 0. Read as max over jobs, a stopped cluster looked healthy."""
    _Prometheus.up = dict.fromkeys((t.name for t in TARGETS), "1")
    src = source(prometheus)
    # one fresh job at up 0 and a frozen one at up 1: reported by _up_series per job
    from controller.observe.prometheus import _down, _UpSeries

    old, new = _UpSeries("pd", 1.0, END - 200), _UpSeries("pd-prefill", 0.0, END - 1)
    failure = _down("x:1", [old, new], [new], {}, END)
    assert failure.kind == FailureKind.UNREACHABLE
    await src.aclose()


async def test_discovered_targets_are_discovered_again_every_minute(prometheus: str) -> None:
    """Discovered once at the start, new pods were never observed and a replaced pod stayed
    under its old address. A failed or empty discovery keeps the targets it had."""
    from controller.observe.prometheus import (
        PrometheusClient,
        PrometheusSource,
        PrometheusUnavailable,
    )
    from controller.observe.rediscovery import Rediscovery

    answers: list[list[Target] | Exception] = [
        TARGETS[:2], PrometheusUnavailable("down"), [], TARGETS[1:]]
    asked: list[int] = []

    async def rediscover() -> list[Target]:
        asked.append(1)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    _Prometheus.up = dict.fromkeys((t.name for t in TARGETS), "1")
    src = PrometheusSource(PrometheusClient(prometheus, timeout_s=2.0, retries=0), TARGETS,
                           rediscovery=Rediscovery(rediscover, what="target discovery"))
    seen = []
    try:
        for at in (0.0, 30.0, 61.0, 125.0, 190.0, 255.0):
            await src.window(END + at - 30, END + at)
            seen.append(sorted(t.name for t in src.targets()))
    finally:
        await src.aclose()
    every = sorted(t.name for t in TARGETS)
    assert len(asked) == 4  # at 61, 125, 190 and 255 s: not before a minute had passed
    assert seen == [every, every, sorted(t.name for t in TARGETS[:2]),
                    sorted(t.name for t in TARGETS[:2]),  # discovery failed: kept
                    sorted(t.name for t in TARGETS[:2]),  # found none: kept
                    sorted(t.name for t in TARGETS[1:])]


async def test_a_daemon_started_while_prometheus_is_down_finds_its_targets_later(
    prometheus: str, tmp_path: Path
) -> None:
    """With discover_targets, a Prometheus down at the start made `pdctl run` exit 3: a
    restart loop (CrashLoopBackOff) for as long as the outage, with no router reconciled
    meanwhile. The daemon's source starts with no targets and asks every window; `pdctl
    observe` (one shot) still fails at once."""
    from controller.config import load_settings
    from controller.observe.factory import source_from_settings
    from controller.observe.source import NoTargets

    config = tmp_path / "pd.toml"
    config.write_text(f'[prometheus]\nurl = "{prometheus}"\ndiscover_targets = true\n'
                      "retries = 0\ntimeout_s = 2.0\n")
    settings = load_settings(config)
    _Prometheus.unavailable = True
    with pytest.raises(PrometheusUnavailable):
        await source_from_settings(settings, "prometheus")
    src = await source_from_settings(settings, "prometheus", wait_for_targets=True)
    try:
        assert list(src.targets()) == []
        with pytest.raises(NoTargets, match=r"target discovery failed: .*503"):
            await src.window(END - 30, END)
        _Prometheus.unavailable = False
        with pytest.raises(NoTargets, match="target discovery found none"):
            await src.window(END, END + 30)  # asked again at once, not a minute later
        prefill = TARGETS[0].name
        _Prometheus.last_error, _Prometheus.roles = {prefill: ""}, {prefill: "prefill"}
        _Prometheus.up, _Prometheus.data_value, _Prometheus.marker = {prefill: "1"}, "1", True
        w = await src.window(END + 30, END + 60)
        assert [t.name for t in src.targets()] == [prefill]
        assert list(w.answered) == [prefill] and not w.failures
    finally:
        await src.aclose()


@pytest.mark.integration
@pytest.mark.slow
def test_pdctl_run_rides_out_a_prometheus_outage_from_its_start(
    prometheus: str, tmp_path: Path
) -> None:
    """The real daemon with Prometheus down from its start: it stays up and ready, its
    cycles are skipped with the reason, /livez (the liveness probe) stays 200 while
    /healthz says no cycle succeeded; once Prometheus answers, cycles succeed."""
    from tests.support.daemon import write_config
    from tests.support.processes import free_port, http_get, start_daemon, stop_daemon, wait_for

    _Prometheus.unavailable = True
    listen = f"127.0.0.1:{free_port()}"
    config = write_config(tmp_path / "pd.toml", listen, f"sqlite:///{tmp_path / 'h.db'}", {
        "prometheus": {"url": prometheus, "discover_targets": True, "retries": 0,
                       "timeout_s": 1.0},
        "observe": {"source": "prometheus"},
        "routers": {"targets": ["127.0.0.1:1"]},
        "controller": {"interval_s": 0.5, "stalled_after_s": 3.0, "shutdown_timeout_s": 5},
        "rollout": {"push_deadline_s": 0.5, "max_attempts": 1},
    })
    log = tmp_path / "run.log"
    proc = start_daemon(config, log)

    def skipped() -> float:
        r = http_get(f"http://{listen}/metrics")
        for line in (r.text.splitlines() if r is not None else []):
            if line.startswith('pdctl_cycles_total{result="skipped"} '):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    try:
        wait_for("cycles skipped through the outage", lambda: skipped() >= 10, 60, log)
        assert proc.poll() is None, log.read_text()[-2000:]  # not exited 3
        time.sleep(3.5)  # past stalled_after_s without a successful cycle
        live, health = http_get(f"http://{listen}/livez"), http_get(f"http://{listen}/healthz")
        ready = http_get(f"http://{listen}/readyz")
        assert ready is not None and ready.status_code == 200
        assert live is not None and live.status_code == 200, live.text if live else None
        assert health is not None and health.status_code == 503
        assert health.json()["status"] == "no cycle completed yet"
        text = log.read_text()
        assert "target discovery failed at the start" in text
        assert "no targets to observe yet: target discovery failed" in text

        prefill = TARGETS[0].name
        _Prometheus.last_error, _Prometheus.roles = {prefill: ""}, {prefill: "prefill"}
        _Prometheus.up, _Prometheus.data_value, _Prometheus.marker = {prefill: "1"}, "1", True
        _Prometheus.age = {prefill: 0.1}  # sampled within the 0.5 s window
        _Prometheus.unavailable = False
        wait_for("/healthz 200 once Prometheus answers",
                 lambda: (r := http_get(f"http://{listen}/healthz")) is not None
                 and r.status_code == 200, 60, log)
    finally:
        assert stop_daemon(proc, 20) == 0


def test_discovery_that_finds_no_role_says_so(prometheus: str, tmp_path: Any) -> None:
    """It advised setting discover_targets = true, which was set."""
    from typer.testing import CliRunner

    from controller.cli import app

    _Prometheus.last_error = {"127.0.0.1:9101": ""}  # an active target without a role label
    config = tmp_path / "pd.toml"
    config.write_text(f'[prometheus]\nurl = "{prometheus}"\ndiscover_targets = true\n')
    r = CliRunner().invoke(app, ["observe", "--once", "--source", "prometheus", "--config",
                                 str(config)])
    assert r.exit_code == 2, r.output
    assert "none of Prometheus' active targets has a role" in r.output
    assert "discover_targets = true" not in r.output
