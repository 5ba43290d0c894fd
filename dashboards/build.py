"""Grafana dashboards for pd-controller, generated from code (grafana-foundation-sdk==0.0.21).

    python dashboards/build.py           # (re)write dashboards/*.json
    python dashboards/build.py --check   # exit 1 if a committed file differs from the code

Every panel reads Prometheus through the ``${datasource}`` variable and uses raw series
(``pdctl_*`` from the controller, ``pdrouter_*`` from the router agents, ``vllm:*`` and
``sglang:*`` from the workers), not the recording rules, so the dashboards work before the
rules are loaded.
Worker panels group by the ``role`` target label that deploy/prometheus/prometheus.yml sets.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

with warnings.catch_warnings():
    # The classic (v1) dashboard JSON is what every Grafana version imports; the SDK warns
    # at import time that it prefers its v2 builders.
    warnings.simplefilter("ignore", DeprecationWarning)
    from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, timeseries
    from grafana_foundation_sdk.cog.builder import Builder
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.common import (
        DataSourceRef,
        LegendDisplayMode,
        LegendPlacement,
    )

OUT_DIR = Path(__file__).resolve().parent
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"

Query = tuple[str, str]  # (PromQL, legend)


def _targets(queries: list[Query]) -> list[prometheus.Dataquery]:
    return [
        prometheus.Dataquery()
        .expr(expr)
        .legend_format(legend)
        .ref_id(chr(ord("A") + i))
        .datasource(DATASOURCE)
        for i, (expr, legend) in enumerate(queries)
    ]


class _Layout:
    """Hands out stable panel ids (Grafana links and alerts refer to them)."""

    def __init__(self) -> None:
        self.next_id = 1

    def take(self) -> int:
        n = self.next_id
        self.next_id += 1
        return n


def series(
    layout: _Layout,
    title: str,
    unit: str,
    queries: list[Query],
    description: str = "",
    width: int = 12,
    min_val: float | None = None,
    max_val: float | None = None,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .id(layout.take())
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .height(8)
        .span(width)
        .legend(
            common.VizLegendOptions()
            .show_legend(True)
            .display_mode(LegendDisplayMode.LIST)
            .placement(LegendPlacement.BOTTOM)
        )
    )
    if min_val is not None:
        panel = panel.min(min_val)
    if max_val is not None:
        panel = panel.max(max_val)
    for target in _targets(queries):
        panel = panel.with_target(target)
    return panel


def single(
    layout: _Layout, title: str, unit: str, queries: list[Query], description: str = ""
) -> stat.Panel:
    panel = (
        stat.Panel()
        .id(layout.take())
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .height(4)
        .span(6)
    )
    for target in _targets(queries):
        panel = panel.with_target(target)
    return panel


def _base(uid: str, title: str, description: str) -> dashboard.Dashboard:
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["pd-controller"])
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .with_variable(
            dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
        )
    )


def _hq(q: float, metric: str, by: str) -> str:
    """p``q`` of a histogram, summed over the other labels."""
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket[{RATE}])))"


def controller_health() -> dashboard.Dashboard:
    lay = _Layout()
    return (
        _base("pdctl-controller", "pd-controller / controller health",
              "The control loop, drift, guardrail and rollout of pd-controller (pdctl_*).")
        .with_row(dashboard.Row("Control loop").id(lay.take()))
        .with_panel(single(lay, "Since last successful cycle", "s", [
            ("time() - max by (instance) (pdctl_last_cycle_success_timestamp_seconds)",
             "{{instance}}"),
        ], "Alert PdControllerStalled fires above 5 min."))
        .with_panel(single(lay, "Leader", "bool", [("pdctl_leader", "{{instance}}")]))
        .with_panel(single(lay, "Paused / pinned", "bool", [
            ("max(pdctl_paused)", "paused"), ("max(pdctl_pinned)", "pinned"),
        ]))
        .with_panel(single(lay, "Desired policy version", "none", [
            ("max(pdctl_desired_policy_version)", "desired"),
        ]))
        .with_panel(series(lay, "Cycles by result", "ops", [
            (f"sum by (result) (rate(pdctl_cycles_total[{RATE}]))", "{{result}}"),
        ]))
        .with_panel(series(lay, "Cycle duration", "s", [
            (_hq(0.5, "pdctl_cycle_duration_seconds", "instance"), "p50 {{instance}}"),
            (_hq(0.99, "pdctl_cycle_duration_seconds", "instance"), "p99 {{instance}}"),
        ]))
        .with_panel(series(lay, "Job duration p90", "s", [
            (_hq(0.9, "pdctl_job_duration_seconds", "job"), "{{job}}"),
        ]))
        .with_panel(series(lay, "Job runs skipped", "ops", [
            (f"sum by (job, reason) (rate(pdctl_job_skipped_total[{RATE}]))",
             "{{job}} {{reason}}"),
        ]))
        .with_row(dashboard.Row("Drift and calibration").id(lay.take()))
        .with_panel(series(lay, "Drift statistic vs threshold", "none", [
            ("max by (detector, feature) (pdctl_drift_statistic)", "{{detector}} {{feature}}"),
            ("max by (detector, feature) (pdctl_drift_threshold)",
             "threshold {{detector}} {{feature}}"),
        ], "A drift event is raised when a statistic crosses its threshold."))
        .with_panel(series(lay, "Drift events and recalibrations", "ops", [
            (f"sum by (detector) (rate(pdctl_drift_events_total[{RATE}]))",
             "drift {{detector}}"),
            (f"sum by (trigger) (rate(pdctl_recalibrations_total[{RATE}]))",
             "recalibration {{trigger}}"),
        ]))
        .with_panel(series(lay, "Guardrail decisions", "ops", [
            (f"sum by (decision) (rate(pdctl_guardrail_decisions_total[{RATE}]))",
             "{{decision}}"),
        ]))
        .with_panel(series(lay, "Predicted goodput", "percentunit", [
            ("max by (policy) (pdctl_predicted_goodput_ratio)", "{{policy}}"),
        ], min_val=0, max_val=1))
        .with_row(dashboard.Row("Rollout").id(lay.take()))
        .with_panel(series(lay, "Policy version per router: desired vs acknowledged", "none", [
            ("max by (router) (pdctl_router_desired_version)", "desired {{router}}"),
            ("max by (router) (pdctl_router_acked_version)", "acked {{router}}"),
        ], "Alert PdRouterBehindDesiredVersion fires after 10 min of disagreement."))
        .with_panel(series(lay, "Canary state", "bool", [
            ("max by (state) (pdctl_canary_state)", "{{state}}"),
        ]))
        .with_panel(series(lay, "Rollbacks in the last hour", "none", [
            ("sum by (by) (increase(pdctl_rollbacks_total[1h]))", "{{by}}"),
        ], "canary: the judge; watch: a promotion whose fleet goodput fell; operator. Alert "
           "PdPolicyRollbacksRepeated fires at 3 automatic ones in 6 h."))
        .with_panel(series(lay, "Push latency p90 per router", "s", [
            (_hq(0.9, "pdctl_push_duration_seconds", "router"), "{{router}}"),
        ]))
        .with_panel(series(lay, "Failed pushes per router", "ops", [
            (f'sum by (router, result) (rate(pdctl_push_total{{result!="ok"}}[{RATE}]))',
             "{{router}} {{result}}"),
        ]))
    )


def routing() -> dashboard.Dashboard:
    lay = _Layout()
    requests = "pdrouter_requests_total"
    decisions = "pdrouter_decisions_total"
    return (
        _base("pdctl-routing", "pd-controller / routing",
              "What the routers decide: decode-local share per feature cell, exploration, "
              "policy versions (pdrouter_*).")
        .with_row(dashboard.Row("Decisions").id(lay.take()))
        .with_panel(series(lay, "Decode-local share per cell (context bin, io-ratio bin)",
                           "percentunit", [
            (f'sum by (ctx_bin, io_bin) (rate({requests}{{route="DECODE_LOCAL"}}[{RATE}]))'
             f" / sum by (ctx_bin, io_bin) (rate({requests}[{RATE}]))",
             "ctx≤{{ctx_bin}} io≤{{io_bin}}"),
        ], "Share of completed requests routed decode-local in each fixed feature cell.",
            width=24, min_val=0, max_val=1))
        .with_panel(series(lay, "Decode-local and exploration share", "percentunit", [
            (f'sum(rate({decisions}{{route="DECODE_LOCAL"}}[{RATE}]))'
             f" / sum(rate({decisions}[{RATE}]))", "decode-local"),
            (f'sum(rate({decisions}{{reason="explore"}}[{RATE}]))'
             f" / sum(rate({decisions}[{RATE}]))", "exploration"),
            # Turn 1 sent decode-local because every prefill worker was busy, over all turn 1.
            (f'sum(rate({decisions}{{reason="busy_prefill"}}[{RATE}]))'
             f' / sum(rate({decisions}{{reason=~"first_turn|busy_prefill"}}[{RATE}]))',
             "turn 1 diverted (busy prefill)"),
            # Later turns the table sent to a prefill node, diverted the same way, over every
            # later turn that consulted the table.
            (f'sum(rate({decisions}{{reason="busy_later_turn"}}[{RATE}]))'
             f' / sum(rate({decisions}{{reason=~"table|explore|busy_later_turn"}}[{RATE}]))',
             "later turns diverted (busy prefill)"),
        ], "Diverted: the share of first turns (overrides.first_turn_busy_waiting) and of "
           "later turns that consulted the table (overrides.later_turn_busy_waiting) the busy "
           "overrides sent decode-local.", min_val=0, max_val=1))
        .with_panel(series(lay, "Exploration share per router", "percentunit", [
            (f'sum by (instance) (rate({decisions}{{reason="explore"}}[{RATE}]))'
             f" / sum by (instance) (rate({decisions}[{RATE}]))", "{{instance}}"),
        ], min_val=0, max_val=1))
        .with_panel(series(lay, "Decisions by route and reason", "ops", [
            (f"sum by (route, reason) (rate({decisions}[{RATE}]))", "{{route}} {{reason}}"),
        ]))
        .with_panel(series(lay, "Arrival rate per router", "reqps", [
            ("pdrouter_qps", "{{instance}}"),
        ]))
        .with_row(dashboard.Row("Policy").id(lay.take()))
        .with_panel(series(lay, "Policy version per router", "none", [
            ("pdrouter_policy_version", "{{instance}}"),
        ]))
        .with_panel(series(lay, "Policy age per router", "s", [
            ("pdrouter_policy_age_seconds", "{{instance}}"),
        ]))
        .with_panel(series(lay, "Stale routers", "none", [
            ("sum(pdrouter_policy_stale)", "stale routers"),
        ], "Alert PdRouterPolicyStale fires after 5 min."))
        .with_panel(series(lay, "Policy updates by result", "ops", [
            (f"sum by (result) (rate(pdrouter_updates_total[{RATE}]))", "{{result}}"),
        ]))
        .with_row(dashboard.Row("Workload").id(lay.take()))
        .with_panel(series(lay, "Context tokens (p50, p90)", "short", [
            (_hq(0.5, "pdrouter_context_tokens", "job"), "p50"),
            (_hq(0.9, "pdrouter_context_tokens", "job"), "p90"),
        ]))
        .with_panel(series(lay, "Append/output ratio (p50, p90)", "none", [
            (_hq(0.5, "pdrouter_io_ratio", "job"), "p50"),
            (_hq(0.9, "pdrouter_io_ratio", "job"), "p90"),
        ]))
        .with_row(dashboard.Row("Router data plane (pdctl router serve)").id(lay.take()))
        .with_panel(series(lay, "Routes executed", "reqps", [
            (f"sum by (route) (rate(pdrouter_routes_executed_total[{RATE}]))", "{{route}}"),
        ], "What ran after any fallback (decisions are above)."))
        .with_panel(series(lay, "Fallbacks and decode failures", "ops", [
            (f"sum by (reason) (rate(pdrouter_fallbacks_total[{RATE}]))",
             "fallback {{reason}}"),
            (f"sum by (reason, after_prefill) (rate(pdrouter_decode_failures_total[{RATE}]))",
             "decode {{reason}} after_prefill={{after_prefill}}"),
            (f"sum by (stage) (rate(pdrouter_client_disconnects_total[{RATE}]))",
             "client hung up ({{stage}})"),
        ], "Prefill legs that failed (one retry on another P, then decode-local), decode "
           "legs that failed (after_prefill=true pins P's blocks until vLLM's abort timeout) "
           "and clients that hung up."))
        .with_panel(series(lay, "Added latency: the router's own time before the first leg",
                           "s", [
            (_hq(0.5, "pdrouter_overhead_seconds", "job"), "p50"),
            (_hq(0.99, "pdrouter_overhead_seconds", "job"), "p99"),
        ], "Parse, tokenize, decide and pick per request (pdrouter_overhead_seconds)."))
        .with_panel(series(lay, "Answers by HTTP status", "reqps", [
            (f"sum by (code) (rate(pdrouter_http_responses_total[{RATE}]))", "{{code}}"),
            (f"sum by (reason) (rate(pdrouter_http_rejected_total[{RATE}]))",
             "refused: {{reason}}"),
        ], "Every answer by status; requests refused before routing by reason (headers or "
           "framing HTTP cannot parse, a body too large, not UTF-8, not JSON, not routable)."))
    )


def slos() -> dashboard.Dashboard:
    lay = _Layout()
    requests = "pdrouter_requests_total"
    return (
        _base("pdctl-slo", "pd-controller / SLOs",
              "Goodput (requests meeting both TTFT and TPOT SLOs) and latency per route, as "
              "measured by the routers.")
        .with_row(dashboard.Row("Goodput").id(lay.take()))
        .with_panel(series(lay, "Goodput", "percentunit", [
            (f'sum(rate({requests}{{slo="met"}}[{RATE}])) / sum(rate({requests}[{RATE}]))',
             "all"),
            (f'sum by (route) (rate({requests}{{slo="met"}}[{RATE}]))'
             f" / sum by (route) (rate({requests}[{RATE}]))", "{{route}}"),
        ], "Objective 95% (the burn-rate alerts in deploy/prometheus/rules.yml).",
            min_val=0, max_val=1))
        .with_panel(series(lay, "Error budget burn rate (1h)", "none", [
            (f'(sum(rate({requests}{{slo!="met"}}[1h])) / sum(rate({requests}[1h]))) / 0.05',
             "burn rate"),
        ], "1 = spending the 5% budget exactly; the fast-burn alert pages above 14.4."))
        .with_panel(series(lay, "Requests by SLO outcome", "reqps", [
            (f"sum by (slo) (rate({requests}[{RATE}]))", "{{slo}}"),
        ]))
        .with_panel(series(lay, "Requests by route", "reqps", [
            (f"sum by (route) (rate({requests}[{RATE}]))", "{{route}}"),
        ]))
        .with_row(dashboard.Row("Latency per route").id(lay.take()))
        .with_panel(series(lay, "TTFT per route (p50, p90)", "s", [
            (_hq(0.5, "pdrouter_ttft_seconds", "route"), "p50 {{route}}"),
            (_hq(0.9, "pdrouter_ttft_seconds", "route"), "p90 {{route}}"),
        ]))
        .with_panel(series(lay, "TPOT per route (p50, p90)", "s", [
            (_hq(0.5, "pdrouter_tpot_seconds", "route"), "p50 {{route}}"),
            (_hq(0.9, "pdrouter_tpot_seconds", "route"), "p90 {{route}}"),
        ]))
        .with_panel(series(lay, "TTFT p90 per route and context bin", "s", [
            (_hq(0.9, "pdrouter_ttft_seconds", "route, ctx_bin"), "{{route}} ctx≤{{ctx_bin}}"),
        ], width=24))
    )


# One value per SGLang scheduler: with --enable-metrics-for-all-schedulers every TP rank
# repeats it; priority="" is the total beside the per-class series (or no such label).
_SG_RANKS = "max without (tp_rank, pp_rank, moe_ep_rank)"


def _sg(metric: str) -> str:
    return f'{_SG_RANKS} ({metric}{{priority=""}})'


def _worker_latency(board: dashboard.Dashboard, lay: _Layout) -> dashboard.Dashboard:
    return (
        board
        .with_row(dashboard.Row("Latency by role").id(lay.take()))
        .with_panel(series(lay, "Queue time p90 by role", "s", [
            (_hq(0.9, "vllm:request_queue_time_seconds", "role"), "vLLM {{role}}"),
            (_hq(0.9, "sglang:queue_time_seconds", "role"), "SGLang {{role}}"),
        ]))
        .with_panel(series(lay, "KV transfer time p50, p90", "s", [
            (_hq(0.5, "vllm:nixl_xfer_time_seconds", "role"), "vLLM NIXL p50 {{role}}"),
            (_hq(0.9, "vllm:nixl_xfer_time_seconds", "role"), "vLLM NIXL p90 {{role}}"),
            (_hq(0.5, "sglang:kv_transfer_latency_ms", "role") + " / 1000",
             "SGLang p50 {{role}}"),
            (_hq(0.9, "sglang:kv_transfer_latency_ms", "role") + " / 1000",
             "SGLang p90 {{role}}"),
        ], description="vLLM records a transfer on the side that initiates it (decode in "
           "NIXL pull mode), SGLang on the prefill side (ms, shown in seconds)."))
        .with_panel(series(lay, "TPOT p90 by role", "s", [
            (_hq(0.9, "vllm:request_time_per_output_token_seconds", "role"), "vLLM {{role}}"),
            (_hq(0.9, "sglang:request_time_per_output_token_seconds", "role"),
             "SGLang {{role}}"),
        ]))
        .with_panel(series(lay, "TTFT p90 by role", "s", [
            (_hq(0.9, "vllm:time_to_first_token_seconds", "role"), "vLLM {{role}}"),
            (_hq(0.9, "sglang:time_to_first_token_seconds", "role"), "SGLang {{role}}"),
        ]))
    )


def _worker_load(board: dashboard.Dashboard, lay: _Layout) -> dashboard.Dashboard:
    return (
        board
        .with_row(dashboard.Row("Load").id(lay.take()))
        .with_panel(series(lay, "Running and waiting requests per worker", "short", [
            ('sum by (role, instance) (vllm:num_requests_running)',
             "running {{role}} {{instance}}"),
            ('sum by (role, instance) (vllm:num_requests_waiting)',
             "waiting {{role}} {{instance}}"),
            (f"sum by (role, instance) ({_sg('sglang:num_running_reqs')})",
             "running {{role}} {{instance}}"),
            (f"sum by (role, instance) ({_sg('sglang:num_queue_reqs')})",
             "waiting {{role}} {{instance}}"),
        ]))
        .with_panel(series(lay, "KV-cache usage per worker", "percentunit", [
            ("max by (role, instance) (vllm:kv_cache_usage_perc)", "{{role}} {{instance}}"),
            ("max by (role, instance) (sglang:token_usage)", "{{role}} {{instance}}"),
        ], min_val=0, max_val=1))
        .with_panel(series(lay, "Prompt and generation tokens by role", "short", [
            (f"sum by (role) (rate(vllm:prompt_tokens_total[{RATE}]))", "vLLM prompt {{role}}"),
            (f"sum by (role) (rate(vllm:generation_tokens_total[{RATE}]))",
             "vLLM generation {{role}}"),
            (f"sum by (role) (rate(sglang:prompt_tokens_total[{RATE}]))",
             "SGLang prompt {{role}}"),
            (f"sum by (role) (rate(sglang:generation_tokens_total[{RATE}]))",
             "SGLang generation {{role}}"),
        ]))
        .with_panel(series(lay, "Finished requests by outcome", "reqps", [
            (f"sum by (role, finished_reason) (rate(vllm:request_success_total[{RATE}]))",
             "vLLM {{finished_reason}} {{role}}"),
            (f"sum by (role) (rate(sglang:num_requests_total[{RATE}]))",
             "SGLang finished {{role}}"),
            (f"sum by (role) (rate(sglang:num_aborted_requests_total[{RATE}]))",
             "SGLang aborted {{role}}"),
        ], description="vLLM labels each finished request with its reason: abort and error "
           "were not served. SGLang's finished count includes its aborted requests."))
        .with_panel(series(lay, "Preemptions and failed KV transfers", "ops", [
            (f"sum by (role) (rate(vllm:num_preemptions_total[{RATE}]))",
             "vLLM preemptions {{role}}"),
            (f"sum by (role) (rate(vllm:nixl_num_failed_transfers_total[{RATE}]))",
             "vLLM failed transfers {{role}}"),
            (f"sum by (role) ({_SG_RANKS} "
             f"(rate(sglang:num_transfer_failed_reqs_total[{RATE}])))",
             "SGLang failed transfers {{role}}"),
        ]))
    )


def workers() -> dashboard.Dashboard:
    lay = _Layout()
    board = _base("pdctl-workers", "pd-controller / P/D workers",
                  "Prefill and decode workers, vLLM (0.11.2 on) and SGLang (0.5) series side by "
                  "side (docs/engines.md), by the role target label.")
    board = _worker_load(_worker_latency(board, lay), lay)
    return (
        board
        .with_row(dashboard.Row("Capacity").id(lay.take()))
        .with_panel(series(lay, "Recommended vs answering workers by role", "short", [
            ("max by (role) (pdctl_recommended_workers)", "recommended {{role}}"),
            ('count by (role) (up{role=~"prefill|decode"} == 1)', "answering {{role}}"),
        ], description="The leader's capacity recommendation (load and SLOs with headroom; "
           "what the HorizontalPodAutoscalers in deploy/kubernetes/autoscaling.yaml follow) "
           "against the worker targets Prometheus scrapes successfully."))
        .with_panel(series(lay, "Predicted utilisation at the recommendation", "percentunit", [
            ("max by (role) (pdctl_capacity_utilisation)", "{{role}}"),
            ("max by (role) (pdctl_capacity_extrapolated)", "extrapolated {{role}}"),
        ], description="Demand / (recommended workers x per-worker capacity within the SLO). "
           "extrapolated = 1: the fitted model was used beyond the observed load.",
           min_val=0, max_val=1))
    )


DASHBOARDS: dict[str, Callable[[], dashboard.Dashboard]] = {
    "controller-health.json": controller_health,
    "routing.json": routing,
    "slo.json": slos,
    "workers.json": workers,
}


def render(board: Builder[Any]) -> str:
    """Stable JSON text of a dashboard: sorted keys, two-space indent, final newline."""
    return json.dumps(board.build(), cls=JSONEncoder, sort_keys=True, indent=2) + "\n"


def panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel of a rendered dashboard, rows included, nested ones flattened."""
    out: list[dict[str, Any]] = []
    for p in doc.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="fail if a file is out of date")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output directory")
    args = parser.parse_args(argv)
    stale = []
    for name, make in DASHBOARDS.items():
        text = render(make())
        path: Path = args.out / name
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"out of date (run python dashboards/build.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

