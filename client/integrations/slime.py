"""slime: `--custom-rm-path rewardmesh.client.integrations.slime.custom_rm` scores on the Score stream directly.

slime calls `await custom_rm(args, sample)` per sample, or with the list of a group's samples under
`--group-rm`. The target and pipeline come from `args.rewardmesh_target` / `args.rewardmesh_pipeline` when
set, else REWARDMESH_REWARD_TARGET / REWARDMESH_PIPELINE (REWARDMESH_TIMEOUT_S: per-sample deadline, 300).
The reward is the score, or `{"score", <extras>}` when `--reward-key` is set.

A sample the service cannot score raises RewardMeshError naming the sample (slime's index) and the cause,
which fails the rollout: the default. Opt-in, `args.rewardmesh_error_score` or REWARDMESH_ERROR_SCORE: the
sample scores that value and is masked (`sample.remove_sample = True`: slime zeroes its loss mask; its reward
still takes part in its group's normalization). A server that is down, refuses the token or lacks the
pipeline raises either way.

slime scores on one long-lived event loop. A caller that scores on a loop it then ends (`asyncio.run` per call)
awaits `close()` first: grpc.aio work left on a closed loop breaks the calls of the next one.
"""

from __future__ import annotations

import logging
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
    error_text,
    failure,
    make_sample,
)

log = logging.getLogger(__name__)

_scorers: dict[tuple[str, str, float], MeshScorer] = {}


def _scorer(args: Any) -> MeshScorer:
    target = getattr(args, "rewardmesh_target", None) or os.environ.get(TARGET_ENV, "")
    pipeline = getattr(args, "rewardmesh_pipeline", None) or os.environ.get(PIPELINE_ENV, "")
    timeout_s = env_timeout_s()
    key = (target, pipeline, timeout_s)
    if key not in _scorers:
        _scorers[key] = MeshScorer(target, pipeline, timeout_s=timeout_s)
    return _scorers[key]


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):  # chat messages: the last user turn
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1]) if users else ""
    return str(prompt or "")


def _sample(scorer: MeshScorer, s: Any) -> Any:
    """From slime's Sample: tokens = prompt + response ids, the last `response_length` being the response."""
    tokens = list(getattr(s, "tokens", None) or [])
    n = int(getattr(s, "response_length", 0) or 0)
    prompt_ids, response_ids = (tokens[:-n], tokens[-n:]) if 0 < n <= len(tokens) else ([], [])
    mask = getattr(s, "loss_mask", None)
    metadata = getattr(s, "metadata", None) or {}
    return make_sample(
        scorer.next_id(),
        prompt_text=_prompt_text(getattr(s, "prompt", "")),
        response_text=str(getattr(s, "response", "") or ""),
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        response_mask=list(mask) if mask is not None and len(mask) == len(response_ids) else None,
        ground_truth=getattr(s, "label", None),
        data_source=str(metadata.get("data_source", "") if isinstance(metadata, dict) else ""),
        extra_info=metadata if isinstance(metadata, dict) else None,
    )


def _error_score(args: Any) -> float | None:
    value = getattr(args, "rewardmesh_error_score", None)
    return env_error_score() if value is None else float(value)


async def custom_rm(args: Any, samples: Any, **_: Any) -> Any:
    """One reward per sample (a list for a list), scored together on the pipeline."""
    scorer = _scorer(args)
    error_score = _error_score(args)
    batch = samples if isinstance(samples, list) else [samples]
    results = await scorer.score([_sample(scorer, s) for s in batch])
    keyed = bool(getattr(args, "reward_key", None))
    rewards: list[Any] = []
    for s, result in zip(batch, results, strict=True):
        if not result.HasField("error"):
            rewards.append({**result.extras, "score": result.score} if keyed else result.score)
            continue
        what = describe(getattr(s, "index", None), _prompt_text(getattr(s, "prompt", "")))
        if error_score is None or result.error.code in SERVICE_ERRORS:
            raise failure(scorer.pipeline, what, result, f"set {ERROR_SCORE_ENV} to mask failed samples instead")
        log.warning("rewardmesh: %s masked, scored %s: %s", what, error_score, error_text(result))
        s.remove_sample = True  # slime zeroes its loss mask
        rewards.append({"score": error_score, ERROR_KEY: 1.0} if keyed else error_score)
    return rewards if isinstance(samples, list) else rewards[0]


async def close() -> None:
    """Close the running loop's reward clients, before the loop ends."""
    for scorer in _scorers.values():
        await scorer.close()
