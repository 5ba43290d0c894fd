"""Typed configuration of ``pdctl router serve`` (``router.toml``).

Every section forbids unknown keys; :func:`load_router_config` turns a bad file into one
:class:`~controller.errors.ConfigError` listing every problem with its key. The ``[security]``
section is the same model the daemon and ``pdctl router-agent`` use for the gRPC policy port.

Instances are ``http://HOST:PORT`` URLs, or ``dns+NAME:PORT`` (every address the name resolves
to, resolved again every ``[instances] resolve_interval_s``; plain HTTP).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from controller.config import DNS_PREFIX, SecurityConfig, check_host_port
from controller.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def check_instance(value: str) -> str:
    """An upstream engine: ``http(s)://HOST:PORT`` (no path) or ``dns+NAME:PORT``."""
    if value.startswith(DNS_PREFIX):
        check_host_port(value.removeprefix(DNS_PREFIX))
        return value
    for scheme in ("http://", "https://"):
        if value.startswith(scheme):
            rest = value.removeprefix(scheme).rstrip("/")
            if "/" in rest:
                raise ValueError(f"instance {value!r}: give the engine's base URL, no path")
            check_host_port(rest)
            return value.rstrip("/")
    raise ValueError(f"instance {value!r}: expected http://HOST:PORT or dns+NAME:PORT")


class HttpSection(_Section):
    """The OpenAI-compatible API clients call."""

    listen: str = Field("127.0.0.1:8000", description="HOST:PORT of the client API.")
    processes: int = Field(
        1, ge=1, le=64,
        description="Processes sharing the listen port (SO_REUSEPORT); a policy push is "
        "acknowledged only once every process runs it.",
    )
    api_key: SecretStr | None = Field(
        None, description="Bearer token clients must send (None: no check). Prefer "
        "api_key_file. The client's Authorization header is passed on to the engines.",
    )
    api_key_file: Path | None = Field(None, description="File holding api_key.")
    metrics_listen: str | None = Field(
        None, description="HOST:PORT serving /metrics alone (the daemon's [routers] "
        "metrics_targets); /metrics is on the client API's port too.",
    )
    max_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 above).",
    )

    @field_validator("listen", "metrics_listen")
    @classmethod
    def _listen(cls, v: str | None) -> str | None:
        return None if v is None else check_host_port(v, listen=True)

    @model_validator(mode="after")
    def _one_key(self) -> HttpSection:
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give api_key or api_key_file, not both")
        return self

    def client_key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_file is not None:
            try:
                return self.api_key_file.read_text(encoding="utf-8").strip()
            except OSError as e:
                raise ConfigError(f"http.api_key_file {self.api_key_file}: {e}") from None
        return None


class GrpcSection(_Section):
    """The policy port the controller pushes to (``pdcontrol.v1.RouterPolicyService``)."""

    listen: str = Field("127.0.0.1:50151", description="gRPC HOST:PORT.")
    state_file: Path | None = Field(
        None, description="The applied policy, persisted before it goes live and loaded on "
        "start (with several processes, each uses <name>.<n>).",
    )
    initial_policy: Path | None = Field(
        None, description="Policy file used when no state file exists (e.g. [ppd] lookup_table).",
    )
    allow_unauthenticated: bool = Field(
        False, description="Allow a non-loopback listen address without a token or client certs.",
    )
    decision_timeout_ms: float = Field(1.0, gt=0, description="decide() budget before the "
                                       "policy's default route is used.")
    stale_after_s: float = Field(900.0, gt=0, description="Policy staleness limit.")

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return check_host_port(v, listen=True)


class ModelSection(_Section):
    """What the router serves and how it counts tokens."""

    names: list[str] = Field(
        default_factory=list,
        description="Served model names (GET /v1/models; another model answers 404). Empty: "
        "the decode instances' /v1/models answer, and any model is passed on.",
    )
    tokenizer: Path | None = Field(
        None, description="The model's tokenizer.json (or its directory, with "
        "tokenizer_config.json's chat template). None: token counts are estimated, said at "
        "start and in pdrouter_tokenizer_loaded 0.",
    )
    default_output_tokens: float = Field(
        256.0, gt=0, description="expected_output_tokens when a request sets no max_tokens.",
    )


