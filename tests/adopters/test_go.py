"""The Go adopter package (``adopters/go``) against the Python reference.

Real components: Debian's ``go`` toolchain builds the package's commands; the example
router runs as a subprocess on loopback and is scraped over HTTP. Without ``go`` these
tests skip on a developer machine and fail with ``CI=true``.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from controller.core.catalog import ROUTER, is_router
from controller.observe.snapshot import snapshot_from_text
from controller.observe.window_builder import diff_snapshots, router_stats
from controller.policy import (
    Axes,
    Features,
    LookupTable,
    Overrides,
    Policy,
    PolicyValidationError,
    Route,
    Weights,
    decide,
    dumps,
    loads,
)
from controller.policy.bins import CONTEXT_BINS, IO_RATIO_BINS
from controller.policy.checksum import canonical_bytes
from controller.rollout.agent import RouterAgent
from tests.conftest import require

REPO = Path(__file__).resolve().parents[2]
GO_DIR = REPO / "adopters" / "go"
TEST_VECTOR = REPO / "controller" / "policy" / "test_vector.json"
GO = shutil.which("go")


def go_env(tmp: Path) -> dict[str, str]:
    """Offline, reproducible builds: no module downloads, no VCS stamping."""
    env = dict(os.environ)
    env.update(GOFLAGS="-buildvcs=false", GOPROXY="off", GOTOOLCHAIN="local",
               CGO_ENABLED="0")
    if "HOME" not in env and "XDG_CACHE_HOME" not in env:  # go needs somewhere to cache
        env.setdefault("GOCACHE", str(tmp / "gocache"))
        env.setdefault("GOPATH", str(tmp / "gopath"))
    return env


@pytest.fixture(scope="module")
def go_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example router and pdcheck, built once for this module."""
    require("go", GO is not None, "apt-get install golang")
    assert GO is not None
    out = tmp_path_factory.mktemp("gobin")
    for name, pkg in (("example", "./example"), ("pdcheck", "./cmd/pdcheck")):
        subprocess.run([GO, "build", "-o", str(out / name), pkg], cwd=GO_DIR, check=True,
                       env=go_env(out), timeout=300)
    return out


# -- differential: checksum and decisions on random policies ---------------------------------

AWKWARD = (0.0, 0.1, 1 / 3, 5e-324, 2.2250738585072014e-308, 1e-300, 123456.789, 1e15 + 0.5)


def random_edges(rng: random.Random) -> tuple[float, ...]:
    n = rng.randint(1, 6)
    pool = {rng.choice(AWKWARD) for _ in range(2)} | {rng.uniform(0, 5000) for _ in range(n)}
    return tuple(sorted(pool))[:n]


def random_policy(rng: random.Random, version: int) -> Policy:
    axes = Axes(random_edges(rng), random_edges(rng), random_edges(rng))
    n = axes.n_cells
    scores = tuple(rng.choice((-0.0, 0.0, rng.uniform(-1, 1), 1e-310, -2.5e8)) for _ in range(n))
    table = LookupTable(
        axes, tuple(rng.choice(list(Route)) for _ in range(n)), scores,
        tuple(rng.choice((0.0, 0.2, rng.uniform(0, 0.2))) for _ in range(n)))
    first, later = rng.choice((0, 0, 1, 3)), rng.choice((0, 0, 2))
    return Policy(
        version=version, table=table,
        weights=Weights(rng.choice((1.0, 0.1, 3.0)), rng.choice((1.0, 0.0, 1 / 7))),
        overrides=Overrides(rng.choice(list(Route)), rng.choice((0, 32, 2**32 - 1)),
                            first, later),
        default_route=rng.choice(list(Route)))


def random_features(rng: random.Random, policy: Policy) -> dict[str, Any]:
    """Values on, between and beyond the edges, and every kind of invalid input."""
    axes = policy.table.axes

    def pick(edges: tuple[float, ...]) -> float:
        return rng.choice((rng.choice(edges), rng.uniform(0, edges[-1] * 1.5 + 1), 0.0))

    out_tokens = rng.choice((1.0, 10.0, rng.uniform(1, 500)))
    f: dict[str, Any] = {
        "turn": rng.choice((1, 2, 3, 9)),
        "context_tokens": pick(axes.context_tokens),
        "append_tokens": pick(axes.io_ratio) * out_tokens,
        "expected_output_tokens": out_tokens,
        "qps": pick(axes.qps),
    }
    if rng.random() < 0.5:
        f["prefill_waiting"] = rng.choice((0, 1, 2, 3, 2.5, "NaN", "Infinity", -1))
    if rng.random() < 0.1:
        f[rng.choice(("context_tokens", "append_tokens", "qps", "expected_output_tokens"))] = \
            rng.choice(("NaN", "Infinity", -1.0, 0.0))
    if rng.random() < 0.03:
        f["turn"] = 0
    return f


