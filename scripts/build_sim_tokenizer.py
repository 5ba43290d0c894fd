"""Build the simulator's tokenizer: a byte-level BPE with a Llama-3-style chat template.

The corpus is ``scripts/data/sim_tokenizer_corpus.txt``, a frozen snapshot of the project's
own documentation (Apache-2.0, this repository), so the build is reproducible and
licence-clean. The output is ``controller/tokenize/data/sim-tokenizer/`` (``tokenizer.json``
and ``tokenizer_config.json``), loaded by ``controller.tokenize.load_tokenizer`` through the
same code as a model's own files. Deterministic: the same corpus and settings give the same
files (``tests/tokenize/test_bundled.py`` rebuilds and compares).

    python scripts/build_sim_tokenizer.py [--out DIR] [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "scripts" / "data" / "sim_tokenizer_corpus.txt"
OUT = ROOT / "controller" / "tokenize" / "data" / "sim-tokenizer"
VOCAB_SIZE = 4096
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama-3's template, less its tool-calling branches: every message is a header, a blank
# line, the content and <|eot_id|>; the generation prompt opens an assistant header.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


def build(corpus: Path = CORPUS) -> tuple[str, str]:
    """Train the tokenizer; returns (tokenizer.json text, tokenizer_config.json text)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }
    doc = json.loads(tok.to_str())
    return (json.dumps(doc, ensure_ascii=False, indent=1, sort_keys=True) + "\n",
            json.dumps(config, ensure_ascii=False, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true",
                    help="compare with the files in --out instead of writing them")
    args = ap.parse_args(argv)
    tok_json, cfg_json = build()
    files = {"tokenizer.json": tok_json, "tokenizer_config.json": cfg_json}
    if args.check:
        stale = [n for n, text in files.items()
                 if not (args.out / n).is_file()
                 or (args.out / n).read_text(encoding="utf-8") != text]
        for n in stale:
            print(f"{args.out / n}: differs from a fresh build", file=sys.stderr)
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for n, text in files.items():
        (args.out / n).write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({sum(len(t) for t in files.values())} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
