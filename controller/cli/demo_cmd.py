"""``pdctl demo``: the embedded default, runnable on any laptop with no GPU or services.

Until the simulator and the daemon are wired in, the demo shows the rollout path end to
end: three router agents on 127.0.0.1 (real gRPC servers, persistence on), an all-prefill
policy v1 pushed through the reconciler, then a PPD table v2 (decode-local for short
contexts and low io ratios, prefill-node otherwise), each router's acknowledgement, the
decisions each router makes for a handful of sample requests (over its ``RouterAgentService``),
and a second reconcile that finds nothing to push.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controller.cli._app import app

if TYPE_CHECKING:
    from controller.policy import Features, Policy
    from controller.rollout.reconciler import RouterStatus

DEMO_ROUTERS = 3
DEMO_TIMEOUT_S = 20.0


def ppd_policy(version: int, *, reason: str = "pdctl demo") -> Policy:
    """A PPD-style 10 x 10 x 10 table on the default axes.

    Decode-local where the append is cheap relative to the conversation already on the
    decode worker (context up to 16k tokens, io ratio up to 2) and the router is not
    saturated (qps up to 64); prefill-node elsewhere. The score's sign matches the route
    (> 0: decode-local), its size grows with the distance from the boundary.
    """
    from controller.clock import WallClock
    from controller.policy import Axes, LookupTable, Policy, Provenance, Route

    axes = Axes()
    routes: list[Route] = []
    scores: list[float] = []
    for ctx in axes.context_tokens:
        for io in axes.io_ratio:
            for qps in axes.qps:
                margin = min(
                    math.log2(16384 / ctx), math.log2(2 / io) + 0.5, math.log2(64 / qps) + 0.5
                )
                local = margin >= 0
                routes.append(Route.DECODE_LOCAL if local else Route.PREFILL_NODE)
                scores.append(round((margin + 0.25) / 10 if local else margin / 10, 4))
    table = LookupTable(axes, tuple(routes), tuple(scores), (0.0,) * axes.n_cells)
    return Policy(
        version=version,
        table=table,
        provenance=Provenance(
            created_at=WallClock().utcnow(), reason=reason, created_by="pdctl demo"
        ),
    )


def sample_requests() -> list[tuple[str, Features]]:
    from controller.policy import Features

    return [
        ("first turn", Features(1, 0, 1200, 300, 4.0)),
        ("short follow-up", Features(2, 900, 60, 200, 4.0)),
        ("long context, small append", Features(5, 12000, 150, 400, 8.0)),
        ("huge context", Features(3, 100000, 200, 200, 2.0)),
        ("paste a document", Features(2, 2000, 6000, 200, 4.0)),
        ("busy router", Features(4, 3000, 100, 300, 200.0)),
    ]


@dataclass
class DemoResult:
    routers: list[str]
    pushes: list[tuple[str, dict[str, RouterStatus]]]
    decisions: list[tuple[str, str, Features, Any, int]]
    noop: dict[str, RouterStatus]


async def run_demo(state_dir: Path) -> DemoResult:
    from controller.clock import WallClock
    from controller.policy import Policy, Route
    from controller.rollout.agent import RouterAgent
    from controller.rollout.client import GrpcRouterTransport
    from controller.rollout.reconciler import Reconciler
    from controller.rollout.server import RouterServer

    clock = WallClock()
    servers = []
    transport = GrpcRouterTransport()
    try:
        for i in range(DEMO_ROUTERS):
            agent = RouterAgent(
                router_id=f"router-{i}", clock=clock, state_file=state_dir / f"router-{i}.json"
            )
            server = RouterServer(agent)
            await server.start()
            servers.append(server)
        routers = [s.address for s in servers]
        reconciler = Reconciler(transport, clock, deadline_s=5.0, max_attempts=3)

        pushes = []
        v1 = Policy.uniform(1, Route.PREFILL_NODE)
        pushes.append(
            ("v1: all prefill-node", await reconciler.reconcile(dict.fromkeys(routers, v1)))
        )
        v2 = ppd_policy(2)
        pushes.append(("v2: PPD table", await reconciler.reconcile(dict.fromkeys(routers, v2))))

        decisions = []
        for router in routers:
            for label, features in sample_requests():
                decision, version = await transport.decide(router, features, 5.0)
                decisions.append((router, label, features, decision, version))
        noop = await reconciler.reconcile(dict.fromkeys(routers, v2))
        return DemoResult(routers, pushes, decisions, noop)
    finally:
        await transport.close()
        for server in servers:
            await server.stop(grace=1.0)


def _print(result: DemoResult) -> None:
    from rich.console import Console
    from rich.table import Table

    from controller.policy import Route

    console = Console()
    console.print(
        f"[bold]pdctl demo[/bold]: {len(result.routers)} router agents on loopback "
        "(gRPC, persistence on)"
    )
    for title, statuses in result.pushes:
        table = Table(title=f"push {title}")
        for col in ("router", "outcome", "acked", "checksum", "attempts", "ms"):
            table.add_column(col)
        for router, s in statuses.items():
            table.add_row(
                router, s.outcome, f"v{s.acked_version}", (s.acked_checksum or "")[:12],
                str(s.attempts), f"{s.latency_s * 1000:.1f}",
            )
        console.print(table)

    table = Table(title="decisions (RouterAgentService.Decide)")
    for col in ("router", "request", "turn", "ctx", "append", "out", "qps", "route", "cell",
                "reason", "policy"):
        table.add_column(col)
    for router, label, f, d, version in result.decisions:
        table.add_row(
            router, label, str(f.turn), f"{f.context_tokens:g}", f"{f.append_tokens:g}",
            f"{f.expected_output_tokens:g}", f"{f.qps:g}", d.route.name,
            "-" if d.cell is None else ",".join(map(str, d.cell)), d.reason.value, f"v{version}",
        )
    console.print(table)

    noop_pushes = sum(1 for s in result.noop.values() if s.pushed)
    console.print(
        "re-run reconcile: "
        + ", ".join(f"{r} {s.outcome}" for r, s in result.noop.items())
        + f" ({noop_pushes} pushes)"
    )
    acked = [
        "v" + "/".join(sorted({str(s.acked_version) for s in statuses.values()}))
        for _, statuses in result.pushes
    ]
    routes = [d.route for *_, d, _ in result.decisions]
    console.print(
        f"demo: {len(result.routers)} routers acked {' then '.join(acked)}; decisions: "
        f"{routes.count(Route.DECODE_LOCAL)} DECODE_LOCAL, {routes.count(Route.PREFILL_NODE)} "
        f"PREFILL_NODE; re-run: {'no-op' if noop_pushes == 0 else 'pushed'} "
        f"({noop_pushes} pushes)",
        soft_wrap=True,
    )


def _ok(result: DemoResult) -> bool:
    pushes_ok = all(s.ok for _, st in result.pushes for s in st.values())
    return pushes_ok and all(s.ok and not s.pushed for s in result.noop.values())


@app.command("demo")
def demo(
    timeout_s: Annotated[
        float, typer.Option(min=1.0, help="Give up (exit 1) after this many seconds.")
    ] = DEMO_TIMEOUT_S,
) -> None:
    """Start 3 router agents on loopback, push policies through the reconciler, show decisions."""
    import asyncio
    import tempfile

    async def bounded(state_dir: Path) -> DemoResult:
        return await asyncio.wait_for(run_demo(state_dir), timeout_s)

    with tempfile.TemporaryDirectory(prefix="pdctl-demo-") as tmp:
        try:
            result = asyncio.run(bounded(Path(tmp)))
        except TimeoutError:
            typer.echo(f"demo did not finish within {timeout_s:g} s", err=True)
            raise typer.Exit(1) from None
    _print(result)
    if not _ok(result):
        raise typer.Exit(1)
