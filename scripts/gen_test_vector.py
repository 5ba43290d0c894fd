"""Regenerate controller/policy/test_vector.json (the published checksum test vector).

    python scripts/gen_test_vector.py > controller/policy/test_vector.json
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime

from controller.policy import (
    Axes,
    LookupTable,
    Overrides,
    Policy,
    Provenance,
    Route,
    Slo,
    Weights,
    canonical_bytes,
    policy_to_dict,
)


def vector_policy() -> Policy:
    axes = Axes(context_tokens=(2048.0,), io_ratio=(1.0, 8.0), qps=(4.0,))
    table = LookupTable(
        axes,
        (Route.DECODE_LOCAL, Route.PREFILL_NODE),
        (0.25, -0.0),  # -0.0 must encode as 0.0
        (0.1, 0.0),
    )
    return Policy(
        version=42,
        table=table,
        weights=Weights(1.5, 1.0),
        slo=Slo(2.0, 0.1),
        overrides=Overrides(Route.PREFILL_NODE, 64),
        default_route=Route.PREFILL_NODE,
        provenance=Provenance(
            created_at=datetime(2026, 11, 30, tzinfo=UTC), reason="test vector", created_by="docs"
        ),
    )


def main() -> None:
    p = vector_policy()
    out = {
        "description": "Checksum test vector: canonical_bytes_hex is the canonical encoding "
        "of 'policy' (docs/policy-format.md); sha256 of those bytes is 'checksum'.",
        "policy": policy_to_dict(p),
        "canonical_bytes_hex": canonical_bytes(p).hex(),
        "checksum": p.checksum,
    }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
