"""Typed config: the seed PPD file is understood as is; bad keys are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.config import config_reference, load_settings
from controller.errors import ConfigError

SEED = """
[ppd]
enabled = true
first_turn_route = "prefill"
append_prefill_route = "dynamic"
wtft = 1.5
wtpot = 0.5
lookup_table = "./ppd_lookup.json"
decision_timeout_ms = 1
[prefill_pool]
nodes = ["127.0.0.1:8101", "127.0.0.1:8102"]
max_concurrent = 4
[decode_pool]
nodes = ["127.0.0.1:8201", "127.0.0.1:8202", "127.0.0.1:8203"]
max_concurrent = 8
local_append_prefill = true
[kv_transfer]
protocol = "nccl"
timeout_s = 30
max_queue = 64
[metrics]
enable = true
export_interval_s = 5
[slo]
ttft_s = 1.5
tpot_s = 0.08
"""


def write(tmp_path: Path, text: str, name: str = "pd.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_seed_file_is_understood(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, SEED))
    assert s.ppd.wtft == 1.5 and s.ppd.wtpot == 0.5
    assert s.ppd.decision_timeout_ms == 1.0
    assert s.ppd.lookup_table == Path("./ppd_lookup.json")
    assert s.prefill_pool.nodes == ["127.0.0.1:8101", "127.0.0.1:8102"]
    assert s.decode_pool.max_concurrent == 8
    assert (s.slo.ttft_s, s.slo.tpot_s) == (1.5, 0.08)


def test_unknown_keys_are_named(tmp_path: Path) -> None:
    bad = SEED.replace("tpot_s = 0.08", "tpot_s = 0.08\ntpoot_s = 3") + "\n[surprise]\nx = 1\n"
    with pytest.raises(ConfigError) as e:
        load_settings(write(tmp_path, bad))
    msg = str(e.value)
    assert "slo.tpoot_s: unknown key" in msg
    assert "surprise: unknown key" in msg


def test_bad_values_are_all_reported(tmp_path: Path) -> None:
    bad = SEED.replace("wtft = 1.5", "wtft = -1").replace(
        'append_prefill_route = "dynamic"', 'append_prefill_route = "sometimes"'
    )
    with pytest.raises(ConfigError) as e:
        load_settings(write(tmp_path, bad))
    assert "ppd.wtft" in str(e.value) and "ppd.append_prefill_route" in str(e.value)


def test_environment_overrides_one_nested_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDCTL_SLO__TTFT_S", "3.5")
    s = load_settings(write(tmp_path, SEED))
    assert s.slo.ttft_s == 3.5 and s.slo.tpot_s == 0.08


@pytest.mark.parametrize(("section", "line", "key", "reason"), [
    ("metrics", 'listen = "nonsense"', "metrics.listen", "HOST:PORT"),
    ("agent", 'listen = "0.0.0.0:70000"', "agent.listen", "HOST:PORT"),
    ("routers", 'targets = ["r0:50151", "r1"]', "routers.targets", "'r1'"),
    # the router's address is its id: two entries raced in one pass
    ("routers", 'targets = ["r0:50151", "r1:50151", "r0:50151"]', "routers.targets",
     "listed more than once: r0:50151"),
    ("routers", 'metrics_targets = ["dns+routers"]', "routers.metrics_targets", "HOST:PORT"),
    ("decode_pool", 'nodes = ["a:b:c"]', "decode_pool.nodes", "'a:b:c'"),
    ("prometheus", 'url = "prometheus:9090"', "prometheus.url", "http://"),
    # each of these passed, then failed every cycle as a transient error
    ("prometheus", 'url = "http://127.0.0.1:99999"', "prometheus.url", "1-65535"),
    ("prometheus", 'url = "http://p:9090/?x=1"', "prometheus.url", "no ?query"),
    ("prometheus", 'url = "http://p:9090/api/v1"', "prometheus.url", "without /api/v1"),
    ("prometheus", "timeout_s = inf", "prometheus.timeout_s", "finite"),
    ("observe", "scrape_timeout_s = inf", "observe.scrape_timeout_s", "finite"),
    ("store", 'url = "mysql://pdc:hunter2@db/pdc"', "store.url", "sqlite or postgresql"),
    ("store", 'url = "pdc:hunter2@db"', "store.url", "not a database URL"),
])
def test_addresses_and_urls_are_checked_when_loaded(
    tmp_path: Path, section: str, line: str, key: str, reason: str
) -> None:
    """A typo in an address is a config error naming the key, not a traceback later in
    whichever command first connects (and a store URL's password is not echoed)."""
    with pytest.raises(ConfigError) as e:
        load_settings(write(tmp_path, f"[{section}]\n{line}\n"))
    msg = str(e.value)
    assert f"{key}: " in msg and reason in msg
    assert "hunter2" not in msg


def test_good_addresses_load(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, SEED + """
[agent]
listen = "[::1]:0"
[routers]
targets = ["router-0.example:50151", "dns:///routers.example:50151"]
metrics_targets = ["dns+routers.example:9465", "10.0.0.1:9465"]
[prometheus]
url = "https://thanos.example/prometheus"
[store]
url = "postgresql+psycopg://pdc@db.example:5432/pdc"
"""))
    assert s.agent.listen == "[::1]:0" and len(s.routers.targets) == 2


