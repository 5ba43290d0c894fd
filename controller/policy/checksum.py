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
    t = policy.table
    parts: list[bytes] = [MAGIC]
    for edges in (t.axes.context_tokens, t.axes.io_ratio, t.axes.qps):
        parts.append(struct.pack("<I", len(edges)))
        parts.extend(_f64(e) for e in edges)
    for route, score, expl in zip(t.routes, t.scores, t.exploration, strict=True):
        parts.append(struct.pack("<B", int(route)))
        parts.append(_f64(score))
        parts.append(_f64(expl))
    parts.append(_f64(policy.weights.wtft))
    parts.append(_f64(policy.weights.wtpot))
    parts.append(struct.pack("<B", int(policy.overrides.first_turn_route)))
    parts.append(struct.pack("<Q", int(policy.overrides.bypass_append_tokens)))
    parts.append(struct.pack("<B", int(policy.default_route)))
    return b"".join(parts)


def policy_checksum(policy: Policy) -> str:
    """Hex sha256 of :func:`canonical_bytes`."""
    return hashlib.sha256(canonical_bytes(policy)).hexdigest()
