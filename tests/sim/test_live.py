"""``pdctl sim serve`` as a real subprocess on loopback: scrape, parse, converse, stop."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import sim_serve, write_scenario

pytestmark = pytest.mark.integration



@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[dict[str, Any], subprocess.Popen[str]]]:
    path = write_scenario(tmp_path / "live.toml", "live-test", 1, routers=2)
    with sim_serve(path, "--policy", "local") as served:
        yield served


def _scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    r = httpx.get(url, timeout=5.0)
    assert r.status_code == 200
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _total(scrape: dict[str, Any], name: str, **labels: str) -> float:
    return sum(v for k, v in scrape.get(name, {}).items()
               if all((a, b) in k for a, b in labels.items()))


def _wait_for(pred: Any, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return False


def test_live_mode_end_to_end(served: tuple[dict[str, Any], subprocess.Popen[str]]) -> None:
    addresses, proc = served
    workers = addresses["workers"]
    routers = addresses["routers"]
    assert {w["role"] for w in workers} == {"prefill", "decode"} and len(workers) == 3
    assert len(routers) == 2 and all(r["grpc"] for r in routers)

    # every endpoint answers with a parseable exposition; the expected families move
    first = {w["name"]: _scrape(w["metrics"]) for w in workers}
    for s in first.values():
        for fam in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                    "vllm:time_to_first_token_seconds_bucket", "vllm:cache_config_info",
                    "vllm:prompt_tokens_by_source_total", "vllm:nixl_xfer_time_seconds_count"):
            assert fam in s, fam
    r_first = [_scrape(r["metrics"]) for r in routers]
    assert all("pdrouter_decisions_total" in s for s in r_first)

    def moved() -> bool:
        now = {w["name"]: _scrape(w["metrics"]) for w in workers}
        gen = all(_total(now[n], "vllm:generation_tokens_total")
                  > _total(first[n], "vllm:generation_tokens_total") for n in now)
        itl = any(_total(now[n], "vllm:inter_token_latency_seconds_count")
                  > _total(first[n], "vllm:inter_token_latency_seconds_count") for n in now)
        decided = all(_total(_scrape(r["metrics"]), "pdrouter_decisions_total")
                      > _total(f, "pdrouter_decisions_total")
                      for r, f in zip(routers, r_first, strict=True))
        return gen and itl and decided
    assert _wait_for(moved)

    # a multi-turn conversation through the OpenAI-compatible API
    from openai import OpenAI

    router = routers[0]
    before = _scrape(router["metrics"])
    client = OpenAI(base_url=router["openai"], api_key="unused", timeout=30.0, max_retries=0)
    messages: list[dict[str, str]] = [{"role": "user", "content": "hello " * 400}]
    reply = client.chat.completions.create(model=addresses["model"], messages=messages,  # type: ignore[arg-type]
                                           max_tokens=12, user="conv-1")
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert reply.choices[0].message.content == " ".join(["sim"] * 12)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "and more " * 30}]
    stream = client.chat.completions.create(model=addresses["model"], messages=messages,  # type: ignore[arg-type]
                                            max_tokens=20, stream=True, user="conv-1")
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces).split() == ["sim"] * 20
    assert len([p for p in pieces if p]) >= 2  # tokens arrive over several chunks
    done = client.completions.create(model=addresses["model"], prompt="x" * 100, max_tokens=5)
    assert done.choices[0].text.split() == ["sim"] * 5
    after = _scrape(router["metrics"])
    assert (_total(after, "pdrouter_decisions_total", reason="first_turn")
            >= _total(before, "pdrouter_decisions_total", reason="first_turn") + 2)
    assert (_total(after, "pdrouter_decisions_total", route="DECODE_LOCAL", reason="table")
            >= _total(before, "pdrouter_decisions_total", route="DECODE_LOCAL",
                      reason="table") + 1)
    r = httpx.post(router["openai"] + "/chat/completions", json={"messages": "nope"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
