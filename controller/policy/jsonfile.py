"""The JSON lookup-table file (``schema_version`` 1): import, export, validation.

Format (documented in ``docs/policy-format.md``)::

    {"schema_version": 1, "version": 7, "checksum": "<sha256 hex>",
     "axes": {"context_tokens": [...], "io_ratio": [...], "qps": [...]},
     "routes": ["PREFILL_NODE" | "DECODE_LOCAL", ...],      # n_ctx*n_io*n_qps, C order
     "scores": [...], "exploration": [...],
     "weights": {"wtft": 1.0, "wtpot": 1.0},
     "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
     "overrides": {"first_turn_route": "PREFILL_NODE", "bypass_append_tokens": 0,
                   "first_turn_busy_waiting": 2,                 # optional, omitted when 0
                   "later_turn_busy_waiting": 2},                # optional, omitted when 0
     "default_route": "PREFILL_NODE",
     "provenance": {"created_at": ISO-8601, "reason": "", "created_by": "",
                    "trained_from": ISO-8601 | null, "trained_to": ISO-8601 | null}}

``checksum`` is optional on import; when present it must match the content.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from typing import Any

from controller.policy.model import (
    AXIS_NAMES,
    Axes,
    LookupTable,
    Overrides,
    Policy,
    Provenance,
    Route,
    Slo,
    Weights,
)
from controller.policy.validation import PolicyValidationError, Problem, validate_policy

SCHEMA_VERSION = 1
# Refuse absurd files before parsing them: 64^3 cells of ~40 bytes is ~10 MB.
MAX_FILE_BYTES = 32 * 1024 * 1024
# Optional override fields, written only when on so routers of earlier releases read the file.
BUSY_OVERRIDES = ("first_turn_busy_waiting", "later_turn_busy_waiting")

_TOP_KEYS = {
    "schema_version", "version", "checksum", "axes", "routes", "scores", "exploration",
    "weights", "slo", "overrides", "default_route", "provenance",
}


def _iso(d: datetime | None) -> str | None:
    return d.isoformat() if d is not None else None


def policy_to_dict(p: Policy) -> dict[str, Any]:
    pv = p.provenance
    return {
        "schema_version": SCHEMA_VERSION,
        "version": p.version,
        "checksum": p.checksum,
        "axes": {n: list(getattr(p.table.axes, n)) for n in AXIS_NAMES},
        "routes": [r.name for r in p.table.routes],
        "scores": list(p.table.scores),
        "exploration": list(p.table.exploration),
        "weights": {"wtft": p.weights.wtft, "wtpot": p.weights.wtpot},
        "slo": {"ttft_s": p.slo.ttft_s, "tpot_s": p.slo.tpot_s},
        "overrides": {
            "first_turn_route": p.overrides.first_turn_route.name,
            "bypass_append_tokens": p.overrides.bypass_append_tokens,
            **{name: getattr(p.overrides, name) for name in BUSY_OVERRIDES
               if getattr(p.overrides, name)},
        },
        "default_route": p.default_route.name,
        "provenance": {
            "created_at": _iso(pv.created_at),
            "reason": pv.reason,
            "created_by": pv.created_by,
            "trained_from": _iso(pv.trained_from),
            "trained_to": _iso(pv.trained_to),
        },
    }


def dumps(p: Policy, indent: int | None = 1) -> str:
    """JSON text; ``indent=None`` writes the compact form (several times faster to encode)."""
    separators = (",", ":") if indent is None else None
    return json.dumps(policy_to_dict(p), indent=indent, separators=separators, allow_nan=False)


class _Reader:
    """Collects problems while reading loosely-typed JSON into typed values."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def bad(self, path: str, msg: str) -> None:
        self.problems.append(Problem(path, msg))

    def obj(self, d: Any, path: str, allowed: set[str]) -> dict[str, Any]:
        if not isinstance(d, dict):
            self.bad(path or "$", f"must be an object, got {type(d).__name__}")
            return {}
        for k in d:
            if k not in allowed:
                self.bad(f"{path}.{k}" if path else k, "unknown key")
        return d

    def number(self, d: dict[str, Any], key: str, path: str, default: float | None) -> float:
        full = f"{path}.{key}" if path else key
        if key not in d:
            if default is None:
                self.bad(full, "missing")
                return math.nan
            return default
        v = d[key]
        if isinstance(v, bool) or not isinstance(v, int | float):
            self.bad(full, f"must be a number, got {v!r}")
            return math.nan
        return float(v)

    def integer(self, d: dict[str, Any], key: str, path: str, default: int | None) -> int:
        full = f"{path}.{key}" if path else key
        if key not in d:
            if default is None:
                self.bad(full, "missing")
            return default or 0
        v = d[key]
        if isinstance(v, bool) or not isinstance(v, int):
            self.bad(full, f"must be an integer, got {v!r}")
            return 0
        return v

    def route(self, v: Any, path: str) -> Route:
        if not isinstance(v, str):
            self.bad(path, f"must be a route name, got {v!r}")
            return Route.PREFILL_NODE
        try:
            return Route.parse(v)
        except ValueError as e:
            self.bad(path, str(e))
            return Route.PREFILL_NODE

    def numbers(self, v: Any, path: str) -> tuple[float, ...]:
        if not isinstance(v, list):
            self.bad(path, f"must be a list of numbers, got {type(v).__name__}")
            return ()
        out: list[float] = []
        for i, x in enumerate(v):
            if isinstance(x, bool) or not isinstance(x, int | float):
                self.bad(f"{path}[{i}]", f"must be a number, got {x!r}")
                out.append(math.nan)
            else:
                out.append(float(x))
        return tuple(out)

    def when(self, d: dict[str, Any], key: str, path: str) -> datetime | None:
        v = d.get(key)
        if v is None:
            return None
        if not isinstance(v, str):
            self.bad(f"{path}.{key}", f"must be an ISO-8601 string or null, got {v!r}")
            return None
        try:
            t = datetime.fromisoformat(v)
        except ValueError:
            self.bad(f"{path}.{key}", f"not an ISO-8601 timestamp: {v!r}")
            return None
        if t.tzinfo is None:
            self.bad(f"{path}.{key}", "timestamp needs a time zone (e.g. +00:00)")
        return t

    def text(self, d: dict[str, Any], key: str, path: str) -> str:
        v = d.get(key, "")
        if not isinstance(v, str):
            self.bad(f"{path}.{key}", f"must be a string, got {v!r}")
            return ""
        return v


