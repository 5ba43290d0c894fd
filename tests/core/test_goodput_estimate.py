"""The goodput estimate's corrections (issue 5/7 diagnosis, docs/learning.md):
turn 1's share of context bin 0, the probit shift of P(met), the drift onset and the
post-change windows a drift or scaling calibration trains on."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from controller.core.calibrate import CalibrationConfig, table_grid
from controller.core.drift import DetectorState, drift_onset
from controller.core.features import N_IO_BINS, build_training_set, first_turn_share
from controller.core.latency_model import fit_latency_model, training_scenario
from controller.core.trigger import Cause, Trigger
from controller.core.window import RouteOutcome, Window, WorkerStats
from controller.loop.learning import shape_change
from controller.policy.model import Route, Slo
from tests.core.synth import Mix, Truth, make_window, training_windows

SLO = Slo(ttft_s=1.0, tpot_s=0.05)
START = 1_700_000_000.0
# Cells of context bin 0 (where turn 1 lands) next to cells the table decides.
MIX = Mix({(0, 5): 0.3, (0, 7): 0.2, (3, 2): 0.25, (5, 4): 0.25})


def _forced_runs(turn1: float, n: int = 40) -> list[Window]:
    """An all-prefill-node run, then an all-decode-local run in which ``turn1`` of each
    context-bin-0 cell still goes to a prefill node (the turn-1 override)."""
    rng = np.random.default_rng(3)
    k, _ = MIX.arrays()
    local = np.where(k // N_IO_BINS == 0, 1.0 - turn1, 1.0)
    out = [make_window(Truth(), MIX, 2.0, 0.0, rng, START + i * 30.0, slo=SLO)[0]
           for i in range(n)]
    out += [make_window(Truth(), MIX, 2.0, local, rng, START + (n + i) * 30.0, slo=SLO)[0]
            for i in range(n)]
    return out


@pytest.mark.parametrize("turn1", [0.3, 0.7])
def test_first_turn_share_is_recovered_from_the_decode_local_run(turn1: float) -> None:
    ts = build_training_set(_forced_runs(turn1))
    share = first_turn_share(ts)
    assert share[5] == pytest.approx(turn1, abs=0.06)
    assert share[7] == pytest.approx(turn1, abs=0.06)
    # Context bins other than 0 hold no turn 1: the table's grid keeps them movable.
    grid = table_grid(ts, CalibrationConfig().axes, ts.n_windows)
    assert grid.forced_p is not None and grid.forced_l is not None
    assert grid.forced_p[5] == pytest.approx(turn1, abs=0.06)
    assert grid.forced_p[3 * 10 + 2] == 0.0
    # Turn 1 decode-local moves exactly that share to the other route.
    flipped = grid.with_first_turn(Route.DECODE_LOCAL)
    assert flipped.forced_p is not None and flipped.forced_l is not None
    assert flipped.forced_p[5] == pytest.approx(0.0, abs=1e-12)
    assert flipped.forced_l[5] == pytest.approx(grid.forced_p[5])


def _with_met_scaled(windows: list[Window], route: Route, factor: float) -> list[Window]:
    """The same windows with ``route``'s requests meeting the SLOs ``factor`` times as often
    (a heavier tail than the log-normal spread around the mean explains)."""
    out = []
    for w in windows:
        rows = [dataclasses.replace(o, met=o.met * factor) if o.route is route else o
                for o in w.outcomes]
        out.append(Window.build(w.start, w.end, w.interval_s, w.workers, rows, w.workload,
                                source=w.source))
    return out


def _predicted_met(model: object, ts: object) -> np.ndarray:
    sc, column = training_scenario(ts)  # type: ignore[arg-type]
    pred = model.predict(sc)  # type: ignore[attr-defined]
    p = model.met_probability(pred, sc, SLO.ttft_s, SLO.tpot_s)  # type: ignore[attr-defined]
    return p[ts.row_window, column[ts.row_cell], ts.row_route]  # type: ignore[attr-defined]


def test_goodput_shift_matches_observed_met_per_route() -> None:
    windows = _with_met_scaled(training_windows(Truth(), Mix(), 120, seed=5, slo=SLO),
                               Route.PREFILL_NODE, 0.6)
    ts = build_training_set(windows)
    model = fit_latency_model(ts, SLO.ttft_s, SLO.tpot_s)
    assert model.goodput_shift is not None
    p = _predicted_met(model, ts)
    for col in (0, 1):
        sel = ts.row_route == col
        observed = ts.row_met[sel].sum() / ts.row_requests[sel].sum()
        predicted = float(np.sum(ts.row_requests[sel] * p[sel]) / ts.row_requests[sel].sum())
        assert predicted == pytest.approx(observed, abs=0.02), (col, predicted, observed)
    # Without the shift the same model misses the prefill node's SLO attainment badly.
    plain = dataclasses.replace(model, goodput_shift=None)
    p0 = _predicted_met(plain, ts)
    sel = ts.row_route == 0
    observed = ts.row_met[sel].sum() / ts.row_requests[sel].sum()
    assert float(np.sum(ts.row_requests[sel] * p0[sel]) / ts.row_requests[sel].sum()) \
        > observed + 0.1


def test_drift_onset_is_the_last_window_within_threshold() -> None:
    history = ((10.0, 0.2), (20.0, 0.9), (30.0, 1.3), (40.0, float("nan")), (50.0, 1.6))
    assert drift_onset(DetectorState(history=history), 1.0) == 20.0
    assert drift_onset(DetectorState(history=history), 0.5) == 10.0
    assert drift_onset(DetectorState(history=((10.0, 2.0), (20.0, 3.0))), 1.0) is None


def _shaped(start: float, n_prefill: int, n_decode: int) -> Window:
    workers = [WorkerStats(worker=f"p{i}", role="prefill") for i in range(n_prefill)]
    workers += [WorkerStats(worker=f"d{i}", role="decode") for i in range(n_decode)]
    outcome = RouteOutcome("r", Route.PREFILL_NODE, 1, 1, 10, 10, 1.0, 10, 0.1, 10)
    return Window.build(start, start + 30.0, 30.0, workers, [outcome])


def test_shape_change_finds_the_first_window_of_the_current_worker_counts() -> None:
    windows = [_shaped(30.0 * i, 2 if i < 5 else 1, 6) for i in range(8)]
    assert shape_change(windows) == 150.0
    assert shape_change([_shaped(30.0 * i, 2, 6) for i in range(4)]) is None


def test_a_scaling_calibration_learns_from_the_windows_after_the_change() -> None:
    from controller.config import load_settings
    from controller.loop.learning import MIN_MIX_WINDOWS, MIN_REGIME_WINDOWS, CoreLearner

    learner = CoreLearner(load_settings())
    long_after = [_shaped(30.0 * i, 2 if i < 5 else 1, 6) for i in range(5 + MIN_REGIME_WINDOWS)]
    windows, config, regime_only = learner._regime(long_after, Cause(Trigger.SCALING))
    assert regime_only
    assert [w.start for w in windows] == [w.start for w in long_after[5:]]
    assert config.recent_windows == MIN_REGIME_WINDOWS
    # Too few windows since the change: train on all, take the mix from the newest ones.
    just_after = long_after[:7]
    windows, config, regime_only = learner._regime(just_after, Cause(Trigger.SCALING))
    assert len(windows) == 7 and config.recent_windows == MIN_MIX_WINDOWS and not regime_only
    # A scheduled calibration is not about a change: everything, default mix.
    windows, config, regime_only = learner._regime(long_after, Cause(Trigger.SCHEDULE))
    assert len(windows) == len(long_after) and config.recent_windows == 20 and not regime_only


def test_a_drift_older_than_every_window_makes_them_all_the_new_regime() -> None:
    # A drift older than the training set: every window is from since it began, so a
    # verdict on them is about the new regime (a refusal renews the reference).
    from controller.config import load_settings
    from controller.loop.learning import MIN_REGIME_WINDOWS, CoreLearner

    learner = CoreLearner(load_settings())
    windows = [_shaped(300.0 + 30.0 * i, 2, 6) for i in range(MIN_REGIME_WINDOWS)]
    learner._drift_onset = 120.0
    DRIFT = Cause(Trigger.DRIFT, "workload")
    trained, config, regime_only = learner._regime(windows, DRIFT)
    assert regime_only and len(trained) == len(windows)
    assert config.recent_windows == 20  # the default mix: every window is the new regime
    _, _, thin = learner._regime(windows[:-1], DRIFT)
    assert not thin, "fewer than MIN_REGIME_WINDOWS are too few to judge a regime on"
    learner._drift_onset = None
    assert not learner._regime(windows, DRIFT)[2], "no onset known: not a regime"
