"""OpenRLHF 0.11.2: `--train.agent_func_path <this file>` scores each rollout on a rewardmesh pipeline over gRPC.

OpenRLHF's own reward paths (`--reward.remote_url` to a URL or a `reward_func` file) catch every exception of
the reward call, log it at INFO and leave the sample without a reward, so no reward service can stop a step
through them. An agent executor's exception does stop it: OpenRLHF's rollout actor gathers `execute()` and the
trainer's `ray.get` raises it. This executor is OpenRLHF's single-turn one (same generation, same output), its
reward taken from rewardmesh; a sample the service cannot score raises RewardMeshError naming the sample and the
cause. Opt-in: REWARDMESH_ERROR_SCORE scores it that value instead, flagged by `rewardmesh_error` in
`extra_logs`. A server that is down, refuses the token or lacks the pipeline raises either way.

OpenRLHF builds the executor with no arguments inside its rollout actors, so it reads REWARDMESH_REWARD_TARGET,
REWARDMESH_PIPELINE, REWARDMESH_TIMEOUT_S (per sample, default 300) and REWARDMESH_ERROR_SCORE from the
environment (pass them with `ray job submit --runtime-env-json`). A dataset label is the ground truth, or a
JSON object with ground_truth, data_source and extra_info. `extra_logs` holds the pipeline's announced extras
(ListRewards; NaN where a sample has none) and `rewardmesh_error`, the same keys for every sample.
"""

from __future__ import annotations

import math
import os
from typing import Any

from rewardmesh.client.integrations.scoring import (
    ERROR_KEY,
    ERROR_SCORE_ENV,
    PIPELINE_ENV,
    SERVICE_ERRORS,
    TARGET_ENV,
    MeshScorer,
    describe,
    env_error_score,
    env_timeout_s,
    failure,
    label_fields,
    make_sample,
)

try:  # OpenRLHF is optional: this module imports without it
    from openrlhf.utils.agent import SingleTurnAgentExecutor
except ImportError:  # pragma: no cover - exercised where OpenRLHF is absent
    SingleTurnAgentExecutor = object


class AgentExecutor(SingleTurnAgentExecutor):
    """OpenRLHF's single-turn executor whose reward comes from a rewardmesh pipeline."""

    def __init__(
        self,
        target: str | None = None,
        pipeline: str | None = None,
        *,
        timeout_s: float | None = None,
        error_score: float | None = None,
    ) -> None:
        super().__init__(remote_rm_url=None)  # no OpenRLHF reward call: the reward is ours
        self.scorer = MeshScorer(
            target or os.environ.get(TARGET_ENV, ""),
            pipeline or os.environ.get(PIPELINE_ENV, ""),
            timeout_s=float(timeout_s) if timeout_s is not None else env_timeout_s(),
        )
        self.error_score = error_score if error_score is not None else env_error_score()

    async def execute(
        self,
        prompt: Any,
        label: Any,
        sampling_params: Any,
        max_length: int,
        hf_tokenizer: Any,
        llm_engine: Any,
        images: Any = None,
    ) -> dict[str, Any]:
        output: dict[str, Any] = await super().execute(
            prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=images
        )
        tokens = list(output["observation_tokens"])
        start, end = output["action_ranges"][0]
        truth, source, extra = label_fields(label)
        prompt_text = prompt if isinstance(prompt, str) else str(prompt)
        sample = make_sample(
            self.scorer.next_id(),
            prompt_text=prompt_text,
            response_text=hf_tokenizer.decode(tokens[start:end], skip_special_tokens=True),
            prompt_ids=tokens[:start],
            response_ids=tokens[start:end],
            ground_truth=truth,
            data_source=source,
            extra_info=extra,
        )
        (result,) = await self.scorer.score([sample])
        failed = result.HasField("error")
        if failed and (self.error_score is None or result.error.code in SERVICE_ERRORS):
            what = describe(extra.get("index"), prompt_text)
            raise failure(self.scorer.pipeline, what, result, f"set {ERROR_SCORE_ENV} to score failed samples instead")
        reward = self.error_score if failed else result.score
        keys = await self.scorer.extra_keys()
        extra_logs = {k: float(result.extras[k]) if k in result.extras else math.nan for k in keys}
        extra_logs[ERROR_KEY] = 1.0 if failed else 0.0
        output.update(reward=reward, scores=reward, extra_logs=extra_logs)
        return output
