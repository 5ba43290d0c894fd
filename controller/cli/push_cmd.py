"""``pdctl push POLICY.json --router HOST:PORT ...``: one reconcile pass, printed per router.

Routers come from ``--router`` (repeatable) or, without it, ``[routers] targets`` of the
config. Security, deadlines, retries and concurrency come from ``[security]`` and
``[rollout]``. Exit 0 when every router acknowledged the policy, 1 when any did not, 2 for
bad input (unreadable or invalid policy file, no routers, invalid config).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from controller.cli._app import app, load_settings_or_exit, table_console
from controller.cli.shown import shown

if TYPE_CHECKING:
    from controller.rollout.reconciler import RouterStatus


def _print_table(statuses: dict[str, RouterStatus], version: int, rollback: bool) -> None:
    from rich.table import Table
    from rich.text import Text

    console = table_console()
    kind = "rollback to" if rollback else "push of"
    table = Table(title=f"{kind} policy v{version}")
    for col in ("router", "ok", "outcome", "acked", "checksum", "attempts", "ms"):
        table.add_column(col, no_wrap=True)
    for router, s in statuses.items():
        acked = "-" if s.acked_version is None else f"v{s.acked_version}"
        if s.reissued_as is not None:
            acked += " (re-issued)"
        table.add_row(
            shown(router, markup=True),
            "[green]yes[/green]" if s.ok else "[red]no[/red]",
            shown(s.outcome, markup=True),
            acked,
            shown((s.acked_checksum or "")[:12], markup=True),
            str(s.attempts),
            f"{s.latency_s * 1000:.1f}",
        )
    console.print(table)
    for router, s in statuses.items():
        if s.last_error:
            console.print(Text.assemble((shown(router), "red"), ": ", shown(s.last_error)),
                          soft_wrap=True)


@app.command("push")
def push(
    policy_file: Annotated[Path, typer.Argument(help="Policy JSON file (schema_version 1).")],
    router: Annotated[
        list[str] | None,
        typer.Option("--router", "-r", help="Router agent HOST:PORT (repeatable)."),
    ] = None,
    rollback: Annotated[
        bool, typer.Option("--rollback", help="Apply the file's version even where it is "
                           "lower than the router's own (without it, the same table is "
                           "re-issued above that router's version).")
    ] = False,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="TOML config ([security], [rollout]).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Push a policy to routers once (only where it differs) and print each router's result.

    A router ahead of the file's version (or at it with other content) gets the table under
    a new version above its own, shown as "(re-issued)"; --rollback applies the file's
    version as it is to a router ahead (one at that version with other content still gets
    it re-issued: two tables never share a version). Exit 0 every router acknowledged, 1
    any did not, 2 bad input.

    This push is not recorded in the store: with `pdctl run` leading, the daemon brings the
    routers back to its desired version on its next cycle (use `pdctl rollback` there)."""
    import asyncio

    from controller.clock import WallClock
    from controller.config import check_host_port, token_without_tls_problem
    from controller.errors import ConfigError
    from controller.policy import PolicyValidationError, loads
    from controller.rollout.client import GrpcRouterTransport
    from controller.rollout.reconciler import Reconciler, reissued_versions

    settings = load_settings_or_exit(config)
    try:
        policy = loads(policy_file.read_bytes())
    except OSError as e:
        typer.echo(f"cannot read {policy_file}: {e}", err=True)
        raise typer.Exit(2) from None
    except PolicyValidationError as e:
        typer.echo(f"{policy_file}: {e}", err=True)
        raise typer.Exit(2) from None
    from controller.rollout.codec import MAX_MESSAGE_BYTES, policy_to_proto, too_large

    if (size := policy_to_proto(policy).ByteSize()) > MAX_MESSAGE_BYTES:
        typer.echo(f"{policy_file}: {too_large(size)}", err=True)
        raise typer.Exit(2)
    routers = list(router or settings.routers.targets)
    if not routers:
        typer.echo("no routers: pass --router HOST:PORT or set [routers] targets", err=True)
        raise typer.Exit(2)
    for address in router or []:
        try:
            check_host_port(address)
        except ValueError as e:
            typer.echo(f"--router {address}: {e}", err=True)
            raise typer.Exit(2) from None
    if problem := token_without_tls_problem(settings.security, router or [], "--router"):
        typer.echo(problem, err=True)
        raise typer.Exit(2)

    async def once() -> dict[str, RouterStatus]:
        transport = GrpcRouterTransport(settings.security)
        try:
            reconciler = Reconciler.from_config(transport, WallClock(), settings.rollout)
            return await reconciler.reconcile(dict.fromkeys(routers, policy), rollback=rollback)
        finally:
            await transport.close()

    try:
        statuses = asyncio.run(once())
    except ConfigError as e:  # unreadable certificates or token file
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "version": policy.version,
                    "checksum": policy.checksum,
                    "rollback": rollback,
                    "reissued_as": sorted(set(reissued_versions(statuses).values())),
                    "routers": [asdict(s) for s in statuses.values()],
                },
                indent=1,
            )
        )
    else:
        _print_table(statuses, policy.version, rollback)
        for version in sorted(set(reissued_versions(statuses).values())):
            why = "with other content" if rollback else "with other content, or a later one"
            typer.echo(
                f"note: a router ran v{policy.version} {why}; the same policy now runs as "
                f"v{version} - use v{version} as the desired version from now on"
            )
    if not all(s.ok for s in statuses.values()):
        raise typer.Exit(1)
