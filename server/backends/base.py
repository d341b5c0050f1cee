"""The one small interface every generation backend implements: token ids in, token ids out, async."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rewardmesh.common.weights import WeightsError  # the one weight validator's error

__all__ = ["Backend", "GenerationFailed", "GenerationOutput", "GenerationRequest", "WeightsError"]


@dataclass
class GenerationRequest:
    """One generation turn of one sample."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop_token_ids: list[int] = field(default_factory=list)  # beside the model's eos
    stop: list[str] = field(default_factory=list)  # stop strings; the matched text is not returned
    seed: int | None = None
    logprobs: bool = False  # return the log-prob of each sampled token (GenerationOutput.logprobs)


@dataclass
class GenerationOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    num_preempted: int = -1  # -1: the backend cannot tell
    policy_version: int = 0  # the oldest weights version that generated any of these tokens
    # Per token, when the request asked: log-prob of the sampled token under the distribution the engine
    # sampled from (after temperature, top-k and top-p; greedy rows at temperature 1), as vLLM's
    # "processed_logprobs".
    logprobs: list[float] | None = None
    # Per token, where the engine knows it: the weights version that produced that token (None: unknown).
    token_versions: list[int] | None = None


class GenerationFailed(RuntimeError):
    """The engine failed this one request (vLLM's finish_reason "error"): the sample's error, not a completion."""


class Backend(Protocol):
    """A generation engine with many requests in flight.

    Cancelling the task awaiting `generate` aborts that request and frees its slot.
    `update_weights` validates everything first (WeightsError naming the tensor, nothing applied),
    then swaps weights atomically between generation steps and sets `policy_version`.
    """

    name: str  # "hf" | "vllm" | ...
    model: str  # path or name
    max_model_len: int
    tokenizer: Any  # a transformers tokenizer (chat template, decode, eos)
    policy_version: int

    async def start(self) -> None: ...

    async def generate(self, request: GenerationRequest) -> GenerationOutput: ...

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...

    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None: ...

    @property
    def running(self) -> int: ...

    async def close(self) -> None: ...
