"""The hf backend's requests as the decode loop holds them: waiting (Pending), then decoding (Row)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from rewardmesh.server.rollout.backends.base import GenerationOutput, GenerationRequest

__all__ = ["Pending", "Row", "next_uniform"]


@dataclass(eq=False)
class Pending:
    request: GenerationRequest
    future: asyncio.Future[GenerationOutput]
    arrival_step: int  # steps completed when the request arrived


@dataclass(eq=False)
class Row:
    slot: Pending
    generator: torch.Generator
    stop_ids: frozenset[int]
    stops: tuple[str, ...]
    tail_tokens: int  # how many trailing tokens to decode to be sure a new stop-string match is seen
    reserve: int  # prompt + max_tokens: what this row counts against max_batch_tokens
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # when the request asked for them
    versions: list[int] = field(default_factory=list)  # weights version of each token
    finish_reason: str | None = None
    first_step: int = -1  # the step that produced its first token
    start: int = 0  # slot cache: the column of its first token
    uniforms: list[float] = field(default_factory=list)  # its generator's next draws, drawn a few at a time


def next_uniform(row: Row) -> float:
    """The row's next uniform draw; a greedy row draws none (it never uses one).

    Draws come from the row's own generator 32 at a time: ``torch.rand(32)`` yields the same numbers as 32
    calls of ``torch.rand(1)``, so seeded outputs are unchanged, for a 32nd of the per-call cost.
    """
    if row.slot.request.temperature <= 1e-5:
        return 0.0
    if not row.uniforms:
        row.uniforms = torch.rand(32, generator=row.generator).tolist()[::-1]
    return row.uniforms.pop()
