"""Typed configuration: one object, grouped by concern.

Sources, highest first: explicit arguments > environment (``PDCTL_SECTION__KEY``) > the TOML
file > defaults. The seed PPD deployment file operators already write (``[ppd]``,
``[prefill_pool]``, ``[decode_pool]``, ``[kv_transfer]``, ``[metrics]``) is read as it is;
pd-controller adds its own sections. Unknown keys are errors that name the key.

``python -m controller.config --reference`` writes ``docs/config-reference.md`` from these
models (CI checks the committed file is current).
"""

from __future__ import annotations

import ipaddress
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from controller.errors import ConfigError
from controller.policy.model import MAX_EXPLORATION

# ``dns+NAME:PORT``: every address NAME resolves to (a headless service), resolved again
# as the daemon runs (controller.observe.discovery).
DNS_PREFIX = "dns+"


def check_host_port(value: str, *, listen: bool = False) -> str:
    """``value`` when it is HOST:PORT (an IPv6 host in brackets); a listen address may take
    port 0 (any free port)."""
    host, sep, port = value.rpartition(":")
    low = 0 if listen else 1
    if not sep or not host or not port.isdigit() or not low <= int(port) <= 65535 \
            or any(c.isspace() for c in value) or host.startswith("[") != host.endswith("]"):
        raise ValueError(f"expected HOST:PORT with a port in {low}..65535, got {value!r}")
    return value


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP (``127.0.0.0/8``, ``::1``); brackets allowed."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_target(target: str) -> bool:
    """A loopback HOST:PORT gRPC target (``dns:///`` and ``ipv4:``/``ipv6:`` prefixes
    allowed). Not a Unix socket: the client's local credentials are LOCAL_TCP."""
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(prefix):
            target = target[len(prefix):]
            break
    return is_loopback(target.rpartition(":")[0] or target)


def token_without_tls_problem(security: SecurityConfig, targets: Iterable[str],
                              what: str) -> str | None:
    """Why a bearer token without TLS cannot reach ``targets``, or None. gRPC sends call
    credentials only over TLS or a local connection: every call to another host failed as
    "Endpoint is neither UDS or TCP loopback address", read as an unreachable router."""
    if not security.has_token() or security.uses_tls():
        return None
    remote = [t for t in targets if not is_local_target(t)]
    if not remote:
        return None
    return (f"[security] token/token_file without TLS works on loopback only (gRPC sends a "
            f"token over TLS or a local connection), and {what} {remote[0]!r} is not "
            "loopback: set tls_ca (the routers' CA; tls_cert/tls_key too for mutual TLS), "
            "or leave the token out")


def _scrape_address(value: str) -> str:
    """HOST:PORT, or dns+NAME:PORT (every address of a headless service)."""
    check_host_port(value.removeprefix(DNS_PREFIX))
    return value


DAY = 86_400.0


