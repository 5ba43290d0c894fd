"""Tuned knobs for routers that keep their own rule: the best rule of a peer's form.

NVIDIA Dynamo and llm-d decide prefill-node vs decode-local with a static threshold rule,
not a table. For users who keep their router, this module fits the threshold of each peer's
own form by the calibrator's objective — predicted goodput (the share of requests meeting
both SLOs) of the latency model, at the stored windows' own mix of contexts, io ratios and
loads (:func:`controller.core.calibrate.evaluated_goodput`) — and reports it beside the
predicted goodput of the full table, i.e. what keeping the simpler rule gives up.

Rule forms (sources: ``docs/adopting.md``, which cites the peers' documentation and code):

- **llm-d** ``prefix-based-pd-decider``: disaggregate iff the request's non-cached prompt
  tokens ``>= nonCachedTokens``; ``nonCachedTokens <= 0`` means always disaggregate. A later
  turn's non-cached tokens are its append (the decode worker holds the conversation), a
  first turn's its whole prompt: the rule decides every request, turn 1 included.
- **Dynamo** KV router conditional disaggregation (``--router-conditional-disagg-config``,
  policy ``isl_bounding``): decode-local iff effective ISL (prompt minus the cached prefix)
  ``< eff_isl_threshold`` **and** effective / raw ISL ``< eff_isl_ratio_threshold``. A turn 1
  has a ratio of 1, so with a ratio threshold <= 1 it always goes to a prefill node.

A rule is evaluated on the calibration grid's ``(context, io ratio)`` cells: each cell routes
all its traffic one way, by its representative append (``ratio x output tokens``) and context.
Only thresholds between the appends of cells that carry traffic change the routing, so those
are the candidates (plus "always" and "never"); every threshold in the reported range
``[low, high)`` routes the windows alike, the exported value is their geometric middle.
Exploration is not part of a peer's rule; the table is evaluated with its own.

Pure: a model, a grid and a policy in; a :class:`PeerExport` out.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from controller.core.calibrate import TableGrid, evaluated_goodput, policy_routes_on
from controller.core.features import FloatArray
from controller.core.latency_model import LatencyModel
from controller.policy.model import Policy, Route, Slo

# Ratio thresholds the Dynamo fit tries (effective / raw ISL of a request).
DYNAMO_RATIOS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# Predicted goodputs closer than this are a tie (far below the model's own error): the rule
# moving the fewest requests decode-local wins.
TIE = 1e-4

DYNAMO_TARGET = ("NVIDIA Dynamo KV router conditional disaggregation (Dynamo 1.6: frontend "
                 "--router-conditional-disagg --router-conditional-disagg-config, policy "
                 "isl_bounding; keys eff_isl_threshold, eff_isl_ratio_threshold)")
LLMD_TARGET = ("llm-d inference scheduler prefix-based-pd-decider (parameter "
               "nonCachedTokens; <= 0 always disaggregates)")

Mask = NDArray[np.bool_]
Evaluate = Callable[[Mask], float]  # decode-local per (ctx, io) cell -> predicted goodput


class PeerFormat(enum.StrEnum):
    DYNAMO = "dynamo"
    LLM_D = "llm-d"


@dataclass(frozen=True, slots=True)
class RuleCells:
    """The ``(context, io ratio)`` cells a rule decides, with their traffic share."""

    append: FloatArray  # [K] non-cached (append) tokens
    context: FloatArray  # [K] cached context tokens
    mix: FloatArray  # [K] share of requests
    # [K] share of each cell's requests the rule decides (None: all; Dynamo: not turn 1)
    movable: FloatArray | None = None

    @property
    def seen(self) -> Mask:
        out: Mask = self.mix > 0
        return out

    @property
    def cached_ratio(self) -> FloatArray:
        """Effective / raw ISL: the share of the prompt the decode worker must compute."""
        raw = self.context + self.append
        out: FloatArray = np.where(raw > 0, self.append / np.where(raw > 0, raw, 1.0), 1.0)
        return out


@dataclass(frozen=True, slots=True)
class RuleFit:
    """The best rule of one form: decode-local iff ``append < threshold`` (and, for Dynamo,
    ``cached_ratio < ratio``)."""

    threshold: float  # the exported value (tokens): 0 = always a prefill node
    low: float  # every threshold in (low, high] routes the windows' cells alike
    high: float  # inf: above every append seen (never a prefill node, ratio permitting)
    ratio: float | None  # Dynamo's eff_isl_ratio_threshold (None for llm-d)
    predicted_goodput: float
    local_share: float  # share of requests the rule sends decode-local
    evaluated: int  # candidate rules evaluated


def threshold_candidates(cells: RuleCells) -> list[tuple[float, float]]:
    """``(low, high]`` intervals of thresholds that route the traffic-carrying cells alike,
    lowest first: ``(0, a1]`` sends all of them to a prefill node, ``(a_n, inf)`` none
    (``a1`` < ... < ``a_n``: their distinct appends)."""
    appends = sorted({float(a) for a in cells.append[cells.seen]})
    bounds = [0.0, *appends, math.inf]
    return list(itertools.pairwise(bounds))


def exported_threshold(low: float, high: float) -> float:
    """A round value in ``(low, high]``: 0 for "always a prefill node"; the geometric middle
    between two appends; twice the largest append for "never"."""
    if low <= 0.0:
        return 0.0
    if math.isinf(high):
        return float(math.ceil(2.0 * low))
    mid = float(math.ceil(math.sqrt(low * high)))
    return min(max(mid, math.floor(low) + 1.0), high)


def fit_threshold(cells: RuleCells, evaluate: Evaluate,
                  ratios: tuple[float, ...] | None = None) -> RuleFit:
    """The candidate with the highest predicted goodput. Candidates within :data:`TIE` of it
    are equally good for the model; of those, the one sending the fewest requests
    decode-local (then the lower threshold, then the lower ratio) wins, so a flat optimum
    gives a stable answer that moves the least traffic off the peer's default of always
    disaggregating. ``ratios`` None: llm-d's form (no ratio clause)."""
    cache: dict[bytes, float] = {}
    ratio_ok = cells.cached_ratio
    total = max(float(cells.mix.sum()), 1e-300)
    moved = cells.mix if cells.movable is None else cells.mix * cells.movable
    found: list[RuleFit] = []
    for ratio in ratios if ratios is not None else (None,):
        for low, high in threshold_candidates(cells):
            threshold = exported_threshold(low, high)
            mask: Mask = cells.append < threshold
            if ratio is not None:
                mask = mask & (ratio_ok < ratio)
            key = mask.tobytes()
            g = cache.get(key)
            if g is None:
                g = cache[key] = float(evaluate(mask))
            share = float(moved[mask].sum()) / total
            found.append(RuleFit(threshold, low, high, ratio, g, share, 0))
    top = max(f.predicted_goodput for f in found)
    best = min((f for f in found if f.predicted_goodput >= top - TIE),
               key=lambda f: (round(f.local_share, 12), f.threshold, f.ratio or 0.0))
    return replace(best, evaluated=len(cache))


def rule_cells(grid: TableGrid, form: PeerFormat = PeerFormat.LLM_D) -> RuleCells:
    forced = rule_grid(grid, form).forced_p
    return RuleCells(append=grid.ratio * grid.output_tokens, context=grid.context.copy(),
                     mix=grid.mix.copy(), movable=None if forced is None else 1.0 - forced)


def rule_grid(grid: TableGrid, form: PeerFormat) -> TableGrid:
    """``grid`` with the rule deciding its traffic: llm-d's rule decides every request; in
    Dynamo's, turn 1 (effective = raw ISL, ratio 1) always goes to a prefill node."""
    zeros = np.zeros_like(grid.mix)
    if form is PeerFormat.DYNAMO and grid.first_turn is not None:
        return replace(grid, forced_p=grid.first_turn.copy(), forced_l=zeros,
                       first_turn_route=Route.PREFILL_NODE)
    return replace(grid, forced_p=zeros, forced_l=zeros)


def goodput_of_rules(model: LatencyModel, grid: TableGrid, slo: Slo,
                     form: PeerFormat) -> Evaluate:
    """Predicted goodput of routing each cell's rule-decided traffic decode-local per
    ``mask``, at the windows' own loads (the calibrator's objective)."""
    g = rule_grid(grid, form)

    def evaluate(mask: Mask) -> float:
        return evaluated_goodput(model, g, mask.astype(bool), 0.0, slo)

    return evaluate


