"""The evaluation's results over several runs: one Markdown table of every run (a scenario
and a seed each) and, for a scenario run with several seeds, one line over its seeds.

The generated blocks of ``docs/results.md`` are this module's output over the committed runs:
``eval-tuned`` and ``eval-heldout`` over each evaluation set's results
(``scenarios/bench/seeds.toml``, written by ``benchmarks/eval_all.py``, which also writes the
README's ``eval-claims`` block), and ``bench-results`` and ``bench-heldout`` over the tuning
runs the loop's variants are judged on (``results/bench/*/*/summary.json`` and
``results/bench-heldout/*/*/summary.json``; ``benchmarks/bench_summary.py --doc
docs/results.md [--block NAME]``). ``tests/bench/test_summary.py`` checks every block still
matches the committed summaries.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from controller.bench.evaluation import EvalSet, SeedPlan
from controller.bench.goals import phase_margins
from controller.bench.report import seconds_list
from controller.bench.runner import POLICIES, STATIC, BenchPolicy
from controller.bench.uncertainty import MIN_SEEDS, Margin, Verdict, margin_over_strongest

RESULTS_BLOCK = "bench-results"
HELDOUT_BLOCK = "bench-heldout"


CLAIMS_BLOCK = "eval-claims"  # the README's: each evaluation set's claims


def _markers(block: str) -> tuple[str, str]:
    writer = ("benchmarks/eval_all.py" if block.startswith("eval-")
              else "benchmarks/bench_summary.py --doc")
    return (f"<!-- {block}: begin ({writer}; do not edit) -->", f"<!-- {block}: end -->")


def _best_static(policies: Mapping[str, Any]) -> str:
    return max((k for k in STATIC if k in policies), key=lambda k: policies[k]["goodput"])


def lowest_phase_margin(policies: Mapping[str, Any], field: str = "goodput"
                        ) -> float | None:
    """Adaptive's goodput minus the best static policy's, in its worst phase (each phase
    against the static policy best in that phase; ``field`` ``adapted_goodput``: from
    adaptive's first approval in the phase). None: no such figures recorded."""
    phases = [p.get(field) for p in policies["adaptive"].get("phases") or []]
    if not phases or None in phases:
        return None
    try:
        return min(phase_margins(policies, [float(g) for g in phases], field))
    except (ValueError, KeyError, TypeError):
        return None


def run_row(doc: Mapping[str, Any]) -> str:
    """One run: goodput per policy, adaptive against the best static policy (over the run
    and in its worst phase) and the oracle, the adaptive loop's policy changes, adaptation
    and detection time per event."""
    pol = doc["policies"]
    cells = [f"`{doc['scenario']}`", str(doc.get("seed", "-"))]
    cells += [f"{pol[k]['goodput']:.3f}" if k in pol else "-" for k in POLICIES]
    if "adaptive" in pol and any(k in pol for k in STATIC):
        best = _best_static(pol)
        ratio = doc.get("oracle_ratio")
        lowest = lowest_phase_margin(pol)
        adapted = lowest_phase_margin(pol, "adapted_goodput")
        cells += [
            f"{pol['adaptive']['goodput'] - pol[best]['goodput']:+.3f} ({best})",
            "-" if lowest is None else f"{lowest:+.3f}",
            "-" if adapted is None else f"{adapted:+.3f}",
            "-" if ratio is None else f"{ratio:.3f}",
            str(pol["adaptive"]["policy_changes"]),
            seconds_list(pol["adaptive"]["adaptation_s"]),
            seconds_list(pol["adaptive"].get("detection_s")),
        ]
    else:
        cells += ["-"] * 7
    return "| " + " | ".join(cells) + " |"


def strongest_margin(runs: Iterable[Mapping[str, Any]]) -> Margin | None:
    """Adaptive against the scenario's strongest static policy over its seeds
    (:func:`controller.bench.uncertainty.margin_over_strongest`); None: not computable."""
    goodputs = [{k: float(v["goodput"]) for k, v in d["policies"].items()
                 if v.get("goodput") is not None} for d in runs]
    try:
        return margin_over_strongest(goodputs, [str(k) for k in STATIC], BenchPolicy.ADAPTIVE)
    except (ValueError, KeyError):
        return None


def strongest_margin_cells(runs: Iterable[Mapping[str, Any]]) -> list[str]:
    """The policy, the mean margin with its 95 % paired bootstrap interval, the claim."""
    m = strongest_margin(runs)
    if m is None:
        return ["-", "-", "-"]
    claim = m.verdict.value if m.seeds >= MIN_SEEDS else f"none ({m.seeds} < {MIN_SEEDS} seeds)"
    return [m.against, f"{m.mean:+.4f} [{m.low:+.4f}, {m.high:+.4f}]", claim]


def claim_line(name: str, m: Margin) -> str:
    """The sentence a scenario's interval allows (prose quotes these, never its own)."""
    ci = f"{m.mean:+.4f}, 95 % interval {m.low:+.4f} to {m.high:+.4f} over {m.seeds} seeds"
    if m.seeds < MIN_SEEDS:  # a bootstrap over a handful of seeds is too narrow to claim on
        return (f"- `{name}`: no claim, {m.seeds} seeds (a claim needs {MIN_SEEDS}); adaptive "
                f"minus `{m.against}`: {ci}.")
    if m.verdict is Verdict.BEATS:
        return f"- `{name}`: adaptive beats `{m.against}` ({ci})."
    if m.verdict is Verdict.LOSES:
        return f"- `{name}`: adaptive loses to `{m.against}` ({ci})."
    return (f"- `{name}`: adaptive ties with `{m.against}` ({ci}): learning adds nothing "
            "measurable here.")


def seed_rows(docs: Iterable[Mapping[str, Any]]) -> list[str]:
    """Per scenario run with two or more seeds: adaptive's margin over the best static
    policy per seed, on how many seeds it was above, the mean margin, its worst phase over
    the seeds, the oracle ratios, and the margin over the scenario's strongest static policy
    with its interval and claim ("beats" only where the interval excludes zero)."""
    by_scenario: dict[str, list[Mapping[str, Any]]] = {}
    for doc in docs:
        if "adaptive" in doc["policies"]:
            by_scenario.setdefault(str(doc["scenario"]), []).append(doc)
    rows = []
    for name, runs in by_scenario.items():
        if len({d.get("seed") for d in runs}) < 2:
            continue
        margins = [d["policies"]["adaptive"]["goodput"]
                   - d["policies"][_best_static(d["policies"])]["goodput"] for d in runs]
        ratios = [float(d["oracle_ratio"]) for d in runs if d.get("oracle_ratio") is not None]
        ratio_range = f"{min(ratios):.3f}–{max(ratios):.3f}" if ratios else "-"
        lows = [m for d in runs if (m := lowest_phase_margin(d["policies"])) is not None]
        rows.append(
            f"| `{name}` | {', '.join(str(d.get('seed', '-')) for d in runs)} "
            f"| {', '.join(f'{m:+.3f}' for m in margins)} "
            f"| {sum(m > 0 for m in margins)} of {len(runs)} "
            f"| {sum(margins) / len(runs):+.3f} | {f'{min(lows):+.3f}' if lows else '-'} "
            f"| {ratio_range} | " + " | ".join(strongest_margin_cells(runs)) + " |")
    return rows


def claim_lines(docs: Iterable[Mapping[str, Any]]) -> list[str]:
    """One claim per scenario run with two or more seeds, in scenario order."""
    by_scenario: dict[str, list[Mapping[str, Any]]] = {}
    for doc in docs:
        if "adaptive" in doc["policies"]:
            by_scenario.setdefault(str(doc["scenario"]), []).append(doc)
    out = []
    for name in sorted(by_scenario):
        runs = by_scenario[name]
        m = strongest_margin(runs) if len({d.get("seed") for d in runs}) >= 2 else None
        if m is not None:
            out.append(claim_line(name, m))
    return out


def set_docs(plan: SeedPlan, name: str, root: Path) -> list[dict[str, Any]]:
    """The committed summaries of evaluation set ``name``, in path order."""
    return [json.loads(p.read_text(encoding="utf-8"))
            for p in sorted(root.glob(f"{plan.sets[name].results}/*/seed-*/summary.json"))]


def set_title(eval_set: EvalSet) -> str:
    """"The five scenarios ... , seeds 11–20": a set's description and its seeds."""
    seeds = sorted(eval_set.seeds)
    contiguous = seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 2
    listed = f"{seeds[0]}–{seeds[-1]}" if contiguous else ", ".join(map(str, seeds))
    text = eval_set.description or "scenarios"
    return f"{text[:1].upper()}{text[1:]}, seeds {listed}"


def evaluation_claims(plan: SeedPlan, root: Path) -> str:
    """The README's ``eval-claims`` block: every set's claims from its committed results."""
    return claims_markdown((set_title(s), set_docs(plan, name, root))
                           for name, s in plan.sets.items())


def claims_markdown(sets: Iterable[tuple[str, Iterable[Mapping[str, Any]]]]) -> str:
    """Per evaluation set, its title and one claim per scenario (:func:`claim_lines`): what
    the README may say of the evaluation, and all it says."""
    parts = [f"{title}:\n\n" + "\n".join(claims) + "\n"
             for title, docs in sets if (claims := claim_lines(docs))]
    return "\n".join(parts)


def suite_markdown(docs: Iterable[Mapping[str, Any]]) -> str:
    """Both tables, runs ordered by scenario then seed."""
    ordered = sorted(docs, key=lambda d: (str(d["scenario"]), int(d.get("seed", 0))))
    lines = ["| scenario | seed | " + " | ".join(POLICIES)
             + " | adaptive - best static | lowest phase | lowest phase once adapted "
               "| adaptive / oracle | adaptive changes | adaptation s per event "
               "| detection s per event |",
             "|---" * (len(POLICIES) + 9) + "|"]
    lines += [run_row(d) for d in ordered]
    seeds = seed_rows(ordered)
    if seeds:
        lines += ["", "| scenario | seeds | adaptive - best static, per seed | adaptive above "
                  "| mean | lowest phase | adaptive / oracle | strongest static "
                  "| adaptive - strongest, mean [95 % CI] | claim |",
                  "|---" * 10 + "|", *seeds]
        claims = claim_lines(ordered)
        if claims:
            lines += ["", *claims]
    return "\n".join(lines) + "\n"


def _block_pattern(block: str) -> re.Pattern[str]:
    begin, end = _markers(block)
    return re.compile(re.escape(begin) + r"\n(.*?)" + re.escape(end), re.S)


def doc_block(text: str, block: str = RESULTS_BLOCK) -> str | None:
    """The generated block named ``block`` of a document (None: it has no markers)."""
    m = _block_pattern(block).search(text)
    return m.group(1) if m else None


def with_doc_block(text: str, table: str, block: str = RESULTS_BLOCK) -> str:
    """``text`` with its generated block named ``block`` replaced by ``table``; ValueError
    if it has no such markers."""
    begin, end = _markers(block)
    if doc_block(text, block) is None:
        raise ValueError(f"no {block} block: expected the lines {begin!r} and {end!r}")
    return _block_pattern(block).sub(lambda _: f"{begin}\n{table}{end}", text, count=1)
