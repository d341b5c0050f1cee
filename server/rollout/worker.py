"""The rollout data plane: samples generated -> rewarded -> timed, and the load counters GetInfo reports.

The servicer (`server/rollout/service.py`) decodes and validates a GenerateRequest into `Job`s and encodes
what this module returns; everything between (the agent loop, the Score stream to a reward server, the
timing) lives here, as the reward servicer's data plane lives in `RewardEngine`.

Where the agent loop allows it (no tools: one turn per sample) the samples of one prompt go to the backend as one
group (`Backend.generate_group`: vLLM prepares the prompt once and runs its n samples as one request); each is still
handed on, to the reward stream and the caller, the moment it finishes. A sample with tools runs its own agent loop.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from opentelemetry.util.types import AttributeValue

from rewardmesh.client.reward_client import RewardClient
from rewardmesh.common.tensors import numpy_to_tensor
from rewardmesh.server.decoding import decoder
from rewardmesh.server.rollout.agent_loop import AgentSettings, Rollout, one_turn, run_agent_loop, turn_max_tokens
from rewardmesh.server.rollout.backends.base import Backend, GenerationOutput, GenerationRequest
from rewardmesh.server.rollout.telemetry import NO_TRACE, NoTrace, RolloutTelemetry, SampleTrace, traces_on
from rewardmesh.server.status import SAMPLE_ERRORS, status_proto
from rewardmesh.v1 import common_pb2, reward_pb2, rollout_pb2

log = logging.getLogger(__name__)

FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "max_turns": common_pb2.FINISH_REASON_MAX_TURNS,
}

Answer = asyncio.Future[rollout_pb2.GenerateResponse]


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


# A sample's per-token lists go on the wire packed in C by `array` (typecode -> wire dtype): the wire is
# little-endian, as array is on such a machine; elsewhere numpy converts.
_WIRE = {"i": common_pb2.DTYPE_INT32, "q": common_pb2.DTYPE_INT64, "f": common_pb2.DTYPE_FLOAT32}
_NUMPY = {"i": np.int32, "q": np.int64, "f": np.float32}
_LITTLE = sys.byteorder == "little"
_ONE_INT32 = (1).to_bytes(4, "little")


def _put(tensor: common_pb2.Tensor, values: list[int] | list[float], typecode: str) -> None:
    """Write `values` into `tensor` as a 1-D tensor of the typecode's wire dtype, in place."""
    if not _LITTLE:
        tensor.CopyFrom(numpy_to_tensor(np.asarray(values, dtype=_NUMPY[typecode])))
        return
    tensor.dtype = _WIRE[typecode]
    tensor.shape.append(len(values))
    tensor.raw_data = array.array(typecode, values).tobytes()


def groups(jobs: Sequence[Job]) -> Iterator[tuple[int, int]]:
    """[lo, hi) runs of samples one engine request can draw: one prompt, seeds consecutive (or all unseeded)."""
    lo = 0
    for i in range(1, len(jobs) + 1):
        if i == len(jobs) or not _same_group(jobs[i - 1], jobs[i]):
            yield lo, i
            lo = i


def _same_group(a: Job, b: Job) -> bool:
    if a.prompt is not b.prompt:
        return False
    if a.seed is None or b.seed is None:
        return a.seed is b.seed
    return b.seed == a.seed + 1


