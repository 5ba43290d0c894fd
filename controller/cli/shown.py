"""What ``pdctl`` prints of text it did not write: every string from the store or a peer
(operators' reasons and names, routers' and workers' error messages, outcomes) goes through
:func:`shown` on its way to a terminal, so that a stored escape sequence cannot move the
cursor, recolour, hide or reorder what an operator reads.

Escaped: C0 controls (``\\x00``–``\\x1f``, newlines and tabs included unless
``keep_newlines``), DEL and C1 controls (``\\x7f``–``\\x9f``) as ``\\xHH``; the Unicode
bidirectional controls (U+061C, U+200E, U+200F, U+202A–U+202E, U+2066–U+2069) as
``\\uHHHH``. With ``markup`` (text handed to rich's ``Console.print``), rich's markup is
escaped too, so ``[bold]`` in a reason is printed, not applied. JSON output needs none of
this: JSON escapes control characters itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e"
                      "\u2066-\u2069]")
_CONTROL_AND_NEWLINES = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e"
                                   "\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shown(value: object, *, keep_newlines: bool = False, markup: bool = False) -> str:
    """``str(value)`` with control characters escaped (see the module's docstring)."""
    pattern = _CONTROL if keep_newlines else _CONTROL_AND_NEWLINES
    text = pattern.sub(_escape, str(value))
    if markup:
        from rich.markup import escape

        text = escape(text)
    return text


def shown_doc(doc: Any, *, markup: bool = False) -> Any:
    """``doc`` (dicts, lists, scalars) with :func:`shown` applied to every string in it,
    keys included: for the text rendering of a document also printed as JSON."""
    if isinstance(doc, str):
        return shown(doc, markup=markup)
    if isinstance(doc, Mapping):
        return {shown_doc(k, markup=markup): shown_doc(v, markup=markup)
                for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return type(doc)(shown_doc(v, markup=markup) for v in doc)
    return doc