class _Section(BaseModel):
    """Every number is finite (``inf``, ``nan`` and TOML's ``1e400``, read as inf, refused)
    and every duration and size has an upper bound in its ``Field`` (the reference lists
    each key's range): ``1e308`` seconds overflowed the scheduler and gRPC's deadlines."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PpdConfig(_Section):
    """The seed PPD section, as operators already write it."""

    enabled: bool = Field(
        True,
        description="Use PPD routing at all. false = classic P/D: every calibration yields "
        "every turn to a prefill node, no overrides; applied at the next calibration.",
    )
    first_turn_route: Literal["prefill", "decode"] = Field(
        "prefill",
        description="Where turn 1 (no cached context) goes to start with; a calibration moves "
        "it to the other route when its model predicts a gain (not under a pin).",
    )
    append_prefill_route: Literal["prefill", "decode", "dynamic"] = Field(
        "dynamic",
        description='Later turns: "prefill" = classic P/D (x=0), "decode" = all local (x=1) '
        '(pins: a uniform table, applied at the next calibration without the guardrail), '
        '"dynamic" = the calibrated lookup table.',
    )
    wtft: float = Field(1.0, ge=0, le=1000,
        description="TTFT weight; larger leans to decode-local.")
    wtpot: float = Field(1.0, ge=0, le=1000,
        description="TPOT weight; larger leans to prefill-node.")
    pin_weights: bool = Field(
        False, description="Keep wtft/wtpot as configured instead of tuning them."
    )
    lookup_table: Path | None = Field(
        None, description="JSON lookup-table file (policy format, schema_version 1)."
    )
    decision_timeout_ms: float = Field(
        1.0, gt=0, le=60_000,
        description="A slower decision falls back to the default route and is counted."
    )
    bypass_append_tokens: int = Field(
        0, ge=0, le=10_000_000,
        description="Appends strictly shorter than this run decode-local (0 = off)."
    )
    first_turn_busy_waiting: int = Field(
        2, ge=0, le=2**32 - 1,
        description="Turn 1 runs decode-local while every prefill worker has at least this "
        "many requests waiting (0 = off; needs routers that report prefill_waiting).",
    )
    later_turn_busy_waiting: int = Field(
        2, ge=0, le=2**32 - 1,
        description="A later turn its cell sends to a prefill node runs decode-local instead "
        "while every prefill worker has at least this many requests waiting, as long as turn 1 "
        "goes to a prefill node (0 = off; needs routers that report prefill_waiting).",
    )


class PoolConfig(_Section):
    nodes: list[str] = Field(
        default_factory=list,
        description="Worker addresses HOST:PORT (/metrics); dns+NAME:PORT expands to every "
        "address of a headless service (resolved again every 60 s).",
    )
    max_concurrent: int = Field(8, ge=1, le=100_000, description="Concurrent requests per worker.")
    local_append_prefill: bool = Field(
        True, description="Decode workers may run append-prefill locally (decode pool only)."
    )

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, v: list[str]) -> list[str]:
        return [_scrape_address(n) for n in v]


class KvTransferConfig(_Section):
    protocol: Literal["nccl", "rdma", "nixl", "tcp"] = Field("nccl", description="KV link kind.")
    timeout_s: float = Field(30.0, gt=0, le=3600, description="KV transfer timeout.")
    max_queue: int = Field(64, ge=1, le=1_000_000, description="Pending transfers per link.")


class MetricsConfig(_Section):
    enable: bool = Field(True, description="Export metrics.")
    export_interval_s: float = Field(5.0, gt=0, le=3600, description="Export interval.")
    listen: str = Field("127.0.0.1:9464", description="HOST:PORT of the /metrics endpoint.")

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return check_host_port(v, listen=True)


class SloConfig(_Section):
    ttft_s: float = Field(2.0, gt=0, le=3600, description="Time-to-first-token SLO (seconds).")
    tpot_s: float = Field(0.1, gt=0, le=60, description="Time-per-output-token SLO (seconds).")


class RoutersConfig(_Section):
    targets: list[str] = Field(
        default_factory=list, description="Router agents' gRPC addresses HOST:PORT (static list)."
    )
    metrics_targets: list[str] = Field(
        default_factory=list,
        description="Routers' /metrics addresses HOST:PORT (pdrouter_* series), one per "
        "router target and in the same order: the canary judge pairs them (with the "
        "prometheus source, each must be the router's `instance` label). The scrape source "
        "scrapes them; dns+NAME:PORT expands to every address of a headless service "
        "(resolved again every 60 s), scraped but not paired.",
    )

    @field_validator("targets")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        checked = [check_host_port(t) for t in v]
        # A router's address is its id in the store: listed twice, two passes would race on
        # one router, and its metrics name would be paired with two positions.
        twice = sorted({t for t in checked if checked.count(t) > 1})
        if twice:
            raise ValueError(f"listed more than once: {', '.join(twice)}")
        return checked

    @field_validator("metrics_targets")
    @classmethod
    def _metrics_targets(cls, v: list[str]) -> list[str]:
        return [_scrape_address(t) for t in v]


class SecurityConfig(_Section):
    tls_cert: Path | None = Field(None, description="PEM certificate of this side.")
    tls_key: Path | None = Field(None, description="PEM private key of this side.")
    tls_ca: Path | None = Field(
        None, description="PEM CA bundle: verifies the peer (server: requires client certs)."
    )
    token: SecretStr | None = Field(
        None, description="Bearer token (prefer PDCTL_SECURITY__TOKEN or token_file)."
    )
    token_file: Path | None = Field(None, description="File holding the bearer token.")
    server_name: str | None = Field(
        None, description="Override the TLS server name checked on the router's certificate."
    )

    def has_token(self) -> bool:
        return self.token is not None or self.token_file is not None

    def uses_tls(self) -> bool:
        """The client sends over TLS (``rollout.security.channel_credentials`` asks this)."""
        return self.tls_ca is not None or self.tls_cert is not None

    def bearer_token(self) -> str | None:
        if self.token is not None:
            return self.token.get_secret_value()
        if self.token_file is not None:
            return self.token_file.read_text(encoding="utf-8").strip()
        return None

    @model_validator(mode="after")
    def _pairs(self) -> SecurityConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.token is not None and self.token_file is not None:
            raise ValueError("give token or token_file, not both")
        return self


class AgentConfig(_Section):
    listen: str = Field("127.0.0.1:50151", description="gRPC listen address of the router agent.")
    state_file: Path | None = Field(
        None, description="Where the applied policy is persisted (atomic write) and read on start."
    )
    stale_after_s: float = Field(
        900.0, gt=0, le=30 * DAY,
        description="Raise the staleness signal when no update came for this long."
    )
    metrics_listen: str | None = Field(
        None, description="HOST:PORT for the agent's /metrics (None: not served)."
    )
    prefill_poll_interval_s: float = Field(
        1.0, ge=0, le=3600,
        description="Poll the [prefill_pool] nodes' /metrics this often for the waiting count "
        "turn 1's busy override needs, used when a router's request leaves prefill_waiting "
        "out (0 = off).",
    )
    prefill_stale_after_s: float = Field(
        5.0, gt=0, le=3600,
        description="A prefill worker's polled waiting count older than this is unknown; with "
        "none known the busy override does not fire.",
    )

    @field_validator("listen", "metrics_listen")
    @classmethod
    def _listen(cls, v: str | None) -> str | None:
        return None if v is None else check_host_port(v, listen=True)


class RolloutConfig(_Section):
    push_deadline_s: float = Field(2.0, gt=0, le=600,
        description="Deadline of one ApplyPolicy call.")
    max_attempts: int = Field(5, ge=1, le=100,
        description="Attempts per router and reconcile pass.")
    backoff_initial_s: float = Field(0.05, gt=0, le=600, description="First retry delay.")
    backoff_max_s: float = Field(5.0, gt=0, le=3600,
        description="Largest retry delay (with full jitter).")
    max_concurrency: int = Field(64, ge=1, le=100_000, description="Routers pushed to at once.")
    unacked_hold_initial_s: float = Field(
        10.0, gt=0, le=3600,
        description="A router pushed without acknowledging (a mismatch, a conflict, no "
        "answer to the update) is not contacted for this long; doubled after each such "
        "push in a row of the same content, up to unacked_hold_max_s.")
    unacked_hold_max_s: float = Field(
        900.0, gt=0, le=86_400,
        description="The longest a router that does not acknowledge is left alone.")


class ControllerConfig(_Section):
    interval_s: float = Field(30.0, gt=0, le=3600, description="Control interval (window length).")
    calibrate_every_s: float | None = Field(
        3600.0, gt=0, le=30 * DAY,
        description="Scheduled recalibration period (None: only on drift, "
        "scaling or operator request). The next due time follows from the last calibration "
        "stored, so a restart keeps it.",
    )
    training_windows: int = Field(
        120, ge=2, le=100_000, description="Newest complete windows a calibration trains on."
    )
    min_training_windows: int = Field(
        4, ge=2, le=100_000,
        description="Windows with routed requests needed before the first calibration."
    )
    min_policy_interval_s: float = Field(
        300.0, ge=0, le=7 * DAY,
        description="Automatic approvals at most this often (operator actions "
        "and a drift led by the KV link's own transfer times, measured rather than modelled, "
        "are not limited). A drift or scaling held back is calibrated for once the limit "
        "allows, also by a restarted or newly elected daemon (read back from the store).",
    )
    guardrail_margin: float = Field(
        0.005, ge=0, le=1, description="A candidate needs predicted goodput >= current + margin."
    )
    refinement_margin: float = Field(
        0.01, ge=0, le=1, description="A refinement needs predicted goodput >= current + this "
        "(at least guardrail_margin): a calibration for a performance drift alone (not the KV "
        "link's) while neither the workload nor the SLO detector has fired since the last "
        "approval. The traffic is the one the running policy was learned on, so a small "
        "predicted gain is the model's extrapolation, and each change is a push.",
    )
    guardrail_overload_goodput: float = Field(
        0.5, ge=0, le=1, description="Where the current policy is predicted below this goodput "
        "(overloaded), a candidate's gain must also exceed the model's held-out goodput error.",
    )
    exploration_max_rate: float = Field(
        0.2, ge=0, le=1,
        description="Requests per second a table cell may send the predicted-worse "
        "way to keep both routes measured (its exploration share is capped to this, floor "
        "included: the model needs samples, and a busy cell pays most per explored request).",
    )
    adopted_exploration: float = Field(
        0.05, ge=0, le=MAX_EXPLORATION, description="When the daemon adopts the routers' own "
        "policy and it explores nowhere (classic P/D as routers ship it), its first push is "
        "that table with this exploration share in every cell, so the learner measures the "
        "route the routers never take; recorded as the policy's provenance (pdctl status). "
        "0: adopt it as it is (nothing is learned until `pdctl calibrate-active` or "
        "`pdctl recalibrate --force`). Not with a pinned route ([ppd]) or while "
        "exploration is off.",
    )
    advisory: bool = Field(
        False, description="Everything but pushes: candidates are recorded as advisory."
    )
    canary_fraction: float = Field(
        0.25, gt=0, le=1, description="Share of routers that get a new policy first (>= 1)."
    )
    bake_windows: int = Field(3, ge=1, le=10_000,
        description="Windows a canary bakes before judging.")
    bake_min_requests: float = Field(
        100.0, ge=0, le=1e9, description="Requests needed on both canary and control routers."
    )
    max_bake_windows: int = Field(
        12, ge=1, le=10_000,
        description="A canary still short of requests after this many windows is "
        "rolled back (no evidence, no promotion).",
    )
    canary_refit: bool = Field(
        True, description="When the judge is about to promote a canary, refit on windows that "
        "include its own traffic; a refit the guardrail prefers to the canary bakes in its "
        "place (the fleet changes once, not twice). A refit is not refitted.",
    )
    promote_margin: float = Field(
        0.02, ge=0, le=1, description="Canary goodput may be this much below control's and still "
        "be promoted.",
    )
    promote_alpha: float = Field(
        0.05, gt=0, lt=0.5, description="One-sided significance of the two-proportion test "
        "that rolls a canary back, and of the post-promotion watch's over all its windows "
        "(each look at promote_alpha / watch_windows).",
    )
    watch_windows: int = Field(
        3, ge=0, le=10_000,
        description="Windows after a canary's promotion in which the fleet's goodput "
        "is compared with the bake's (a route fine for the canary's share of the traffic can "
        "overload a shared pool for all of it); 0: no watch.",
    )
    watch_drop: float = Field(
        0.1, ge=0, le=1, description="The watch rolls a promotion back when the fleet's "
        "goodput since is below the bake's by more than this.",
    )
    watch_load_rise: float = Field(
        0.1, ge=0, le=100, description="...unless the request rate rose by more than this share "
        "since the bake (a heavier load explains the fall without the policy).",
    )
    lease_ttl_s: float = Field(
        15.0, gt=0, le=3600,
        description="Leader lease lifetime (both stores: on PostgreSQL the lease "
        "row on top of the advisory lock fences each cycle's writes); a follower takes over "
        "once a dead leader's lease expired."
    )
    stalled_after_s: float | None = Field(
        None, gt=0, le=DAY, description="/healthz fails when no cycle completed ok for this long; "
        "/livez (the liveness probe) and the systemd watchdog when no cycle ended at all, "
        "a wedged loop (None: 3 intervals + 30 s).",
    )
    shutdown_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="On SIGTERM, wait this long for the in-flight cycle."
    )
    replica_id: str | None = Field(
        None, description="This replica's name in leases and request claims (None: "
        "HOSTNAME-PID); each process adds a nonce of its own, so replicas given one name "
        "cannot both lead.",
    )
    sidecar_router: str | None = Field(
        None, description="Sidecar mode: reconcile only this router, one of [routers] "
        "targets (needs PostgreSQL)."
    )

    def stalled_after(self) -> float:
        """``stalled_after_s``, or its default: 3 intervals + 30 s."""
        return self.stalled_after_s if self.stalled_after_s is not None \
            else 3 * self.interval_s + 30.0


class DriftSettings(_Section):
    """Drift detectors (workload PSI/qps/QPS CUSUM, performance CUSUM, SLO band)."""

    cooldown_s: float = Field(
        300.0, ge=0, le=7 * DAY,
        description="After a detector fires or a recalibration, it stays quiet "
        "this long (a shift whose calibration was refused fires again after it, measured "
        "against the running policy's reference)."
    )
    hysteresis: int = Field(
        2, ge=1, le=1000, description="Consecutive windows over threshold before the workload and "
        "SLO detectors fire."
    )
    min_requests: float = Field(
        50.0, ge=0, le=1e9, description="Requests a window needs before the workload and SLO "
        "detectors judge it."
    )
    reference_windows: int = Field(
        10, ge=1, le=100_000,
        description="Newest windows of a calibration set that become the drift "
        "reference (what \"normal\" looks like after a shift)."
    )
    qps_cusum_allowance: float = Field(
        1.0, ge=0, le=1e6, description="Workload detector's QPS CUSUM: allowance k, in standard "
        "deviations of one window's log request rate (Poisson plus the calibration windows' "
        "overdispersion), before the reference's own error is added; larger: less sensitive."
    )
    qps_cusum_threshold: float = Field(
        5.0, gt=0, le=1e6, description="Workload detector's QPS CUSUM: threshold h, in the same "
        "standard deviations (one window moves it by at most 0.8 h)."
    )


class CapacityConfig(_Section):
    """Capacity planning: how many prefill and decode workers the load and SLOs need."""

    enabled: bool = Field(
        True, description="The daemon computes, stores and exports a recommendation "
        "(pdctl_recommended_workers{role})."
    )
    headroom: float = Field(
        0.2, ge=0, le=10, description="Spare capacity on top of the demand (0.2 = plan for "
        "120% of the observed load).",
    )
    interval_s: float = Field(
        300.0, gt=0, le=7 * DAY,
        description="Seconds between two recommendations (the planner runs on "
        "the control cycle that follows)."
    )
    min_windows: int = Field(
        2, ge=1, le=100_000, description="Stored windows needed before the first recommendation."
    )


class ExportConfig(_Section):
    """Tuned knobs for a router that keeps its own rule (docs/adopting.md): on every
    approval the daemon fits the peer's rule to the approved policy's calibration and
    writes its config fragment to ``path`` (atomic replace), as ``pdctl export`` prints it."""

    format: Literal["dynamo", "llm-d"] | None = Field(
        None, description="The peer's rule to export: dynamo (conditional disaggregation, "
        "isl_bounding) or llm-d (prefix-based-pd-decider nonCachedTokens); unset: off."
    )
    path: Path | None = Field(
        None, description="File the fragment is written to on every approval (needs format)."
    )
    traffic_chars_per_token: float = Field(
        4.0, gt=0, le=64, description="Average characters per tokenizer token of your traffic "
        "(llm-d: converts the fitted token threshold into llm-d's byte-based estimate)."
    )
    llmd_chars_per_token: float = Field(
        4.0, gt=0, le=64, description="The average characters per token llm-d's decider divides "
        "prompt bytes by."
    )

    @model_validator(mode="after")
    def _format_and_path_together(self) -> ExportConfig:
        if (self.format is None) != (self.path is None):
            raise ValueError("[export] format and path are set together (both, or neither)")
        return self


class PrometheusConfig(_Section):
    """The Prometheus (or Thanos/Mimir) HTTP API the prometheus source queries."""

    url: str = Field("http://127.0.0.1:9090", description="Base URL of the HTTP API.")
    timeout_s: float = Field(10.0, gt=0, le=600, allow_inf_nan=False,
                             description="Total deadline of one window's queries, and of "
                             "each API call (connect, headers, body and retries together).")
    retries: int = Field(
        2, ge=0, le=10, description="Retries on connection errors and HTTP 429/502/503/504."
    )
    window_mode: Literal["edges", "increase"] = Field(
        "edges",
        description="edges: diff the cumulative values at the window's start and end (exact "
        "counts, new series counted); increase: increase() at the end (extrapolated counts), "
        "a target one of whose counters fell in the window read as edges.",
    )
    escaped_names: bool = Field(
        False,
        description="Prometheus stored vllm:x as vllm_x (prometheus_client 0.22+ answering a "
        "Prometheus < 2.49 over OpenMetrics).",
    )
    discover_targets: bool = Field(
        False, description="Take workers and routers from /api/v1/targets instead of the "
        "static lists (again every 60 s: pods come and go).",
    )
    role_label: str = Field(
        "role", description="Target label holding prefill|decode|router (else the job name)."
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        from urllib.parse import urlsplit

        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"expected an http:// or https:// URL, got {v!r}")
        # Each of these passed and then failed every cycle as a transient error.
        try:
            parts.port  # noqa: B018 - raises for a port out of range
        except ValueError:
            raise ValueError(f"{v!r}: the port must be 1-65535") from None
        if parts.query or parts.fragment:
            raise ValueError(f"{v!r}: the base URL takes no ?query or #fragment")
        if parts.path.rstrip("/").endswith("/api/v1"):
            raise ValueError(f"{v!r}: give the base URL, without /api/v1 (it is added)")
        return v


class ObserveConfig(_Section):
    """How windows are observed."""

    source: Literal["scrape", "prometheus"] = Field(
        "scrape", description="scrape: GET every target's /metrics; prometheus: PromQL."
    )
    scrape_timeout_s: float = Field(5.0, gt=0, le=600, allow_inf_nan=False,
                                    description="Timeout of one /metrics scrape.")
    scrape_concurrency: int = Field(32, ge=1, le=10_000, description="Scrapes in flight at once.")


# URI schemes libpq takes for PostgreSQL (``postgres://`` is what Heroku, psql and most
# tools print); SQLAlchemy 1.4+ knows only ``postgresql``. Without a driver the store
# uses psycopg 3, the one it depends on (SQLAlchemy's default would be psycopg2).
LIBPQ_SCHEMES = ("postgresql", "postgres")
PG_DRIVER = "postgresql+psycopg"


def libpq_scheme(url: str) -> str:
    """``url`` with a libpq PostgreSQL scheme made SQLAlchemy's psycopg 3 one:
    ``postgres://`` and ``postgresql://`` become ``postgresql+psycopg://``,
    ``postgres+DRIVER://`` becomes ``postgresql+DRIVER://``. The rest of the URL (user,
    password, host, query) is kept byte for byte; any other URL is returned as it is."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    backend, plus, driver = scheme.partition("+")
    if backend.lower() not in LIBPQ_SCHEMES:
        return url
    return f"{PG_DRIVER if not plus else 'postgresql+' + driver}://{rest}"



