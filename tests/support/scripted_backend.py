"""A deterministic backend that answers from a script: drives tool-call paths the tiny model cannot."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from rewardmesh.server.rollout.backends.base import Backend, GenerationOutput, GenerationRequest, WeightsError

# script(prompt text so far, turn index) -> (response text, seconds the "generation" takes)
Script = Callable[[str, int], tuple[str, float]]


class ScriptedBackend(Backend):
    name = "scripted"

    def __init__(self, tokenizer: Any, script: Script, max_model_len: int = 512) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.model = "scripted"
        self.max_model_len = max_model_len
        self.policy_version = 0
        self.weights = {"w": torch.zeros(2, 2)}
        self.requests: list[GenerationRequest] = []
        self.cancelled = 0
        self._running = 0

    @property
    def running(self) -> int:
        return self._running

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        self.requests.append(request)
        text = self.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
        reply, seconds = self.script(text, text.count("<tool_response>"))
        self._running += 1
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self._running -= 1
        ids = list(self.tokenizer.encode(reply, add_special_tokens=False))
        ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        reason = "length" if len(ids) > request.max_tokens else "stop"
        ids = ids[: request.max_tokens]
        return GenerationOutput(
            ids,
            reason,
            0,
            self.policy_version,
            # a made-up but recognisable log-prob per token: -(turn + 1) / 10
            logprobs=[-(text.count("<tool_response>") + 1) / 10] * len(ids) if request.logprobs else None,
            token_versions=[self.policy_version] * len(ids),
        )

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(v.shape), v.dtype) for k, v in self.weights.items()}

    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        for name in tensors:
            if name not in self.weights:
                raise WeightsError(f"unknown tensor {name}")
        for name, value in tensors.items():
            self.weights[name] = value.to(torch.float32)
        self.policy_version = version
