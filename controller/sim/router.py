"""The simulated router: session affinity, features as a real router computes them, and
every decision through the policy issue's :class:`RouterAgent`.

Features (DESIGN §2): ``context_tokens`` = prompt tokens the session's decode worker holds
(its prefix-cache hit for this prompt), ``append_tokens`` = prompt - that,
``expected_output_tokens`` = the request's ``max_tokens`` (never the true output length),
``qps`` = this router's arrival rate over a sliding window, ``prefill_waiting`` = requests
waiting on the least-busy prefill worker (what a router reads off the prefill workers'
``vllm:num_requests_waiting``; exact here, where a real router's view lags by its scrape).

``decider`` (optional, default None): a rule that replaces the table for this router's
decisions (the bench's ``threshold`` baseline). It gets the features and the full prompt
length and returns the :class:`Decision`; outcomes still go through the agent.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from controller.clock import Clock
from controller.policy import Decision, Features, Policy
from controller.rollout.agent import RouterAgent
from controller.rollout.qps import QpsMeter

# (features, prompt tokens) -> decision: a rule-based router instead of the table.
Decider = Callable[[Features, int], Decision]


class SimRouter:
    def __init__(
        self,
        index: int,
        clock: Clock,
        policy: Policy | None,
        *,
        seed: int,
        qps_window_s: float = 10.0,
    ) -> None:
        self.index = index
        self.router_id = f"sim-router-{index}"
        self.agent = RouterAgent(
            router_id=self.router_id,
            clock=clock,
            draw=random.Random(seed).random,
            initial_policy=policy,
        )
        self.qps = QpsMeter(clock, window_s=qps_window_s)
        self.decisions = 0
        self.decider: Decider | None = None

    def decide(self, turn: int, context_tokens: int, prompt_tokens: int,
               max_tokens: int, prefill_waiting: int | None = None
               ) -> tuple[Features, Decision]:
        self.qps.note_arrival()
        features = Features(
            turn=turn,
            context_tokens=float(context_tokens),
            append_tokens=float(prompt_tokens - context_tokens),
            expected_output_tokens=float(max_tokens),
            qps=self.qps.rate(),
            prefill_waiting=None if prefill_waiting is None else float(prefill_waiting),
        )
        self.decisions += 1
        if self.decider is not None:
            return features, self.decider(features, prompt_tokens)
        return features, self.agent.decide(features)

    def observe(self, decision: Decision, ttft_s: float, tpot_s: float | None,
                features: Features) -> str:
        return self.agent.observe(decision, ttft_s, tpot_s, features)