class StoreConfig(_Section):
    """The history database (SQLite embedded default, PostgreSQL in production)."""

    url: str = Field(
        "sqlite:///./pd-controller.db",
        description="SQLAlchemy URL: sqlite:///PATH (relative paths resolve against the working "
        "directory at load time) or postgresql+psycopg://USER@HOST:PORT/DB (postgres:// and "
        "postgresql://, as libpq takes them, are read as postgresql+psycopg://).",
        validate_default=True,
    )
    retention_days: float = Field(
        30.0, gt=0, le=36_500,
        description="Windows older than this are compacted (policies, events and "
        "requests are kept).",
    )
    echo: bool = Field(False, description="Log every SQL statement (debugging).")
    busy_timeout_ms: int = Field(
        5000, ge=0, le=600_000, description="SQLite: wait this long for a lock before failing."
    )
    sqlite_synchronous: Literal["NORMAL", "FULL"] = Field(
        "NORMAL",
        description="SQLite (WAL): NORMAL = commits survive a process crash, the last ones "
        "may be lost on power loss; FULL = fsync every commit.",
    )

    @field_validator("url")
    @classmethod
    def _absolute_sqlite_path(cls, v: str) -> str:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        # libpq's schemes (postgres://, postgresql://) name PostgreSQL through psycopg 3.
        v = libpq_scheme(v)
        try:  # a typo here would otherwise surface as a traceback in every store command
            backend = make_url(v).get_backend_name()
        except ArgumentError:
            # Not echoed: the URL may hold a password.
            raise ValueError("not a database URL (expected sqlite:///PATH or "
                             "postgresql+psycopg://USER@HOST:PORT/DB)") from None
        if backend not in ("sqlite", "postgresql"):
            raise ValueError(f"{backend}: the store runs on sqlite or postgresql only")
        prefix = "sqlite:///"
        if not v.startswith(prefix):
            return v
        path, sep, query = v[len(prefix) :].partition("?")
        if not path or path.startswith(("/", ":memory:", "file:")):
            return v
        return f"{prefix}{Path(path).expanduser().resolve()}{sep}{query}"


