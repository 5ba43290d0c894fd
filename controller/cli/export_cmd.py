"""``pdctl export``: the tuned threshold of a peer router's own rule, as its config fragment.

The model is the one ``pdctl explain`` uses: the current calibration's (the version the
routers should run), refitted on its stored training windows. The rule is fitted on those
windows' mix of contexts, io ratios and loads, laid on the cells of the running policy (or
``--version N``), and printed in the peer's format with the rule's predicted goodput beside
the full table's (``docs/adopting.md``).

Exit codes: 0 done, 2 bad input, an unknown version or no calibration stored yet, 3 store
unavailable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from controller.cli._app import EXIT_BAD_INPUT, app
from controller.cli.explain_cmd import (
    ConfigOption,
    JsonOption,
    UrlOption,
    learned_or_exit,
    settings_and_store,
)

if TYPE_CHECKING:
    from controller.cli.explain_cmd import Learned
    from controller.config import Settings
    from controller.policy import Policy
    from controller.store import Store


def _policy_or_exit(store: Store, learned: Learned, version: int | None) -> Policy:
    """``version``'s stored policy; None: the routers' (else the calibration's own)."""
    from controller.policy import loads

    if version is None:
        return learned.policy if learned.policy is not None else learned.result.policy
    with store.read() as tx:
        rec = tx.policy(version)
    if rec is None:
        typer.echo(f"error: no policy v{version} in the store", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    return loads(rec.body_json)


def export_doc(settings: Settings, learned: Learned, policy: Policy, form: str,
               traffic_chars_per_token: float, llmd_chars_per_token: float,
               ) -> tuple[dict[str, object], str]:
    """The fitted rule (JSON-ready) and its fragment, on ``learned``'s windows."""
    from controller.core.calibrate import table_grid
    from controller.core.features import build_training_set
    from controller.exporter import fragment
    from controller.loop.learning import calibration_config

    cfg = calibration_config(settings)
    # Turn 1 as the windows saw it (the routers' policy), then as ``policy`` routes it.
    seen_under = (learned.policy or policy).overrides.first_turn_route
    grid = table_grid(build_training_set(learned.windows), policy.table.axes,
                      cfg.recent_windows, seen_under)
    grid = grid.with_first_turn(policy.overrides.first_turn_route)
    export, text = fragment(learned.result.model, grid, policy, cfg.slo, form,
                            traffic_chars_per_token, llmd_chars_per_token)
    doc: dict[str, object] = {**export.to_dict(), "calibration_id": learned.record.id,
                              "training_windows": len(learned.windows), "fragment": text}
    return doc, text


@app.command("export")
def export_command(
    fmt: Annotated[str, typer.Option(
        "--format", help="The peer's rule: dynamo (conditional disaggregation, isl_bounding) "
        "or llm-d (prefix-based-pd-decider nonCachedTokens).")],
    version: Annotated[int | None, typer.Option(
        "--version", min=1, help="Fit for this stored policy version (default: the one the "
        "routers run).")] = None,
    traffic_chars_per_token: Annotated[float | None, typer.Option(
        "--traffic-chars-per-token", min=0.01, help="llm-d: characters per tokenizer token "
        "of your traffic (default: [export] traffic_chars_per_token, 4).")] = None,
    llmd_chars_per_token: Annotated[float | None, typer.Option(
        "--llmd-chars-per-token", min=0.01, help="llm-d: the characters per token its "
        "decider divides prompt bytes by (default: [export] llmd_chars_per_token, 4).")] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Also write the fragment to this file (atomic replace).")] = None,
    as_json: JsonOption = False, url: UrlOption = None, config: ConfigOption = None,
) -> None:
    """Fit a peer router's own rule (Dynamo, llm-d) by predicted goodput and print its config."""
    if fmt not in ("dynamo", "llm-d"):
        typer.echo(f"error: --format must be dynamo or llm-d, got {fmt!r}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    settings, store = settings_and_store(config, url)
    try:
        learned = learned_or_exit(store, settings)
        policy = _policy_or_exit(store, learned, version)
    finally:
        store.close()
    doc, text = export_doc(
        settings, learned, policy, fmt,
        traffic_chars_per_token or settings.export.traffic_chars_per_token,
        llmd_chars_per_token or settings.export.llmd_chars_per_token)
    if output is not None:
        from controller.exporter import write_fragment

        write_fragment(output, text)
    typer.echo(json.dumps(doc) if as_json else text, nl=as_json)
