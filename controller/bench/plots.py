"""PNG plots of a bench run (matplotlib, Agg backend: no display needed).

- ``goodput.png``: goodput per control interval (by arrival time) per policy, events marked;
- ``ttft_cdf.png`` / ``tpot_cdf.png``: CDFs of Turn-2+ TTFT and of TPOT per policy;
- ``tables-<policy>.png``: the table before and after each recalibration, as heat-maps of
  the decode-local share over the QPS bins of every (context, io-ratio) cell.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from controller.policy import Policy, Route
from controller.sim.run import RequestRecord


def goodput_series(records: Sequence[RequestRecord], bin_s: float, end_s: float,
                   ttft_slo: float, tpot_slo: float) -> tuple[list[float], list[float | None]]:
    """(bin start, goodput of requests arriving in the bin) over ``[0, end_s)``."""
    n_bins = max(1, int(end_s // bin_s + (1 if end_s % bin_s else 0)))
    met = [0] * n_bins
    total = [0] * n_bins
    for r in records:
        i = int(r.arrival_s // bin_s)
        if 0 <= i < n_bins:
            total[i] += 1
            if not r.rejected and r.ttft_s is not None and r.ttft_s <= ttft_slo \
                    and (r.tpot_s is None or r.tpot_s <= tpot_slo):
                met[i] += 1
    return ([i * bin_s for i in range(n_bins)],
            [m / t if t else None for m, t in zip(met, total, strict=True)])


def decode_local_share(policy: Policy) -> list[list[float]]:
    """[context bin][io bin] share of QPS bins whose route is decode-local."""
    n_ctx, n_io, n_qps = policy.table.axes.shape
    return [[sum(policy.table.route_at(c, i, q) is Route.DECODE_LOCAL for q in range(n_qps))
             / n_qps for i in range(n_io)] for c in range(n_ctx)]


def write_plots(out: Path, bench: Any, doc: dict[str, Any]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    scenario = bench.scenario
    results = {k: r.result for k, r in bench.runs.items()}
    if bench.oracle is not None:
        from controller.bench.oracle import oracle_records

        oracle = oracle_records(bench.candidates, bench.oracle)
    else:
        oracle = None

    fig, ax = plt.subplots(figsize=(10, 4.5))
    series = {k: r.records for k, r in results.items()}
    if oracle is not None:
        series["oracle"] = oracle
    colors = _colors(list(series))
    for key, recs in series.items():
        xs, ys = goodput_series(recs, scenario.interval_s, scenario.duration_s,
                                scenario.ttft_slo_s, scenario.tpot_slo_s)
        style = "--" if key.startswith("table-") else "-"
        ax.plot(xs, [float("nan") if y is None else y for y in ys], style, label=key,
                color=colors[key], linewidth=0.8 if key.startswith("table-") else 1.6)
    adaptive = bench.runs.get("adaptive")
    if adaptive is not None and len(adaptive.tables) > 1:
        ax.plot([t for t, _ in adaptive.tables[1:]], [0.02] * (len(adaptive.tables) - 1), "^",
                color=colors["adaptive"], markersize=8, label="adaptive: new policy")
    for e in scenario.events:
        ax.axvline(e.at_s, color="black", linestyle=":", linewidth=1)
        ax.annotate(e.kind, (e.at_s, 1.01), fontsize=7, rotation=0, ha="left")
    ax.set_xlabel("arrival time (virtual s)")
    ax.set_ylabel(f"goodput per {scenario.interval_s:g} s")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{scenario.name}: goodput over time")
    ax.legend(fontsize=7, ncol=3, loc="lower left")
    fig.tight_layout()
    written.append(_save(fig, out / "goodput.png"))
    plt.close(fig)

    cdfs: tuple[tuple[str, Callable[[RequestRecord], float | None], str], ...] = (
        ("ttft_cdf.png", _turn2_ttft, "Turn-2+ TTFT (s)"),
        ("tpot_cdf.png", _tpot, "TPOT (s)"),
    )
    for name, pick, label in cdfs:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key, recs in series.items():
            values = sorted(v for v in map(pick, recs) if v is not None)
            if not values:
                continue
            n = len(values)
            ax.step(values, [(i + 1) / n for i in range(n)], where="post", label=key,
                    color=colors[key], linewidth=0.8 if key.startswith("table-") else 1.5)
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{scenario.name}: {label} CDF")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, out / name))
        plt.close(fig)

    for key, run in bench.runs.items():
        tables = [(t, p) for t, p in run.tables if p.table.routes]
        if key in ("pd", "local") or not tables:
            continue
        n = len(tables)
        # Constrained layout: the panels' labels and the shared colour bar never overlap.
        fig, axes = plt.subplots(1, n, figsize=(3.2 * n + 1.4, 3.8), squeeze=False,
                                 layout="constrained")
        for j, (ax, (t, p)) in enumerate(zip(axes[0], tables, strict=True)):
            img = ax.imshow(decode_local_share(p), origin="lower", vmin=0, vmax=1,
                            cmap="viridis", aspect="auto")
            edges = p.table.axes
            ax.set_title(f"v{p.version} from {t:.0f} s", fontsize=8)
            ax.set_xticks(range(len(edges.io_ratio)), [f"{e:g}" for e in edges.io_ratio],
                          rotation=90, fontsize=6)
            ax.set_yticks(range(len(edges.context_tokens)),
                          [f"{e:g}" for e in edges.context_tokens], fontsize=6)
            ax.set_xlabel("io ratio (bin upper edge)", fontsize=7)
            if j == 0:
                ax.set_ylabel("context tokens (bin upper edge)", fontsize=7)
        fig.colorbar(img, ax=axes[0].tolist(), label="decode-local share of QPS bins")
        fig.suptitle(f"{scenario.name} / {key}: tables over the run", fontsize=9)
        written.append(_save(fig, out / f"tables-{key}.png"))
        plt.close(fig)
    return written


def _colors(keys: Sequence[str]) -> dict[str, Any]:
    """Distinct colours: the built-in policies from tab10, oracle candidates from tab20's pale
    half, the oracle black."""
    import matplotlib

    main = [matplotlib.colormaps["tab10"](i) for i in range(10)]
    pale = [matplotlib.colormaps["tab20"](i) for i in range(1, 20, 2)]
    out: dict[str, Any] = {}
    i = j = 0
    for k in keys:
        if k == "oracle":
            out[k] = "black"
        elif k.startswith("table-"):
            out[k] = pale[j % len(pale)]
            j += 1
        else:
            out[k] = main[i % len(main)]
            i += 1
    return out


def _turn2_ttft(r: RequestRecord) -> float | None:
    return r.ttft_s if r.turn >= 2 else None


def _tpot(r: RequestRecord) -> float | None:
    return r.tpot_s


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path
