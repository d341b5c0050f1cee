"""The rollout data plane: one sample's generate -> reward -> timing, and the load counters GetInfo reports.

The servicer (`server/rollout/service.py`) decodes and validates a GenerateRequest into `Job`s and encodes
what this module returns; everything between (the agent loop, the Score stream to a reward server, the
timing) lives here, as the reward servicer's data plane lives in `RewardEngine`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
from opentelemetry.util.types import AttributeValue

from rewardmesh.client.reward_client import RewardClient
from rewardmesh.common.tensors import ids_tensor, numpy_to_tensor
from rewardmesh.server.decoding import decoder
from rewardmesh.server.rollout.agent_loop import AgentSettings, Rollout, run_agent_loop
from rewardmesh.server.rollout.backends.base import Backend, GenerationRequest
from rewardmesh.server.rollout.telemetry import NoTrace, RolloutTelemetry, SampleTrace
from rewardmesh.server.status import SAMPLE_ERRORS, status_proto
from rewardmesh.v1 import common_pb2, reward_pb2, rollout_pb2

log = logging.getLogger(__name__)

FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "max_turns": common_pb2.FINISH_REASON_MAX_TURNS,
}


@dataclass(frozen=True)
class PromptInput:
    """One decoded prompt, shared by its n samples: decoded once, its id tensor encoded at most once."""

    prompt: rollout_pb2.Prompt
    group_id: str
    ids: list[int]  # what the backend generates from
    ids_tensor: common_pb2.Tensor  # what travels: the request's own tensor for a token-id prompt
    text: str  # Sample.prompt_text (see common.proto for its one meaning)


@dataclass(frozen=True)
class Job:
    """One sample to generate."""

    sample_id: str
    prompt: PromptInput
    seed: int | None


@dataclass(frozen=True)
class RunSettings:
    """What every sample of one Generate call shares."""

    sampling: GenerationRequest  # the per-turn template (its prompt_ids and seed are set per sample)
    agent: AgentSettings
    reward: str  # pipeline name; empty: unscored
    reward_timeout: float | None
    step_deadline: float | None = None  # time.monotonic() by which the call's samples must be scored


class RolloutWorker:
    """Runs samples through the agent loop and, when a pipeline is named, the reward service."""

    def __init__(self, backend: Backend, rewards: RewardClient | None = None) -> None:
        self.backend = backend
        self.rewards = rewards
        self.running_samples = 0
        self.pending_rewards = 0
        self.active_requests = 0
        self.traces = RolloutTelemetry()  # sample timelines; span trees only for the samples kept

    def load(self) -> rollout_pb2.RolloutLoad:
        return rollout_pb2.RolloutLoad(
            running_samples=self.running_samples,
            pending_rewards=self.pending_rewards,
            active_requests=self.active_requests,
        )

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Count one Generate call as active for as long as it streams."""
        self.active_requests += 1
        try:
            yield
        finally:
            self.active_requests -= 1

    async def keep_traces(self, sample_ids: Sequence[str]) -> tuple[int, int]:
        """Export these samples' span trees here and on every reward target: (samples known, spans exported)."""
        kept, exported, rewards = self.traces.keep(sample_ids)
        if self.rewards is not None and rewards:
            await self.rewards.announce_kept(rewards)  # with the traceparents those samples were sent without
        return kept, exported

    async def run(self, job: Job, settings: RunSettings) -> rollout_pb2.GenerateResponse:
        """One sample, generated and (if asked) scored; a generation failure is this sample's error."""
        attrs: dict[str, AttributeValue] = {
            "rewardmesh.sample_id": job.sample_id,
            "rewardmesh.group_id": job.prompt.group_id,
            "rewardmesh.prompt_length": len(job.prompt.ids),
        }
        span = self.traces.begin(job.sample_id, attrs)
        response = None
        try:
            response = await self._run(job, settings, span)
            return response
        finally:
            self.traces.finish(span, response)

    async def _run(self, job: Job, settings: RunSettings, span: SampleTrace | NoTrace) -> rollout_pb2.GenerateResponse:
        self.running_samples += 1
        try:
            sampling = replace(settings.sampling, seed=job.seed)
            rollout = await run_agent_loop(self.backend, job.prompt.ids, sampling, settings.agent, span.turn)
        except SAMPLE_ERRORS as exc:  # any failure is this sample's error, not the stream's
            log.warning("sample %s failed in generation: %s", job.sample_id, exc)
            span.failed(str(exc))
            failed = common_pb2.Sample(sample_id=job.sample_id, group_id=job.prompt.group_id)
            return rollout_pb2.GenerateResponse(
                sample=failed, result=reward_pb2.RewardResult(sample_id=job.sample_id, error=status_proto(exc))
            )
        finally:
            self.running_samples -= 1
        response = rollout_pb2.GenerateResponse()
        sample = response.sample  # built in place: the response is the one Sample this call keeps
        self._fill(sample, job, rollout)
        span.annotate(
            {
                "rewardmesh.response_length": len(rollout.response_ids),
                "rewardmesh.num_preempted": rollout.num_preempted,
                "rewardmesh.num_turns": rollout.num_turns,
                "rewardmesh.policy_version": rollout.policy_version,
            }
        )
        if not settings.reward or self.rewards is None:
            return response
        self.pending_rewards += 1
        started = time.perf_counter()
        try:
            ctx = span.reward_context(settings.reward)
            result = await self.rewards.submit(
                sample,
                settings.reward,
                timeout=settings.reward_timeout,
                trace_context=ctx,
                step_deadline=settings.step_deadline,
            )
            span.reward_done(result)
            if result.HasField("error") and ctx is None and isinstance(span, SampleTrace):
                # Kept: it failed. Its reward server remembers the failure until it hears the traceparent.
                await self.rewards.announce_kept({job.sample_id: span.reward_traceparent()})
        finally:
            self.pending_rewards -= 1
        sample.timing.reward = time.perf_counter() - started
        sample.timing.reward_queue = result.timing.queue
        sample.timing.reward_compute = result.timing.compute
        response.result.CopyFrom(result)
        return response

    def _fill(self, sample: common_pb2.Sample, job: Job, rollout: Rollout) -> None:
        """Write the finished sample's fields; the prompt tensor is passed through as it came."""
        resp = rollout.response_ids
        prompt = job.prompt
        sample.sample_id = job.sample_id
        sample.group_id = prompt.group_id
        sample.prompt_ids.CopyFrom(prompt.ids_tensor)
        sample.response_ids.CopyFrom(ids_tensor(resp))
        sample.response_mask.CopyFrom(ids_tensor(rollout.response_mask))
        sample.prompt_text = prompt.text
        sample.response_text = decoder(self.backend.tokenizer)(resp)
        sample.data_source = prompt.prompt.data_source
        sample.ground_truth = prompt.prompt.ground_truth
        sample.policy_version = rollout.policy_version
        sample.finish_reason = FINISH.get(rollout.finish_reason, common_pb2.FINISH_REASON_UNSPECIFIED)
        timing = sample.timing
        timing.generate_sequences = rollout.generate_s
        timing.tool_calls = rollout.tool_s
        timing.num_preempted = rollout.num_preempted
        timing.num_turns = rollout.num_turns
        timing.prompt_length = len(prompt.ids)
        timing.response_length = len(resp)
        if prompt.prompt.HasField("extra_info"):
            sample.extra_info.CopyFrom(prompt.prompt.extra_info)
        if rollout.response_logprobs is not None:
            sample.response_logprobs.CopyFrom(numpy_to_tensor(np.asarray(rollout.response_logprobs, np.float32)))
        if rollout.response_versions is not None:
            sample.response_policy_versions.CopyFrom(numpy_to_tensor(np.asarray(rollout.response_versions, np.int64)))