def policy_from_dict(d: Any) -> Policy:
    """Parse and validate; raise :class:`PolicyValidationError` listing every problem.

    Problems are listed in the order the fields are read (the order of the JSON format)."""
    r = _Reader()
    top = r.obj(d, "", _TOP_KEYS)
    if not isinstance(d, dict):
        raise PolicyValidationError(r.problems)
    sv = top.get("schema_version")
    # ``True == 1`` and ``1.0 == 1`` in Python: the type is checked too, as for every field.
    if type(sv) is not int or sv != SCHEMA_VERSION:
        r.bad("schema_version", f"unsupported schema_version {sv!r} (this build reads 1)")
    version = r.integer(top, "version", "", None)
    axes, routes, scores, exploration = _read_table(r, top)
    wd = r.obj(top.get("weights", {}), "weights", {"wtft", "wtpot"})
    sd = r.obj(top.get("slo", {}), "slo", {"ttft_s", "tpot_s"})
    od = r.obj(
        top.get("overrides", {}), "overrides",
        {"first_turn_route", "bypass_append_tokens", *BUSY_OVERRIDES},
    )
    pd_ = r.obj(
        top.get("provenance", {}),
        "provenance",
        {"created_at", "reason", "created_by", "trained_from", "trained_to"},
    )
    policy = Policy(
        version=version,
        table=LookupTable(axes, routes, scores, exploration),
        weights=Weights(
            r.number(wd, "wtft", "weights", 1.0), r.number(wd, "wtpot", "weights", 1.0)
        ),
        slo=Slo(r.number(sd, "ttft_s", "slo", None), r.number(sd, "tpot_s", "slo", None)),
        overrides=_read_overrides(r, od),
        default_route=r.route(top.get("default_route", "PREFILL_NODE"), "default_route"),
        provenance=_read_provenance(r, pd_),
    )
    problems = _all_problems(r, top, policy)
    if problems:
        raise PolicyValidationError(problems)
    return policy