@dataclass(frozen=True, slots=True)
class PeerExport:
    """A fitted rule in a peer's form, and what the full table would give instead."""

    form: PeerFormat
    policy_version: int
    rule: RuleFit
    table_goodput: float  # the policy's table (overrides and exploration included)
    always_prefill_goodput: float  # the peer's default of always disaggregating
    # The same table with no exploration: a rule explores nothing, so the difference to
    # ``table_goodput`` is what the table's exploration costs, not a better routing.
    table_unexplored_goodput: float

    @property
    def given_up(self) -> float:
        """Predicted goodput the rule gives up against the table (negative: it gains)."""
        return self.table_goodput - self.rule.predicted_goodput

    def to_dict(self) -> dict[str, Any]:
        r = self.rule
        return {
            "format": self.form.value, "target": target(self.form),
            "policy_version": self.policy_version,
            "threshold_tokens": r.threshold, "threshold_range": [r.low, _json_num(r.high)],
            "ratio_threshold": r.ratio, "decode_local_share": r.local_share,
            "predicted_goodput": {"rule": r.predicted_goodput, "table": self.table_goodput,
                                  "table_unexplored": self.table_unexplored_goodput,
                                  "always_prefill": self.always_prefill_goodput,
                                  "given_up": self.given_up},
            "candidates_evaluated": r.evaluated,
        }


def target(form: PeerFormat) -> str:
    return DYNAMO_TARGET if form is PeerFormat.DYNAMO else LLMD_TARGET


def _json_num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def export_rule(model: LatencyModel, grid: TableGrid, policy: Policy, slo: Slo,
                form: PeerFormat) -> PeerExport:
    """Fit ``form``'s best rule on ``grid`` (the windows' mix, laid on ``policy``'s cells)
    and predict the goodput of ``policy``'s own table on the same grid."""
    evaluate = goodput_of_rules(model, grid, slo, form)
    cells = rule_cells(grid, form)
    rule = fit_threshold(cells, evaluate, DYNAMO_RATIOS if form is PeerFormat.DYNAMO else None)
    routes, exploration = policy_routes_on(policy, grid)
    table = evaluated_goodput(model, grid, routes, exploration, slo)
    unexplored = evaluated_goodput(model, grid, routes, 0.0, slo)
    always = evaluate(np.zeros_like(cells.seen))
    return PeerExport(form, policy.version, rule, table, always, unexplored)


def llmd_non_cached_tokens(threshold: float, traffic_chars_per_token: float,
                           llmd_chars_per_token: float) -> int:
    """The ``nonCachedTokens`` to configure: llm-d estimates a prompt's tokens as its bytes
    / its own average characters per token, so a threshold of ``threshold`` tokenizer
    tokens is ``threshold x traffic chars per token / llm-d's chars per token`` of its
    estimate (0 stays 0: always disaggregate)."""
    if threshold <= 0.0:
        return 0
    return max(1, math.ceil(threshold * traffic_chars_per_token / llmd_chars_per_token))


def render(export: PeerExport, traffic_chars_per_token: float = 4.0,
           llmd_chars_per_token: float = 4.0) -> str:
    """The config fragment in the peer's own format, with comments giving its provenance
    and the predicted goodput of the rule beside the full table's."""
    r = export.rule
    head = [
        f"# pd-controller export for {target(export.form)}",
        f"# fitted for policy v{export.policy_version} on the stored windows' mix of "
        "contexts, io ratios and loads",
        f"# predicted goodput: this rule {r.predicted_goodput:.4f}, the full table "
        f"{export.table_goodput:.4f} (given up: {export.given_up:+.4f}), always a prefill "
        f"node {export.always_prefill_goodput:.4f}",
        f"# the full table without its exploration {export.table_unexplored_goodput:.4f} "
        f"(its exploration costs {export.table_unexplored_goodput - export.table_goodput:+.4f}"
        "; a rule explores nothing)",
        f"# decode-local share of requests under this rule: {r.local_share:.3f}",
    ]
    if export.form is PeerFormat.LLM_D:
        tokens = llmd_non_cached_tokens(r.threshold, traffic_chars_per_token,
                                        llmd_chars_per_token)
        head.append(
            f"# nonCachedTokens assumes llm-d's token estimate (bytes / chars per token = "
            f"{llmd_chars_per_token:g}) on traffic of {traffic_chars_per_token:g} chars per "
            f"tokenizer token: {r.threshold:g} tokenizer tokens x "
            f"{traffic_chars_per_token:g} / {llmd_chars_per_token:g}"
            + ("; 0 = always disaggregate" if tokens == 0 else ""))
        body = ["plugins:", "- type: prefix-based-pd-decider", "  parameters:",
                f"    nonCachedTokens: {tokens}"]
        return "\n".join(head + body) + "\n"
    config = {"policy": "isl_bounding", "eff_isl_threshold": math.ceil(r.threshold),
              "eff_isl_ratio_threshold": r.ratio}
    if config["eff_isl_threshold"] == 0:
        head.append("# eff_isl_threshold 0: every request goes to a prefill node")
    text = json.dumps(config, separators=(",", ":"))
    body = [f"--router-conditional-disagg --router-conditional-disagg-config '{text}'"]
    return "\n".join(head + body) + "\n"