class Settings(BaseSettings):
    """The whole configuration."""

    model_config = SettingsConfigDict(
        env_prefix="PDCTL_", env_nested_delimiter="__", extra="forbid", frozen=True
    )
    ppd: PpdConfig = Field(default_factory=PpdConfig)
    prefill_pool: PoolConfig = Field(default_factory=PoolConfig)
    decode_pool: PoolConfig = Field(default_factory=PoolConfig)
    kv_transfer: KvTransferConfig = Field(default_factory=KvTransferConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    slo: SloConfig = Field(default_factory=SloConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    routers: RoutersConfig = Field(default_factory=RoutersConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    drift: DriftSettings = Field(default_factory=DriftSettings)
    store: StoreConfig = Field(default_factory=StoreConfig)
    prometheus: PrometheusConfig = Field(default_factory=PrometheusConfig)
    observe: ObserveConfig = Field(default_factory=ObserveConfig)
    capacity: CapacityConfig = Field(default_factory=CapacityConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)

    _toml_file: ClassVar[Path | None] = None

    @model_validator(mode="after")
    def _sidecar_router_is_a_target(self) -> Settings:
        mine, targets = self.controller.sidecar_router, self.routers.targets
        if mine is not None and mine not in targets:
            # Desired versions are keyed by the targets' names: any other name is never given
            # a policy, so this replica would push nothing, ever.
            raise ValueError(f"controller.sidecar_router: {mine!r} is not one of [routers] "
                             f"targets {targets}: its router would never be given a policy")
        return self

    @model_validator(mode="after")
    def _token_reaches_the_routers(self) -> Settings:
        problem = token_without_tls_problem(self.security, self.routers.targets,
                                            "router target")
        if problem is not None:
            raise ValueError(problem)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls._toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cls._toml_file))
        sources.append(file_secret_settings)
        return tuple(sources)


def windows_compaction_keeps(settings: Settings) -> int:
    """The newest windows retention never deletes, whatever ``retention_days`` says: twice
    what a calibration trains on, so a fit still running (on the newest
    ``training_windows``, while more arrive) finds every window its calibration names."""
    return 2 * settings.controller.training_windows


def sidecar_store_problem(settings: Settings) -> str | None:
    """What `pdctl run` refuses (and `pdctl config check` reports) about a sidecar's store."""
    if settings.controller.sidecar_router is not None and \
            settings.store.url.startswith("sqlite"):
        return ("[controller] sidecar_router needs PostgreSQL as the shared store (every "
                "replica reconciles its own router)")
    return None


def router_outcome_names(settings: Settings) -> dict[str, str]:
    """Each router target's name in the windows' outcomes (the scrape target, or Prometheus'
    ``instance`` label): its ``[routers] metrics_targets`` entry in the same place, when the
    two lists pair up one to one; else none (an outcome is then named by its target)."""
    targets, metrics = settings.routers.targets, settings.routers.metrics_targets
    if len(metrics) != len(targets) or any(m.startswith(DNS_PREFIX) for m in metrics):
        return {}
    return dict(zip(targets, metrics, strict=True))


def canary_names_problem(settings: Settings) -> str | None:
    """What `pdctl run` refuses (and `pdctl config check` reports) when the canary judge
    could not tell canary routers' requests from control routers': it pairs router targets
    with metrics names by position, and without a pair every canary would see no requests and
    be rolled back after ``max_bake_windows``."""
    targets, metrics = settings.routers.targets, settings.routers.metrics_targets
    has_control = len(targets) >= 2 and settings.controller.canary_fraction < 1
    # Observing nothing, the daemon never calibrates: only operator actions, which skip the
    # canary.
    observes = (settings.observe.source == "prometheus" or metrics
                or settings.prefill_pool.nodes or settings.decode_pool.nodes)
    if not has_control or not observes or router_outcome_names(settings):
        return None
    have = (f"{len(metrics)} entr{'y' if len(metrics) == 1 else 'ies'}"
            + (" with a dns+ name" if any(m.startswith(DNS_PREFIX) for m in metrics) else ""))
    return (f"[routers] metrics_targets must name each of the {len(targets)} router targets' "
            f"/metrics address HOST:PORT, in the same order (has {have}; with the "
            "prometheus source each must be the router's `instance` label): the canary "
            "judge tells canary routers' requests from control routers' by them, and "
            "without them every canary is rolled back for want of requests. Or set "
            "[controller] canary_fraction = 1 (no canary)")


def load_settings(path: Path | str | None = None, **overrides: Any) -> Settings:
    """Load the config file (absolute or relative to the working directory).

    Raises :class:`ConfigError` naming every bad key; a missing file is an error too.
    """
    toml: Path | None = None
    if path is not None:
        toml = Path(path).expanduser().resolve()
        if not toml.is_file():
            raise ConfigError(f"config file not found: {toml}")
    cls: type[Settings] = type("_LoadedSettings", (Settings,), {"_toml_file": toml})
    env = _environment_keys()
    unknown = [f"  - {key}: unknown key (from {name})" for key, name in env.items()
               if not _is_setting(key)]
    if unknown:
        raise ConfigError("invalid configuration in the environment:\n" + "\n".join(unknown))
    try:
        return cls(**overrides)
    except ValidationError as e:
        where = f" in {toml}" if toml else ""
        raise ConfigError(f"invalid configuration{where}:\n{_format_errors(e, env)}") from None
    except (OSError, ValueError) as e:  # TOML syntax errors surface as ValueError
        raise ConfigError(f"cannot read configuration {toml}: {e}") from None


def _environment_keys() -> dict[str, str]:
    """``section.key`` -> the ``PDCTL_SECTION__KEY`` variable that sets it, for every nested
    variable in the environment (a flat ``PDCTL_NAME`` without ``__`` is not a setting)."""
    import os

    out: dict[str, str] = {}
    for name in os.environ:
        rest = name[len("PDCTL_"):] if name.upper().startswith("PDCTL_") else ""
        if "__" in rest:
            out[".".join(part.lower() for part in rest.split("__"))] = name
    return out


def _is_setting(key: str) -> bool:
    section, _, field = key.partition(".")
    model = Settings.model_fields.get(section)
    if model is None or model.annotation is None:
        return False
    return field.split(".")[0] in model.annotation.model_fields


def _format_errors(e: ValidationError, env: dict[str, str] | None = None) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        msg = msg.removeprefix("Value error, ")
        # The environment overrides the file: name the variable, or the operator edits the file.
        name = next((n for k, n in (env or {}).items() if key == k or key.startswith(k + ".")),
                    None)
        where = f"{key}: " if key else ""  # a check across sections names its keys itself
        lines.append(f"  - {where}{msg}" + (f" (from {name})" if name else ""))
    return "\n".join(lines)


def config_reference() -> str:
    """Markdown reference of every key: type, default, meaning."""
    out = [
        "# Configuration reference",
        "",
        "Generated by `python -m controller.config --reference` from `controller/config.py`;"
        " do not edit by hand.",
        "",
        "Every key can also be set from the environment as `PDCTL_<SECTION>__<KEY>` "
        "(e.g. `PDCTL_SLO__TTFT_S=1.5`). Unknown keys are rejected, in the file and in the "
        "environment (an error from a variable names it). Every number must be finite "
        "(`inf`, `nan` and TOML's `1e400`, read as infinity, are refused) and within its "
        "range; `pdctl config check` and `pdctl run` name the key that is not.",
    ]
    for name, field in Settings.model_fields.items():
        model = field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        out += ["", f"## `[{name}]`", ""]
        if model.__doc__:
            out += [model.__doc__.strip(), ""]
        out += ["| key | type | default | range | meaning |", "|---|---|---|---|---|"]
        for key, f in model.model_fields.items():
            typ = _type_name(f.annotation)
            default = f.default_factory() if f.default_factory else f.default  # type: ignore[call-arg]
            out.append(f"| `{key}` | {typ} | `{default!r}` | {value_range(f)} | "
                       f"{f.description or ''} |")
    return "\n".join(out) + "\n"


def value_range(f: FieldInfo) -> str:
    """A numeric key's accepted range as ``low < x <= high`` (finite values only), else ""."""
    low = high = ""
    for m in f.metadata:
        for attr, fmt in (("gt", "{} <"), ("ge", "{} ≤"), ("lt", "< {}"), ("le", "≤ {}")):
            v = getattr(m, attr, None)
            if v is not None:
                text = fmt.format(f"{int(v):,}" if float(v).is_integer() else f"{v:g}")
                low, high = (text, high) if attr[0] == "g" else (low, text)
    return f"{low} x {high}".strip() if low or high else ""


def _type_name(t: Any) -> str:
    s = str(t).replace("typing.", "").replace("pathlib.", "").replace("pydantic.types.", "")
    s = s.replace("<class '", "").replace("'>", "")
    return s.replace("|", "\\|")


if __name__ == "__main__":  # pragma: no cover - documentation generator
    if sys.argv[1:] == ["--reference"]:
        sys.stdout.write(config_reference())
    else:
        sys.stderr.write("usage: python -m controller.config --reference\n")
        sys.exit(2)