class RolloutWorker:
    """Runs samples through the agent loop and, when a pipeline is named, the reward service."""

    def __init__(self, backend: Backend, rewards: RewardClient | None = None) -> None:
        self.backend = backend
        self.rewards = rewards
        self.running_samples = 0
        self.pending_rewards = 0
        self.active_requests = 0
        self.traces = RolloutTelemetry()  # sample timelines; span trees only for the samples kept
        self._tasks: set[asyncio.Task[None]] = set()  # background announcements of failed samples' traces

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

    def start(self, jobs: Sequence[Job], settings: RunSettings) -> list[Answer]:
        """Start these samples: one future per job, in order, each resolving with that sample's response once it
        is generated and (if asked) scored; a failure is that sample's error in its response. Cancelling a future
        abandons its sample (its generation is aborted once no sample of its engine request is left)."""
        loop = asyncio.get_running_loop()
        samples = [_Sample(self, job, settings, loop) for job in jobs]
        if settings.agent.tools:  # the agent loop decides per sample how many turns it takes
            for s in samples:
                s.task = loop.create_task(self._agent_loop(s))
        else:
            for lo, hi in groups(jobs):
                group = samples[lo:hi]
                task = loop.create_task(self._generate_group(group))
                for s in group:
                    s.task, s.group = task, group
        return list(samples)

    async def _agent_loop(self, s: _Sample) -> None:
        self.running_samples += 1
        try:
            sampling = replace(s.settings.sampling, seed=s.job.seed)
            rollout = await run_agent_loop(self.backend, s.job.prompt.ids, sampling, s.settings.agent, s.span.turn)
        except SAMPLE_ERRORS as exc:  # any failure is this sample's error, not the stream's
            s.failed(exc)
            return
        finally:
            self.running_samples -= 1
        s.generated(rollout)

    async def _generate_group(self, group: list[_Sample]) -> None:
        """One engine request for samples of one prompt, each handed on the moment the engine finishes it."""
        first, n = group[0], len(group)
        settings = first.settings
        prompt = first.job.prompt.ids
        max_tokens = turn_max_tokens(self.backend, len(prompt), 0, settings.sampling, settings.agent)
        if max_tokens <= 0:
            for s in group:
                s.generated(one_turn(self.backend, settings.sampling, None, 0.0))
            return
        request = replace(settings.sampling, prompt_ids=prompt, max_tokens=max_tokens, seed=first.job.seed)
        waiting = [True] * n
        self.running_samples += n
        started = time.time_ns()

        def on_sample(k: int, out: GenerationOutput | Exception) -> None:
            if not waiting[k]:
                return
            waiting[k] = False
            self.running_samples -= 1
            s = group[k]
            ended = time.time_ns()
            s.span.turn("generate", "turn 0", started, ended)
            if isinstance(out, Exception):
                s.failed(out)
                return
            try:
                rollout = one_turn(self.backend, request, out, (ended - started) / 1e9)
            except SAMPLE_ERRORS as exc:
                s.failed(exc)
            else:
                s.generated(rollout)

        try:
            await self.backend.generate_group(request, n, on_sample)
        except SAMPLE_ERRORS as exc:  # the request failed as a whole: every sample not yet handed on
            for k in range(n):
                on_sample(k, exc)
        except BaseException:  # cancelled: the samples never finished
            for k in range(n):
                if waiting[k]:
                    waiting[k] = False
                    self.running_samples -= 1
                    group[k].cancel()
            raise
        for k in range(n):  # an engine that returned without reporting a sample: that sample's error
            on_sample(k, RuntimeError(f"the {self.backend.name} backend reported no output for this sample"))

    def _fill(self, sample: common_pb2.Sample, job: Job, rollout: Rollout) -> None:
        """Write the finished sample's fields; the prompt tensor is passed through as it came."""
        resp = rollout.response_ids
        prompt = job.prompt
        sample.sample_id = job.sample_id
        sample.group_id = prompt.group_id
        sample.prompt_ids.CopyFrom(prompt.ids_tensor)
        _put(sample.response_ids, resp, "i")
        if rollout.num_tool_calls == 0 and _LITTLE:  # no tool output: every token is the policy's
            mask = sample.response_mask
            mask.dtype, mask.raw_data = common_pb2.DTYPE_INT32, _ONE_INT32 * len(resp)
            mask.shape.append(len(resp))
        else:
            _put(sample.response_mask, rollout.response_mask, "i")
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
            _put(sample.response_logprobs, rollout.response_logprobs, "f")
        if rollout.response_versions is not None:
            _put(sample.response_policy_versions, rollout.response_versions, "q")

    def _announce_failed(self, sample_id: str, traceparent: str) -> None:
        """A scored sample failed and was sent without its trace context: its reward server keeps the failure's
        spans until it hears the traceparent."""
        if self.rewards is None:
            return
        task = asyncio.get_running_loop().create_task(self.rewards.announce_kept({sample_id: traceparent}))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class _Sample(asyncio.Future[rollout_pb2.GenerateResponse]):
    """One sample, and the future of its response: generated (by its own agent loop or its group's request), then
    scored by a callback on the reward future, with no task of its own. Cancelling it abandons the sample: its
    reward is cancelled on the reward server, its generation once no sample of its engine request is left."""

    __slots__ = ("group", "job", "reward", "reward_context", "scoring", "settings", "span", "started", "task",
                 "worker")  # fmt: skip

    def __init__(self, worker: RolloutWorker, job: Job, settings: RunSettings, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self.worker = worker
        self.job = job
        self.settings = settings
        self.task: asyncio.Task[None] | None = None  # what generates it
        self.group: list[_Sample] | None = None  # the samples that task generates, where it is a group's request
        self.reward: asyncio.Future[reward_pb2.RewardResult] | None = None
        self.reward_context: dict[str, str] | None = None
        self.scoring: rollout_pb2.GenerateResponse | None = None
        self.started = 0.0
        self.span: SampleTrace | NoTrace = (
            worker.traces.begin(job.sample_id, self._attributes()) if traces_on() else NO_TRACE
        )

    def _attributes(self) -> dict[str, AttributeValue]:
        job = self.job
        return {
            "rewardmesh.sample_id": job.sample_id,
            "rewardmesh.group_id": job.prompt.group_id,
            "rewardmesh.prompt_length": len(job.prompt.ids),
        }

    def generated(self, rollout: Rollout) -> None:
        """Build the sample, then score it (a pipeline named) or answer; a failure on the way is its error."""
        if self.done():  # abandoned meanwhile
            return
        try:
            self._build_and_score(rollout)
        except SAMPLE_ERRORS as exc:
            self.failed(exc)

    def _build_and_score(self, rollout: Rollout) -> None:
        worker, settings, span = self.worker, self.settings, self.span
        response = rollout_pb2.GenerateResponse()
        sample = response.sample  # built in place: the response is the one Sample this call keeps
        worker._fill(sample, self.job, rollout)
        if span is not NO_TRACE:
            span.annotate(
                {
                    "rewardmesh.response_length": len(rollout.response_ids),
                    "rewardmesh.num_preempted": rollout.num_preempted,
                    "rewardmesh.num_turns": rollout.num_turns,
                    "rewardmesh.policy_version": rollout.policy_version,
                }
            )
        rewards = worker.rewards
        if not settings.reward or rewards is None:
            self._finish(response)
            return
        worker.pending_rewards += 1
        self.scoring = response
        self.started = time.perf_counter()
        self.reward_context = span.reward_context(settings.reward)
        self.reward = rewards.submit(
            sample,
            settings.reward,
            timeout=settings.reward_timeout,
            trace_context=self.reward_context,
            step_deadline=settings.step_deadline,
        )
        self.reward.add_done_callback(self._scored)

    def _scored(self, fut: asyncio.Future[reward_pb2.RewardResult]) -> None:
        self.worker.pending_rewards -= 1
        response = self.scoring
        if fut.cancelled() or response is None:  # the sample was abandoned
            return
        try:
            self._answer_scored(fut, response)
        except SAMPLE_ERRORS as exc:
            self.failed(exc)

    def _answer_scored(
        self, fut: asyncio.Future[reward_pb2.RewardResult], response: rollout_pb2.GenerateResponse
    ) -> None:
        exc = fut.exception()
        result = fut.result() if exc is None else _error_result(self.job.sample_id, exc)
        span = self.span
        span.reward_done(result)
        if result.HasField("error") and self.reward_context is None and isinstance(span, SampleTrace):
            self.worker._announce_failed(self.job.sample_id, span.reward_traceparent())
        timing = response.sample.timing
        timing.reward = time.perf_counter() - self.started
        timing.reward_queue = result.timing.queue
        timing.reward_compute = result.timing.compute
        response.result.CopyFrom(result)
        self._finish(response)

    def failed(self, exc: BaseException) -> None:
        """This sample failed (in generation, or building or scoring it): its error, not the stream's."""
        if self.done():
            return
        job = self.job
        log.warning("sample %s failed: %s", job.sample_id, exc)
        self.span.failed(str(exc))
        failed = common_pb2.Sample(sample_id=job.sample_id, group_id=job.prompt.group_id)
        self._finish(
            rollout_pb2.GenerateResponse(
                sample=failed, result=reward_pb2.RewardResult(sample_id=job.sample_id, error=status_proto(exc))
            )
        )

    def _finish(self, response: rollout_pb2.GenerateResponse) -> None:
        self.worker.traces.finish(self.span, response)
        if not self.done():
            self.set_result(response)

    def cancel(self, msg: Any | None = None) -> bool:
        """Abandon the sample (see the class)."""
        if not super().cancel(msg):
            return False
        self.worker.traces.finish(self.span, None)
        if self.reward is not None:
            self.reward.cancel()
        task, group = self.task, self.group
        if task is not None and not task.done() and (group is None or all(s.done() for s in group)):
            task.cancel()
        return True


def _error_result(sample_id: str, exc: BaseException) -> reward_pb2.RewardResult:
    return reward_pb2.RewardResult(sample_id=sample_id, error=status_proto(exc))
