"""Canonical byte encoding and sha256 checksum of a policy's decision-relevant fields.

The encoding is documented in ``docs/policy-format.md`` so routers in other languages can
reproduce it; ``controller/policy/test_vector.json`` publishes one policy with its bytes'
digest. Everything is little-endian; floats are IEEE-754 binary64 with ``-0.0`` written as
``0.0``.

    magic        8 bytes  b"PDPOL\\x00\\x01\\x00"   (format 1)
    for each axis in (context_tokens, io_ratio, qps):
        u32 n, then n x f64 edges
    for each cell in C order (context, io_ratio, qps):
        u8 route (1 = PREFILL_NODE, 2 = DECODE_LOCAL), f64 score, f64 exploration
    f64 wtft, f64 wtpot
    u8 first_turn_route, u64 bypass_append_tokens
    u8 default_route
    u32 first_turn_busy_waiting    only when it or later_turn_busy_waiting is not 0
    u32 later_turn_busy_waiting    only when it is not 0

The trailing fields are left out when zero, so a policy without busy overrides keeps the
checksum it has under the format without them (routers and stores hold such checksums); the
lengths tell the two apart.

The version, the SLOs and the provenance are not covered: re-issuing the same table under a
higher version keeps its checksum.
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controller.policy.model import Policy

MAGIC = b"PDPOL\x00\x01\x00"


def _f64(x: float) -> bytes:
    return struct.pack("<d", 0.0 if x == 0 else float(x))


def canonical_bytes(policy: Policy) -> bytes:
    # One struct.pack per section: routers hash a policy on every update, so this runs
    # 1000s of cells at a time. ``x + 0.0`` turns -0.0 into 0.0 and leaves every other value
    # (NaN and infinities included) as it is, exactly like _f64.
    t = policy.table
    parts: list[bytes] = [MAGIC]
    for edges in (t.axes.context_tokens, t.axes.io_ratio, t.axes.qps):
        parts.append(struct.pack(f"<I{len(edges)}d", len(edges), *[e + 0.0 for e in edges]))
    n = len(t.routes)
    if not len(t.scores) == n == len(t.exploration):
        raise ValueError("routes, scores and exploration differ in length")
    cells: list[float] = [0.0] * (3 * n)
    cells[0::3] = [int(r) for r in t.routes]
    cells[1::3] = [s + 0.0 for s in t.scores]
    cells[2::3] = [e + 0.0 for e in t.exploration]
    parts.append(struct.pack("<" + "Bdd" * n, *cells))
    parts.append(_f64(policy.weights.wtft))
    parts.append(_f64(policy.weights.wtpot))
    parts.append(struct.pack("<B", int(policy.overrides.first_turn_route)))
    parts.append(struct.pack("<Q", int(policy.overrides.bypass_append_tokens)))
    parts.append(struct.pack("<B", int(policy.default_route)))
    o = policy.overrides
    if o.later_turn_busy_waiting:
        parts.append(struct.pack("<II", int(o.first_turn_busy_waiting),
                                 int(o.later_turn_busy_waiting)))
    elif o.first_turn_busy_waiting:
        parts.append(struct.pack("<I", int(o.first_turn_busy_waiting)))
    return b"".join(parts)


def policy_checksum(policy: Policy) -> str:
    """Hex sha256 of :func:`canonical_bytes`."""
    return hashlib.sha256(canonical_bytes(policy)).hexdigest()