def as_float(v: Any) -> float:
    return float(v.replace("Infinity", "inf")) if isinstance(v, str) else float(v)


def python_decision(policy: Policy, f: dict[str, Any], draw: float) -> dict[str, Any]:
    pw = f.get("prefill_waiting")
    d = decide(policy, Features(
        turn=f["turn"], context_tokens=as_float(f["context_tokens"]),
        append_tokens=as_float(f["append_tokens"]),
        expected_output_tokens=as_float(f["expected_output_tokens"]), qps=as_float(f["qps"]),
        prefill_waiting=None if pw is None else as_float(pw)), lambda: draw)
    return {"route": d.route.name, "reason": d.reason.value,
            "cell": None if d.cell is None else list(d.cell), "explored": d.explored}


def run_pdcheck(go_bin: Path, policy_text: str, cases: list[dict[str, Any]], tmp: Path
                ) -> list[dict[str, Any]]:
    path = tmp / "policy.json"
    path.write_text(policy_text)
    stdin = "".join(json.dumps(c) + "\n" for c in cases)
    done = subprocess.run([str(go_bin / "pdcheck"), str(path)], input=stdin, text=True,
                          capture_output=True, check=True, timeout=60)
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_go_matches_python_on_random_policies(go_bin: Path, tmp_path: Path) -> None:
    rng = random.Random(42)
    compared = 0
    for i in range(40):
        policy = random_policy(rng, version=i + 1)
        cases: list[dict[str, Any]] = [{"features": random_features(rng, policy),
                  "draw": rng.choice((0.0, 0.1, 0.2, rng.random()))} for _ in range(150)]
        head, *decisions = run_pdcheck(go_bin, dumps(policy), cases, tmp_path)
        assert head == {"checksum": policy.checksum,
                        "canonical_bytes_hex": canonical_bytes(policy).hex()}, i
        for case, got in zip(cases, decisions, strict=True):
            assert got == python_decision(policy, case["features"], case["draw"]), case
            compared += 1
    assert compared == 40 * 150


def test_go_refuses_what_python_refuses(go_bin: Path, tmp_path: Path) -> None:
    good = json.loads(TEST_VECTOR.read_text())["policy"]
    tampered = dict(good, scores=[0.5, 0.0])  # checksum kept: the content changed
    bad_edges = dict(good, axes=dict(good["axes"], io_ratio=[8.0, 1.0]))
    nulls = [dict(good, weights=None), dict(good, scores=[0.25, None]),
             dict(good, default_route=None), dict(good, provenance=dict(good["provenance"],
                                                                       reason=None))]
    for doc in (tampered, bad_edges, *nulls):
        text = json.dumps(doc)
        with pytest.raises(PolicyValidationError):
            loads(text)
        (head,) = run_pdcheck(go_bin, text, [], tmp_path)
        assert "error" in head
    # A null timestamp is allowed by both.
    text = json.dumps(dict(good, provenance=dict(good["provenance"], created_at=None)))
    (head,) = run_pdcheck(go_bin, text, [], tmp_path)
    assert head["checksum"] == good["checksum"] == loads(text).checksum


ODD_VALUES: tuple[Any, ...] = (None, "x", "DECODE", -1, 0, 1.5, 2**40, 2**64, [], {}, True,
                                "2026-11-30T00:00:00", "2026-11-30T00:00:00+00:00", [1.0],
                                [None], 0.2, 0.21, -0.0, 1e308)


def mutate(rng: random.Random, doc: Any) -> Any:
    """``doc`` with one random change: a value replaced, a key dropped or one added."""
    doc = json.loads(json.dumps(doc))
    node, key = doc, None
    for _ in range(3):  # walk down a few levels
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        key = rng.choice(keys)
        if not isinstance(node[key], (dict, list)) or rng.random() < 0.4:
            break
        node, key = node[key], None
    action = rng.random()
    if key is None or action < 0.1:
        if isinstance(node, dict):
            node["unexpected"] = 1
    elif action < 0.25 and isinstance(node, dict):
        del node[key]
    else:
        node[key] = rng.choice(ODD_VALUES)
    return doc


