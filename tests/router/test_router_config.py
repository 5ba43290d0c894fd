"""router.toml validation, ``pdctl router check`` and the token counters' loading."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from controller.cli import app
from controller.errors import ConfigError
from controller.router.config import load_router_config, parse_router_config
from controller.router.tokens import load_counts
from controller.tokenize import bundled_tokenizer_dir, load_tokenizer

runner = CliRunner()


def test_a_minimal_config_takes_the_defaults() -> None:
    cfg = parse_router_config({"instances": {"decode": ["http://127.0.0.1:8001/"]}})
    assert cfg.instances.decode == ["http://127.0.0.1:8001"]
    assert cfg.http.processes == 1 and cfg.model.tokenizer is None
    assert cfg.timeouts.connect_s > 0


@pytest.mark.parametrize(("doc", "says"), [
    ({"instances": {"decode": []}}, "instances.decode"),
    ({"instances": {"decode": ["127.0.0.1:8001"]}}, "expected http://HOST:PORT"),
    ({"instances": {"decode": ["http://h:1/v1"]}}, "no path"),
    ({"instances": {"decode": ["http://h:1", "http://h:1"]}}, "listed twice"),
    ({"instances": {"decode": ["dns+svc:80"]}, "typo": 1}, "typo: unknown key"),
    ({"instances": {"decode": ["dns+svc:80"]}, "timeouts": {"connect_s": 0}},
     "timeouts.connect_s"),
    ({"instances": {"decode": ["dns+svc:80"]}, "http": {"api_key": "a", "api_key_file": "f"}},
     "not both"),
])
def test_bad_configs_name_the_key(doc: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match="invalid router configuration") as e:
        parse_router_config(doc)
    assert says in str(e.value)


def test_router_check_exits_2_with_every_problem(tmp_path: Path) -> None:
    bad = tmp_path / "r.toml"
    bad.write_text('[instances]\ndecode = ["nope"]\nprefill = ["http://a:1/x"]\n[http]\nx=1\n')
    result = runner.invoke(app, ["router", "check", "--config", str(bad)])
    assert result.exit_code == 2
    for key in ("instances.decode", "instances.prefill", "http.x"):
        assert key in result.output
    good = tmp_path / "g.toml"
    good.write_text('[instances]\ndecode = ["http://127.0.0.1:9"]\n')
    ok = runner.invoke(app, ["router", "check", "--config", str(good)])
    assert ok.exit_code == 0 and "none (estimates)" in ok.output
    with pytest.raises(ConfigError, match="not found"):
        load_router_config(tmp_path / "missing.toml")


def test_counts_come_from_the_models_tokenizer_when_configured(tmp_path: Path) -> None:
    counts = load_counts(bundled_tokenizer_dir())
    tok = load_tokenizer(bundled_tokenizer_dir())
    words = (Path(__file__).parents[2] / "docs" / "config-reference.md").read_text().split()
    msgs = [{"role": "system", "content": " ".join(words[:40])}]
    for i in range(4):
        msgs.append({"role": "user", "content": " ".join(words[100 * i:100 * i + 90])})
        msgs.append({"role": "assistant", "content": " ".join(words[50 * i:50 * i + 30])})
    exact = tok.count_chat(msgs)
    # per-message counts + the template's overhead: within a token or so per message
    assert counts.loaded and abs(counts.chat(msgs) - exact) <= 0.02 * exact
    assert counts.chat(msgs) == counts.chat([dict(m) for m in msgs])  # cached: same answer
    assert counts.text("hello world") == tok.count_text("hello world")
    estimate = load_counts(None)
    assert not estimate.loaded and estimate.text("abcdefgh") == 2
    with pytest.raises(ConfigError, match=r"model\.tokenizer"):
        load_counts(tmp_path)


def test_docs_name_every_router_config_key() -> None:
    from pydantic import BaseModel

    from controller.router.config import RouterConfig

    text = (Path(__file__).parents[2] / "docs" / "router.md").read_text()
    table = text[text.index("## Configuration"):text.index("## The protocol")]
    missing = []
    for name, field in RouterConfig.model_fields.items():
        model = field.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            if name == "security":  # the daemon's own section, documented there
                continue
            missing += [f"[{name}] {key}" for key in model.model_fields
                        if f"{key}`" not in table]
        elif f"`{name}`" not in table:
            missing.append(name)
    assert not missing, f"docs/router.md does not list: {missing}"
