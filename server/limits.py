"""Server-side limits on every count and size a client controls, and the one helper that enforces them.

A request over a limit is refused at once with INVALID_ARGUMENT naming the field, its value and the
option that sets the limit, before the server allocates anything for it. Every limit is a server option
(``ServerOptions`` inherits these fields), so it is read like the others: flag-less, from
``REWARDMESH_<NAME>`` or the YAML file's ``server:`` section. docs/reliability.md's limits table lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rewardmesh.reward_engine.errors import InvalidInput


class LimitExceeded(InvalidInput):
    """A count or size over one of this server's limits (INVALID_ARGUMENT; the message names the option)."""


@dataclass
class Limits:
    """The limits; defaults are far above any sane request and far below what would hurt the server."""

    # Reward side (and samples a rollout server forwards).
    max_samples_per_request: int = 4096  # ScoreBatchRequest.samples, ScoreRequest.items
    max_sample_id_chars: int = 512  # Sample.sample_id, ScoreRequest.cancel_sample_ids[], Prompt.sample_ids[]
    max_tensor_elements: int = 1 << 20  # elements of any token-id tensor (prompt, response, mask)
    max_text_chars: int = 4 << 20  # Sample.prompt_text, response_text, ground_truth, data_source
    max_extra_info_bytes: int = 1 << 20  # Sample.extra_info, serialized
    max_extra_info_depth: int = 32  # nesting of Sample.extra_info
    # Rollout side.
    max_n: int = 1024  # GenerateRequest.n
    max_prompts_per_request: int = 4096  # GenerateRequest.prompts
    max_samples_per_generate: int = 65536  # prompts x n of one GenerateRequest
    max_tokens_limit: int = 1 << 20  # SamplingParams.max_tokens (the model's context also bounds it)
    max_weight_chunks: int = 1 << 20  # TensorChunk messages in one UpdateWeights stream


DEFAULT_LIMITS = Limits()


def check(value: int, limit: int, what: str, option: str) -> None:
    """Raise LimitExceeded when ``value`` is over ``limit``: ``what`` names the field (and unit),
    ``option`` the Limits field that sets the limit."""
    if value > limit:
        raise LimitExceeded(
            f"{what} is {value}, over this server's limit of {limit} "
            f"(server option {option}, env REWARDMESH_{option.upper()})"
        )


def depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON-like value, counted without recursion and at most ``limit + 1``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest
