"""Windows → training set: the outcome rows come from the windows' packed columns.

The expected numbers are summed here from the RouteOutcome objects, one by one, so the
vectorised path over the columns is checked against the plain meaning of the fields.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict

import numpy as np
import pytest

from controller.core.features import N_CTX_BINS, N_IO_BINS, build_training_set
from controller.core.window import RouteOutcome, Window, Workload
from controller.policy.model import Route

COLUMN = {Route.PREFILL_NODE: 0, Route.DECODE_LOCAL: 1}


def _windows(seed: int, n: int = 6) -> list[Window]:
    rng = random.Random(seed)
    out = []
    for w in range(n):
        outcomes = []
        for router in ("router-a", "router-b", "router-c"):
            for _ in range(rng.randint(0, 12)):
                requests = float(rng.randint(0, 40))
                outcomes.append(RouteOutcome(
                    router, rng.choice(list(Route)),
                    rng.randint(0, N_CTX_BINS + 2),  # past the last bin: clipped into it
                    rng.randint(0, N_IO_BINS + 2),
                    requests, float(rng.randint(0, int(requests))),
                    requests * rng.random(), requests, requests * rng.random() * 0.05, requests,
                ))
        qps = {"router-a": rng.random() * 5} if w % 2 else {}
        out.append(Window.build(1.8e9 + 30 * w, 1.8e9 + 30 * (w + 1), 30.0,
                                outcomes=outcomes, workload=Workload(qps_by_router=qps)))
    return out


def _expected(windows: list[Window]) -> dict[tuple[int, int, int], list[float]]:
    sums: dict[tuple[int, int, int], list[float]] = defaultdict(lambda: [0.0] * 6)
    for i, w in enumerate(windows):
        for o in w.outcomes:
            cell = min(o.ctx_bin, N_CTX_BINS - 1) * N_IO_BINS + min(o.io_bin, N_IO_BINS - 1)
            acc = sums[(i, cell, COLUMN[o.route])]
            for j, v in enumerate((o.requests, o.met, o.ttft_sum, o.ttft_count, o.tpot_sum,
                                   o.tpot_count)):
                acc[j] += v
    return sums


@pytest.mark.parametrize("seed", [1, 2])
def test_outcome_rows_sum_each_window_cell_and_route_over_routers(seed: int) -> None:
    windows = _windows(seed)
    ts = build_training_set(windows)
    expected = _expected(windows)
    got = {
        (int(w), int(c), int(r)): i
        for i, (w, c, r) in enumerate(zip(ts.row_window, ts.row_cell, ts.row_route, strict=True))
    }
    assert got.keys() == expected.keys()
    for key, (req, met, ttft_sum, ttft_n, tpot_sum, tpot_n) in expected.items():
        i = got[key]
        assert ts.row_requests[i] == pytest.approx(req)
        assert ts.row_met[i] == pytest.approx(met)
        if ttft_n > 0:
            assert ts.row_ttft[i] == pytest.approx(ttft_sum / ttft_n)
            assert ts.row_tpot[i] == pytest.approx(tpot_sum / tpot_n)
        else:
            assert np.isnan(ts.row_ttft[i]) and np.isnan(ts.row_tpot[i])
        w, cell, col = key
        assert ts.rate[w, cell, col] == pytest.approx(req / 30.0)
    assert ts.rate.sum() == pytest.approx(sum(v[0] for v in expected.values()) / 30.0)
    for i, w in enumerate(windows):  # qps: the routers' own, else requests over the interval
        total = sum(o.requests for o in w.outcomes)
        want = sum(w.workload.qps_by_router.values()) or total / 30.0
        assert ts.cluster_qps[i] == pytest.approx(want)


def test_windows_read_back_from_the_stored_form_give_the_same_training_set() -> None:
    windows = _windows(3, n=8)
    stored = [Window.from_dict(json.loads(json.dumps(w.to_dict(compact=True))))
              for w in windows]
    a, b = build_training_set(windows), build_training_set(stored)
    for name in ("rate", "row_window", "row_cell", "row_route", "row_requests", "row_met",
                 "row_ttft", "row_tpot", "cluster_qps", "goodput"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
