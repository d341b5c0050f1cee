"""verl 0.9.1: a reward manager for the reward loop, and an async `compute_score` for text-only pipelines.

Reward manager (registered as `rewardmesh` through the `verl.plugins` entry point, which `import verl` loads):

    reward.reward_manager.name=rewardmesh
    +reward.rewardmesh.target=dns:///reward.NAMESPACE.svc.cluster.local:50051
    +reward.rewardmesh.pipeline=gsm8k

Optional: `+reward.rewardmesh.timeout_s=300`, `+reward.rewardmesh.error_score=0.0` (score a failed sample
this way, flagged by `rewardmesh/error`, instead of failing the step: the default; a server that is down,
refuses the token or lacks the pipeline fails the step either way), and `+reward.rewardmesh.extra_keys=[acc]`
(report these extras instead of the pipeline's). verl builds its extra-info columns from the first sample's
keys, in whichever of its reward-loop workers, so every sample returns the same keys: `rewardmesh/queue_s`,
`rewardmesh/compute_s`, `rewardmesh/batch_size`, `rewardmesh/error` (the gRPC code, 0 when scored) and the
pipeline's extras as the server announces them in ListRewards (NaN where a sample has none). Token ids go
with the text.

Function form (verl's naive manager calls it with the decoded response):

    reward.custom_reward_function.path=pkg://rewardmesh.client.integrations.verl
    reward.custom_reward_function.name=compute_score
    +reward.custom_reward_function.reward_kwargs.target=HOST:PORT
    +reward.custom_reward_function.reward_kwargs.pipeline=gsm8k
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

from rewardmesh.client.integrations.scoring import (
    PIPELINE_ENV,
    SERVICE_ERRORS,
    TARGET_ENV,
    MeshScorer,
    describe,
    error_text,
    extra_info_from,
    failure,
    make_sample,
)
from rewardmesh.v1 import reward_pb2

try:  # verl is optional: the function form and the helpers work without it
    from verl.experimental.reward_loop.reward_manager import register
    from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
except ImportError:  # pragma: no cover - exercised where verl is absent
    RewardManagerBase = object

    def register(name: str) -> Any:
        return lambda cls: cls


log = logging.getLogger(__name__)

FIXED_KEYS = ("rewardmesh/queue_s", "rewardmesh/compute_s", "rewardmesh/batch_size", "rewardmesh/error")


_warned: set[tuple[str, str]] = set()


def extra_info_of(result: reward_pb2.RewardResult, extra_keys: Sequence[str], pipeline: str = "") -> dict[str, float]:
    """The fixed keys, then `extra_keys` (NaN where the result has none); others are left out, said once."""
    for key in result.extras:
        if key not in extra_keys and (pipeline, key) not in _warned:
            _warned.add((pipeline, key))
            log.warning(
                "rewardmesh: pipeline '%s' returned extra '%s', which it does not announce: verl needs the same "
                "keys from every sample, so it is left out (declare it with extra_keys in the pipeline's config)",
                pipeline,
                key,
            )
    failed = result.HasField("error")
    info: dict[str, float] = {
        "rewardmesh/queue_s": float("nan") if failed else result.timing.queue,
        "rewardmesh/compute_s": float("nan") if failed else result.timing.compute,
        "rewardmesh/batch_size": float(result.batch_size) if not failed else float("nan"),
        "rewardmesh/error": float(result.error.code) if failed else 0.0,
    }
    for key in extra_keys:
        info[key] = float(result.extras[key]) if key in result.extras else math.nan
    return info


def _option(section: Any, key: str, default: Any) -> Any:
    value = section.get(key) if section is not None else None
    return default if value is None else value


@register("rewardmesh")
class RewardMeshRewardManager(RewardManagerBase):
    """Scores each sample of verl's reward loop on a rewardmesh pipeline (ids and text)."""

    def __init__(
        self,
        config: Any,
        tokenizer: Any,
        compute_score: Any = None,
        reward_router_address: str | None = None,
        reward_model_tokenizer: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, tokenizer, compute_score)
        section = config.reward.get("rewardmesh") if "reward" in config else config.get("rewardmesh")
        target = _option(section, "target", os.environ.get(TARGET_ENV, ""))
        if not isinstance(target, str):
            target = [str(t) for t in target]
        pipeline = str(_option(section, "pipeline", os.environ.get(PIPELINE_ENV, "")))
        self.scorer = MeshScorer(target, pipeline, timeout_s=float(_option(section, "timeout_s", 300.0)))
        error_score = _option(section, "error_score", None)
        self.error_score: float | None = None if error_score is None else float(error_score)
        configured = _option(section, "extra_keys", None)
        # The extras in every sample's extra info: configured, else what the server announces for the pipeline.
        self.extra_keys: tuple[str, ...] | None = tuple(str(k) for k in configured) if configured is not None else None

    def _sample(self, data: Any) -> Any:
        item = data[-1]  # multi-turn outputs: verl scores the last sequence
        prompts, responses = item.batch["prompts"], item.batch["responses"]
        mask = item.batch["attention_mask"]
        prompt_len = prompts.shape[-1]
        prompt_ids = prompts[mask[:prompt_len].bool()].tolist()  # prompts are left-padded
        valid = int(mask[prompt_len:].sum())
        response_ids = responses[:valid].tolist()  # responses are right-padded
        response_mask = item.batch["response_mask"][:valid].tolist() if "response_mask" in item.batch else None
        nt = item.non_tensor_batch
        reward_model = nt.get("reward_model") or {}
        index = extra_info_from(nt.get("extra_info")).get("index", nt.get("uid", "?"))
        return {
            "index": index,
            "prompt_ids": prompt_ids,
            "response_ids": response_ids,
            "response_mask": response_mask,
            "ground_truth": reward_model.get("ground_truth", "") if isinstance(reward_model, dict) else "",
            "data_source": str(nt.get("data_source", "") or ""),
            "extra_info": extra_info_from(nt.get("extra_info")),
        }

    async def run_single(self, data: Any) -> dict[str, Any]:
        fields = self._sample(data)
        decode = self.tokenizer.decode
        loop = asyncio.get_running_loop()
        prompt_text, response_text = await asyncio.gather(
            loop.run_in_executor(None, lambda: decode(fields["prompt_ids"], skip_special_tokens=True)),
            loop.run_in_executor(None, lambda: decode(fields["response_ids"], skip_special_tokens=True)),
        )
        index = fields.pop("index")
        sample = make_sample(self.scorer.next_id(), prompt_text=prompt_text, response_text=response_text, **fields)
        (result,) = await self.scorer.score([sample])
        if result.HasField("error"):
            what = describe(index, prompt_text)
            if self.error_score is None or result.error.code in SERVICE_ERRORS:
                hint = "set +reward.rewardmesh.error_score=... to score failed samples instead"
                raise failure(self.scorer.pipeline, what, result, hint)
            log.warning("rewardmesh: %s scored %s after an error: %s", what, self.error_score, error_text(result))
            score = self.error_score
        else:
            score = result.score
        if self.extra_keys is None:
            self.extra_keys = await self.scorer.extra_keys()
        return {
            "reward_score": score,
            "reward_extra_info": extra_info_of(result, self.extra_keys, self.scorer.pipeline),
        }


