"""Hypothesis strategies for policies and features (shared by policy and rollout tests)."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import strategies as st

from controller.policy import Axes, LookupTable, Overrides, Policy, Provenance, Route, Slo, Weights


@st.composite
def edges(draw: st.DrawFn, max_size: int = 6) -> tuple[float, ...]:
    values = draw(
        st.lists(
            st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False),
            min_size=1,
            max_size=max_size,
            unique=True,
        )
    )
    return tuple(sorted(values))


routes = st.sampled_from(list(Route))
timestamps = st.none() | st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)
)


@st.composite
def policies(draw: st.DrawFn, max_edges: int = 6) -> Policy:
    axes = Axes(draw(edges(max_edges)), draw(edges(max_edges)), draw(edges(max_edges)))
    n = axes.n_cells
    table = LookupTable(
        axes,
        tuple(draw(st.lists(routes, min_size=n, max_size=n))),
        tuple(
            draw(
                st.lists(
                    st.floats(-10, 10, allow_nan=False, allow_infinity=False),
                    min_size=n,
                    max_size=n,
                )
            )
        ),
        tuple(draw(st.lists(st.floats(0, 0.2), min_size=n, max_size=n))),
    )
    return Policy(
        version=draw(st.integers(1, 2**62)),
        table=table,
        weights=Weights(draw(st.floats(0.01, 100)), draw(st.floats(0.01, 100))),
        slo=Slo(draw(st.floats(0.01, 60)), draw(st.floats(0.001, 5))),
        overrides=Overrides(draw(routes), draw(st.integers(0, 4096)),
                            draw(st.sampled_from([0, 0, 1, 2, 5, 2**32 - 1])),
                            draw(st.sampled_from([0, 0, 1, 3, 2**32 - 1]))),
        default_route=draw(routes),
        provenance=Provenance(
            created_at=draw(timestamps),
            reason=draw(st.text(max_size=40)),
            created_by=draw(st.text(max_size=20)),
            trained_from=draw(timestamps),
            trained_to=draw(timestamps),
        ),
    )


any_float = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-10, 10**7)
