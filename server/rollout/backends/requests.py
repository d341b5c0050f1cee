"""What every backend does the same way with a request: check it before it joins a shared batch, and find where
its output ends (eos tokens, stop strings)."""

from __future__ import annotations

from typing import Any

from rewardmesh.common.errors import InvalidInput
from rewardmesh.server.rollout.backends.base import GenerationRequest

__all__ = ["eos_token_ids", "trim_at_stop", "validate_request"]


def eos_token_ids(tokenizer: Any, generation_config: Any = None) -> set[int]:
    """The tokenizer's eos plus the generation config's (chat models often end turns on a second token)."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, list | tuple):
        ids.update(int(i) for i in gen_eos)
    return ids


def trim_at_stop(tokenizer: Any, token_ids: list[int], stops: list[str] | tuple[str, ...]) -> list[int] | None:
    """Cut ``token_ids`` before the earliest stop string in their text, or None when there is none.

    Only whole tokens are kept: a token whose text runs into the stop string is dropped with it, so the
    returned ids decode to text that ends at or before the match and never contains it.
    """
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    hits = [pos for pos in (text.find(s) for s in stops if s) if pos >= 0]
    if not hits:
        return None
    cut = min(hits)
    keep = len(token_ids)
    while keep > 0:
        prefix = tokenizer.decode(token_ids[:keep], skip_special_tokens=True)
        if len(prefix) <= cut and text.startswith(prefix):
            break
        keep -= 1
    return list(token_ids[:keep])


def validate_request(request: GenerationRequest, *, max_model_len: int, vocab_size: int | None) -> None:
    """Reject what would otherwise fail inside a shared batch (and take its neighbours down with it)."""
    n = len(request.prompt_ids)
    if n == 0:
        raise InvalidInput("prompt_ids is empty: the model needs at least one prompt token")
    if request.max_tokens < 1:
        raise InvalidInput(f"max_tokens must be at least 1, got {request.max_tokens}")
    if n + request.max_tokens > max_model_len:
        raise InvalidInput(
            f"prompt length {n} + max_tokens {request.max_tokens} = {n + request.max_tokens} exceeds "
            f"max_model_len {max_model_len}; lower max_tokens to at most {max(max_model_len - n, 0)}"
        )
    if not 0 <= request.min_tokens <= request.max_tokens:
        raise InvalidInput(f"min_tokens must be in [0, max_tokens={request.max_tokens}], got {request.min_tokens}")
    if request.temperature < 0:
        raise InvalidInput(f"temperature must be >= 0, got {request.temperature}")
    if not 0 < request.top_p <= 1:
        raise InvalidInput(f"top_p must be in (0, 1], got {request.top_p}")
    if request.top_k < 0:
        raise InvalidInput(f"top_k must be >= 0 (0: off), got {request.top_k}")
    if vocab_size is not None:
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidInput(f"prompt_ids hold ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
