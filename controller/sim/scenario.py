"""Scenario files (TOML): what cluster, what traffic, what happens when, what SLOs.

Parsing validates everything and names the bad key (``cluster.kv_link_gbps: must be > 0``);
unknown keys are errors. The JSON Schema of the same format ships as
``controller/sim/scenario.schema.json`` (for editors and CI); this module is the reference.
"""

from __future__ import annotations

import itertools
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.errors import ConfigError
from controller.sim.cluster import ClusterConfig
from controller.sim.profiles import Profile, load_profile
from controller.sim.workloads.base import SOURCES, WorkloadConfig

EVENT_KINDS = ("rate_scale", "link_bandwidth", "remove_worker", "add_worker", "workload")
SCHEMA_PATH = Path(__file__).with_name("scenario.schema.json")
# Upper bounds: beyond them a run does not end in useful time, and nothing said why (a
# billion workers, a microsecond control interval, a day scaled a million times).
MAX_WORKERS = 4096  # per role, as `pdctl plan` sizes
MAX_ROUTERS = 1024
MAX_DURATION_S = 30 * 86_400.0
MAX_INTERVALS = 100_000  # control intervals in one run
MAX_RATE_FACTOR = 1000.0


def check_intervals(duration_s: float, interval_s: float) -> None:
    if duration_s / interval_s > MAX_INTERVALS:
        raise ScenarioError(
            f"controller.interval_s: {interval_s:g} s gives {duration_s / interval_s:.3g} "
            f"control intervals over duration_s {duration_s:g}; at most {MAX_INTERVALS}")


class ScenarioError(ConfigError):
    """A scenario file is invalid; the message names the key."""


@dataclass(frozen=True, slots=True)
class Event:
    at_s: float
    kind: str
    factor: float = 1.0
    role: str = ""
    count: int = 1
    workload: WorkloadConfig | None = None


MAX_PORT_BASE = 65535 - 400  # the layout of docs/simulator.md spans base .. base + 400
SERVE_KEYS = {"port_base", "tokenizer", "abort_timeout_s", "no_handle_fraction",
              "default_max_tokens"}


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """``[serve]``: how ``pdctl sim serve`` exposes the cluster (live mode only)."""

    port_base: int | None = None  # None: the OS picks free ports
    tokenizer: Path | None = None  # None: the bundled simulator tokenizer
    abort_timeout_s: float = 480.0  # VLLM_NIXL_ABORT_REQUEST_TIMEOUT (recent vLLM)
    no_handle_fraction: float = 0.0  # prefill legs whose first token is EOS (no handle)
    default_max_tokens: int = 64


def _serve(data: Any, source_path: Path | None) -> ServeConfig:
    t = _Table(data, "serve", SERVE_KEYS)
    port_base = None
    if "port_base" in data:
        port_base = t.integer("port_base", ge=1024, le=MAX_PORT_BASE)
    tokenizer = None
    if "tokenizer" in data:
        tokenizer = Path(t.string("tokenizer")).expanduser()
        if source_path is not None and not tokenizer.is_absolute():
            tokenizer = source_path.parent / tokenizer
    return ServeConfig(
        port_base=port_base, tokenizer=tokenizer,
        abort_timeout_s=t.number("abort_timeout_s", 480.0, gt=0),
        no_handle_fraction=t.number("no_handle_fraction", 0.0, ge=0, le=1),
        default_max_tokens=t.integer("default_max_tokens", 64, ge=1),
    )


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    seed: int
    duration_s: float
    cluster: ClusterConfig
    profile: Profile
    workload: WorkloadConfig
    events: tuple[Event, ...] = ()
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    interval_s: float = 30.0
    description: str = ""
    serve: ServeConfig = field(default_factory=ServeConfig)
    source_path: Path | None = field(default=None, compare=False)

    def phase_bounds(self) -> list[tuple[float, float]]:
        """Phases split at event times: [(start, end), ...] covering [0, duration_s]."""
        cuts = sorted({e.at_s for e in self.events if 0 < e.at_s < self.duration_s})
        edges = [0.0, *cuts, self.duration_s]
        return list(itertools.pairwise(edges))


class _Table:
    def __init__(self, data: Any, where: str, allowed: set[str]) -> None:
        if not isinstance(data, Mapping):
            raise ScenarioError(f"{where}: expected a table")
        self.data = data
        self.where = where
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ScenarioError(
                f"{self.key(unknown[0])}: unknown key (allowed: {', '.join(sorted(allowed))})"
            )

    def key(self, k: str) -> str:
        return f"{self.where}.{k}" if self.where else k

    def number(self, k: str, default: float | None = None, *, gt: float | None = None,
               ge: float | None = None, le: float | None = None) -> float:
        v = self.data.get(k, default)
        if v is None:
            raise ScenarioError(f"{self.key(k)}: required")
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ScenarioError(f"{self.key(k)}: expected a number, got {v!r}")
        if gt is not None and not v > gt:
            raise ScenarioError(f"{self.key(k)}: must be > {gt}, got {v}")
        if ge is not None and not v >= ge:
            raise ScenarioError(f"{self.key(k)}: must be >= {ge}, got {v}")
        if le is not None and not v <= le:
            raise ScenarioError(f"{self.key(k)}: at most {le:g}, got {v:g}")
        return float(v)

    def integer(self, k: str, default: int | None = None, *, ge: int = 0,
                le: int | None = None) -> int:
        v = self.data.get(k, default)
        if v is None:
            raise ScenarioError(f"{self.key(k)}: required")
        if isinstance(v, bool) or not isinstance(v, int):
            raise ScenarioError(f"{self.key(k)}: expected an integer, got {v!r}")
        if v < ge:
            raise ScenarioError(f"{self.key(k)}: must be >= {ge}, got {v}")
        if le is not None and v > le:
            raise ScenarioError(f"{self.key(k)}: at most {le}, got {v}")
        return v

    def boolean(self, k: str, default: bool) -> bool:
        v = self.data.get(k, default)
        if not isinstance(v, bool):
            raise ScenarioError(f"{self.key(k)}: expected true or false, got {v!r}")
        return v

    def string(self, k: str, default: str | None = None,
               choices: tuple[str, ...] | None = None) -> str:
        v = self.data.get(k, default)
        if v is None:
            raise ScenarioError(f"{self.key(k)}: required")
        if not isinstance(v, str) or not v:
            raise ScenarioError(f"{self.key(k)}: expected a non-empty string, got {v!r}")
        if choices is not None and v not in choices:
            raise ScenarioError(f"{self.key(k)}: {v!r} is not one of {', '.join(choices)}")
        return v


CLUSTER_KEYS = {"prefill_workers", "decode_workers", "profile", "kv_link_gbps",
                "kv_link_setup_ms", "max_batch_tokens", "routers", "prefill_prefix_cache",
                "transfer_missing_only", "qps_window_s", "custom_histogram_buckets",
                "metrics_engine", "sglang_tp_ranks"}
WORKLOAD_KEYS = {"source", "rate_scale", "time_slice_s", "params"}


def _workload(data: Any, where: str, duration_s: float) -> WorkloadConfig:
    t = _Table(data, where, WORKLOAD_KEYS)
    source = t.string("source", choices=SOURCES)
    rate = t.number("rate_scale", 1.0, gt=0)
    sl = t.data.get("time_slice_s")
    if sl is not None and (not isinstance(sl, list) or len(sl) != 2
            or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in sl)
            or not 0 <= sl[0] < sl[1]):
        raise ScenarioError(
            f"{t.key('time_slice_s')}: expected [start, end] with 0 <= start < end, got {sl!r}"
        )
    params = t.data.get("params", {})
    if not isinstance(params, Mapping):
        raise ScenarioError(f"{t.key('params')}: expected a table")
    params = dict(params)
    try:
        return WorkloadConfig(
            source=source,  # type: ignore[arg-type]
            rate_scale=rate,
            time_slice_s=(float(sl[0]), float(sl[1])) if sl is not None else None,
            params=params,
        )
    except ConfigError as e:
        raise ScenarioError(f"{where}: {e}") from None


def _buckets(data: Any) -> tuple[tuple[str, tuple[float, ...]], ...]:
    from controller.sim.vllm_metrics import BUCKET_FAMILIES

    where = "cluster.custom_histogram_buckets"
    t = _Table(data, where, set(BUCKET_FAMILIES))
    out = []
    for family, bounds in t.data.items():
        numbers = isinstance(bounds, list) and bool(bounds) and all(
            isinstance(b, int | float) and not isinstance(b, bool) and math.isfinite(b)
            for b in bounds)  # NaN compares false both ways: it passed as increasing
        if not numbers or any(b <= a for a, b in itertools.pairwise(bounds)):
            raise ScenarioError(
                f"{where}.{family}: expected a strictly increasing list of finite numbers")
        out.append((str(family), tuple(float(b) for b in bounds)))
    return tuple(out)


def parse_scenario(data: Mapping[str, Any], source_path: Path | None = None) -> Scenario:
    top = _Table(data, "", {"name", "seed", "duration_s", "description", "cluster", "workload",
                            "events", "slo", "controller", "serve"})
    name = top.string("name")
    seed = top.integer("seed", 0)
    duration = top.number("duration_s", gt=0, le=MAX_DURATION_S)
    description = data.get("description", "")
    if not isinstance(description, str):  # the schema says a string; the loader took any
        raise ScenarioError(f"description: expected a string, got {description!r}")
    c = _Table(data.get("cluster", {}), "cluster", CLUSTER_KEYS)
    profile_ref = c.string("profile", "llama-3.1-8b-h100")
    if source_path is not None and profile_ref.endswith(".json"):
        ref = Path(profile_ref)
        if not ref.is_absolute():
            profile_ref = str(source_path.parent / ref)
    try:
        profile = load_profile(profile_ref)
    except ConfigError as e:
        raise ScenarioError(f"cluster.profile: {e}") from None
    cluster = ClusterConfig(
        prefill_workers=c.integer("prefill_workers", 1, ge=0, le=MAX_WORKERS),
        decode_workers=c.integer("decode_workers", 1, ge=1, le=MAX_WORKERS),
        profile=profile,
        kv_link_gbps=c.number("kv_link_gbps", 100.0, gt=0),
        kv_link_setup_s=c.number("kv_link_setup_ms", 1.0, ge=0) / 1000.0,
        max_batch_tokens=c.integer("max_batch_tokens", 8192, ge=16, le=1 << 22),
        routers=c.integer("routers", 1, ge=1, le=MAX_ROUTERS),
        prefill_prefix_cache=c.boolean("prefill_prefix_cache", True),
        transfer_missing_only=c.boolean("transfer_missing_only", True),
        qps_window_s=c.number("qps_window_s", 10.0, gt=0),
        custom_histogram_buckets=_buckets(c.data.get("custom_histogram_buckets", {})),
        metrics_engine=c.string("metrics_engine", "vllm", choices=("vllm", "sglang")),
        sglang_tp_ranks=c.integer("sglang_tp_ranks", 1, ge=1, le=64),
    )
    if "workload" not in data:
        raise ScenarioError("workload: required")
    workload = _workload(data["workload"], "workload", duration)
    raw_events = data.get("events", [])
    if not isinstance(raw_events, list):
        raise ScenarioError("events: expected an array of tables ([[events]])")
    events: list[Event] = []
    prefill_n, decode_n = cluster.prefill_workers, cluster.decode_workers
    for i, raw in enumerate(raw_events):
        where = f"events[{i}]"
        kind = _Table(raw, where, {"at_s", "kind", "factor", "role", "count", "source",
                                   "rate_scale", "time_slice_s", "params"}).string(
            "kind", choices=EVENT_KINDS)
        allowed = {"at_s", "kind"} | {
            "rate_scale": {"factor"}, "link_bandwidth": {"factor"},
            "remove_worker": {"role", "count"}, "add_worker": {"role", "count"},
            "workload": {"source", "rate_scale", "time_slice_s", "params"},
        }[kind]
        t = _Table(raw, where, allowed)
        at = t.number("at_s", ge=0)
        if at >= duration:
            raise ScenarioError(f"{t.key('at_s')}: must be < duration_s ({duration}), got {at}")
        if events and at < events[-1].at_s:
            raise ScenarioError(f"{t.key('at_s')}: events must be in time order")
        if kind in ("rate_scale", "link_bandwidth"):
            events.append(Event(at, kind, factor=t.number(
                "factor", gt=0, le=MAX_RATE_FACTOR if kind == "rate_scale" else None)))
        elif kind in ("remove_worker", "add_worker"):
            role = t.string("role", choices=("prefill", "decode"))
            count = t.integer("count", 1, ge=1)
            sign = 1 if kind == "add_worker" else -1
            if role == "prefill":
                prefill_n += sign * count
            else:
                decode_n += sign * count
            if max(prefill_n, decode_n) > MAX_WORKERS:
                raise ScenarioError(f"{t.key('count')}: more than {MAX_WORKERS} {role} workers")
            if prefill_n < 0 or decode_n < 1:
                raise ScenarioError(
                    f"{t.key('count')}: removes more {role} workers than exist at that time"
                    " (at least one decode worker must remain)"
                )
            events.append(Event(at, kind, role=role, count=count))
        else:
            wl = {k: v for k, v in raw.items() if k not in ("at_s", "kind")}
            events.append(Event(at, kind, workload=_workload(wl, where, duration)))
    slo = _Table(data.get("slo", {}), "slo", {"ttft_s", "tpot_s"})
    ctl = _Table(data.get("controller", {}), "controller", {"interval_s"})
    interval = ctl.number("interval_s", 30.0, gt=0)
    check_intervals(duration, interval)
    return Scenario(
        name=name, seed=seed, duration_s=duration, cluster=cluster, profile=profile,
        workload=workload, events=tuple(events),
        ttft_slo_s=slo.number("ttft_s", 2.0, gt=0), tpot_slo_s=slo.number("tpot_s", 0.1, gt=0),
        interval_s=interval, description=description,
        serve=_serve(data.get("serve", {}), source_path),
        source_path=source_path,
    )


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ScenarioError(f"cannot read scenario {p}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"scenario {p}: TOML syntax error: {e}") from None
    try:
        return parse_scenario(data, source_path=p.resolve())
    except ScenarioError as e:
        raise ScenarioError(f"scenario {p}: {e}") from None
