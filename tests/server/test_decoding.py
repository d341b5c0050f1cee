"""server/decoding.py: the fast decoder gives transformers' text, and its cache of decoders stays bounded."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence
from typing import Any

from rewardmesh.server import decoding


class _Tokenizer:
    """Anything with transformers' `decode` signature (decoding falls back to it when there is no Rust tokenizer)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return f"{self.tag}:{','.join(map(str, ids))}"


def test_decoder_matches_the_tokenizers_own_decode(tok: Any) -> None:
    ids = tok.encode("The answer is 42, so #### 42.")
    assert decoding.decoder(tok)(ids) == tok.decode(ids, skip_special_tokens=True)
    assert decoding.decoder(tok) is decoding.decoder(tok)  # built once, then cached


def test_cache_keeps_the_most_recently_used_decoders_and_lets_the_rest_go() -> None:
    first = _Tokenizer("first")
    first_decode = decoding.decoder(first)
    gone = weakref.ref(made := _Tokenizer("gone"))
    decoding.decoder(made)
    del made
    for i in range(decoding.CACHE_SIZE * 3):
        decoding.decoder(_Tokenizer(f"t{i}"))
        assert decoding.decoder(first) is first_decode  # used again and again: never evicted
        assert len(decoding._CACHE) <= decoding.CACHE_SIZE
    gc.collect()
    assert gone() is None, "an evicted tokenizer is no longer kept alive by the cache"
    assert first_decode([1, 2]) == "first:1,2"
