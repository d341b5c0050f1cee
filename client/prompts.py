"""What a trainer asks of a step: its prompts (token ids or chat messages, with what their reward needs) and the
sampling parameters, each turned into its protobuf message once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import struct_pb2

from rewardmesh.common.tensors import ids_tensor
from rewardmesh.v1 import rollout_pb2

__all__ = ["PromptSpec", "Sampling"]


@dataclass
class PromptSpec:
    """One prompt of a step: token ids or chat messages, and what its reward needs."""

    token_ids: Sequence[int] | None = None
    messages: list[dict[str, str]] | None = None
    data_source: str = ""
    ground_truth: str = ""
    extra_info: dict[str, Any] | None = None
    group_id: str = ""

    def to_proto(self, group_id: str, sample_ids: list[str]) -> rollout_pb2.Prompt:
        p = rollout_pb2.Prompt(group_id=group_id, sample_ids=sample_ids, data_source=self.data_source,
                               ground_truth=self.ground_truth)  # fmt: skip
        if self.token_ids is not None:
            p.token_ids.CopyFrom(ids_tensor(list(self.token_ids)))
        elif self.messages is not None:
            p.chat.messages.extend(rollout_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in self.messages)
        if self.extra_info:
            s = struct_pb2.Struct()
            s.update(self.extra_info)
            p.extra_info.CopyFrom(s)
        return p


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False  # return each token's log-prob (RolloutBatch.rollout_log_probs), for off-policy correction
    ignore_eos: bool = False  # run every sample to max_tokens (the model's eos does not end it), as benchmarks need
    min_tokens: int = 0  # the model's eos cannot end a turn before this many tokens

    def to_proto(self) -> rollout_pb2.SamplingParams:
        p = rollout_pb2.SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                       max_tokens=self.max_tokens, stop=self.stop, logprobs=self.logprobs,
                                       ignore_eos=self.ignore_eos, min_tokens=self.min_tokens)  # fmt: skip
        if self.seed is not None:
            p.seed = self.seed
        return p
