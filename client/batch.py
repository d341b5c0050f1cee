"""Scored samples -> training batches in verl's layout, GRPO advantages, and metrics with verl's names."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import torch

from rewardmesh.common.status_codes import code_name
from rewardmesh.common.tensors import ids_from, tensor_to_numpy
from rewardmesh.v1 import common_pb2, rollout_pb2

TIMING_KEYS = ("generate_sequences", "tool_calls", "reward", "reward_queue", "reward_compute", "num_preempted")
SLOWEST_KEYS = ("generate_sequences", "tool_calls", "reward", "num_preempted", "prompt_length", "response_length")


@dataclass
class ScoredSample:
    """One finished, scored sample as a trainer sees it."""

    sample_id: str
    group_id: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    score: float
    extras: dict[str, float]
    timing: dict[str, float]
    policy_version: int
    response_text: str = ""
    error: str = ""  # set when generation or reward failed: never trained on (mask 0, advantage 0)
    error_code: int = 0  # the failure's grpc.StatusCode value (0: none)
    advantage: float = 0.0
    response_logprobs: np.ndarray | None = None  # float32 per response token, when the engine was asked for them
    arrived: float = 0.0  # seconds from the start of its rollout call until it reached the trainer
    trace_context: dict[str, str] = field(default_factory=dict)  # the rollout.sample span, when traced

    @classmethod
    def from_response(cls, r: rollout_pb2.GenerateResponse) -> ScoredSample:
        s = r.sample
        response = ids_from(s.response_ids, "sample.response_ids")
        mask = ids_from(s.response_mask, "sample.response_mask") if s.HasField("response_mask") else None
        t = s.timing
        failed = r.HasField("result") and r.result.HasField("error")
        code = (r.result.error.code or grpc.StatusCode.UNKNOWN.value[0]) if failed else 0
        error = (r.result.error.message or code_name(code)) if failed else ""
        logprobs = None
        if s.HasField("response_logprobs"):
            logprobs = tensor_to_numpy(s.response_logprobs, "sample.response_logprobs", dtype=common_pb2.DTYPE_FLOAT32,
                                       ndim=1)  # fmt: skip
            if logprobs.shape != response.shape:
                raise ValueError(f"sample.response_logprobs has {logprobs.shape[0]} values for "
                                 f"{response.shape[0]} response tokens")  # fmt: skip
        return cls(
            sample_id=s.sample_id,
            group_id=s.group_id,
            prompt_ids=ids_from(s.prompt_ids, "sample.prompt_ids"),
            response_ids=response,
            response_mask=mask if mask is not None else np.ones_like(response),
            score=0.0 if error else r.result.score,
            extras={} if error else dict(r.result.extras),
            timing={
                "generate_sequences": t.generate_sequences,
                "tool_calls": t.tool_calls,
                "reward": t.reward,
                "reward_queue": t.reward_queue,
                "reward_compute": t.reward_compute,
                "num_preempted": float(t.num_preempted),
                "num_turns": float(t.num_turns),
                "prompt_length": float(t.prompt_length or len(s.prompt_ids.raw_data) // 4),
                "response_length": float(t.response_length or response.shape[0]),
            },
            policy_version=s.policy_version,
            response_text=s.response_text,
            error=error,
            error_code=code,
            trace_context=dict(r.trace_context),
            response_logprobs=logprobs,
        )

    @property
    def failed(self) -> bool:
        """Generation or reward failed: the sample has no score to learn from."""
        return bool(self.error) or self.error_code != 0

    @property
    def error_name(self) -> str:
        return code_name(self.error_code) if self.error_code else "UNKNOWN"

    @property
    def total_time(self) -> float:
        """What makes a sample the slowest: generate + tool + reward time."""
        return self.timing["generate_sequences"] + self.timing["tool_calls"] + self.timing["reward"]


def grpo_advantages(scores: Sequence[float], *, normalize_std: bool = True, eps: float = 1e-6) -> list[float]:
    """Group-relative advantages as verl's GRPO: (score - mean) / (std + eps); a group of one gets its score."""
    if len(scores) == 1:
        return [float(scores[0])]
    mean = statistics.fmean(scores)
    if not normalize_std:
        return [s - mean for s in scores]
    std = statistics.stdev(scores)
    return [(s - mean) / (std + eps) for s in scores]