_function_scorers: dict[tuple[str, str, float], MeshScorer] = {}


async def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    *,
    target: str | None = None,
    pipeline: str | None = None,
    timeout_s: float = 300.0,
    **_: Any,
) -> dict[str, Any]:
    """verl's custom reward function signature, scored on a rewardmesh pipeline (text only).

    Returns `{"score", the rewardmesh/* keys, the pipeline's announced extras}`; raises RewardMeshError on a
    failed sample (a failed sample is never a silent 0).
    """
    target = target or os.environ.get(TARGET_ENV, "")
    pipeline = pipeline or os.environ.get(PIPELINE_ENV, "")
    key = (target, pipeline, float(timeout_s))
    scorer = _function_scorers.get(key)
    if scorer is None:
        scorer = _function_scorers[key] = MeshScorer(target, pipeline, timeout_s=float(timeout_s))
    extra = extra_info_from(extra_info)
    sample = make_sample(
        scorer.next_id(),
        prompt_text=str(extra.get("question", "") or ""),
        response_text=solution_str,
        ground_truth=ground_truth,
        data_source=data_source,
        extra_info=extra,
    )
    (result,) = await scorer.score([sample])
    if result.HasField("error"):
        raise failure(pipeline, describe(extra.get("index", "?"), sample.prompt_text or solution_str), result)
    return {"score": result.score, **extra_info_of(result, await scorer.extra_keys(), pipeline)}
