"""Cost of counting a chat prompt's tokens with controller.tokenize (the router's per-request cost).

Run from the repository root: ``.venv/bin/python benchmarks/tokenize_cost.py [--tokenizer DIR]``.

Builds a multi-turn chat whose rendered prompt is about ``--tokens`` tokens (2,048 by default)
from the project's docs, then times, ``--repeat`` times each, and prints p50/p99/mean in
microseconds:

- ``count_chat`` cold: every message new (the piece cache emptied before each call);
- ``count_chat`` next turn: the earlier messages seen before, the last user message new
  (what a router sees on a conversation's later turn);
- ``count_chat`` repeated: the same messages again;
- ``count_text`` of the rendered text (one encode of everything, no cache) and
  ``render_chat`` alone.

One thread; the machine's other load shows in p99.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from controller.tokenize import bundled_tokenizer_dir, load_tokenizer  # noqa: E402


def chat_of(tok_count: int, tokenizer) -> list[dict[str, str]]:  # type: ignore[no-untyped-def]
    words = (REPO / "docs" / "simulator.md").read_text().split()
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    i = 0
    while tokenizer.count_chat(msgs) < tok_count:
        role = "user" if len(msgs) % 2 else "assistant"
        msgs.append({"role": role, "content": " ".join(words[i % len(words):][:60])})
        i += 60
    return msgs


def timed(fn, repeat: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, default=bundled_tokenizer_dir())
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    tok = load_tokenizer(args.tokenizer)
    msgs = chat_of(args.tokens, tok)
    text = tok.render_chat(msgs)
    n = tok.count_chat(msgs)
    print(f"tokenizer {args.tokenizer}; chat of {len(msgs)} messages, {n} prompt tokens, "
          f"{len(text)} chars; {args.repeat} repeats; piece cache "
          f"{'on' if tok.segments is not None else 'off (this tokenizer)'}")
    seg = tok.segments
    turn = iter(range(10**9))

    def cold() -> int:
        if seg is not None:
            seg.cache.clear()
        return tok.count_chat(msgs)

    def next_turn() -> int:
        last = {"role": "user", "content": f"{next(turn)}: " + msgs[-1]["content"]}
        return tok.count_chat([*msgs[:-1], last])

    for name, fn in (("count_chat, cold", cold),
                     ("count_chat, next turn", next_turn),
                     ("count_chat, repeated", lambda: tok.count_chat(msgs)),
                     ("count_text (one encode)", lambda: tok.count_text(text)),
                     ("render_chat (template only)", lambda: tok.render_chat(msgs))):
        timed(fn, 50)  # warm up
        us = sorted(timed(fn, args.repeat))
        print(f"{name:<28} p50 {us[len(us) // 2]:8.1f} us  p99 {us[int(len(us) * 0.99)]:8.1f} us"
              f"  mean {statistics.fmean(us):8.1f} us")


if __name__ == "__main__":
    main()
