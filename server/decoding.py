"""Token ids to text without per-token Python: transformers' `decode` converts every id in Python before its
Rust tokenizer runs; for a fast tokenizer we call the Rust one directly (same text, same cleanup)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

Decode = Callable[[Sequence[int]], str]

CACHE_SIZE = 8  # tokenizers whose decoders are kept; a process serves one or two, a test run builds many
# id(tokenizer) -> (tokenizer kept alive, its decoder), least recently used first: the entry keeps its tokenizer
# alive (so its id is not reused by another object), hence the bound.
_CACHE: OrderedDict[int, tuple[Any, Decode]] = OrderedDict()
_LOCK = threading.Lock()  # decoders are asked for from executor threads too


def decoder(tokenizer: Any) -> Decode:
    """`ids -> text` with special tokens skipped, as `tokenizer.decode(ids, skip_special_tokens=True)`."""
    key = id(tokenizer)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0] is tokenizer:
            _CACHE.move_to_end(key)
            return hit[1]
    fn = _build(tokenizer)
    with _LOCK:
        _CACHE[key] = (tokenizer, fn)
        _CACHE.move_to_end(key)
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
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