def set_group_advantages(group: list[ScoredSample], *, normalize_std: bool = True) -> None:
    """GRPO over the group's scored samples only: a failed sample gets advantage 0 and moves no statistic.

    A group that failures left with a single scored sample has no baseline, so it teaches nothing (0);
    a group of one by design (n=1) keeps verl's rule (advantage = score).
    """
    ok = [s for s in group if not s.failed]
    for s in group:
        s.advantage = 0.0
    if not ok or (len(ok) == 1 and len(group) > 1):
        return
    for sample, adv in zip(ok, grpo_advantages([s.score for s in ok], normalize_std=normalize_std), strict=True):
        sample.advantage = adv


def _stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    return {f"{prefix}/min": min(values), f"{prefix}/mean": statistics.fmean(values), f"{prefix}/max": max(values)}


def compute_metrics(samples: Sequence[ScoredSample], gen_seconds: float | None = None) -> dict[str, float]:
    """verl's agent-loop metric names, the slowest-sample breakdown, scores, lengths and reward extras."""
    if not samples:
        return {}
    metrics: dict[str, float] = {}
    for key in TIMING_KEYS:
        metrics.update(_stats(f"timing_s/agent_loop/{key}", [s.timing[key] for s in samples]))
    slowest = max(samples, key=lambda s: s.total_time)
    for key in SLOWEST_KEYS:
        metrics[f"timing_s/agent_loop/slowest/{key}"] = slowest.timing[key]
    scored = [s for s in samples if not s.failed]  # a failed sample has no score: it would read as 0
    if scored:
        metrics.update(_stats("critic/score", [s.score for s in scored]))
    metrics.update(_stats("response_length", [float(s.response_ids.shape[0]) for s in samples]))
    for name in sorted({k for s in scored for k in s.extras}):
        values = [s.extras[name] for s in scored if name in s.extras]
        metrics[f"reward_extra/{name}/mean"] = statistics.fmean(values)
    metrics.update(failure_metrics(samples))
    if gen_seconds is not None:
        metrics["timing_s/gen"] = gen_seconds
    metrics["rollout/num_samples"] = float(len(samples))
    metrics["rollout/num_errors"] = float(sum(1 for s in samples if s.error))
    return metrics


def failure_metrics(samples: Sequence[ScoredSample]) -> dict[str, float]:
    """`rewardmesh/failed_samples` (always present) and `rewardmesh/failed_samples/<CODE>` per status code."""
    failed = [s for s in samples if s.failed]
    metrics = {"rewardmesh/failed_samples": float(len(failed))}
    for s in failed:
        key = f"rewardmesh/failed_samples/{s.error_name}"
        metrics[key] = metrics.get(key, 0.0) + 1.0
    return metrics


def slowest_sample(samples: Sequence[ScoredSample]) -> ScoredSample:
    return max(samples, key=lambda s: s.total_time)


@dataclass
class RolloutBatch:
    """Padded tensors in verl's layout plus per-sample metadata and metrics."""

    prompts: torch.Tensor  # [B, P] left-padded
    responses: torch.Tensor  # [B, R] right-padded
    input_ids: torch.Tensor  # [B, P+R]
    attention_mask: torch.Tensor  # [B, P+R]
    position_ids: torch.Tensor  # [B, P+R]
    response_mask: torch.Tensor  # [B, R]: 1 on policy tokens, 0 on tool output, padding and failed samples
    token_level_scores: torch.Tensor  # [B, R]: the score on each sample's last response token
    scores: torch.Tensor  # [B]
    advantages: torch.Tensor  # [B] (GRPO, per sample)
    policy_versions: torch.Tensor  # [B]
    sample_ids: list[str]
    group_ids: list[str]
    extras: dict[str, torch.Tensor]
    samples: list[ScoredSample]
    metrics: dict[str, float] = field(default_factory=dict)
    # [B, R] right-padded like `responses`: each token's log-prob under the policy that sampled it (verl's
    # name); None unless every scored sample carries them (ask with Sampling(logprobs=True)).
    rollout_log_probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.sample_ids)


