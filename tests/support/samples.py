"""Samples as the reward engine's sources see them, built with only what a test sets (the rest empty)."""

from __future__ import annotations

from typing import Any

import numpy as np

from rewardmesh.reward_engine.types import RewardInput


def reward_input(
    response: str = "",
    ground_truth: str = "",
    data_source: str = "unit",
    sid: str = "s",
    *,
    prompt: str = "",
    **extra_info: Any,
) -> RewardInput:
    """A sample whose text is `response`; keywords the engine does not name go to `extra_info` (as a trainer's
    extra columns do). Token ids are placeholders: sources that read text never look at them."""
    return RewardInput(
        sample_id=sid,
        prompt_ids=np.zeros(2, dtype=np.int32),
        response_ids=np.zeros(3, dtype=np.int32),
        prompt_text=prompt,
        response_text=response,
        ground_truth=ground_truth,
        data_source=data_source,
        extra_info=extra_info,
    )
