"""A tiny multi-turn request generator for engine/cluster tests (no workload package)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from controller.policy import Policy, Route
from controller.sim.cluster import ClusterConfig, SimCluster, SimRequest
from controller.sim.profiles import load_profile


def drive(
    *,
    route: Route = Route.DECODE_LOCAL,
    runs: bool = True,
    sessions: int = 30,
    turns: int = 3,
    gap_s: float = 0.2,
    seed: int = 5,
    cfg: dict[str, object] | None = None,
    before_run: Callable[[SimCluster], None] | None = None,
    until: float = 1e9,
) -> tuple[SimCluster, list[SimRequest], dict[str, int]]:
    """Sessions arriving every ``gap_s``; each later turn 1 s after the previous finishes."""
    prof = load_profile("llama-3.1-8b-h100")
    config = ClusterConfig(**{"prefill_workers": 1, "decode_workers": 3,
                              "closed_form_runs": runs, **(cfg or {})})  # type: ignore[arg-type]
    cluster = SimCluster(config, prof, Policy.uniform(1, route), seed=1)
    rng = random.Random(seed)
    rid = itertools.count()
    done: list[SimRequest] = []
    issued = {"requests": 0, "prompt": 0, "output": 0}

    def submit(session: str, turn: int, prompt: int, new: int) -> None:
        out = rng.randint(2, 300)
        issued["requests"] += 1
        issued["prompt"] += prompt
        issued["output"] += out
        cluster.submit(SimRequest(next(rid), session, turn, 0.0, prompt, new, out, 512,
                                  on_complete=complete))

    def complete(r: SimRequest) -> None:
        done.append(r)
        if r.turn < turns and not r.rejected:
            new = rng.randint(20, 400)
            cluster.loop.at(cluster.loop.now + 1.0, submit, r.session, r.turn + 1,
                            r.prompt + r.output_tokens + new, new)

    for s in range(sessions):
        p = rng.randint(100, 3000)
        cluster.loop.at(s * gap_s, submit, f"s{s}", 1, p, p)
    if before_run is not None:
        before_run(cluster)
    assert cluster.loop.run(until, 10**7)
    return cluster, done, issued
