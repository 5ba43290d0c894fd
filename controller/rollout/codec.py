"""Conversion between :mod:`controller.policy` values and their ``pdcontrol.v1`` messages.

Lossless both ways for every valid policy: ``policy_from_proto(policy_to_proto(p)) == p``.
Provenance timestamps travel as ``google.protobuf.Timestamp`` (UTC instants): an aware
datetime comes back as the same instant in UTC, which compares equal; a naive one is refused
because it names no instant.

Decoding is a router's first line of defence against hostile or broken messages: it never
raises anything but :class:`PolicyValidationError`, which lists every problem with its field
path (``routes[17]``, ``axes.qps[3]``, ``weights``); unspecified or unknown enum values and a
checksum that does not match the content are problems like any other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import UTC, datetime

from google.protobuf.timestamp_pb2 import Timestamp

from controller._proto.pdcontrol.v1 import policy_pb2 as pb
from controller._proto.pdcontrol.v1 import router_agent_service_pb2 as agent_pb
from controller.policy import (
    Axes,
    Decision,
    Features,
    LookupTable,
    Overrides,
    Policy,
    PolicyValidationError,
    Problem,
    Provenance,
    Reason,
    Route,
    Slo,
    Weights,
    validate_policy,
)

# gRPC message size limit on both sides (default is 4 MiB): the largest table, 64 x 64 x 64
# cells, is about 4.5 MB on the wire.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def too_large(size: int, limit: int = MAX_MESSAGE_BYTES) -> str:
    return (f"the policy is {size:,} bytes as a gRPC message, above the {limit:,}-byte "
            f"limit ({limit / 2**20:g} MiB; a long provenance.reason, or very fine axes?)")

# Wire value -> Route; anything else (0 = ROUTE_UNSPECIFIED, or a value from a newer schema)
# is refused by name.
_ROUTES: dict[int, Route] = {int(r): r for r in Route}
_REASONS: dict[str, Reason] = {r.value: r for r in Reason}


# -- timestamps --------------------------------------------------------------------------


def datetime_to_timestamp(value: datetime, path: str) -> Timestamp:
    if value.tzinfo is None or value.utcoffset() is None:
        raise PolicyValidationError(
            [Problem(path, "timestamp needs a time zone (naive datetimes name no instant)")]
        )
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def timestamp_to_datetime(ts: Timestamp) -> datetime:
    return ts.ToDatetime(tzinfo=UTC)


def epoch_to_timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    whole = math.floor(seconds)
    ts.seconds = whole
    ts.nanos = min(999_999_999, round((seconds - whole) * 1e9))
    return ts


def timestamp_to_epoch(ts: Timestamp) -> float:
    return ts.seconds + ts.nanos / 1e9


# -- policy ------------------------------------------------------------------------------


def policy_to_proto(policy: Policy, *, checksum: str | None = None) -> pb.Policy:
    """Encode a policy. It is not validated here (the receiver validates);
    ``checksum`` overrides the computed one (tests of the receiver's integrity check)."""
    t = policy.table
    msg = pb.Policy(
        version=policy.version,
        checksum=policy.checksum if checksum is None else checksum,
        axes=pb.Axes(
            context_tokens=t.axes.context_tokens, io_ratio=t.axes.io_ratio, qps=t.axes.qps
        ),
        weights=pb.Weights(wtft=policy.weights.wtft, wtpot=policy.weights.wtpot),
        slo=pb.Slo(ttft_s=policy.slo.ttft_s, tpot_s=policy.slo.tpot_s),
        overrides=pb.Overrides(
            first_turn_route=int(policy.overrides.first_turn_route),  # type: ignore[arg-type]
            bypass_append_tokens=policy.overrides.bypass_append_tokens,
            first_turn_busy_waiting=policy.overrides.first_turn_busy_waiting,
            later_turn_busy_waiting=policy.overrides.later_turn_busy_waiting,
        ),
        default_route=int(policy.default_route),  # type: ignore[arg-type]
    )
    msg.routes.extend(int(r) for r in t.routes)  # type: ignore[misc]
    msg.scores.extend(t.scores)
    msg.exploration.extend(t.exploration)
    pv = policy.provenance
    prov = msg.provenance
    prov.reason = pv.reason
    prov.created_by = pv.created_by
    for name in ("created_at", "trained_from", "trained_to"):
        value: datetime | None = getattr(pv, name)
        if value is not None:
            getattr(prov, name).CopyFrom(datetime_to_timestamp(value, f"provenance.{name}"))
    return msg


def _route(value: int, path: str, problems: list[Problem]) -> Route:
    route = _ROUTES.get(value)
    if route is None:
        what = "ROUTE_UNSPECIFIED" if value == 0 else f"unknown route value {value}"
        problems.append(Problem(path, f"{what}: expected ROUTE_PREFILL_NODE or ROUTE_DECODE_LOCAL"))
        return Route.PREFILL_NODE
    return route


def _routes(values: Iterable[int], problems: list[Problem]) -> tuple[Route, ...]:
    decoded = tuple(map(_ROUTES.get, values))
    if None not in decoded:
        return decoded  # type: ignore[return-value]
    out: list[Route] = []
    for i, (raw, route) in enumerate(zip(values, decoded, strict=True)):
        out.append(route if route is not None else _route(raw, f"routes[{i}]", problems))
    return tuple(out)


def _when(msg: pb.Provenance, name: str) -> datetime | None:
    return timestamp_to_datetime(getattr(msg, name)) if msg.HasField(name) else None  # type: ignore[arg-type]


def policy_from_proto(msg: pb.Policy) -> Policy:
    """Decode and validate; raise :class:`PolicyValidationError` listing every problem."""
    problems: list[Problem] = []
    for name in ("axes", "weights", "slo", "overrides"):
        if not msg.HasField(name):
            problems.append(Problem(name, "missing"))
    provenance = Provenance()
    if msg.HasField("provenance"):
        pv = msg.provenance
        try:
            provenance = Provenance(
                created_at=_when(pv, "created_at"),
                reason=pv.reason,
                created_by=pv.created_by,
                trained_from=_when(pv, "trained_from"),
                trained_to=_when(pv, "trained_to"),
            )
        except (ValueError, OverflowError) as e:  # a Timestamp outside datetime's range
            problems.append(Problem("provenance", f"timestamp out of range: {e}"))
    policy = Policy(
        version=msg.version,
        table=LookupTable(
            axes=Axes(
                context_tokens=tuple(msg.axes.context_tokens),
                io_ratio=tuple(msg.axes.io_ratio),
                qps=tuple(msg.axes.qps),
            ),
            routes=_routes(msg.routes, problems),
            scores=tuple(msg.scores),
            exploration=tuple(msg.exploration),
        ),
        weights=Weights(wtft=msg.weights.wtft, wtpot=msg.weights.wtpot),
        slo=Slo(ttft_s=msg.slo.ttft_s, tpot_s=msg.slo.tpot_s),
        overrides=Overrides(
            first_turn_route=_route(
                msg.overrides.first_turn_route, "overrides.first_turn_route", problems
            ),
            bypass_append_tokens=msg.overrides.bypass_append_tokens,
            first_turn_busy_waiting=msg.overrides.first_turn_busy_waiting,
            later_turn_busy_waiting=msg.overrides.later_turn_busy_waiting,
        ),
        default_route=_route(msg.default_route, "default_route", problems),
        provenance=provenance,
    )
    problems.extend(validate_policy(policy))
    if not problems:
        if not msg.checksum:
            problems.append(Problem("checksum", "missing"))
        elif msg.checksum != policy.checksum:
            problems.append(
                Problem(
                    "checksum",
                    f"does not match the content (message {msg.checksum!r}, computed "
                    f"{policy.checksum!r})",
                )
            )
    if problems:
        raise PolicyValidationError(problems)
    return policy


# -- agent service values ----------------------------------------------------------------


def features_to_proto(f: Features) -> agent_pb.Features:
    return agent_pb.Features(
        turn=int(f.turn),
        context_tokens=f.context_tokens,
        append_tokens=f.append_tokens,
        expected_output_tokens=f.expected_output_tokens,
        qps=f.qps,
        prefill_waiting=f.prefill_waiting,
    )


def features_from_proto(msg: agent_pb.Features) -> Features:
    """Features are never refused: bad values make ``decide()`` answer ``invalid_input``."""
    return Features(
        turn=msg.turn,
        context_tokens=msg.context_tokens,
        append_tokens=msg.append_tokens,
        expected_output_tokens=msg.expected_output_tokens,
        qps=msg.qps,
        prefill_waiting=msg.prefill_waiting if msg.HasField("prefill_waiting") else None,
    )


def decision_to_proto(d: Decision) -> agent_pb.Decision:
    msg = agent_pb.Decision(
        route=int(d.route),  # type: ignore[arg-type]
        reason=d.reason.value,
        explored=d.explored,
    )
    if d.cell is not None:
        msg.cell.CopyFrom(agent_pb.Cell(context_bin=d.cell[0], io_bin=d.cell[1], qps_bin=d.cell[2]))
    return msg


def decision_from_proto(msg: agent_pb.Decision) -> Decision:
    """Raise :class:`PolicyValidationError` for an unspecified route or an unknown reason."""
    problems: list[Problem] = []
    route = _route(msg.route, "decision.route", problems)
    reason = _REASONS.get(msg.reason)
    if reason is None:
        problems.append(
            Problem("decision.reason", f"unknown reason {msg.reason!r}: one of {sorted(_REASONS)}")
        )
    if problems:
        raise PolicyValidationError(problems)
    assert reason is not None
    cell = None
    if msg.HasField("cell"):
        cell = (msg.cell.context_bin, msg.cell.io_bin, msg.cell.qps_bin)
    return Decision(route=route, cell=cell, reason=reason, explored=msg.explored)
