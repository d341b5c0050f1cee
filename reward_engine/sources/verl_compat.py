"""verl reward-function compatibility: one place that turns a verl-style return into a RewardOutput.

Rules and user functions share verl's signature
``compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict`` so that a
reward function written for verl runs here unchanged; both sources convert its return value here,
so they accept and reject exactly the same things.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

from rewardmesh.common.errors import SourceFailed
from rewardmesh.reward_engine.types import RewardInput, RewardOutput

# verl's signature: (data_source, solution_str, ground_truth, extra_info) -> float | dict
VerlScoreFn = Callable[..., Any]

# A returned dict's size: every extra travels in each result and lands in the trainer's metrics, so a function
# returning millions of entries fails its sample (checked before anything is copied) instead of the server.
MAX_EXTRAS = 256  # entries besides "score"
MAX_EXTRA_NAME_CHARS = 128


def _as_number(value: Any) -> float | None:
    """A float for bools, ints, floats and numpy scalars; None for anything else (str, list, ...)."""
    if value.__class__ is float:  # the common case, before the ABC check below (slow per sample)
        return value
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def to_output(value: Any, what: str = "reward function") -> RewardOutput:
    """Convert a verl-style return (number or dict with "score") to a RewardOutput.

    A dict's other numeric values become extras (bools as 0/1) so callers can log why a sample
    scored as it did; non-numeric values are dropped silently, as verl's reward managers only
    aggregate numbers. A NaN or infinite score is rejected: one would poison the training batch.
    ``what`` names the producer (e.g. "rule 'gsm8k'") in error messages.
    """
    if value.__class__ is float and value - value == 0.0:  # a finite float: most rules, every sample
        return RewardOutput(value, {})
    if isinstance(value, dict):
        if len(value) > MAX_EXTRAS + 1:
            raise SourceFailed(f"{what} returned a dict of {len(value)} entries; at most {MAX_EXTRAS} besides 'score'")
        if "score" not in value:
            keys = ", ".join(repr(k) for k in list(value)[:8])
            raise SourceFailed(f"{what} returned a dict without a 'score' key (keys: {keys})")
        score = _as_number(value["score"])
        if score is None:
            raise SourceFailed(f"{what} returned a non-numeric 'score' of type {type(value['score']).__name__}")
        extras: dict[str, float] = {}
        for key, item in value.items():
            if key == "score" or not isinstance(key, str):
                continue
            if len(key) > MAX_EXTRA_NAME_CHARS:
                raise SourceFailed(f"{what} returned an extra named {key[:40]!r}... of {len(key)} characters; "
                                   f"at most {MAX_EXTRA_NAME_CHARS}")  # fmt: skip
            number = _as_number(item)
            if number is not None:
                extras[key] = number
    else:
        score = _as_number(value)
        if score is None:
            raise SourceFailed(
                f"{what} returned {type(value).__name__}; expected a number or a dict with a 'score' key"
            )
        extras = {}
    if not math.isfinite(score):
        raise SourceFailed(f"{what} returned a non-finite score ({score})")
    return RewardOutput(score=score, extras=extras)


def verl_kwargs(sample: RewardInput) -> dict[str, Any]:
    """Keyword arguments for a verl-style call; keywords, as verl's reward managers pass them."""
    return {
        "data_source": sample.data_source,
        "solution_str": sample.response_text,
        "ground_truth": sample.ground_truth,
        "extra_info": sample.extra_info,
    }
