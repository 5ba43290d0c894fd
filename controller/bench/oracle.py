"""Tables calibrated from observed windows, and the hindsight oracle.

``calibrated_table`` runs :func:`controller.core.calibrate.calibrate` (the learning core's
real calibration: latency model, fixed point under the table's own load) with the weights
pinned, on windows recorded while forced policies ran. ``ppd-static`` is the table built this
way from an active calibration's grid with weights (1, 1); the oracle's candidates add, per
phase, tables built from that phase's own windows with wtft:wtpot of 1:4, 1:2, 1:1, 2:1 and
4:1.

The oracle picks, for every phase, the candidate with the highest goodput measured on that
phase (hindsight: it may pick a different candidate in every phase); its per-request records
are the union of the chosen candidates' records of their phases.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from controller.core.window import Window
from controller.policy import Overrides, Policy, Slo, Weights
from controller.sim.run import RequestRecord, RunResult

if TYPE_CHECKING:
    from controller.core.calibrate import CalibrationResult

# wtft:wtpot ratios of the oracle's per-phase tables.
ORACLE_RATIOS: tuple[tuple[float, float], ...] = ((1, 4), (1, 2), (1, 1), (2, 1), (4, 1))


def ratio_key(wtft: float, wtpot: float) -> str:
    return f"table-{wtft:g}:{wtpot:g}"


def calibrated_table(windows: Sequence[Window], slo: Slo, weights: Weights, version: int,
                     reason: str, tune_first_turn: bool = True,
                     overrides: Overrides | None = None) -> Policy:
    """:func:`calibrated_result`'s table."""
    return calibrated_result(windows, slo, weights, version, reason, tune_first_turn,
                             overrides)[0]


def calibrated_result(windows: Sequence[Window], slo: Slo, weights: Weights, version: int,
                      reason: str, tune_first_turn: bool = True,
                      overrides: Overrides | None = None
                      ) -> tuple[Policy, CalibrationResult, list[Window]]:
    """A table from ``windows`` (any order; sorted by end time) with ``weights`` pinned, the
    calibration's result and the windows it used (sorted).
    ``tune_first_turn=False`` keeps turn 1 on a prefill node (the PPD paper's table);
    ``overrides``: the rules before the table (default: none).

    Raises :class:`controller.core.calibrate.CalibrationError` when the windows cannot
    support a fit (fewer than 2 windows with routed requests)."""
    from controller.core.calibrate import CalibrationConfig, calibrate

    usable = sorted((w for w in windows if w.outcomes and not w.failures),
                    key=lambda w: (w.end, w.start))
    # The whole phase is "the current mix" of a table calibrated in hindsight for it.
    cfg = CalibrationConfig(slo=slo, pinned_weights=weights,
                            recent_windows=max(len(usable), 1),
                            tune_first_turn=tune_first_turn,
                            overrides=overrides or Overrides())
    now = usable[-1].end if usable else 0.0
    result = calibrate(usable, now, None, cfg, reason=reason)
    return result.policy.with_version(version), result, usable


def windows_in(windows: Sequence[Window], start: float, end: float) -> list[Window]:
    """Windows lying inside ``[start, end]`` (a window straddling a boundary is left out:
    it mixes two phases)."""
    return [w for w in windows if w.start >= start - 1e-9 and w.end <= end + 1e-9]


@dataclass(frozen=True, slots=True)
class OraclePick:
    phase: int
    policy: str  # the candidate chosen for this phase
    goodput: float | None


def phase_goodputs(result: RunResult) -> list[tuple[int, int]]:
    """(requests meeting both SLOs, requests) per phase."""
    out = [[0, 0] for _ in result.phases]
    for r in result.records:
        cell = out[r.phase]
        cell[1] += 1
        if _met(r, result.ttft_slo_s, result.tpot_slo_s):
            cell[0] += 1
    return [(a, b) for a, b in out]


def _met(r: RequestRecord, ttft_slo: float, tpot_slo: float) -> bool:
    if r.rejected or r.ttft_s is None:
        return False
    return r.ttft_s <= ttft_slo and (r.tpot_s is None or r.tpot_s <= tpot_slo)


def pick_per_phase(candidates: Mapping[str, RunResult]) -> list[OraclePick]:
    """For every phase, the candidate with the highest measured goodput (ties: the first
    in ``candidates`` order)."""
    if not candidates:
        raise ValueError("the oracle needs at least one candidate")
    n_phases = len(next(iter(candidates.values())).phases)
    per = {k: phase_goodputs(res) for k, res in candidates.items()}
    picks = []
    for i in range(n_phases):
        best_key, best = None, -1.0
        for key, cells in per.items():
            met, n = cells[i]
            g = met / n if n else -1.0
            if best_key is None or g > best:  # a phase with no requests: the first one
                best_key, best = key, g
        assert best_key is not None
        picks.append(OraclePick(i, best_key, best if best >= 0 else None))
    return picks


def oracle_records(candidates: Mapping[str, RunResult], picks: Sequence[OraclePick]
                   ) -> list[RequestRecord]:
    chosen = {p.phase: p.policy for p in picks}
    out: list[RequestRecord] = []
    for phase, key in sorted(chosen.items()):
        out.extend(r for r in candidates[key].records if r.phase == phase)
    return out
