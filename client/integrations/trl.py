"""TRL: `GRPOTrainer(reward_funcs=[RewardMeshReward("reward:50051", "gsm8k")])`.

TRL awaits async reward callables on its own event-loop thread with `prompts=`, `completions=`,
`completion_ids=`, every dataset column and `trainer_state=` as keywords, and expects one float or None
per completion. The name TRL logs the reward under (`rewards/<name>/mean`) is `__name__`.

A failed sample raises RewardMeshError naming the sample and the cause, which ends `trainer.train()`: the
default. Opt-in: `error_score=X` scores it X, or `mask_errors=True` returns None, which TRL 1.16 turns into
NaN: a completion every reward function left None gets advantage 0 and stays out of its group's baseline (with
other reward functions, only this one's term is left out). A server that is down, refuses the token, or lacks
the pipeline always raises: every sample would fail.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from rewardmesh.client.integrations.scoring import (
    SERVICE_ERRORS,
    MeshScorer,
    describe,
    error_text,
    extra_info_from,
    failure,
    make_sample,
)

log = logging.getLogger(__name__)
GROUND_TRUTH_COLUMNS = ["ground_truth", "solution", "answer", "label"]


def _text(value: Any) -> str:
    """A standard completion is a string; a conversational one is messages: their contents, joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(str(m.get("content", "")) for m in value if isinstance(m, dict))
    return str(value)


def _prompt_text(value: Any) -> str:
    """A conversational prompt's last user message (what rules and judges read); a plain prompt as it is."""
    if isinstance(value, list):
        users = [m for m in value if isinstance(m, dict) and m.get("role") == "user"]
        return _text([users[-1]]) if users else _text(value)
    return _text(value)


class RewardMeshReward:
    """An async TRL reward function scoring every completion on a rewardmesh pipeline.

    Dataset columns feed the sample: `ground_truth_column` (default: the first of ground_truth, solution,
    answer, label present), `data_source` and `extra_info`. A sample the server fails raises, unless
    `error_score` or `mask_errors` is set (see the module's docstring).
    """

    def __init__(
        self,
        target: str | Sequence[str],
        pipeline: str,
        *,
        timeout_s: float = 300.0,
        ground_truth_column: str | None = None,
        name: str | None = None,
        error_score: float | None = None,
        mask_errors: bool = False,
    ) -> None:
        if error_score is not None and mask_errors:
            raise ValueError("rewardmesh: set error_score or mask_errors, not both")
        self.scorer = MeshScorer(target, pipeline, timeout_s=timeout_s)
        self.error_score = error_score
        self.mask_errors = mask_errors
        self.ground_truth_column = ground_truth_column
        self.__name__ = name or f"rewardmesh_{pipeline}"

    def _truths(self, n: int, columns: dict[str, Any]) -> list[Any]:
        names = [self.ground_truth_column] if self.ground_truth_column else GROUND_TRUTH_COLUMNS
        for column in names:
            if column in columns and columns[column] is not None:
                return list(columns[column])
        return [""] * n

    async def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]] | None = None,
        **columns: Any,
    ) -> list[float | None]:
        n = len(completions)
        truths = self._truths(n, columns)
        sources = columns.get("data_source") or [""] * n
        extras = columns.get("extra_info") or [None] * n
        samples = [
            make_sample(
                self.scorer.next_id(),
                prompt_text=_prompt_text(prompts[i]),
                response_text=_text(completions[i]),
                response_ids=completion_ids[i] if completion_ids is not None else None,
                ground_truth=truths[i],
                data_source=str(sources[i] or ""),
                extra_info=extra_info_from(extras[i]),
            )
            for i in range(n)
        ]
        results = await self.scorer.score(samples)
        rewards: list[float | None] = []
        lenient = self.error_score is not None or self.mask_errors
        for i, result in enumerate(results):
            if not result.HasField("error"):
                rewards.append(result.score)
                continue
            what = describe(i, _prompt_text(prompts[i]))
            if not lenient or result.error.code in SERVICE_ERRORS:
                hint = "pass error_score= or mask_errors=True to RewardMeshReward to go on without it"
                raise failure(self.scorer.pipeline, what, result, hint)
            log.warning("rewardmesh: %s %s: %s", what, "masked" if self.mask_errors else "scored", error_text(result))
            rewards.append(None if self.mask_errors else self.error_score)
        return rewards
