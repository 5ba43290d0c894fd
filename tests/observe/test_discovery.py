from __future__ import annotations

from pathlib import Path

import pytest

from controller.config import load_settings
from controller.core.window import FailureKind
from controller.errors import ConfigError, TransientError
from controller.observe.discovery import (
    NameUnresolved,
    static_targets,
    targets_from_prometheus,
    targets_from_settings,
)


def test_static_lists_keep_roles_and_order() -> None:
    ts = static_targets(["127.0.0.1:8101", "127.0.0.1:8102"], ["127.0.0.1:8201"],
                        ["127.0.0.1:9464"])
    assert [(t.name, t.role) for t in ts] == [
        ("127.0.0.1:8101", "prefill"), ("127.0.0.1:8102", "prefill"),
        ("127.0.0.1:8201", "decode"), ("127.0.0.1:9464", "router")]
    assert ts[0].metrics_url == "http://127.0.0.1:8101/metrics"


def test_dns_name_expands_to_every_address() -> None:
    ts = static_targets([], ["dns+localhost:8200"], [])
    names = {t.name for t in ts}
    assert "127.0.0.1:8200" in names
    assert all(t.role == "decode" for t in ts)
    assert names <= {"127.0.0.1:8200", "[::1]:8200"}


@pytest.mark.parametrize("bad", ["no-port", "host:", ":80", "dns+no-port.invalid"])
def test_bad_addresses_are_config_errors(bad: str) -> None:
    with pytest.raises(ConfigError):
        static_targets([bad], [], [])


def test_a_name_that_does_not_resolve_may_resolve_later() -> None:
    """Not a config error: a headless service has no address while none of its pods is
    ready. The daemon asks again; a one-shot command fails as a transient error."""
    with pytest.raises(NameUnresolved, match=r"nonexistent\.invalid") as e:
        static_targets([], ["dns+nonexistent.invalid:80"], [])
    assert isinstance(e.value, TransientError) and not isinstance(e.value, ConfigError)


def test_targets_from_the_seed_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = tmp_path / "ppd.toml"
    cfg.write_text(
        '[prefill_pool]\nnodes = ["127.0.0.1:8101"]\n'
        '[decode_pool]\nnodes = ["127.0.0.1:8201", "127.0.0.1:8202"]\n'
        '[routers]\ntargets = ["127.0.0.1:50151"]\nmetrics_targets = ["127.0.0.1:9464"]\n'
    )
    ts = targets_from_settings(load_settings(cfg))
    assert [t.role for t in ts] == ["prefill", "decode", "decode", "router"]
    assert ts[-1].name == "127.0.0.1:9464"  # the router's /metrics, not its gRPC port


def test_prometheus_targets_take_roles_from_labels_or_job() -> None:
    active = [
        {"labels": {"instance": "a:1", "job": "x", "role": "prefill"}, "scrapeUrl": "http://a:1/m"},
        {"labels": {"instance": "b:1", "job": "vllm-decode"}, "scrapeUrl": "http://b:1/metrics"},
        {"labels": {"instance": "c:1", "job": "node-exporter"}},
        {"labels": {"instance": "d:1", "job": "pd", "tier": "router"}},
    ]
    ts = targets_from_prometheus(active)
    assert [(t.name, t.role, t.url) for t in ts] == [
        ("a:1", "prefill", "http://a:1/m"), ("b:1", "decode", "http://b:1/metrics")]
    assert [t.role for t in targets_from_prometheus(active, role_label="tier")] == [
        "decode", "router"]


@pytest.mark.integration
async def test_dns_names_are_resolved_again_as_the_source_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A headless service's addresses were resolved once, at the start: a pod added later
    was never scraped, a replaced one was scraped at its old address. A lookup that fails
    or finds none keeps the targets the source had."""
    from prometheus_client import generate_latest

    from controller.observe import discovery
    from controller.observe.factory import source_from_settings
    from tests.observe.cluster import VllmWorker
    from tests.observe.textserver import TextServer

    text = generate_latest(VllmWorker().registry).decode()
    first = TextServer(text)
    second = TextServer(text, host="127.0.0.2", port=first.port)
    a, b = first.address, second.address
    answers: list[list[str] | Exception] = [
        [a], [a, b], NameUnresolved("cannot resolve 'workers.test'"), [b]]
    asked: list[str] = []

    def resolve_all(host: str, port: int) -> list[str]:
        asked.append(host)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return [x for x in answer if x.endswith(f":{port}")]

    monkeypatch.setattr(discovery, "resolve_all", resolve_all)
    cfg = tmp_path / "pd.toml"
    cfg.write_text(f'[decode_pool]\nnodes = ["dns+workers.test:{first.port}"]\n')
    source = await source_from_settings(load_settings(cfg), "scrape")
    seen = []
    try:
        for at in (30.0, 60.0, 91.0, 152.0, 213.0):
            w = await source.window(at - 30, at)
            seen.append(([t.name for t in source.targets()], sorted(w.answered),
                         sorted(f.target for f in w.failures if f.kind == FailureKind.NO_BASELINE)))
    finally:
        await source.aclose()
        first.close()
        second.close()
    assert asked == ["workers.test"] * 4  # at the start, then at 91, 152 and 213 s
    assert seen == [([a], [a], [a]), ([a], [a], []),
                    ([a, b], [a, b], [b]),  # the added pod, from its first window
                    ([a, b], [a, b], []),  # the lookup failed: both kept
                    ([b], [b], [])]  # the first one gone
    assert source._previous.keys() == {b}  # type: ignore[attr-defined]
    assert source._clients.keys() == set()  # type: ignore[attr-defined]  # closed by aclose


@pytest.mark.integration
async def test_a_name_without_an_address_at_the_start_is_asked_again_every_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A headless service has no address until a pod is ready, and the controller may start
    first: `pdctl run` exited (and crash-looped) on it. The daemon's source starts with no
    targets and resolves every window until the name answers; `pdctl observe` still fails."""
    from prometheus_client import generate_latest

    from controller.observe import discovery
    from controller.observe.factory import source_from_settings
    from controller.observe.source import NoTargets
    from tests.observe.cluster import VllmWorker
    from tests.observe.textserver import TextServer

    server = TextServer(generate_latest(VllmWorker().registry).decode())
    answers: list[list[str] | None] = [None, None, None, [server.address]]

    def resolve_all(host: str, port: int) -> list[str]:
        answer = answers.pop(0)
        if answer is None:
            raise NameUnresolved(f"cannot resolve {host!r}: Name or service not known")
        return answer

    monkeypatch.setattr(discovery, "resolve_all", resolve_all)
    cfg = tmp_path / "pd.toml"
    cfg.write_text(f'[decode_pool]\nnodes = ["dns+workers.test:{server.port}", '
                   f'"{server.address}"]\n')
    with pytest.raises(NameUnresolved):
        await source_from_settings(load_settings(cfg), "scrape")
    source = await source_from_settings(load_settings(cfg), "scrape", wait_for_targets=True)
    try:
        assert list(source.targets()) == []
        with pytest.raises(NoTargets, match=r"DNS failed: cannot resolve 'workers\.test'"):
            await source.window(0.0, 30.0)
        w = await source.window(30.0, 31.0)  # a second later: asked again, not in a minute
        assert [t.name for t in source.targets()] == [server.address]
        assert list(w.answered) == [server.address]
    finally:
        await source.aclose()
        server.close()
    assert answers == []
