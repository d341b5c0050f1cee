"""The engine's own sample and score types, so no source ever sees a protobuf."""

from __future__ import annotations

from dataclasses import dataclass, field
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
