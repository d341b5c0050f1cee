"""Token ids to text without per-token Python: transformers' `decode` converts every id in Python before its
Rust tokenizer runs; for a fast tokenizer we call the Rust one directly (same text, same cleanup)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Decode = Callable[[Sequence[int]], str]

_CACHE: dict[int, tuple[Any, Decode]] = {}  # id(tokenizer) -> (tokenizer kept alive, its decoder)


def decoder(tokenizer: Any) -> Decode:
    """`ids -> text` with special tokens skipped, as `tokenizer.decode(ids, skip_special_tokens=True)`."""
    hit = _CACHE.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    fn = _build(tokenizer)
    _CACHE[id(tokenizer)] = (tokenizer, fn)
    return fn


def _build(tokenizer: Any) -> Decode:
    inner = getattr(tokenizer, "_tokenizer", None)  # a PreTrainedTokenizerFast's tokenizers.Tokenizer
    if inner is None or not callable(getattr(inner, "decode", None)):
        return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))
    rust = inner.decode
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        cleanup = tokenizer.clean_up_tokenization
        return lambda ids: str(cleanup(rust(list(ids), skip_special_tokens=True)))
    return lambda ids: str(rust(list(ids), skip_special_tokens=True))
