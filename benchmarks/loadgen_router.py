"""A real load generator (GuideLLM, from PyPI) against ``pdctl router serve``, outside CI.

Run from the repository root, once the generator is installed in its own environment (it
pulls in torch, transformers and datasets, about 1.5 GB; never into the project's ``.venv``):

    python3 -m venv .venv-loadgen
    .venv-loadgen/bin/pip install torch==2.13.0 -e '.[loadgen]'   # the CPU torch wheel
    .venv/bin/python benchmarks/loadgen_router.py [--requests 200] [--rate 10]
        [--prompt-tokens 512] [--output-tokens 64] [--max-seconds 120]
        [--scenario scenarios/ppd-2p2d.toml] [--guidellm .venv-loadgen/bin/guidellm]

What it does: starts the simulated vLLM workers (``pdctl sim serve SCENARIO --workers-only
--write-config``) and the real router in front of them (``pdctl router serve`` with the
written config), runs ``guidellm run`` against the router's OpenAI endpoint (streamed chat
completions, synthetic prompts, a constant ``--rate``, at most ``--requests`` requests and
``--max-seconds`` seconds), then reads GuideLLM's JSON report and the router's ``/metrics``
and prints one JSON line: both request counts and whether they are equal, and GuideLLM's
TTFT / ITL / throughput figures.

Offline: GuideLLM loads the repository's own tokenizer (``controller/tokenize``'s bundled
``tokenizer.json`` with its ``tokenizer_config.json``) through transformers, with
``HF_HUB_OFFLINE=1``: nothing is fetched from a model hub. Exit status 0 when the counts
are equal and GuideLLM completed every request, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from controller.tokenize import bundled_tokenizer_dir  # noqa: E402
from tests.support.processes import PDCTL, sim_serve  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def scenario_doc(args: argparse.Namespace, target: str, model: str, out: Path) -> dict[str, Any]:
    """GuideLLM's run spec: streamed chat at a constant rate, bounded in count and time."""
    return {"spec": {
        "backend": {"kind": "openai_http", "target": target, "model": model,
                    "request_format": "/v1/chat/completions", "stream": True},
        "profile": {"kind": "constant", "rate": [args.rate]},
        "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
                  "output_tokens": args.output_tokens}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(args.tokenizer)},
        "constraints": [{"kind": "max_requests", "count": args.requests},
                        {"kind": "max_duration", "seconds": args.max_seconds}],
        "outputs": [{"kind": "json", "path": str(out)}],
    }}


def router_counts(base: str) -> dict[str, float]:
    """The router's own counters: answers on the chat endpoint by status, routes executed,
    completion tokens relayed."""
    text = httpx.get(base + "/metrics", timeout=10.0, trust_env=False).text
    got: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "pdrouter_http_responses_total" and s.labels.get(
                    "endpoint") == "/v1/chat/completions":
                key = f"responses_{s.labels['code']}"
                got[key] = got.get(key, 0.0) + s.value
            elif s.name == "pdrouter_routes_executed_total":
                key = f"routes_{s.labels['route']}"
                got[key] = got.get(key, 0.0) + s.value
            elif s.name == "pdrouter_completion_tokens_total":
                got["completion_tokens"] = got.get("completion_tokens", 0.0) + s.value
    return got