def test_a_bad_environment_value_names_its_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The environment overrides the file: an error only the variable causes must say so,
    or the operator searches the file for it."""
    monkeypatch.setenv("PDCTL_SLO__TTFT_S", "abc")
    with pytest.raises(ConfigError) as e:
        load_settings(write(tmp_path, SEED))
    assert "slo.ttft_s: " in str(e.value) and "(from PDCTL_SLO__TTFT_S)" in str(e.value)


def test_an_unknown_environment_key_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unknown keys in the file are errors, so a misspelt variable is one too (it would
    otherwise be ignored silently); variables that are not nested settings are left alone."""
    monkeypatch.setenv("PDCTL_DATA_DIR", "/tmp")  # flat: not a nested setting
    monkeypatch.setenv("PDCTL_SLO__TTFT", "3")
    with pytest.raises(ConfigError, match=r"slo\.ttft: unknown key \(from PDCTL_SLO__TTFT\)"):
        load_settings(write(tmp_path, SEED))
    monkeypatch.delenv("PDCTL_SLO__TTFT")
    monkeypatch.setenv("PDCTL_STOER__URL", "sqlite:///x.db")
    with pytest.raises(ConfigError, match=r"stoer\.url: unknown key"):
        load_settings(write(tmp_path, SEED))


def test_a_sidecar_router_must_be_one_of_the_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Desired versions are keyed by the targets' names: a sidecar named otherwise (the
    Kubernetes manifest once used loopback) is never given a policy."""
    config = write(tmp_path, '[routers]\ntargets = ["pd-router-0.pd-router:50151"]\n')
    monkeypatch.setenv("PDCTL_CONTROLLER__SIDECAR_ROUTER", "127.0.0.1:50151")
    with pytest.raises(ConfigError) as e:
        load_settings(config)
    assert "  - controller.sidecar_router: '127.0.0.1:50151' is not one of [routers] targets" \
        in str(e.value)
    monkeypatch.setenv("PDCTL_CONTROLLER__SIDECAR_ROUTER", "pd-router-0.pd-router:50151")
    assert load_settings(config).controller.sidecar_router == "pd-router-0.pd-router:50151"


@pytest.mark.parametrize("targets, ok", [
    ('["127.0.0.1:50151", "localhost:50152", "[::1]:50153"]', True),
    ('["127.0.0.1:50151", "pd-router-0.pd-router:50151"]', False),
    ('["dns:///routers.example:50151"]', False),
    ('["10.0.0.7:50151"]', False),
])
def test_a_token_without_tls_must_not_name_a_router_on_another_host(
    tmp_path: Path, targets: str, ok: bool
) -> None:
    """gRPC sends a token over TLS or a local connection only: the shipped configs (a token,
    no TLS, routers on other hosts) passed `config check` and then no push ever reached a
    router ("Endpoint is neither UDS or TCP loopback address", read as unreachable)."""
    token = write(tmp_path, "secret\n", "token")
    body = f'[routers]\ntargets = {targets}\n[security]\ntoken_file = "{token}"\n'
    if ok:
        assert load_settings(write(tmp_path, body)).security.has_token()
    else:
        with pytest.raises(ConfigError, match=r"security\] token/token_file without TLS "
                                              r"works on loopback only"):
            load_settings(write(tmp_path, body))
    ca = write(tmp_path, "not read when loading\n", "ca.pem")
    assert load_settings(write(tmp_path, body + f'tls_ca = "{ca}"\n')).security.uses_tls()


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(write(tmp_path, "[ppd\nwtft = "))


def test_secret_token_is_not_printed(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, SEED + '\n[security]\ntoken = "hunter2"\n'))
    assert "hunter2" not in repr(s) and "hunter2" not in str(s.security)
    assert s.security.bearer_token() == "hunter2"


def test_reference_lists_every_key() -> None:
    ref = config_reference()
    for key in ("`wtft`", "`decision_timeout_ms`", "`ttft_s`", "`tpot_s`", "`lookup_table`"):
        assert key in ref


def test_committed_reference_is_current() -> None:
    doc = Path(__file__).parents[1] / "docs" / "config-reference.md"
    assert doc.read_text() == config_reference(), "regenerate docs/config-reference.md"


def test_calibration_knobs_reach_the_learner(monkeypatch: pytest.MonkeyPatch) -> None:
    from controller.loop.learning import CoreLearner

    monkeypatch.setenv("PDCTL_CONTROLLER__EXPLORATION_MAX_RATE", "0.05")
    monkeypatch.setenv("PDCTL_CONTROLLER__GUARDRAIL_OVERLOAD_GOODPUT", "0.3")
    config = CoreLearner(load_settings(None))._config
    assert (config.exploration_max_rate, config.guardrail_overload_goodput) == (0.05, 0.3)
    monkeypatch.setenv("PDCTL_CONTROLLER__EXPLORATION_MAX_RATE", "-1")
    with pytest.raises(ConfigError, match="exploration_max_rate"):
        load_settings(None)


def test_the_ppd_overrides_reach_the_calibrated_policies(tmp_path: Path) -> None:
    """[ppd] first_turn_route, bypass_append_tokens and the two busy overrides are what every
    policy the controller calibrates starts from (calibrate() keeps them, tuning only turn 1's
    route)."""
    from controller.loop.learning import calibration_config
    from controller.policy import Overrides, Route

    assert calibration_config(load_settings(write(tmp_path, SEED))).overrides == Overrides(
        Route.PREFILL_NODE, 0, 2, 2)
    text = SEED.replace('first_turn_route = "prefill"', 'first_turn_route = "decode"\n'
                        "bypass_append_tokens = 64\nfirst_turn_busy_waiting = 0\n"
                        "later_turn_busy_waiting = 5")
    assert calibration_config(load_settings(write(tmp_path, text))).overrides == Overrides(
        Route.DECODE_LOCAL, 64, 0, 5)
    for key in ("first_turn_busy_waiting", "later_turn_busy_waiting"):
        with pytest.raises(ConfigError, match=key):
            load_settings(write(tmp_path, SEED.replace("[prefill_pool]",
                                                       f"{key} = -1\n[prefill_pool]")))


@pytest.mark.parametrize(("ppd", "route"), [
    ({"append_prefill_route": "decode"}, "DECODE_LOCAL"),
    ({"enabled": False}, "PREFILL_NODE"),
])
def test_an_operator_pin_replaces_a_calibrated_table_at_the_next_calibration(
    ppd: dict[str, object], route: str
) -> None:
    """[ppd] enabled = false (classic P/D) and append_prefill_route pins are applied, not
    judged by the guardrail; a policy that already follows the pin is judged as usual."""
    from controller.loop.learning import CoreLearner
    from controller.policy import Overrides, Route
    from tests.core.synth import Mix, Truth, training_windows

    slo = {"ttft_s": 1.0, "tpot_s": 0.05}
    windows = training_windows(Truth(), Mix(), 60, seed=4)
    free = CoreLearner(load_settings(None, slo=slo))
    running = free.calibrate(windows, None, windows[-1].end, "initial").policy
    assert len(set(running.table.routes)) == 2  # a mixed table is running

    pinned = CoreLearner(load_settings(None, slo=slo, ppd=ppd))
    outcome = pinned.calibrate(windows, running, windows[-1].end, "scheduled")
    assert outcome.approved
    assert set(outcome.policy.table.routes) == {Route[route]}
    assert not any(outcome.policy.table.exploration)
    if ppd.get("enabled") is False:
        assert outcome.policy.overrides == Overrides(Route.PREFILL_NODE, 0, 0)
    again = pinned.calibrate(windows, outcome.policy, windows[-1].end, "scheduled")
    assert not again.approved  # the same uniform table: a predicted tie, refused


@pytest.mark.parametrize("metrics, paired", [
    ('["r0:9465", "r1:9465"]', True),
    ("[]", False),
    ('["dns+routers:9465"]', False),
    ('["r0:9465"]', False),
])
def test_the_canary_needs_each_routers_metrics_name(
    tmp_path: Path, metrics: str, paired: bool
) -> None:
    """The shipped ConfigMap named its two routers' metrics by one dns+ name: nothing paired
    a canary router with its requests, and every canary was rolled back for want of them."""
    from controller.config import canary_names_problem, router_outcome_names

    routers = f'[routers]\ntargets = ["r0:50151", "r1:50151"]\nmetrics_targets = {metrics}\n'
    body = '[prefill_pool]\nnodes = ["p0:8000"]\n' + routers
    settings = load_settings(write(tmp_path, body))
    if paired:
        assert router_outcome_names(settings) == {"r0:50151": "r0:9465", "r1:50151": "r1:9465"}
        assert canary_names_problem(settings) is None
    else:
        assert router_outcome_names(settings) == {}
        problem = canary_names_problem(settings)
        assert problem is not None and "metrics_targets must name each of the 2" in problem
        # Without a control group there is nothing to pair.
        no_canary = load_settings(write(tmp_path, body + "[controller]\ncanary_fraction = 1\n"))
        assert canary_names_problem(no_canary) is None
        # Observing nothing, it never calibrates: nothing for a canary to judge either.
        if metrics == "[]":
            assert canary_names_problem(load_settings(write(tmp_path, routers))) is None
