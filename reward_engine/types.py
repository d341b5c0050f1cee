"""The engine's own sample and score types, so no source ever sees a protobuf."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import numpy as np


@dataclass
class RewardInput:
    """One sample as a reward source sees it."""

    sample_id: str
    prompt_ids: np.ndarray  # int32 [prompt_length]
    response_ids: np.ndarray  # int32 [response_length]
    prompt_text: str = ""
    response_text: str = ""
    data_source: str = ""
    ground_truth: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    response_mask: np.ndarray | None = None  # int32, 0 on tool-output tokens

    @property
    def num_tokens(self) -> int:
        """Tokens the sample occupies in a padded batch (what max_batch_tokens counts)."""
        return int(self.prompt_ids.shape[0] + self.response_ids.shape[0])


_I4 = np.dtype("<i4")


def _ids_field(name: str) -> Any:
    """A property over the instance dict: validated little-endian int32 bytes become an array on first read."""

    def get(self: RewardInput) -> np.ndarray:
        d = self.__dict__
        value = d[name]
        if value.__class__ is bytes:
            value = d[name] = np.frombuffer(value, _I4)
        return value

    def put(self: RewardInput, value: np.ndarray) -> None:
        self.__dict__[name] = value

    return property(get, put)


class WireInput(RewardInput):
    """A RewardInput as it came off the wire: its token ids stay bytes (checked: int32, 1-D, >= 0) until a
    source reads them. Rules and judges never do, and an array per id tensor was a tenth of the reward
    server's CPU per rule-scored sample. Pickles as a plain RewardInput."""

    prompt_ids = _ids_field("prompt_ids")
    response_ids = _ids_field("response_ids")

    @classmethod
    def of(
        cls,
        sample_id: str,
        prompt_ids: bytes | np.ndarray,
        response_ids: bytes | np.ndarray,
        prompt_text: str,
        response_text: str,
        data_source: str,
        ground_truth: str,
        extra_info: dict[str, Any],
        response_mask: np.ndarray | None,
    ) -> WireInput:
        """Ids as little-endian int32 bytes (already validated) or arrays; no __init__ (one dict, no setters)."""
        self = cls.__new__(cls)
        self.__dict__ = {
            "sample_id": sample_id,
            "prompt_ids": prompt_ids,
            "response_ids": response_ids,
            "prompt_text": prompt_text,
            "response_text": response_text,
            "data_source": data_source,
            "ground_truth": ground_truth,
            "extra_info": extra_info,
            "response_mask": response_mask,
        }
        return self

    @property
    def num_tokens(self) -> int:
        """As RewardInput's, without making the arrays."""
        d = self.__dict__
        p, r = d["prompt_ids"], d["response_ids"]
        return (len(p) >> 2 if p.__class__ is bytes else int(p.shape[0])) + (
            len(r) >> 2 if r.__class__ is bytes else int(r.shape[0])
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (RewardInput, tuple(getattr(self, f.name) for f in fields(RewardInput)))


@dataclass
class RewardOutput:
    """A source's verdict on one sample."""

    score: float
    extras: dict[str, float] = field(default_factory=dict)


# A source returns, per input and in input order, either an output or the exception that sample raised:
# one bad sample must not fail its batch-mates.
BatchResult = list[RewardOutput | BaseException]


class RewardSource(Protocol):
    """Anything that scores a batch of samples: a rule, a user function, a reward model, a judge."""

    name: str
    kind: str  # "rule" | "function" | "model" | "judge"
    target: str  # rule name, function spec, model path or judge URL

    async def score_batch(self, batch: list[RewardInput]) -> BatchResult: ...

    async def close(self) -> None: ...
