"""Derive a compact ServeGen aggregate CSV from an upstream ServeGen tarball.

Usage (from the repository root)::

    python scripts/derive_servegen_aggregate.py servegen_reason_deepseek-r1.tar.gz \
        > controller/data/traces/servegen_deepseek-r1_aggregate_derived.csv

The tarball is ``alibaba/ServeGen`` ``data/<category>/<model>/`` (Apache-2.0) packed as
``data/<category>/<model>/chunk-<client>-trace.csv`` (no header: ``window_start_s, rate, cv,
pattern, param1, param2`` per 600 s window) and ``chunk-<client>-dataset.json``
(``{window_start_s: {field: "<python dict repr {value: probability}>"}}`` per 6 h window).

One output row per 600 s window:

- ``window_start_s``; ``total_rate_rps``: the sum of every client's ``rate``;
- ``len_window_start_s``: the start of the 6 h length window holding the row;
- ``input_p50/p90/p99``, ``output_p50/p90/p99``: percentiles of the mixture of the clients'
  length distributions of that 6 h window, each client weighted by its requests in the 6 h
  window (the sum of rate x 600 s over its 600 s windows); only clients with length data
  count. A percentile is the smallest value whose mixture CDF reaches the level;
- where the clients have ``reason_ratio`` (the reasoning share of the output, deepseek-r1):
  ``reason_ratio_p50/p90/p99`` (same rule) and ``reason_ratio_mean``.

Run on ``servegen_language_m-large.tar.gz`` it reproduces the bundled
``servegen_m-large_aggregate_derived.csv`` byte for byte (the same rule made both files).
"""

from __future__ import annotations

import argparse
import ast
import csv
import io
import json
import re
import sys
import tarfile
from collections import defaultdict
from collections.abc import Iterable, Sequence

WINDOW_S = 600
LENGTH_FIELDS = ("input_tokens", "output_tokens")
REASON_FIELD = "reason_ratio"
LEVELS = (0.50, 0.90, 0.99)
CHUNK = re.compile(r"chunk-(\d+)-(trace\.csv|dataset\.json)$")

Dist = dict[float, float]
Rates = dict[int, dict[int, float]]  # client -> {window_start_s: rate}
Lengths = dict[int, dict[int, dict[str, Dist]]]  # client -> {length window: {field: dist}}


def read_tarball(path: str) -> tuple[Rates, Lengths]:
    """Per client: {window_start_s: rate} and {length window start: {field: distribution}}."""
    rates: Rates = {}
    lengths: Lengths = {}
    with tarfile.open(path, "r:gz") as tar:
        for member in tar:
            match = CHUNK.search(member.name)
            fh = tar.extractfile(member) if match and member.isfile() else None
            if match is None or fh is None:
                continue
            client, kind = int(match.group(1)), match.group(2)
            text = fh.read().decode("utf-8")
            if kind == "trace.csv":
                rates[client] = {int(float(row[0])): float(row[1] or 0.0)
                                 for row in csv.reader(io.StringIO(text)) if row}
            else:
                raw = json.loads(text)
                lengths[client] = {
                    int(float(start)): {k: {float(v): float(p) for v, p in
                                            ast.literal_eval(d).items()} for k, d in fields.items()}
                    for start, fields in raw.items()
                }
    if not rates:
        raise SystemExit(f"{path}: no chunk-*-trace.csv members")
    return rates, lengths


def percentile(mixture: Dist, level: float) -> float:
    """The smallest value whose CDF under ``mixture`` (weights need not sum to 1) reaches
    ``level``."""
    total = sum(mixture.values())
    acc = 0.0
    items = sorted(mixture.items())
    for value, weight in items:
        acc += weight
        if acc >= level * total - 1e-12:
            return value
    return items[-1][0]


def mix(parts: Iterable[tuple[float, Dist]]) -> Dist:
    out: Dist = defaultdict(float)
    for weight, dist in parts:
        for value, p in dist.items():
            out[value] += weight * p
    return out


def fmt(value: float, integral: bool) -> str:
    return str(int(value)) if integral else f"{value:.4f}"


def length_columns(rates: Rates, lengths: Lengths, start: int, span: int,
                   fields: Sequence[str]) -> list[str]:
    """The percentile (and reason-ratio mean) columns of the length window at ``start``."""
    out: list[str] = []
    for field in fields:
        mixture = mix(
            (sum(r * WINDOW_S for w, r in rates.get(c, {}).items() if start <= w < start + span),
             per[start][field])
            for c, per in lengths.items() if start in per and field in per[start]
        )
        integral = field != REASON_FIELD
        if sum(mixture.values()) <= 0:
            out += [""] * (len(LEVELS) + (0 if integral else 1))
            continue
        out += [fmt(percentile(mixture, q), integral) for q in LEVELS]
        if not integral:
            mean = sum(v * p for v, p in mixture.items()) / sum(mixture.values())
            out.append(f"{mean:.4f}")
    return out


def derive_rows(rates: Rates, lengths: Lengths) -> tuple[list[str], list[list[str]]]:
    windows = sorted({w for per in rates.values() for w in per})
    len_starts = sorted({s for per in lengths.values() for s in per})
    has_reason = any(REASON_FIELD in f for per in lengths.values() for f in per.values())
    header = ["window_start_s", "total_rate_rps", "len_window_start_s"]
    header += [f"{k.split('_')[0]}_p{round(q * 100)}" for k in LENGTH_FIELDS for q in LEVELS]
    fields = LENGTH_FIELDS + ((REASON_FIELD,) if has_reason else ())
    if has_reason:
        header += [f"{REASON_FIELD}_p{round(q * 100)}" for q in LEVELS] + [f"{REASON_FIELD}_mean"]
    ends = [*len_starts[1:], windows[-1] + WINDOW_S]
    columns = {s: length_columns(rates, lengths, s, e - s, fields)
               for s, e in zip(len_starts, ends, strict=True)}
    rows = []
    for w in windows:
        total = sum(per.get(w, 0.0) for per in rates.values())
        ls = max(s for s in len_starts if s <= w)
        rows.append([str(w), f"{total:.4f}", str(ls), *columns[ls]])
    return header, rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tarball", help="an upstream ServeGen data tarball (.tar.gz)")
    args = parser.parse_args(argv)
    header, rows = derive_rows(*read_tarball(args.tarball))
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
