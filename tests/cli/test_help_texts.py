"""Every command's --help shows its option texts as written (config sections such as
"[store]" included: a markup renderer would swallow them as tags)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import typer.main
from typer.core import TyperGroup, TyperOption
from typer.testing import CliRunner

from controller.cli import app


def _commands(
    group: TyperGroup, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], Any]]:
    for name, cmd in group.commands.items():
        if isinstance(cmd, TyperGroup):
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


def test_option_help_texts_naming_config_sections_render_verbatim() -> None:
    root = typer.main.get_command(app)
    assert isinstance(root, TyperGroup)
    runner = CliRunner()
    checked = 0
    for path, cmd in _commands(root):
        sections = sorted({
            word for p in cmd.params if isinstance(p, TyperOption) and p.help
            for word in p.help.replace("(", " ").replace(",", " ").split()
            if word.startswith("[") and word.rstrip(").").endswith("]")
        })
        if not sections:
            continue
        out = runner.invoke(app, [*path, "--help"], terminal_width=200).output
        for section in sections:
            assert section.rstrip(").") in out, (path, section)
        checked += 1
    assert checked >= 5  # the texts exist: db, history, explain, plan, agent ...