def _read_table(
    r: _Reader, top: dict[str, Any]
) -> tuple[Axes, tuple[Route, ...], tuple[float, ...], tuple[float, ...]]:
    """The lookup table's parts: axes, routes, scores, exploration."""
    axes_d = r.obj(top.get("axes", {}), "axes", set(AXIS_NAMES))
    edges = {}
    for n in AXIS_NAMES:
        if n not in axes_d:
            r.bad(f"axes.{n}", "missing")
        edges[n] = r.numbers(axes_d.get(n, []), f"axes.{n}")
    axes = Axes(**edges)
    routes_raw = top.get("routes")
    routes: tuple[Route, ...] = ()
    if not isinstance(routes_raw, list):
        r.bad("routes", "must be a list of route names")
    else:
        routes = tuple(r.route(v, f"routes[{i}]") for i, v in enumerate(routes_raw))
    scores = r.numbers(top.get("scores"), "scores")
    exploration = r.numbers(top.get("exploration", [0.0] * len(routes)), "exploration")
    return axes, routes, scores, exploration


def _read_overrides(r: _Reader, od: dict[str, Any]) -> Overrides:
    return Overrides(
        r.route(od.get("first_turn_route", "PREFILL_NODE"), "overrides.first_turn_route"),
        r.integer(od, "bypass_append_tokens", "overrides", 0),
        r.integer(od, "first_turn_busy_waiting", "overrides", 0),
        r.integer(od, "later_turn_busy_waiting", "overrides", 0),
    )


def _read_provenance(r: _Reader, pd_: dict[str, Any]) -> Provenance:
    return Provenance(
        created_at=r.when(pd_, "created_at", "provenance"),
        reason=r.text(pd_, "reason", "provenance"),
        created_by=r.text(pd_, "created_by", "provenance"),
        trained_from=r.when(pd_, "trained_from", "provenance"),
        trained_to=r.when(pd_, "trained_to", "provenance"),
    )


def _all_problems(r: _Reader, top: dict[str, Any], policy: Policy) -> list[Problem]:
    """What the reader refused, then what validation finds, then a checksum mismatch."""
    # A field the reader already refused (``"version": 5.0``) holds a placeholder: its
    # "must be between 1 and ..., got 0" would be a second, bogus problem.
    refused = {p.path for p in r.problems}
    problems = r.problems + [p for p in validate_policy(policy) if p.path not in refused]
    if not problems and "checksum" in top:
        cs = top["checksum"]
        if cs != policy.checksum:
            problems.append(
                Problem("checksum", f"does not match the content (file {cs!r}, computed "
                        f"{policy.checksum!r}): the file was edited or corrupted")
            )
    return problems


def loads(text: str | bytes) -> Policy:
    if len(text) > MAX_FILE_BYTES:
        raise PolicyValidationError([Problem("$", f"file larger than {MAX_FILE_BYTES} bytes")])
    try:
        data = json.loads(text, parse_constant=_reject_constant,
                          object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError) as e:
        raise PolicyValidationError([Problem("$", f"not valid JSON: {e}")]) from None
    return policy_from_dict(data)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of two equal keys: '"version": 2, "version": 99' applied v99,
    # while an unknown key is refused.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed in a policy file")
