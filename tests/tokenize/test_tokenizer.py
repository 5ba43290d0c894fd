"""controller.tokenize: the bundled tokenizer rebuilds identically, counts as vLLM counts
(template overhead included), and a user's tokenizer.json goes through the same loader."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.tokenize import TokenizerError, bundled_tokenizer_dir, load_tokenizer
from controller.tokenize.tokenizer import SegmentCounter

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = load_tokenizer(bundled_tokenizer_dir())


def _build_module():  # scripts/ is not a package: load the build script by path
    spec = importlib.util.spec_from_file_location(
        "build_sim_tokenizer", ROOT / "scripts" / "build_sim_tokenizer.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_build_script_reproduces_the_committed_files() -> None:
    tok_json, cfg_json = _build_module().build()
    d = bundled_tokenizer_dir()
    assert json.loads(tok_json)["model"]["vocab"] == json.loads(
        (d / "tokenizer.json").read_text())["model"]["vocab"]
    assert tok_json == (d / "tokenizer.json").read_text()
    assert cfg_json == (d / "tokenizer_config.json").read_text()
    assert (d / "tokenizer.json").stat().st_size < 1_000_000
    assert len(json.loads(tok_json)["model"]["vocab"]) == 4096


def test_text_counts_are_sane_and_round_trip() -> None:
    tok = load_tokenizer(bundled_tokenizer_dir())
    text = (ROOT / "docs" / "simulator.md").read_text()[:4000]
    ids = tok.encode(text)
    assert ids[0] == tok.hf.token_to_id("<|begin_of_text|>")  # BOS, as Llama 3 adds it
    assert tok.count_text(text) == len(ids)
    # a BPE trained on this kind of text: between 2 and 8 bytes a token
    assert len(text.encode()) / 8 < len(ids) < len(text.encode()) / 2
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.count_text("x" * 4000) < tok.count_text("the router " * 400) * 4


def test_chat_count_is_the_rendered_template_encoded_without_extra_specials() -> None:
    tok = load_tokenizer(bundled_tokenizer_dir())
    msgs = [{"role": "system", "content": "You are brief."},
            {"role": "user", "content": "How does decode-local work?"}]
    rendered = tok.render_chat(msgs)
    assert rendered == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                        "You are brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
                        "How does decode-local work?<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    n = tok.count_chat(msgs)
    assert n == len(tok.encode(rendered, add_special_tokens=False))
    body = sum(tok.count_text(m["content"]) - 1 for m in msgs)  # less each BOS
    # the overhead: BOS, 3 headers of 4 tokens at least (start, role, end, blank line), 2 EOT
    assert n - body >= 1 + 3 * 3 + 2
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    assert tok.count_chat(parts) == tok.count_chat([{"role": "user", "content": "a\nb"}])


def test_a_user_directory_loads_through_the_same_code(tmp_path: Path) -> None:
    src = bundled_tokenizer_dir()
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    bare = load_tokenizer(tmp_path / "tokenizer.json")  # a file path works, no template
    assert not bare.has_chat_template
    assert bare.count_text("hello") == load_tokenizer(src).count_text("hello")
    with pytest.raises(TokenizerError, match="no chat_template"):
        bare.count_chat([{"role": "user", "content": "hi"}])
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["bos_token"] = {"content": "<|begin_of_text|>", "lstrip": False}  # AddedToken form
    cfg["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path)
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<|begin_of_text|>hi"


@pytest.mark.parametrize("case", ["missing", "bad_json", "bad_template", "raise"])
def test_clear_errors(tmp_path: Path, case: str) -> None:
    src = bundled_tokenizer_dir()
    if case == "missing":
        with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
            load_tokenizer(tmp_path)
        return
    if case == "bad_json":
        (tmp_path / "tokenizer.json").write_text("{not json")
        with pytest.raises(TokenizerError, match=r"not a valid tokenizer\.json"):
            load_tokenizer(tmp_path)
        return
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    template = ("{% for m in messages %" if case == "bad_template"
                else "{{ raise_exception('only user roles') }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    if case == "bad_template":
        with pytest.raises(TokenizerError, match="not a valid Jinja2 template"):
            load_tokenizer(tmp_path)
    else:
        with pytest.raises(TokenizerError, match="only user roles"):
            load_tokenizer(tmp_path).count_chat([{"role": "user", "content": "x"}])


SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
_TEXT = st.lists(st.one_of(st.sampled_from([*SPECIALS, " ", "\n\n", "  ", "the router",
                                            "décodé", "日本語", "'s", "123456"]),
                           st.text(max_size=12)), max_size=12).map("".join)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), _TEXT),
                min_size=1, max_size=6))
def test_cached_chat_counts_equal_a_full_encode(turns: list[tuple[str, str]]) -> None:
    """The piece cache (earlier messages counted once) gives the full encode's count, for
    any text, added tokens inside messages and whitespace around them included."""
    tok = BUNDLED
    assert tok.segments is not None
    msgs = [{"role": r, "content": c} for r, c in turns]
    for i in range(1, len(msgs) + 1):  # a conversation growing turn by turn
        assert tok.count_chat(msgs[:i]) == len(tok.encode_chat(msgs[:i]))


def test_the_piece_cache_is_off_where_the_cut_is_not_exact(tmp_path: Path) -> None:
    src = bundled_tokenizer_dir()
    doc = json.loads((src / "tokenizer.json").read_text())
    doc["added_tokens"][4]["lstrip"] = True  # <|eot_id|> eats the spaces before it
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    shutil.copy(src / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    tok = load_tokenizer(tmp_path)
    assert tok.segments is None
    msgs = [{"role": "user", "content": "spaces   <|eot_id|> before an added token"}]
    assert tok.count_chat(msgs) == len(tok.encode_chat(msgs))
    # cutting at the added tokens would count the spaces the token ate: a wrong count
    assert BUNDLED.segments is not None
    naive = SegmentCounter(tok.hf, BUNDLED.segments.pattern)
    assert naive.count(tok.render_chat(msgs)) > tok.count_chat(msgs)
