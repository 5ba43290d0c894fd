"""``pdctl table show|decide|new``: inspect, query and create lookup-table policy files
(``show`` also the store's policies: ``--version N``, ``--desired``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controller.cli._app import load_policy_or_exit, table_app, writable_file_or_exit
from controller.policy.validation import MAX_VERSION

if TYPE_CHECKING:
    from controller.policy import Features, Policy

_EXIT_BAD_INPUT = 2


def fmt_edge(value: float) -> str:
    """Compact number: 1024, 0.125, 1.5e+06."""
    v = float(value)
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.6g}"


def bin_bounds(edges: tuple[float, ...], i: int) -> tuple[float | None, float | None]:
    """(exclusive lower, inclusive upper) of bin ``i``; None = unbounded.

    Bin 0 starts at 0 (features are never negative); the last bin also takes every value
    beyond the last edge, so its upper bound is open.
    """
    lower = float(edges[i - 1]) if i > 0 else None
    upper = float(edges[i]) if i < len(edges) - 1 else None
    return lower, upper


def bin_text(edges: tuple[float, ...], i: int) -> str:
    lower, upper = bin_bounds(edges, i)
    low = "[0" if lower is None else f"({fmt_edge(lower)}"
    high = "+inf)" if upper is None else f"{fmt_edge(upper)}]"
    return f"{low}, {high}"


def _route_letter(route: Any) -> str:
    from controller.policy import Route

    return "L" if route is Route.DECODE_LOCAL else "P"


# -- show -------------------------------------------------------------------------------------


@table_app.command("show")
def show(
    policy_file: Annotated[Path | None, typer.Argument(
        help="Policy JSON file (lookup-table format); or --version / --desired.")] = None,
    version: Annotated[int | None, typer.Option(
        "--version", min=1, max=MAX_VERSION,
        help="Show the stored policy of this version (from the store: --url or --config's "
        "[store]).")] = None,
    desired: Annotated[bool, typer.Option(
        "--desired", help="Show the stored policy the fleet's routers are desired to run "
        "(a canary's routers are named).")] = False,
    calibration: Annotated[int | None, typer.Option(
        "--calibration", min=1, help="Show the policy calibration ID produced: its version's, "
        "or the candidate the guardrail refused (kept with the calibration, no version).")
    ] = None,
    url: Annotated[str | None, typer.Option(
        "--url", help="Database URL for --version / --desired (overrides the config).")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="Config file whose [store] --version / --desired read.")] = None,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="Also draw heat-maps (one panel per io-ratio bin) to a PNG."),
    ] = None,
) -> None:
    """Print a policy: header, then per io-ratio bin a context x qps grid of route and score.

    The policy comes from a file, or from the store: --version N (any stored version),
    --desired (the fleet's) or --calibration ID (what that calibration produced: a candidate
    the guardrail refused has no version and is shown this way). P = prefill node (classic
    P/D), L = decode-local (PPD). Exits 2 on an invalid file or no such version or
    calibration (listing every problem of a file with its field path), 3 when the store is
    unavailable.
    """
    from rich.console import Console

    chosen = [x for x in (policy_file is not None, version is not None, desired,
                          calibration is not None) if x]
    if len(chosen) != 1:
        typer.echo("table show takes one of: a policy file, --version N, --desired, "
                   "--calibration ID", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT)
    stored: list[str] = []
    label: str | None = None
    if policy_file is not None:
        policy = load_policy_or_exit(policy_file)
    elif calibration is not None:
        policy, stored, label = _calibration_policy_or_exit(calibration, url, config)
    else:
        policy, stored = _stored_policy_or_exit(version, url, config)
    if plot is not None:
        writable_file_or_exit(plot, "--plot")
    axes = policy.table.axes
    # Wide enough that no cell is cut (rich would otherwise squeeze to the terminal's 80).
    width = 4 + max(len(bin_text(axes.context_tokens, i)) for i in range(axes.shape[0])) + sum(
        3 + max(8, len(bin_text(axes.qps, k))) for k in range(axes.shape[2])
    )
    console = Console(width=max(100, width), highlight=False)
    console.print(_header(policy, stored, label))
    console.print(
        "Per io-ratio bin: rows = context tokens, columns = qps; each cell shows its route "
        "(P = prefill node, L = decode-local), its score, and * when it explores."
    )
    for j in range(axes.shape[1]):
        console.print(_io_panel(policy, j))
    if plot is not None:
        draw_heatmaps(policy, plot)
        console.print(f"heat-maps written to {plot}")


def _stored_policy_or_exit(version: int | None, url: str | None, config: Path | None
                           ) -> tuple[Policy, list[str]]:
    """The stored policy ``version`` (None: the fleet's desired one) and the store's lines
    about it (status, reason, who is desired to run it)."""
    from controller.cli.ops_cmd import open_store
    from controller.loop.policies import read_rollout

    store = open_store(url, config)
    try:
        with store.read() as tx:
            rollout = read_rollout(tx)
            if version is None and rollout.fleet_version is None:
                typer.echo("--desired: no router has a desired version yet (no policy "
                           "stored, or the daemon has not started)", err=True)
                raise typer.Exit(_EXIT_BAD_INPUT)
            wanted = rollout.fleet_version if version is None else version
            assert wanted is not None
            record = tx.policy(wanted)
            desired = tx.desired_versions()
    finally:
        store.close()
    if record is None:
        typer.echo(f"--version {wanted}: no such policy version in the store", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT)
    policy = _loads_or_exit(record.body_json, f"v{wanted}")
    routers = sorted(r for r, v in desired.items() if v == wanted)
    role = ("the fleet's" if wanted == rollout.fleet_version else
            "baking as a canary" if wanted == rollout.canary_version else "")
    lines = [f"{record.status}" + (f" ({role})" if role else "") + f": {record.reason}",
             f"desired by {', '.join(routers)}" if routers else "desired by no router"]
    return policy, lines


def _calibration_policy_or_exit(calibration_id: int, url: str | None, config: Path | None
                                ) -> tuple[Policy, list[str], str | None]:
    """What calibration ``calibration_id`` produced: its stored version (as ``--version``),
    or the candidate the guardrail refused, kept with it (no version: ``label`` names it)."""
    from controller.cli.ops_cmd import open_store

    store = open_store(url, config)
    try:
        record = store.calibration(calibration_id)
    finally:
        store.close()
    if record is None:
        typer.echo(f"--calibration {calibration_id}: no such calibration in the store",
                   err=True)
        raise typer.Exit(_EXIT_BAD_INPUT)
    if record.policy_version is not None:
        policy, lines = _stored_policy_or_exit(record.policy_version, url, config)
        return policy, [f"produced by calibration #{calibration_id}", *lines], None
    details = record.details or {}
    if record.candidate_body_json is None:
        why = details.get("not_stored") or ("a dry run" if details.get("dry_run") else
                                            "no policy")
        typer.echo(f"--calibration {calibration_id}: it stored no policy ({why})", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT)
    policy = _loads_or_exit(record.candidate_body_json, f"calibration #{calibration_id}'s "
                            "refused candidate")
    return policy, [f"rejected by the guardrail: {details.get('reason', '-')}",
                    "desired by no router"], \
        f"no version: the refused candidate of calibration #{calibration_id}"


def _loads_or_exit(body_json: str, what: str) -> Policy:
    from controller.policy import PolicyValidationError, loads

    try:
        return loads(body_json)
    except PolicyValidationError as e:  # a stored table this release cannot read
        typer.echo(f"{what} as stored is not a valid policy: "
                   + "; ".join(f"{p.path}: {p.message}" for p in e.problems), err=True)
        raise typer.Exit(_EXIT_BAD_INPUT) from None


def _header(policy: Policy, stored: list[str] | None = None, label: str | None = None) -> Any:
    from rich.table import Table

    from controller.policy import Route, first_turn_busy_waiting, later_turn_busy_waiting

    t = policy.table
    n = t.axes.n_cells
    local = sum(1 for r in t.routes if r is Route.DECODE_LOCAL)
    explored = [e for e in t.exploration if e > 0]
    pv = policy.provenance
    bypass = policy.overrides.bypass_append_tokens
    busy = first_turn_busy_waiting(policy)
    later_busy = later_turn_busy_waiting(policy)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    rows = [
        ("policy", f"version {policy.version}" if label is None else label),
        ("checksum", policy.checksum),
        ("table", f"{' x '.join(map(str, t.axes.shape))} = {n} cells "
                  "(context_tokens x io_ratio x qps); "
                  f"decode-local in {local} ({100 * local / n:.1f}%)"),
        ("exploration", (f"{len(explored)} cell(s), {min(explored):.3g} to {max(explored):.3g}"
                         if explored else "none")),
        ("weights", f"wtft={policy.weights.wtft:g}  wtpot={policy.weights.wtpot:g}"),
        ("SLOs", f"TTFT <= {policy.slo.ttft_s:g} s, TPOT <= {policy.slo.tpot_s:g} s"),
        ("overrides", f"turn 1 -> {policy.overrides.first_turn_route.name}"
                      + (f" (DECODE_LOCAL while every prefill worker has >= {busy} waiting)"
                         if busy else "") + "; "
                      + (f"append_tokens < {bypass} -> DECODE_LOCAL" if bypass
                         else "no append bypass")
                      + (f"; later turns' PREFILL_NODE cells -> DECODE_LOCAL while every "
                         f"prefill worker has >= {later_busy} waiting" if later_busy else "")),
        ("default route", f"{policy.default_route.name} (invalid input, timeouts)"),
        ("created", f"{pv.created_at.isoformat() if pv.created_at else '-'}"
                    f" by {pv.created_by or '-'}: {pv.reason or '-'}"),
        ("trained on", f"{pv.trained_from.isoformat() if pv.trained_from else '-'} .. "
                       f"{pv.trained_to.isoformat() if pv.trained_to else '-'}"),
    ]
    rows += [("stored", line) for line in stored or []]
    for key, value in rows:
        grid.add_row(key, value)
    return grid


def _io_panel(policy: Policy, j: int) -> Any:
    from rich.table import Table
    from rich.text import Text

    t = policy.table
    axes = t.axes
    n_ctx, _, n_qps = axes.shape
    table = Table(
        title=f"io_ratio bin {j}: {bin_text(axes.io_ratio, j)}",
        title_justify="left",
        pad_edge=False,
    )
    table.add_column("context \\ qps", no_wrap=True)
    for k in range(n_qps):
        table.add_column(bin_text(axes.qps, k), justify="right", no_wrap=True)
    for i in range(n_ctx):
        cells: list[Text | str] = [bin_text(axes.context_tokens, i)]
        for k in range(n_qps):
            idx = axes.cell_index(i, j, k)
            letter = _route_letter(t.routes[idx])
            mark = "*" if t.exploration[idx] > 0 else ""
            cells.append(
                Text(f"{letter}{t.scores[idx]:+.2f}{mark}",
                     style="green" if letter == "L" else "cyan")
            )
        table.add_row(*cells)
    return table


def draw_heatmaps(policy: Policy, out: Path) -> None:
    """One panel per io-ratio bin: context (rows) x qps (columns), coloured by route."""
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from controller.policy import Route

    t = policy.table
    axes = t.axes
    n_ctx, n_io, n_qps = axes.shape
    local = np.array([r is Route.DECODE_LOCAL for r in t.routes], dtype=float)
    local = local.reshape(n_ctx, n_io, n_qps)
    scores = np.array(t.scores, dtype=float).reshape(n_ctx, n_io, n_qps)
    colours = ("#4c78a8", "#f58518")  # prefill node, decode-local
    cols = min(n_io, 5)
    rows = math.ceil(n_io / cols)
    fig = Figure(figsize=(cols * 3.8, rows * 3.6 + 0.6), layout="constrained")
    panels = fig.subplots(rows, cols, squeeze=False)
    annotate = n_ctx * n_qps <= 400
    font = 6 if max(n_ctx, n_qps) > 6 else 8
    for j in range(rows * cols):
        ax = panels[j // cols][j % cols]
        if j >= n_io:
            ax.set_axis_off()
            continue
        ax.imshow(local[:, j, :], cmap=ListedColormap(colours), vmin=0, vmax=1,
                  origin="lower", aspect="auto", interpolation="nearest")
        if annotate:
            for i in range(n_ctx):
                for k in range(n_qps):
                    ax.text(k, i, f"{scores[i, j, k]:.2f}", ha="center", va="center",
                            fontsize=font - 1, color="white")
        ax.set_title(f"io_ratio {bin_text(axes.io_ratio, j)}", fontsize=9)
        ax.set_xticks(range(n_qps), [fmt_edge(e) for e in axes.qps], rotation=90, fontsize=font)
        ax.set_yticks(range(n_ctx), [fmt_edge(e) for e in axes.context_tokens], fontsize=font)
        ax.set_xlabel("qps (bin upper edge)", fontsize=font + 1)
        ax.set_ylabel("context tokens (bin upper edge)", fontsize=font + 1)
    fig.suptitle(f"policy v{policy.version} ({policy.checksum[:12]}): route per cell, "
                 "score annotated")
    fig.legend(handles=[Patch(color=colours[0], label="P: prefill node"),
                        Patch(color=colours[1], label="L: decode-local")],
               loc="outside lower center", ncols=2)
    fig.savefig(out, format="png", dpi=110)


# -- decide -----------------------------------------------------------------------------------


@table_app.command("decide")
def decide_cmd(
    policy_file: Annotated[Path, typer.Argument(help="Policy JSON file.")],
    turn: Annotated[int, typer.Option("--turn", help="Turn number (1 = first turn).")],
    context: Annotated[float, typer.Option("--context", help="Cached context tokens.")],
    append: Annotated[float, typer.Option("--append", help="New prompt tokens of this turn.")],
    output: Annotated[float, typer.Option("--output", help="Expected output tokens.")],
    qps: Annotated[float, typer.Option("--qps", help="The router's windowed arrival rate.")],
    prefill_waiting: Annotated[
        float | None,
        typer.Option("--prefill-waiting",
                     help="Requests waiting on the least-busy prefill worker (omit: unknown)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show the route a router would take for one request, and the cell, override or reason.

    Exploration is not drawn: the answer is the table's route, and the cell's exploration
    fraction says how often a router would take the other one.
    """
    from controller.policy import Features

    policy = load_policy_or_exit(policy_file)
    f = Features(turn=turn, context_tokens=context, append_tokens=append,
                 expected_output_tokens=output, qps=qps, prefill_waiting=prefill_waiting)
    report = explain(policy, f)
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    typer.echo(f"route: {report['route']}  (reason: {report['reason']})")
    typer.echo(f"policy: v{report['policy_version']} {report['checksum'][:12]}")
    if report["cell"] is None:
        typer.echo(report["why"])
        return
    for name, b in report["bins"].items():
        typer.echo(f"  {name:<15} {b['value']:<12g} bin {b['index']:>2}  {b['range']}")
    typer.echo(f"cell {tuple(report['cell'])} (flat index {report['cell_index']}): "
               f"score {report['score']:+.4g}, exploration {report['exploration']:.3g}")
    typer.echo(report["why"])


def explain(policy: Policy, f: Features) -> dict[str, Any]:
    """The decision for ``f`` (exploration not drawn) and what it came from, as plain data."""
    from controller.policy import Reason, decide

    d = decide(policy, f, lambda: 1.0)  # a draw of 1.0 never explores
    report: dict[str, Any] = {
        "route": d.route.name,
        "reason": d.reason.value,
        "cell": list(d.cell) if d.cell is not None else None,
        "policy_version": policy.version,
        "checksum": policy.checksum,
    }
    waiting = fmt_edge(float(f.prefill_waiting or 0))  # what the busy overrides read
    if d.reason is Reason.INVALID_INPUT:
        report["why"] = ("invalid input (" + "; ".join(_invalid_features(f))
                         + f"): the default route {policy.default_route.name} is used")
    elif d.reason is Reason.FIRST_TURN:
        report["why"] = (f"override: turn 1 has no cached context and goes to "
                         f"{policy.overrides.first_turn_route.name} (overrides.first_turn_route)")
    elif d.reason is Reason.BUSY_PREFILL:
        report["why"] = (f"override: turn 1 runs DECODE_LOCAL because the least-busy prefill "
                         f"worker has {waiting} request(s) waiting, at least "
                         f"{policy.overrides.first_turn_busy_waiting} "
                         "(overrides.first_turn_busy_waiting)")
    elif d.reason is Reason.BUSY_LATER_TURN:
        report["why"] = (f"override: the cell routes to PREFILL_NODE, but the least-busy "
                         f"prefill worker has {waiting} request(s) waiting, at least "
                         f"{policy.overrides.later_turn_busy_waiting} "
                         "(overrides.later_turn_busy_waiting): DECODE_LOCAL")
    elif d.reason is Reason.BYPASS:
        report["why"] = (f"override: append_tokens {fmt_edge(f.append_tokens)} < "
                         f"{policy.overrides.bypass_append_tokens} "
                         "(overrides.bypass_append_tokens) runs DECODE_LOCAL")
    if d.cell is None:
        return report
    axes = policy.table.axes
    values = {"context_tokens": f.context_tokens, "io_ratio": f.io_ratio, "qps": f.qps}
    bins = {}
    for (name, edges), i in zip(axes.by_name().items(), d.cell, strict=True):
        lower, upper = bin_bounds(edges, i)
        bins[name] = {"value": values[name], "index": i, "range": bin_text(edges, i),
                      "lower_exclusive": lower, "upper_inclusive": upper}
    idx = axes.cell_index(*d.cell)
    expl = policy.table.exploration[idx]
    report.update(
        bins=bins,
        cell_index=idx,
        score=policy.table.scores[idx],
        exploration=expl,
    )
    route = policy.table.routes[idx]
    cell_why = (f"table cell: {route.name}"
                + (f"; {100 * expl:.3g}% of such requests explore {route.other.name}"
                   if expl > 0 else ""))
    # The later-turn busy override consulted the cell and overrode it: say both.
    report["why"] = f"{report['why']} ({cell_why})" if "why" in report else cell_why
    return report


def _invalid_features(f: Features) -> list[str]:
    out = []
    if not math.isfinite(f.turn) or f.turn < 1:  # one message for every bad turn, -1 or 0
        out.append(f"turn={f.turn} must be >= 1")
    for name in ("context_tokens", "append_tokens", "expected_output_tokens", "qps"):
        v = getattr(f, name)
        if not math.isfinite(v) or v < 0:
            out.append(f"{name}={v} must be a finite number >= 0")
    if f.expected_output_tokens == 0:
        out.append("expected_output_tokens must be > 0")
    return out


# -- new --------------------------------------------------------------------------------------


@table_app.command("new")
def new(
    route: Annotated[
        str, typer.Option("--route", help="prefill | decode: the route of every cell.")
    ],
    version: Annotated[int, typer.Option("--version", help="Policy version.")] = 1,
    exploration: Annotated[
        float, typer.Option("--exploration", help="Exploration fraction of every cell (0 to 0.2).")
    ] = 0.0,
    out: Annotated[
        Path | None, typer.Option("--out", help="Write here (atomically) instead of stdout.")
    ] = None,
) -> None:
    """Write a uniform policy on the default 10 x 10 x 10 axes (for demos and tests)."""
    from controller.clock import WallClock
    from controller.policy import Policy, Provenance, Route, dumps, validate_policy
    from controller.policy.model import MAX_EXPLORATION

    try:
        chosen = Route.parse(route)
    except ValueError as e:
        typer.echo(f"--route: {e}", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT) from None
    if not 0 <= exploration <= MAX_EXPLORATION:  # else one identical problem per cell
        typer.echo(f"--exploration {exploration:g}: must be within [0, {MAX_EXPLORATION:g}]",
                   err=True)
        raise typer.Exit(_EXIT_BAD_INPUT)
    policy = Policy.uniform(
        version, chosen, exploration=exploration,
        provenance=Provenance(created_at=WallClock().utcnow(), created_by="pdctl",
                              reason=f"pdctl table new --route {route}"),
    )
    problems = validate_policy(policy)
    if problems:
        typer.echo(f"cannot build that policy, {len(problems)} problem(s):", err=True)
        for p in problems[:5]:
            typer.echo(f"  {p.path}: {p.message}", err=True)
        if len(problems) > 5:
            typer.echo(f"  ... and {len(problems) - 5} more like these", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT)
    text = dumps(policy) + "\n"
    if out is None:
        typer.echo(text, nl=False)
        return
    from controller.rollout.agent import atomic_write_bytes

    writable_file_or_exit(out, "--out")
    try:
        atomic_write_bytes(out, text.encode())
    except OSError as e:  # e.g. the disk is full
        typer.echo(f"{out}: cannot write: {e.strerror or e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {out}: v{policy.version} all {chosen.name}, exploration {exploration:g}, "
               f"checksum {policy.checksum}", err=True)