def assemble_batch(
    samples: Sequence[ScoredSample], *, pad_token_id: int = 0, metrics: dict[str, Any] | None = None
) -> RolloutBatch:
    if not samples:
        raise ValueError("assemble_batch needs at least one sample")
    b = len(samples)
    p = max(s.prompt_ids.shape[0] for s in samples)
    r = max(max(s.response_ids.shape[0] for s in samples), 1)
    # Filled in numpy (a slice assignment there costs a fraction of torch's), handed to torch once.
    prompts_np = np.full((b, p), pad_token_id, dtype=np.int64)
    responses_np = np.full((b, r), pad_token_id, dtype=np.int64)
    prompt_attn_np = np.zeros((b, p), dtype=np.int64)
    response_attn_np = np.zeros((b, r), dtype=np.int64)
    response_mask_np = np.zeros((b, r), dtype=np.int64)
    token_scores_np = np.zeros((b, r), dtype=np.float32)
    with_logprobs = all(s.response_logprobs is not None for s in samples if not s.failed and s.response_ids.size)
    log_probs_np = np.zeros((b, r), dtype=np.float32) if with_logprobs else None
    for i, s in enumerate(samples):
        lp, lr = s.prompt_ids.shape[0], s.response_ids.shape[0]
        if lp:
            prompts_np[i, p - lp :] = s.prompt_ids
            prompt_attn_np[i, p - lp :] = 1
        if lr:
            responses_np[i, :lr] = s.response_ids
            response_attn_np[i, :lr] = 1
            if not s.failed:  # a failed sample stays in the layout but is never trained on
                response_mask_np[i, :lr] = s.response_mask
                token_scores_np[i, lr - 1] = s.score
            if log_probs_np is not None and s.response_logprobs is not None:
                log_probs_np[i, :lr] = s.response_logprobs
    prompts, responses = torch.from_numpy(prompts_np), torch.from_numpy(responses_np)
    prompt_attn, response_attn = torch.from_numpy(prompt_attn_np), torch.from_numpy(response_attn_np)
    response_mask, token_scores = torch.from_numpy(response_mask_np), torch.from_numpy(token_scores_np)
    rollout_log_probs = torch.from_numpy(log_probs_np) if log_probs_np is not None else None
    attention = torch.cat([prompt_attn, response_attn], dim=1)
    extras_names = sorted({k for s in samples for k in s.extras})
    return RolloutBatch(
        prompts=prompts,
        responses=responses,
        input_ids=torch.cat([prompts, responses], dim=1),
        attention_mask=attention,
        position_ids=torch.clamp(torch.cumsum(attention, dim=1) - 1, min=0),
        response_mask=response_mask,
        token_level_scores=token_scores,
        scores=torch.tensor([0.0 if s.failed else s.score for s in samples], dtype=torch.float32),
        advantages=torch.tensor([0.0 if s.failed else s.advantage for s in samples], dtype=torch.float32),
        policy_versions=torch.tensor([s.policy_version for s in samples], dtype=torch.long),
        sample_ids=[s.sample_id for s in samples],
        group_ids=[s.group_id for s in samples],
        extras={n: torch.tensor([s.extras.get(n, float("nan")) for s in samples]) for n in extras_names},
        samples=list(samples),
        metrics=dict(metrics or {}),
        rollout_log_probs=rollout_log_probs,
    )
