"""``pdctl push`` against ``pdctl router-agent`` subprocesses on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from controller.cli import app
from controller.policy import Policy, Route, dumps

runner = CliRunner()
START_TIMEOUT_S = 30.0


class AgentProcess:
    """``pdctl router-agent`` as a subprocess; its first stdout line names the address."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from controller.cli import main; main()", "router-agent",
             *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        line = ""
        while time.monotonic() < deadline and self.proc.poll() is None:
            line = self.proc.stdout.readline()
            if line.startswith("router-agent listening on"):
                break
        if not line.startswith("router-agent listening on"):
            self.stop()
            raise AssertionError(f"router-agent did not start: {self.stderr()}")
        self.banner = line
        self.address = line.split()[3]

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return ""
        assert self.proc.stderr is not None
        return self.proc.stderr.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=5)


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for a in started:
        a.stop()


def start(agents: list[AgentProcess], *args: str) -> AgentProcess:
    a = AgentProcess("--listen", "127.0.0.1:0", *args)
    agents.append(a)
    return a


def write_policy(tmp_path: Path, version: int, route: Route = Route.DECODE_LOCAL) -> Path:
    path = tmp_path / f"policy-v{version}-{route.name}.json"
    path.write_text(dumps(Policy.uniform(version, route)))
    return path


def push(*args: str) -> tuple[int, Any]:
    result = runner.invoke(app, ["push", *args, "--json"])
    try:
        return result.exit_code, json.loads(result.stdout)
    except json.JSONDecodeError:
        return result.exit_code, result.output


def by_router(report: Any) -> dict[str, dict[str, Any]]:
    return {r["router"]: r for r in report["routers"]}


def test_push_applies_then_is_a_no_op_and_survives_an_agent_restart(
    tmp_path: Path, agents: list[AgentProcess]
) -> None:
    state = tmp_path / "agent-state.json"
    agent = start(agents, "--state-file", str(state))
    assert "policy: none" in agent.banner
    v5 = write_policy(tmp_path, 5)

    code, report = push(str(v5), "--router", agent.address)
    assert code == 0, report
    row = by_router(report)[agent.address]
    assert (row["outcome"], row["acked_version"], row["ok"]) == ("applied", 5, True)
    assert row["acked_checksum"] == report["checksum"]

    code, report = push(str(v5), "-r", agent.address)
    assert code == 0
    assert by_router(report)[agent.address]["outcome"] == "in_sync"

    assert agent.stop() == 0  # SIGTERM: clean stop
    again = start(agents, "--state-file", str(state))
    assert "policy: v5" in again.banner
    code, report = push(str(v5), "-r", again.address)
    assert code == 0
    assert by_router(report)[again.address]["outcome"] == "in_sync"


def test_lower_version_is_reissued_unless_rolled_back(
    tmp_path: Path, agents: list[AgentProcess]
) -> None:
    agent = start(agents)
    assert push(str(write_policy(tmp_path, 5)), "-r", agent.address)[0] == 0
    v3 = write_policy(tmp_path, 3, Route.PREFILL_NODE)

    code, report = push(str(v3), "-r", agent.address, "--rollback")
    assert code == 0
    assert by_router(report)[agent.address]["acked_version"] == 3

    assert push(str(write_policy(tmp_path, 5)), "-r", agent.address)[0] == 0
    code, report = push(str(v3), "-r", agent.address)  # no --rollback: the router is ahead
    assert code == 0
    row = by_router(report)[agent.address]
    assert (row["acked_version"], row["reissued_as"]) == (6, 6)
    assert report["reissued_as"] == [6]


def test_one_unreachable_router_fails_the_command_not_the_others(
    tmp_path: Path, agents: list[AgentProcess]
) -> None:
    agent = start(agents)
    dead = "127.0.0.1:9"  # discard port: nothing listens there
    config = tmp_path / "fast.toml"
    config.write_text("[rollout]\nmax_attempts = 2\nbackoff_initial_s = 0.01\n")
    code, report = push(str(write_policy(tmp_path, 2)), "-r", agent.address, "-r", dead,
                        "--config", str(config))
    assert code == 1
    rows = by_router(report)
    assert rows[agent.address]["ok"] and rows[agent.address]["acked_version"] == 2
    assert (rows[dead]["ok"], rows[dead]["outcome"], rows[dead]["attempts"]) == (
        False, "unreachable", 2,
    )

    # Not a terminal (cron, CI, a pipe): a long router name cut the ok and outcome columns
    # to "…" at rich's default 80 columns.
    long_name = "router-with-a-long-name.example.internal:9"
    table = runner.invoke(app, ["push", str(write_policy(tmp_path, 2)), "-r", agent.address,
                                "-r", dead, "-r", long_name, "--config", str(config)])
    assert table.exit_code == 1
    assert "unreachable" in table.output and "in_sync" in table.output
    assert long_name in table.output and "…" not in table.output


def test_token_protected_agent_refuses_pushes_without_the_token(
    tmp_path: Path, agents: list[AgentProcess]
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    config = tmp_path / "secure.toml"
    config.write_text(f'[security]\ntoken_file = "{token_file}"\n')
    agent = start(agents, "--config", str(config))
    assert "bearer token" in agent.banner
    policy = write_policy(tmp_path, 4)

    code, report = push(str(policy), "-r", agent.address)
    assert code == 1
    row = by_router(report)[agent.address]
    assert row["outcome"] == "refused" and "UNAUTHENTICATED" in row["last_error"]

    code, report = push(str(policy), "-r", agent.address, "--config", str(config))
    assert code == 0 and by_router(report)[agent.address]["acked_version"] == 4


def test_bad_inputs_exit_2(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    data = json.loads(dumps(Policy.uniform(3, Route.DECODE_LOCAL)))
    data["exploration"][7] = 0.9
    broken.write_text(json.dumps(data))
    result = runner.invoke(app, ["push", str(broken), "-r", "127.0.0.1:1"])
    assert result.exit_code == 2
    assert "exploration[7]" in result.output

    result = runner.invoke(app, ["push", str(tmp_path / "missing.json"), "-r", "127.0.0.1:1"])
    assert result.exit_code == 2

    good = write_policy(tmp_path, 1)
    result = runner.invoke(app, ["push", str(good)])
    assert result.exit_code == 2
    assert "no routers" in result.output

    from controller.policy import Provenance

    huge = tmp_path / "huge.json"  # a 17 MB reason: retried 5 times, then "unreachable"
    huge.write_text(dumps(Policy.uniform(3, Route.DECODE_LOCAL,
                                         provenance=Provenance(reason="x" * 17_000_000))))
    result = runner.invoke(app, ["push", str(huge), "-r", "127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert "limit (16 MiB" in result.output

    for address in ("notanaddress", "127.0.0.1:99999", "router one:50151"):
        result = runner.invoke(app, ["push", str(good), "-r", "127.0.0.1:1", "-r", address])
        assert result.exit_code == 2, (address, result.output)
        assert f"--router {address}: expected HOST:PORT" in result.output

    # A token without TLS reaches loopback only: refused before any call, not "unreachable".
    token_only = tmp_path / "token-only.toml"
    token_only.write_text('[security]\ntoken = "t"\n')
    result = runner.invoke(app, ["push", str(good), "--config", str(token_only),
                                 "-r", "127.0.0.1:1", "-r", "10.0.0.7:50151"])
    assert result.exit_code == 2, result.output
    assert "'10.0.0.7:50151' is not loopback" in result.output


def test_agent_refuses_an_unauthenticated_public_listen_address() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from controller.cli import main; main()", "router-agent",
         "--listen", "0.0.0.0:0"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "without authentication" in proc.stderr


def test_agent_exports_its_metrics_and_counts_refusals(
    tmp_path: Path, agents: list[AgentProcess]
) -> None:
    import httpx

    config = tmp_path / "token.toml"
    config.write_text('[security]\ntoken = "metrics-test-token"\n')
    agent = start(agents, "--config", str(config), "--metrics-listen", "127.0.0.1:0")
    assert agent.proc.stdout is not None
    metrics_line = agent.proc.stdout.readline()
    assert metrics_line.startswith("metrics on http://127.0.0.1:")
    url = metrics_line.split()[2]

    with_token = ("--config", str(config))
    assert push(str(write_policy(tmp_path, 7)), "-r", agent.address, *with_token)[0] == 0
    assert push(str(write_policy(tmp_path, 8)), "-r", agent.address)[0] == 1  # no token

    text = httpx.get(url, timeout=10).text
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples["pdrouter_policy_version"] == 7
    assert samples['pdrouter_updates_total{result="applied"}'] == 1
    assert samples['pdrouter_auth_refusals_total{reason="missing_token"}'] == 1
    assert samples['pdrouter_auth_refusals_total{reason="wrong_token"}'] == 0


def test_the_sidecar_polls_the_prefill_workers_for_the_busy_override(
    tmp_path: Path, agents: list[AgentProcess]
) -> None:
    """A router that does not report prefill_waiting: ``pdctl router-agent`` polls the
    ``[prefill_pool]`` nodes' vLLM metrics (a real HTTP server on loopback) and turn 1 goes
    decode-local while the worker's queue is at the policy's bar, back when it drains."""
    import asyncio
    import dataclasses

    from prometheus_client import start_http_server

    from controller.policy import Features, Overrides, Reason
    from controller.rollout.client import GrpcRouterTransport
    from controller.sim.vllm_metrics import WorkerMetrics

    worker = WorkerMetrics(model_name="m", kv_role="kv_producer", num_gpu_blocks=1000,
                           block_size=16, max_model_len=8192)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=worker.registry)
    try:
        policy = dataclasses.replace(Policy.uniform(3, Route.PREFILL_NODE),
                                     overrides=Overrides(first_turn_busy_waiting=2))
        (tmp_path / "policy.json").write_text(dumps(policy))
        config = tmp_path / "pd.toml"
        config.write_text(
            f'[ppd]\nlookup_table = "{tmp_path / "policy.json"}"\n'
            f'[prefill_pool]\nnodes = ["127.0.0.1:{server.server_address[1]}"]\n'
            "[agent]\nprefill_poll_interval_s = 0.05\n")
        agent = start(agents, "--config", str(config))
        assert "policy: v3" in agent.banner

        async def reasons_until(want: Reason) -> Reason:
            transport = GrpcRouterTransport()
            try:
                got = Reason.NO_POLICY
                for _ in range(100):  # bounded: 100 x 0.05 s
                    decision, _ = await transport.decide(
                        agent.address, Features(1, 0.0, 500.0, 100.0, 1.0), 5.0)
                    got = decision.reason
                    if got is want:
                        break
                    await asyncio.sleep(0.05)
                return got
            finally:
                await transport.close()

        worker.waiting_capacity = 2
        assert asyncio.run(reasons_until(Reason.BUSY_PREFILL)) is Reason.BUSY_PREFILL
        worker.waiting_capacity = 1
        assert asyncio.run(reasons_until(Reason.FIRST_TURN)) is Reason.FIRST_TURN
    finally:
        server.shutdown()
        thread.join(5.0)