class InstancesSection(_Section):
    """The engines: prefill (P) and decode (D) instances."""

    prefill: list[str] = Field(default_factory=list, description="P instances.")
    decode: list[str] = Field(..., min_length=1, description="D instances.")
    resolve_interval_s: float = Field(10.0, gt=0, description="Re-resolve dns+ names this often.")
    health_interval_s: float = Field(1.0, gt=0, description="GET /health (and P's /metrics "
                                     "waiting count) this often.")
    unhealthy_after: int = Field(2, ge=1, description="Consecutive failed checks that take an "
                                 "instance out of rotation (one success brings it back).")
    waiting_stale_after_s: float = Field(5.0, gt=0, description="A P's polled waiting count "
                                         "older than this is unknown.")
    api_key: SecretStr | None = Field(
        None, description="Bearer token sent to the engines (their --api-key) instead of the "
        "client's Authorization (None: the client's is passed on as it is).",
    )

    @field_validator("prefill", "decode")
    @classmethod
    def _instances(cls, v: list[str]) -> list[str]:
        out = [check_instance(x) for x in v]
        if len(set(out)) != len(out):
            raise ValueError("an instance is listed twice")
        return out


class TimeoutsSection(_Section):
    """Bounds on every wait (seconds): upstream, and a client's body."""

    connect_s: float = Field(2.0, gt=0, description="TCP connect to an engine.")
    prefill_s: float = Field(60.0, gt=0, description="The whole prefill leg (P's JSON answer).")
    first_byte_s: float = Field(60.0, gt=0, description="D's response headers and first event.")
    between_tokens_s: float = Field(30.0, gt=0, description="Silence allowed between two "
                                    "streamed events (and for a non-streamed body).")
    non_streamed_s: float = Field(600.0, gt=0, description="D's whole non-streamed answer.")
    health_s: float = Field(1.0, gt=0, description="One health check or metrics poll.")
    client_body_s: float = Field(30.0, gt=0, description="A client's whole request body, "
                                 "from its headers on (408 after).")


class SessionsSection(_Section):
    """Per-session state kept by one router (completions' previous prompt lengths)."""

    max_sessions: int = Field(100_000, ge=1, description="Sessions remembered (LRU).")
    opening_chars: int = Field(
        512, ge=1, description="Characters of a completions prompt hashed into its session key "
        "when the request names no session.",
    )
    qps_window_s: float = Field(10.0, gt=0,
                                description="Window of the arrival rate decide() reads.")


class RouterConfig(_Section):
    """``router.toml``: see ``docs/router.md``."""

    router_id: str = Field("", description="Name in logs and metrics (default: host name).")
    http: HttpSection = Field(default_factory=HttpSection)
    grpc: GrpcSection = Field(default_factory=GrpcSection)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    model: ModelSection = Field(default_factory=ModelSection)
    instances: InstancesSection
    timeouts: TimeoutsSection = Field(default_factory=TimeoutsSection)
    sessions: SessionsSection = Field(default_factory=SessionsSection)


def format_errors(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        msg = msg.removeprefix("Value error, ")
        lines.append(f"  - {key + ': ' if key else ''}{msg}")
    return "\n".join(lines)


def parse_router_config(doc: dict[str, Any], where: str = "") -> RouterConfig:
    try:
        return RouterConfig.model_validate(doc)
    except ValidationError as e:
        raise ConfigError(f"invalid router configuration{where}:\n{format_errors(e)}") from None


def load_router_config(path: Path | str) -> RouterConfig:
    """Read and validate ``router.toml``; every problem is named in one ConfigError."""
    p = Path(path).expanduser()
    try:
        doc = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"router config not found: {p}") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read router config {p}: {e}") from None
    return parse_router_config(doc, f" in {p}")
