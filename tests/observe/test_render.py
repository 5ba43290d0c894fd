"""``render_latest`` gives exactly ``generate_latest``'s bytes: for the simulator's registries
(both engine expositions, routers included) and for every metric type, label escaping, HELP
escaping, special values and timestamps, on a first render and on a render from its memo."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    Info,
    Summary,
    generate_latest,
)
from prometheus_client.core import (
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    Metric,
    UnknownMetricFamily,
)

from controller.observe.inprocess import sim_cluster_provider
from controller.observe.render import render_latest
from controller.policy import Route
from tests.sim._synthetic import drive


class _Custom:
    def collect(self) -> Iterator[Metric]:
        g = GaugeHistogramMetricFamily("queue_wait", "gauge\\histogram\nhelp",
                                       labels=["pool"])
        g.add_metric(["a\"b\\c\nd"], [("0.5", 3.0), ("+Inf", 7.0)], gsum_value=2.5)
        yield g
        u = UnknownMetricFamily("odd_thing", "unknown type", labels=["x"])
        u.add_metric(["1"], 12345678.9, timestamp=1700000000.25)
        yield u
        v = GaugeMetricFamily("special_values", "inf, nan, large, tiny", labels=["k"])
        for k, x in (("inf", float("inf")), ("ninf", float("-inf")), ("nan", float("nan")),
                     ("big", 1.5e22), ("small", 3e-9), ("int", 7), ("neg", -0.0)):
            v.add_metric([k], x)
        yield v


def _client_registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    c = Counter("reqs", "requests\\served", ["route", "code"], registry=reg)
    c.labels("decode-local", "200").inc(3)
    c.labels('odd "route"', "5\\00").inc()
    Gauge("temp_celsius", "multi\nline", registry=reg).set(21.5)
    h = Histogram("lat_seconds", "latency", ["w"], registry=reg, buckets=(0.1, 1.0, 10.0))
    h.labels("w1").observe(0.3)
    h.labels("w2").observe(30.0)
    Summary("size_bytes", "sizes", registry=reg).observe(1024)
    Info("build", "build info", registry=reg).info({"version": "1.2", "commit": "abc"})
    e = Enum("state", "a state", states=["up", "down"], registry=reg)
    e.state("down")
    reg.register(_Custom())
    return reg


def test_client_metric_types_render_identically() -> None:
    reg = _client_registry()
    for _ in range(2):  # the second render reads the memoized label parts
        assert render_latest(reg) == generate_latest(reg)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_simulated_cluster_registries_render_identically(engine: str) -> None:
    cluster, done, _ = drive(route=Route.PREFILL_NODE, sessions=8, turns=2,
                             cfg={"metrics_engine": engine})
    assert done
    targets, registries = sim_cluster_provider(cluster)()
    assert len(registries) == len(targets) >= 4
    for name, reg in registries.items():
        first = render_latest(reg)
        assert first == generate_latest(reg), name
        assert render_latest(reg) == first, name


def test_a_collector_error_carries_its_metric() -> None:
    class Broken:
        def collect(self) -> Iterator[Metric]:
            m = GaugeMetricFamily("broken", "a sample with no value")
            m.add_metric([], None)  # type: ignore[arg-type]
            yield m

    reg = CollectorRegistry()
    reg.register(Broken())
    with pytest.raises(TypeError) as ours:
        render_latest(reg)
    with pytest.raises(TypeError) as theirs:
        generate_latest(reg)
    assert ours.value.args[-1].name == theirs.value.args[-1].name == "broken"
