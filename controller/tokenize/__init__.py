"""Token counts from a model's own tokenizer, shared by the router and the simulated workers.

``load_tokenizer(path)`` reads a Hugging Face ``tokenizer.json`` (a file, or a directory
holding one) with the ``tokenizers`` library and, when present beside it,
``tokenizer_config.json``'s ``chat_template``, rendered with Jinja2 the way transformers and
vLLM render it. ``bundled_tokenizer_dir()`` is the small tokenizer the repository builds
itself (``scripts/build_sim_tokenizer.py``); a user's tokenizer goes through the same code.
"""

from controller.tokenize.tokenizer import (
    Tokenizer,
    TokenizerError,
    bundled_tokenizer_dir,
    load_tokenizer,
)

__all__ = ["Tokenizer", "TokenizerError", "bundled_tokenizer_dir", "load_tokenizer"]