def wait_health(base: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{base}/health did not answer 200 within {timeout_s:.0f} s")


def metric(summary: Any, stat: str) -> float | None:
    """One statistic of a GuideLLM metric (its ``successful`` requests' distribution)."""
    if not isinstance(summary, dict):
        return None
    dist = summary.get("successful", summary)
    if not isinstance(dist, dict):
        return None
    if stat.startswith("p"):
        pct = dist.get("percentiles") or {}
        value = pct.get(stat)
    else:
        value = dist.get(stat)
    return round(float(value), 3) if isinstance(value, (int, float)) else None


def report_figures(report: dict[str, Any]) -> dict[str, Any]:
    """Request counts and the latency / throughput figures of GuideLLM's one benchmark."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    totals = m["request_totals"]
    state = bench["scheduler_state"]
    figures: dict[str, Any] = {
        "guidellm_requests": {k: totals.get(k) for k in ("successful", "errored",
                                                          "incomplete", "total")},
        # What its scheduler sent, and what it still held as in flight when it stopped.
        "guidellm_scheduler": {k: state.get(k) for k in ("created_requests",
                                                          "processing_requests",
                                                          "processed_requests")},
    }
    for name, key in (("ttft_ms", "time_to_first_token_ms"),
                      ("itl_ms", "inter_token_latency_ms"),
                      ("request_latency_s", "request_latency")):
        figures[name] = {s: metric(m.get(key), s) for s in ("mean", "median", "p99")}
    figures["guidellm_output_tokens"] = metric(m.get("output_token_count"), "total_sum")
    figures["requests_per_s"] = metric(m.get("requests_per_second"), "mean")
    figures["output_tokens_per_s"] = metric(m.get("output_tokens_per_second"), "mean")
    return figures


def run_guidellm(args: argparse.Namespace, target: str, model: str, tmp: Path
                 ) -> dict[str, Any]:
    out = tmp / "guidellm.json"
    spec = tmp / "guidellm-scenario.json"
    spec.write_text(json.dumps(scenario_doc(args, target, model, out)))
    cmd = [str(args.guidellm), "run", "--scenario", str(spec), "--disable-console-interactive"]
    env = {**os.environ, **OFFLINE, "HF_HOME": str(tmp / "hf-home")}
    with (tmp / "guidellm.log").open("wb") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,  # noqa: S603
                              timeout=args.max_seconds + 180, check=False)
    if proc.returncode != 0 or not out.exists():
        tail = (tmp / "guidellm.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"guidellm exited {proc.returncode}:\n{tail}")
    report: dict[str, Any] = json.loads(out.read_text())
    if args.keep_report is not None:
        args.keep_report.write_text(out.read_text())
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", type=Path, default=REPO / "scenarios" / "ppd-2p2d.toml")
    ap.add_argument("--guidellm", type=Path, default=REPO / ".venv-loadgen" / "bin" / "guidellm")
    ap.add_argument("--tokenizer", type=Path, default=bundled_tokenizer_dir())
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=10.0, help="requests/s (constant)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--max-seconds", type=float, default=120.0)
    ap.add_argument("--keep-report", type=Path, help="copy GuideLLM's JSON report here")
    args = ap.parse_args()
    if not args.guidellm.exists():
        print(f"{args.guidellm} not found: install GuideLLM first (see the docstring)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        with sim_serve(args.scenario, "--workers-only", "--write-config",
                       str(tmp / "pd.toml")) as (addresses, _):
            router_cfg = addresses["configs"]["router"]
            base = addresses["router"]["openai"].removesuffix("/v1")
            with (tmp / "router.log").open("wb") as rlog:
                router = subprocess.Popen([*PDCTL, "router", "serve", "--config", router_cfg],  # noqa: S603
                                          cwd=REPO, stdout=subprocess.DEVNULL, stderr=rlog)
            try:
                wait_health(base)
                before = router_counts(base)
                report = run_guidellm(args, base, addresses["model"], tmp)
                after = router_counts(base)
            finally:
                router.terminate()
                router.wait(15)
    return print_result(args, report, before, after)


def print_result(args: argparse.Namespace, report: dict[str, Any],
                 before: dict[str, float], after: dict[str, float]) -> int:
    figures = report_figures(report)
    delta = {k: int(after.get(k, 0.0) - before.get(k, 0.0)) for k in after}
    routed = sum(v for k, v in delta.items() if k.startswith("responses_"))
    total = figures["guidellm_requests"]["total"]
    ok = figures["guidellm_requests"]["successful"]
    result = {"requests_asked": args.requests, "rate": args.rate,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
              "guidellm_requests_total": total, "router_responses_total": routed,
              "router_counters": delta, "counts_equal": total == routed,
              **figures}
    print(json.dumps(result), flush=True)
    return 0 if total == routed and ok == total else 1


if __name__ == "__main__":
    sys.exit(main())
