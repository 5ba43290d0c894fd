"""Config files ``pdctl sim serve --write-config`` writes for the cluster it started.

- the daemon's (``pdctl run --config FILE``; the schema of ``controller/config.py``): the
  workers' metrics targets, the routers' gRPC and metrics addresses, an SQLite store beside
  the file, the scenario's SLOs and control interval, and the short bake/drift settings the
  demo uses, so a first run learns within minutes;
- with ``--workers-only``, the router's (``pdctl router serve --config FILE``): the prefill
  and decode workers' URLs, the served model, the tokenizer the workers count with, and the
  HTTP/gRPC addresses the daemon's file points at.

Both are plain TOML; :func:`to_toml` writes the subset they need.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from controller.sim.scenario import Scenario


def hostport(url: str) -> str:
    """``http://127.0.0.1:9400/metrics`` -> ``127.0.0.1:9400``."""
    return url.split("//", 1)[1].split("/", 1)[0]


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"TOML: {v} is not a finite number")
        return repr(v)
    if isinstance(v, str | Path):
        return json.dumps(str(v))  # JSON's escapes are valid in TOML basic strings
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"TOML: cannot write {type(v).__name__}")


def to_toml(doc: Mapping[str, Any], header: str = "") -> str:
    """Top-level scalars first, then one ``[table]`` per mapping (one level of nesting)."""
    lines = [f"# {h}" for h in header.splitlines()]
    scalars = {k: v for k, v in doc.items() if not isinstance(v, Mapping)}
    lines += [f"{k} = {_value(v)}" for k, v in scalars.items()]
    for k, v in doc.items():
        if isinstance(v, Mapping):
            lines += ["", f"[{k}]"] + [f"{kk} = {_value(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


def daemon_config(addresses: Mapping[str, Any], scenario: Scenario, store_url: str,
                  routers: list[tuple[str, str]], metrics_listen: str | None) -> dict[str, Any]:
    """The daemon's settings; ``routers`` are (gRPC HOST:PORT, metrics HOST:PORT) pairs."""
    workers = addresses["workers"]
    interval = scenario.interval_s
    doc: dict[str, Any] = {
        "prefill_pool": {"nodes": [hostport(w["metrics"]) for w in workers
                                   if w["role"] == "prefill"]},
        "decode_pool": {"nodes": [hostport(w["metrics"]) for w in workers
                                  if w["role"] == "decode"]},
        "routers": {"targets": [g for g, _ in routers],
                    "metrics_targets": [m for _, m in routers]},
        "store": {"url": store_url},
        "metrics": ({"enable": True, "listen": metrics_listen} if metrics_listen
                    else {"enable": False}),
        "slo": {"ttft_s": scenario.ttft_slo_s, "tpot_s": scenario.tpot_slo_s},
        "controller": {
            "interval_s": interval, "min_training_windows": 3, "training_windows": 5,
            "min_policy_interval_s": 0.0, "calibrate_every_s": max(20.0, 5 * interval),
            "bake_windows": 2, "bake_min_requests": 10.0, "max_bake_windows": 8,
            "promote_margin": 0.05, "lease_ttl_s": 10.0, "shutdown_timeout_s": 5.0,
        },
        "drift": {"min_requests": 10.0, "cooldown_s": 2 * interval},
        "rollout": {"push_deadline_s": 2.0, "max_attempts": 2},
    }
    return doc


def router_config(addresses: Mapping[str, Any], http_listen: str, grpc_listen: str,
                  tokenizer: Path) -> dict[str, Any]:
    """``router.toml`` for ``pdctl router serve`` in front of the simulated workers."""
    workers = addresses["workers"]
    return {
        "router_id": "router-0",
        "http": {"listen": http_listen},
        "grpc": {"listen": grpc_listen},
        "model": {"names": [addresses["model"]], "tokenizer": str(tokenizer)},
        "instances": {
            "prefill": [w["url"] for w in workers if w["role"] == "prefill"],
            "decode": [w["url"] for w in workers if w["role"] == "decode"],
            "health_interval_s": 0.5,
        },
    }
