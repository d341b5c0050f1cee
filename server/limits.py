"""Server-side limits on every count and size a client controls, and the one helper that enforces them.

A request over a limit is refused at once with INVALID_ARGUMENT naming the field, its value and the
option that sets the limit, before the server allocates anything for it. Every limit is a server option
(``ServerOptions`` inherits these fields), so it is read like the others: flag-less, from
``REWARDMESH_<NAME>`` or the YAML file's ``server:`` section. docs/reliability.md's limits table lists them.

``extra_info`` travels nested in other messages (a prompt's in ``GenerateRequest``, a sample's in the batched
``ScoreRequest.items`` and ``GenerateResponse.items``), and protobuf refuses to parse a message nested past its
recursion limit: ``WIRE_MAX_EXTRA_INFO_DEPTH`` is the deepest ``extra_info`` that every envelope still parses,
so a depth accepted at the edge can never fail a whole batched message further on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format

from rewardmesh.common.errors import InvalidInput

if TYPE_CHECKING:
    from rewardmesh.v1 import reward_pb2


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
    max_extra_info_depth: int = 32  # nesting of Sample.extra_info, Prompt.extra_info (at most the wire's 32)
    max_ids_per_message: int = 4096  # ScoreRequest.cancel_sample_ids, keep_traces; KeepTracesRequest.sample_ids
    # Rollout side.
    max_n: int = 1024  # GenerateRequest.n
    max_prompts_per_request: int = 4096  # GenerateRequest.prompts
    max_samples_per_generate: int = 65536  # prompts x n of one GenerateRequest
    max_tokens_limit: int = 1 << 20  # SamplingParams.max_tokens (the model's context also bounds it)
    max_prompt_chars: int = 1 << 20  # characters of one chat prompt (all messages), checked before tokenizing
    max_stop_strings: int = 64  # SamplingParams.stop count
    max_stop_chars: int = 1024  # length of each SamplingParams.stop string
    max_stop_token_ids: int = 1024  # SamplingParams.stop_token_ids count
    max_weight_chunks: int = 1 << 20  # TensorChunk messages in one UpdateWeights stream

    def __post_init__(self) -> None:
        if not 1 <= self.max_extra_info_depth <= WIRE_MAX_EXTRA_INFO_DEPTH:
            raise ValueError(
                f"max_extra_info_depth must be in [1, {WIRE_MAX_EXTRA_INFO_DEPTH}] (deeper extra_info cannot be "
                f"forwarded in a batched message), got {self.max_extra_info_depth}"
            )


# The deepest extra_info (JSON nesting, as `depth` counts it) that still parses inside the deepest envelope it
# travels in (GenerateResponse.items[].sample.extra_info, ScoreRequest.items[].sample.extra_info): protobuf's
# recursion limit is 100 messages, and each JSON level is three (Struct, its map entry, Value).
WIRE_MAX_EXTRA_INFO_DEPTH = 32

DEFAULT_LIMITS = Limits()


def check(value: int, limit: int, what: str, option: str) -> None:
    """Raise LimitExceeded when ``value`` is over ``limit``: ``what`` names the field (and unit),
    ``option`` the Limits field that sets the limit."""
    if value > limit:
        raise LimitExceeded(
            f"{what} is {value}, over this server's limit of {limit} "
            f"(server option {option}, env REWARDMESH_{option.upper()})"
        )


def finite(value: float, what: str) -> float:
    """``value`` when it is a finite number; InvalidInput naming ``what`` for NaN or an infinity."""
    if not math.isfinite(value):
        raise InvalidInput(f"{what} must be a finite number, got {value}")
    return value


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


def extra_info(struct: Any, what: str, lim: Limits) -> dict[str, Any]:
    """A Struct (``extra_info``) as a dict, refused over ``lim``'s size or nesting depth: the one check for
    every extra_info a client sends (a prompt's on Generate, a sample's on Score)."""
    check(struct.ByteSize(), lim.max_extra_info_bytes, f"{what} serialized size", "max_extra_info_bytes")
    value: dict[str, Any] = json_format.MessageToDict(struct)
    check(depth(value, lim.max_extra_info_depth), lim.max_extra_info_depth, f"{what} nesting depth",
          "max_extra_info_depth")  # fmt: skip
    return value


def keep_traces(request: reward_pb2.KeepTracesRequest, lim: Limits) -> None:
    """A KeepTraces request's id lists, each within ``max_ids_per_message`` (both services take KeepTraces)."""
    check(len(request.sample_ids), lim.max_ids_per_message, "KeepTracesRequest.sample_ids count",
          "max_ids_per_message")  # fmt: skip
    check(len(request.traceparents), lim.max_ids_per_message, "KeepTracesRequest.traceparents count",
          "max_ids_per_message")  # fmt: skip