def test_go_accepts_and_refuses_exactly_what_python_does(go_bin: Path, tmp_path: Path
                                                         ) -> None:
    rng = random.Random(11)
    good = json.loads(TEST_VECTOR.read_text())["policy"]
    seeds = [good, {k: v for k, v in good.items() if k != "checksum"}]
    verdicts = {True: 0, False: 0}
    for _ in range(300):
        text = json.dumps(mutate(rng, rng.choice(seeds)))
        try:
            py = loads(text).checksum
        except PolicyValidationError:
            py = None
        (head,) = run_pdcheck(go_bin, text, [], tmp_path)
        assert head.get("checksum") == py, (text, head)
        verdicts[py is not None] += 1
    assert min(verdicts.values()) > 30, verdicts  # both verdicts well exercised


# -- the example router: the pdrouter_* minimum set, read by the daemon's own code ------------


class Example:
    def __init__(self, proc: subprocess.Popen[str], address: str) -> None:
        self.proc, self.base = proc, f"http://{address}"

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    def metrics(self) -> str:
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            text: str = r.read().decode()
            return text


@pytest.fixture
def example(go_bin: Path, tmp_path: Path) -> Iterator[tuple[Example, Path]]:
    policy_file = tmp_path / "policy.json"
    policy_file.write_text(json.dumps(json.loads(TEST_VECTOR.read_text())["policy"]))
    proc = subprocess.Popen(
        [str(go_bin / "example"), "-policy", str(policy_file), "-listen", "127.0.0.1:0",
         "-poll", "20ms", "-seed", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "listening on ADDR", printed once it listens
        assert line.startswith("listening on "), (line, proc.stderr and proc.stderr.read())
        yield Example(proc, line.split()[-1]), policy_file
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def request_mix(rng: random.Random, n: int) -> list[tuple[dict[str, Any], float, float | None]]:
    """Completed requests across context and io bins, some missing each SLO."""
    out = []
    for _ in range(n):
        f = {"turn": rng.randint(1, 5), "context_tokens": 10 ** rng.uniform(1, 5.4),
             "append_tokens": 10 ** rng.uniform(0, 3.3),
             "expected_output_tokens": float(rng.choice((1, 16, 200))), "qps": 3.5}
        tpot = None if f["expected_output_tokens"] == 1 else rng.choice((0.02, 0.1, 0.3))
        out.append((f, rng.choice((0.05, 0.4, 2.0, 4.0)), tpot))  # 2.0, 0.1: the SLOs
    return out


def outcome_table(text: str, before: str) -> tuple[Any, ...]:
    """What the daemon reads from a router between two scrapes (its own parser and code)."""
    prev = snapshot_from_text(before, "router", 0.0)
    cur = snapshot_from_text(text, "router", 10.0)
    stats = router_stats(diff_snapshots(prev, cur), CONTEXT_BINS.labels, IO_RATIO_BINS.labels)
    assert not stats.notes, stats.notes
    rows = {(o.route, o.ctx_bin, o.io_bin): (o.requests, o.met, round(o.ttft_sum, 9),
                                             o.ttft_count, round(o.tpot_sum, 9), o.tpot_count)
            for o in stats.outcomes}
    return rows, stats.context_tokens, stats.io_ratio, stats.qps


def test_example_exports_the_minimum_set_the_daemon_reads(
        example: tuple[Example, Path]) -> None:
    ex, _ = example
    before = ex.metrics()
    snap = snapshot_from_text(before, "router", 0.0)
    assert ROUTER.families() <= snap.families, ROUTER.families() - snap.families
    assert is_router(snap.families)

    # The same requests through the Python router agent: the daemon must read the same.
    policy = loads(json.dumps(json.loads(TEST_VECTOR.read_text())["policy"]))
    registry = CollectorRegistry()
    agent = RouterAgent(initial_policy=policy, registry=registry, draw=lambda: 0.99)
    py_before = generate_latest(registry).decode()
    for f, ttft, tpot in request_mix(random.Random(7), 300):
        got = ex.post("/decide", f)
        feats = Features(**f)
        d = decide(policy, feats, lambda: 0.99)
        if not got["explored"]:  # the example draws its own exploration
            assert (got["route"], got["reason"]) == (d.route.name, d.reason.value)
        agent.decide(feats)
        route = Route[got["route"]]
        slo = ex.post("/complete", {**f, "route": route.name, "ttft_s": ttft, "tpot_s": tpot})
        decision = type(d)(route, d.cell, d.reason, got["explored"])
        assert slo["slo"] == agent.observe(decision, ttft, tpot, feats)
    go_rows, go_ctx, go_io, go_qps = outcome_table(ex.metrics(), before)
    py_rows, py_ctx, py_io, py_qps = outcome_table(generate_latest(registry).decode(), py_before)
    assert sum(r[0] for r in go_rows.values()) == 300
    assert len(go_rows) > 10  # the mix spreads over many (route, ctx, io) cells
    assert go_rows == py_rows
    assert go_ctx == py_ctx and go_io == py_io
    assert go_qps == py_qps == 3.5


def gauge(text: str, name: str) -> float:
    series = snapshot_from_text(text, "router", 0.0).series(name)
    return math.fsum(series.values())


def test_example_keeps_the_last_good_policy_and_counts_refusals(
        example: tuple[Example, Path]) -> None:
    ex, path = example
    good = json.loads(path.read_text())
    text = ex.metrics()
    assert "pdrouter_policy_version 42" in text
    assert 'pdrouter_updates_total{result="invalid"} 0' in text

    def replace(doc: dict[str, Any] | str) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        tmp.replace(path)  # atomic, as the router agent writes it

    def wait_for(needle: str) -> str:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = ex.metrics()
            if needle in text:
                return text
            time.sleep(0.02)
        raise AssertionError(f"{needle!r} never appeared:\n{text}")

    replace(dict(good, version=43, scores=[0.5, 0.0]))  # checksum no longer matches
    text = wait_for('pdrouter_updates_total{result="invalid"} 1')
    assert "pdrouter_policy_version 42" in text
    replace('{"schema_version": 1, "version": 44')  # cut off
    text = wait_for('pdrouter_updates_total{result="invalid"} 2')
    assert "pdrouter_policy_version 42" in text
    f = {"turn": 2, "context_tokens": 100, "append_tokens": 10, "expected_output_tokens": 100,
         "qps": 1}
    assert ex.post("/decide", f)["reason"] == "bypass"  # still deciding with v42
    replace(dict(good, version=45))
    text = wait_for("pdrouter_policy_version 45")
    assert 'pdrouter_updates_total{result="applied"} 2' in text


def test_pushes_to_the_sidecar_reach_the_go_router(go_bin: Path, tmp_path: Path) -> None:
    """The adoption path end to end: `pdctl push` → `pdctl router-agent` persists the policy
    → the Go router (watching that file) decides with it, as Python does."""
    from tests.cli.test_push import AgentProcess, push

    state = tmp_path / "agent-state.json"
    agent = AgentProcess("--listen", "127.0.0.1:0", "--state-file", str(state))
    proc = subprocess.Popen(
        [str(go_bin / "example"), "-policy", str(state), "-listen", "127.0.0.1:0",
         "-poll", "20ms", "-seed", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        assert proc.stdout is not None
        ex = Example(proc, proc.stdout.readline().split()[-1])
        f = {"turn": 3, "context_tokens": 5000, "append_tokens": 300,
             "expected_output_tokens": 100, "qps": 2}
        assert ex.post("/decide", f)["reason"] == "no_policy"  # nothing pushed yet
        rng = random.Random(5)
        for version in (4, 9):
            policy = random_policy(rng, version)
            path = tmp_path / f"v{version}.json"
            path.write_text(dumps(policy))
            code, report = push(str(path), "--router", agent.address)
            assert code == 0, report
            deadline = time.monotonic() + 10
            while f"pdrouter_policy_version {version}\n" not in ex.metrics():
                assert time.monotonic() < deadline, f"v{version} never reached the Go router"
                time.sleep(0.02)
            for _ in range(50):
                case = random_features(rng, policy)
                if any(isinstance(v, str) for v in case.values()):
                    continue  # the example takes numbers only
                got = ex.post("/decide", case)
                want = python_decision(policy, case, 1.0)  # 1.0: never explores
                if not got["explored"]:
                    assert got == want, case
        assert 'pdrouter_updates_total{result="invalid"} 0' in ex.metrics()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        agent.stop()
