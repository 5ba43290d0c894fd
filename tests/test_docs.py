"""The README a newcomer reads, and the links of every document: README.md is short, starts
with its title and links nothing outside the repository; every relative link in README.md,
docs/*.md and the data README points at a file (and heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "controller/data/README.md"]


def prose(text: str, *, inline_code: bool = False) -> str:
    """``text`` without fenced code blocks (where ``#`` is no heading and brackets are no
    links) and, unless ``inline_code``, without inline code."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line if inline_code else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def links(path: Path) -> list[str]:
    return [a or b for a, b in LINK.findall(prose(path.read_text(encoding="utf-8")))]


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = prose(path.read_text(encoding="utf-8"), inline_code=True)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_the_readme_is_short_and_starts_with_its_title() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"
    assert lines[0] == "# pd-controller"
    outside = "/".join(("..", "shared"))  # the sibling folder a user's clone does not have
    assert outside not in README.read_text(encoding="utf-8")


def test_the_readme_links_nothing_outside_the_repository() -> None:
    found = links(README)
    assert found, "README.md links nothing: the link parser is broken"
    for target in found:
        assert not re.match(r"^[a-z][a-z0-9+.-]*:", target), f"README.md links outside: {target}"
        resolved = (ROOT / target.split("#")[0]).resolve()
        assert resolved.is_relative_to(ROOT), f"README.md links outside the repository: {target}"


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_an_existing_file_and_heading(doc: Path) -> None:
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # an external URL (README.md has none, see above)
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        assert path.is_relative_to(ROOT), f"{doc.name}: {target} leaves the repository"
        assert path.exists(), f"{doc.relative_to(ROOT)}: {target} does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{doc.relative_to(ROOT)}: no heading #{anchor}"


def test_the_link_checks_can_fail(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("# Title\n\nsee [a](missing.md), `[b](code.md)` and [c](#title)\n"
                   "```\n[d](fenced.md)\n```\n", encoding="utf-8")
    assert links(doc) == ["missing.md", "#title"]
    assert anchors(doc) == {"title"}
    assert slug("Learning and drift (`controller/core/`, `docs/learning.md`)") == \
        "learning-and-drift-controllercore-docslearningmd"
