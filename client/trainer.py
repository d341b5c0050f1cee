"""TrainerClient: fans prompts out over rollout servers and turns scored samples into training batches.

Each prompt group is one Generate call on the rollout server with the least outstanding work. The
client names every sample id up front, so if a server fails mid-step only the samples it had not yet
returned are asked of another server: none is lost, none is counted twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from google.protobuf import struct_pb2
from grpc import aio
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from rewardmesh.client.batch import (
    RolloutBatch,
    ScoredSample,
    assemble_batch,
    compute_metrics,
    failure_metrics,
    set_group_advantages,
    slowest_sample,
)
from rewardmesh.client.targets import Member, Resolve, TargetPool
from rewardmesh.client.weight_sync import SyncResult, WeightSync, WeightSyncError
from rewardmesh.common.channels import open_channel
from rewardmesh.common.telemetry import group_context, recorder, trace_config, tracer
from rewardmesh.common.tensors import ids_tensor
from rewardmesh.v1 import common_pb2, reward_pb2, rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

MAX_PER_MESSAGE = 64  # asked of rollout servers: samples that finish together share a message

# A failed or draining server: resend its unfinished samples elsewhere. Anything else is the caller's bug.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED, grpc.StatusCode.UNKNOWN}


@dataclass
class PromptSpec:
    """One prompt of a step: token ids or chat messages, and what its reward needs."""

    token_ids: Sequence[int] | None = None
    messages: list[dict[str, str]] | None = None
    data_source: str = ""
    ground_truth: str = ""
    extra_info: dict[str, Any] | None = None
    group_id: str = ""

    def to_proto(self, group_id: str, sample_ids: list[str]) -> rollout_pb2.Prompt:
        p = rollout_pb2.Prompt(group_id=group_id, sample_ids=sample_ids, data_source=self.data_source,
                               ground_truth=self.ground_truth)  # fmt: skip
        if self.token_ids is not None:
            p.token_ids.CopyFrom(ids_tensor(list(self.token_ids)))
        elif self.messages is not None:
            p.chat.messages.extend(rollout_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in self.messages)
        if self.extra_info:
            s = struct_pb2.Struct()
            s.update(self.extra_info)
            p.extra_info.CopyFrom(s)
        return p


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False  # return each token's log-prob (RolloutBatch.rollout_log_probs), for off-policy correction

    def to_proto(self) -> rollout_pb2.SamplingParams:
        p = rollout_pb2.SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                       max_tokens=self.max_tokens, stop=self.stop, logprobs=self.logprobs)  # fmt: skip
        if self.seed is not None:
            p.seed = self.seed
        return p


@dataclass
class _Launched:
    out: asyncio.Queue[ScoredSample | BaseException]
    tasks: list[asyncio.Task[None]]
    total: int
    started: float
    span: trace.Span
    dropped: list[ScoredSample] = field(default_factory=list)  # groups dropped for a failed sample


class _Target(Member):
    """One rollout server: its channel, stub and the samples asked of it that have not come back."""

    def __init__(self, address: str, server_name: str) -> None:
        super().__init__(address, server_name)
        self.channel = open_channel(address, server_name=server_name)
        self.stub: rollout_pb2_grpc.RolloutServiceAsyncStub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self.outstanding = 0

    @property
    def load(self) -> int:
        return self.outstanding

    async def close(self) -> None:
        await self.channel.close(grace=None)


class _Behind(Exception):
    """A sample older than the step's policy version: its server restarted or missed an update."""


class TrainerClient:
    """What a trainer imports: rollouts as scored samples, batches, mini-batches, weight sync."""

    def __init__(
        self,
        targets: Sequence[str] | str,
        *,
        reward: str = "",
        sampling: Sampling | None = None,
        agent: rollout_pb2.AgentLoopConfig | None = None,
        reward_timeout: float | None = None,
        pad_token_id: int = 0,
        normalize_adv_std: bool = True,
        drop_failed_groups: bool = False,
        max_attempts: int = 4,
        retry_backoff_s: float = 0.2,
        resolve: Resolve | None = None,
        resolve_interval_s: float = 30.0,
        generate_timeout_s: float = 3600.0,
    ) -> None:
        if generate_timeout_s <= 0:
            raise ValueError(f"generate_timeout_s must be > 0, got {generate_timeout_s}")
        # The deadline of each Generate call: a sample that never comes is DEADLINE_EXCEEDED, never a hang.
        self.generate_timeout_s = generate_timeout_s
        self.pool: TargetPool[_Target] = TargetPool(
            targets,
            _Target,
            kind="rollout server",
            backoff_s=retry_backoff_s,
            interval_s=resolve_interval_s,
            resolve=resolve,
        )
        self.reward = reward
        self.sampling = sampling or Sampling()
        self.agent = agent or rollout_pb2.AgentLoopConfig()
        self.reward_timeout = reward_timeout
        self.pad_token_id = pad_token_id
        self.normalize_adv_std = normalize_adv_std
        # A failed sample is always masked out of the loss and the group statistics; with this set, its whole
        # group is left out of the batch instead (counted in rewardmesh/dropped_groups).
        self.drop_failed_groups = drop_failed_groups
        self.dropped_failed_samples = 0
        self.max_attempts = max_attempts
        self.retry_backoff_s = retry_backoff_s
        self.policy_version = 0
        self.resent_samples = 0
        self.dropped_stale_samples = 0
        self.weight_sync = WeightSync()
        self.last_weight_sync: SyncResult | None = None
        # Servers that join (a new address behind dns:///, or back after failing: maybe restarted with the base
        # weights) get the current weights before any work; a group of their own keeps the others' group intact.
        self._join_sync = WeightSync()
        self._weights: Mapping[str, torch.Tensor] | None = None
        self._weights_stamp: tuple[int, ...] = ()  # the version counters of `_weights` when they were sent
        self._weights_lock = asyncio.Lock()
        self.join_updates = 0
        self.behind_samples = 0  # samples refused because their server was behind the step's policy version
        self.pool.on_join(self._bring_up_to_date)
        self.groups_started = 0
        self._step = 0
        self._keeping: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> TrainerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every channel (calls in flight on a pod that left the pool finish or fail first)."""
        if self._keeping:  # the last steps' KeepTraces calls (each has its own deadline)
            await asyncio.gather(*self._keeping, return_exceptions=True)
        self.weight_sync.close()
        self._join_sync.close()
        await self.pool.close()

    @property
    def targets(self) -> list[_Target]:
        """The rollout servers the pool holds now (a dns:/// target follows its pods)."""
        return self.pool.members

    # -- rollouts -----------------------------------------------------------------------------

    def _request(self, prompt: rollout_pb2.Prompt, n: int, reward: str, sampling: Sampling) -> Any:
        req = rollout_pb2.GenerateRequest(prompts=[prompt], n=n, reward=reward, sampling=sampling.to_proto(),
                                          agent=self.agent, max_samples_per_message=MAX_PER_MESSAGE)  # fmt: skip
        if self.reward_timeout is not None:
            req.reward_timeout.FromNanoseconds(int(self.reward_timeout * 1e9))
        return req

    async def _run_group(
        self,
        spec: PromptSpec,
        group_id: str,
        sample_ids: list[str],
        reward: str,
        sampling: Sampling,
        out: asyncio.Queue[ScoredSample | BaseException],
        started: float,
    ) -> None:
        remaining = list(sample_ids)
        errors: list[str] = []
        target: _Target | None = None
        floor = self.policy_version  # every server applied it before this step began
        for _attempt in range(self.max_attempts):
            if not remaining:  # every sample came, then the call failed (a server killed before its OK): done
                return
            target = self.pool.pick(avoid=target)
            while target is None:
                await asyncio.sleep(self.pool.retry_in())
                target = self.pool.pick()
            if errors:
                self.resent_samples += len(remaining)
            request = self._request(spec.to_proto(group_id, remaining), len(remaining), reward, sampling)
            target.outstanding += len(remaining)
            call = target.stub.Generate(request, timeout=self.generate_timeout_s)
            try:
                async for message in call:
                    if target.failures:
                        self.pool.mark_ok(target)
                    arrived = time.perf_counter() - started
                    for response in message.items or (message,):  # several samples per message, or one
                        sid = response.sample.sample_id
                        if sid not in remaining:
                            continue  # never count a sample twice
                        sample = ScoredSample.from_response(response)
                        if sample.policy_version < floor and not sample.failed:  # asked again elsewhere, never used
                            raise _Behind(f"serves policy version {sample.policy_version}, behind {floor}")
                        remaining.remove(sid)
                        target.outstanding -= 1
                        sample.arrived = arrived
                        out.put_nowait(sample)
                if not remaining:
                    return
                errors.append(f"{target.address}: stream ended without {len(remaining)} samples")
            except _Behind as exc:  # restarted, or missed an update: the pool's join hook brings it up to date
                call.cancel()
                self.behind_samples += 1
                errors.append(f"{target.address}: {exc}")
                self.pool.mark_failed(target, str(exc))
            except aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # each missing sample fails; the step goes on
                    for sid in remaining:
                        out.put_nowait(_timed_out(sid, group_id, self.generate_timeout_s, started))
                    remaining = []
                    return
                if exc.code() not in RETRYABLE:
                    out.put_nowait(exc)
                    return
                errors.append(f"{target.address}: {exc.code().name}: {exc.details()}")
                self.pool.mark_failed(target, f"{exc.code().name}: {exc.details()}")
                log.debug("re-sending %d samples of group %s after %s failed", len(remaining), group_id, target.address)
            finally:
                target.outstanding -= len(remaining)
        out.put_nowait(RuntimeError(f"group {group_id}: no rollout server finished it: {'; '.join(errors)}"))

    def _launch(
        self, prompts: Sequence[PromptSpec], n: int, reward: str | None, sampling: Sampling | None
    ) -> _Launched:
        """Start every group's Generate call now (they run whenever the caller awaits anything)."""
        self._step += 1
        stamp = f"s{self._step}-{uuid.uuid4().hex[:6]}"
        span = tracer().start_span("trainer.step", attributes={
            "rewardmesh.step": self._step, "rewardmesh.num_prompts": len(prompts), "rewardmesh.n": n,
            "rewardmesh.policy_version": self.policy_version})  # fmt: skip
        launched = _Launched(asyncio.Queue(), [], len(prompts) * n, time.perf_counter(), span)
        token = otel_context.attach(trace.set_span_in_context(span))  # the tasks (and their RPCs) inherit it
        ratio = trace_config().head_ratio
        try:
            for i, spec in enumerate(prompts):
                group = spec.group_id or f"{stamp}-{i}"
                ids = [f"{group}/{k}" for k in range(n)]
                run = self._run_group(spec, group, ids, self.reward if reward is None else reward,
                                      sampling or self.sampling, launched.out, launched.started)  # fmt: skip
                # Head sampling per prompt group, decided here and carried in the trace flags.
                ctx = group_context(span, random.random() < ratio)
                group_token = otel_context.attach(ctx) if ctx is not None else None
                try:
                    launched.tasks.append(asyncio.create_task(run))
                finally:
                    if group_token is not None:
                        otel_context.detach(group_token)
        finally:
            otel_context.detach(token)
        self.groups_started += len(prompts)
        return launched

    @staticmethod
    async def _consume(launched: _Launched) -> AsyncIterator[ScoredSample]:
        try:
            for _ in range(launched.total):
                item = await launched.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for t in launched.tasks:
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*launched.tasks, return_exceptions=True)

    async def rollout(
        self,
        prompts: Sequence[PromptSpec],
        n: int = 1,
        *,
        reward: str | None = None,
        sampling: Sampling | None = None,
    ) -> AsyncIterator[ScoredSample]:
        """Scored samples as they complete, from every rollout server."""
        launched = self._launch(prompts, n, reward, sampling)
        try:
            async for sample in self._consume(launched):
                yield sample
        finally:
            launched.span.end()

    async def _groups(self, launched: _Launched, n: int) -> AsyncIterator[list[ScoredSample]]:
        """Complete groups, advantages computed the moment the group's last sample arrives."""
        pending: dict[str, list[ScoredSample]] = {}
        async for sample in self._consume(launched):
            group = pending.setdefault(sample.group_id, [])
            group.append(sample)
            if len(group) == n:
                del pending[sample.group_id]
                if self.drop_failed_groups and any(s.failed for s in group):
                    launched.dropped += group
                    self.dropped_failed_samples += len(group)
                    continue
                set_group_advantages(group, normalize_std=self.normalize_adv_std)
                yield group

    async def _collect(self, launched: _Launched, n: int) -> RolloutBatch | None:
        """The whole step as one batch; None when every group was dropped for failed samples."""
        try:
            samples = [s async for group in self._groups(launched, n) for s in group]
            if not samples:
                log.warning("every group of a step had a failed sample and was dropped (%d samples)", launched.total)
                return None
            batch = self._batch(samples, time.perf_counter() - launched.started, launched.dropped)
            self._end_step(launched.span, batch.samples, batch.metrics)
            return batch
        finally:
            launched.span.end()

    async def generate_batch(
        self, prompts: Sequence[PromptSpec], n: int = 1, *, reward: str | None = None, sampling: Sampling | None = None
    ) -> RolloutBatch:
        batch = await self._collect(self._launch(prompts, n, reward, sampling), n)
        if batch is None:
            raise RuntimeError("every group had a failed sample and drop_failed_groups is set: no batch to return")
        return batch

    async def stream_minibatches(
        self,
        prompts: Sequence[PromptSpec],
        n: int = 1,
        *,
        minibatch_size: int,
        reward: str | None = None,
        sampling: Sampling | None = None,
    ) -> AsyncIterator[RolloutBatch]:
        """Mini-batches of complete groups as soon as `minibatch_size` samples are in: training starts early."""
        launched = self._launch(prompts, n, reward, sampling)
        ready: list[ScoredSample] = []
        seen: list[ScoredSample] = []
        try:
            async for group in self._groups(launched, n):
                ready += group
                seen += group
                if len(ready) >= minibatch_size:
                    yield self._batch(ready, time.perf_counter() - launched.started, launched.dropped)
                    ready, launched.dropped = [], []
            if ready:
                yield self._batch(ready, time.perf_counter() - launched.started, launched.dropped)
            if seen:
                self._end_step(launched.span, seen, _metrics(seen, time.perf_counter() - launched.started))
        finally:
            launched.span.end()

    def _end_step(self, span: trace.Span, samples: Sequence[ScoredSample], metrics: Mapping[str, float]) -> None:
        """The step span's slowest-sample breakdown, and the step's slowest samples' span trees kept everywhere."""
        _close_step_span(span, samples, metrics)
        k = trace_config().keep_slowest
        if not samples or not k or recorder() is None or not span.is_recording():
            return
        ids = [s.sample_id for s in heapq.nlargest(k, samples, key=lambda s: s.total_time)]
        task = asyncio.get_running_loop().create_task(self._keep_traces(ids))
        self._keeping.add(task)
        task.add_done_callback(self._keeping.discard)

    async def _keep_traces(self, sample_ids: list[str]) -> None:
        """KeepTraces on every rollout server (each forwards to its reward targets); best effort."""
        request = reward_pb2.KeepTracesRequest(sample_ids=sample_ids)

        async def one(t: _Target) -> None:
            try:
                await t.stub.KeepTraces(request, timeout=10.0)
            except aio.AioRpcError as exc:
                log.debug("KeepTraces on %s failed: %s", t.address, exc.code().name)

        await asyncio.gather(*(one(t) for t in self.targets))

    def _batch(
        self, samples: list[ScoredSample], gen_seconds: float, dropped: Sequence[ScoredSample] = ()
    ) -> RolloutBatch:
        metrics = _metrics(samples, gen_seconds)
        if self.drop_failed_groups:  # the dropped groups' failures still count
            metrics.update(failure_metrics([*samples, *dropped]))
            metrics["rewardmesh/dropped_groups"] = float(len({s.group_id for s in dropped}))
        return assemble_batch(samples, pad_token_id=self.pad_token_id, metrics=metrics)

    async def batches(
        self,
        prompt_steps: Iterable[Sequence[PromptSpec]],
        n: int = 1,
        *,
        off_policy_steps: int = 1,
        reward: str | None = None,
        sampling: Sampling | None = None,
    ) -> AsyncIterator[RolloutBatch]:
        """One batch per step; step k+1's rollouts already run while the trainer works on step k.

        Groups with a sample older than `policy_version - off_policy_steps` are dropped, never handed out.
        With `off_policy_steps > 0` the rollout servers are asked for per-token log-probs, so every batch
        carries `rollout_log_probs` for the learner's importance-sampling correction.
        """
        if off_policy_steps > 0:
            sampling = dataclasses.replace(sampling or self.sampling, logprobs=True)
        steps = iter(prompt_steps)
        in_flight: deque[asyncio.Task[RolloutBatch | None]] = deque()

        def launch() -> None:
            prompts = next(steps, None)
            if prompts is not None:
                launched = self._launch(prompts, n, reward, sampling)
                in_flight.append(asyncio.create_task(self._collect(launched, n)))

        try:
            while True:
                while len(in_flight) < off_policy_steps + 1:
                    before = len(in_flight)
                    launch()
                    if len(in_flight) == before:
                        break  # no more steps
                if not in_flight:
                    return
                batch = await in_flight.popleft()
                fresh = None if batch is None else self._drop_stale(batch, off_policy_steps)
                if fresh is not None:
                    yield fresh
        finally:
            for task in in_flight:
                task.cancel()

    def _drop_stale(self, batch: RolloutBatch, bound: int) -> RolloutBatch | None:
        """Drop whole groups with a sample beyond the staleness bound; None when nothing is left."""
        oldest_allowed = self.policy_version - bound
        stale_groups = {s.group_id for s in batch.samples if s.policy_version < oldest_allowed}
        kept = [s for s in batch.samples if s.group_id not in stale_groups]
        self.dropped_stale_samples += len(batch.samples) - len(kept)
        if not kept:
            log.warning("all %d samples of a step were more than %d versions old; step skipped", len(batch), bound)
            return None
        metrics = dict(batch.metrics)
        metrics["off_policy/dropped_samples"] = float(len(batch.samples) - len(kept))
        metrics["off_policy/max_staleness"] = float(
            max((self.policy_version - s.policy_version for s in kept), default=0)
        )
        if not stale_groups:
            batch.metrics = metrics
            return batch
        return assemble_batch(kept, pad_token_id=self.pad_token_id, metrics=metrics)

    # -- weights ------------------------------------------------------------------------------

    async def update_weights(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        version: int | None = None,
        transport: str = "auto",
        chunk_bytes: int = 16 << 20,
    ) -> int:
        """Send the tensors to every rollout server; returns once all of them applied the same version.

        transport: "auto" (the fastest every server supports: shm on one host, else a torch.distributed
        broadcast, else gRPC chunks), or "shm", "dist", "grpc". Raises WeightSyncError naming each server that
        did not apply it (those keep their old weights).

        The client keeps a reference to `state` (no copy) to bring servers that join later (or come back
        restarted) to this version before they get work, and notes each tensor's version counter: if training
        then changes a tensor in place (an optimizer step), those are no longer this version's weights, so a
        joining server is not given them; it waits, out of the pool, for the next `update_weights`. Pass a copy
        to let servers join between updates while training changes the weights in place.
        """
        async with self._weights_lock:
            version = version if version is not None else self.policy_version + 1
            reachable = await self._reachable()
            targets = [(t.address, t.channel) for t, _ in reachable]
            infos = [i for _, i in reachable if i is not None]
            sync = await self.weight_sync.push(targets, state, version, transport, chunk_bytes=chunk_bytes,
                                               infos=infos if len(infos) == len(targets) else None)  # fmt: skip
            self.last_weight_sync = sync
            self.policy_version = version
            self._weights = state
            self._weights_stamp = _stamp(state)
        return version

    async def _reachable(self) -> list[tuple[_Target, rollout_pb2.GetInfoResponse | None]]:
        """The members that answer now, with their GetInfo (the push reuses it). One that cannot be reached (a pod
        restarting) is marked down instead of failing the update: the pool's join hook brings it to the current
        version before it gets work again. When none answers (every pod restarting at once), ask again as their
        backoffs end, until one does or `weight_sync.timeout_s` has passed."""
        deadline = time.monotonic() + self.weight_sync.timeout_s
        while True:
            members = await self.pool.wait_for_members()
            infos = await asyncio.gather(
                *(self._join_sync.infos([(m.address, m.channel)]) for m in members), return_exceptions=True
            )
            up: list[tuple[_Target, rollout_pb2.GetInfoResponse | None]] = []
            for member, info in zip(members, infos, strict=True):
                if isinstance(info, aio.AioRpcError) and info.code() == grpc.StatusCode.UNAVAILABLE:
                    self.pool.mark_failed(member, f"unreachable for a weight update: {info.details()}")
                else:  # any other failure surfaces from the push (which asks again), naming the server
                    up.append((member, None if isinstance(info, BaseException) else info[0]))
            remaining = deadline - time.monotonic()
            if up or remaining <= 0:
                break
            await asyncio.sleep(min(remaining, self.pool.retry_in()))
        if not up:
            raise WeightSyncError(
                f"no rollout server was reachable for the weight update within {self.weight_sync.timeout_s:g}s",
                {m.address: "UNAVAILABLE" for m in members},
            )
        return up

    async def _bring_up_to_date(self, target: _Target) -> None:
        """The pool's join hook: a server behind the current policy version gets the current weights first."""
        async with self._weights_lock:
            if self._weights is None:
                return  # nothing pushed yet: every server holds the base weights
            me = [(target.address, target.channel)]
            infos = await self._join_sync.infos(me)
            if infos[0].policy_version >= self.policy_version:
                return
            if _stamp(self._weights) != self._weights_stamp:  # raising keeps it out of the pool; retried later
                raise RuntimeError(
                    f"rollout server {target.address} needs policy version {self.policy_version}, but the tensors "
                    "passed to update_weights for it were changed in place since: it waits for the next update"
                )
            log.info("rollout server %s serves policy version %d: sending it version %d before any work",
                     target.address, infos[0].policy_version, self.policy_version)  # fmt: skip
            await self._join_sync.push(me, self._weights, self.policy_version, infos=infos)
            self.join_updates += 1

    async def info(self) -> list[rollout_pb2.GetInfoResponse]:
        targets = await self.pool.wait_for_members()
        return list(await asyncio.gather(*(t.stub.GetInfo(rollout_pb2.GetInfoRequest()) for t in targets)))


def _stamp(state: Mapping[str, torch.Tensor]) -> tuple[int, ...]:
    """Each tensor's autograd version counter: any in-place change (an optimizer step, `copy_`) bumps it.
    Tensors made under inference mode have none (-1): they cannot be changed in place outside it."""
    out = []
    for t in state.values():
        try:
            out.append(int(t._version))
        except RuntimeError:
            out.append(-1)
    return tuple(out)


def _timed_out(sid: str, group_id: str, timeout_s: float, started: float) -> ScoredSample:
    """A sample whose Generate call passed its deadline: a failed sample (masked out), not a hang."""
    status = common_pb2.Status(
        code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0], message=f"no sample within generate_timeout_s={timeout_s:g}"
    )
    response = rollout_pb2.GenerateResponse(
        sample=common_pb2.Sample(sample_id=sid, group_id=group_id),
        result=reward_pb2.RewardResult(sample_id=sid, error=status),
    )
    sample = ScoredSample.from_response(response)
    sample.arrived = time.perf_counter() - started
    return sample


def _metrics(samples: Sequence[ScoredSample], gen_seconds: float) -> dict[str, float]:
    return {**compute_metrics(samples, gen_seconds), **reward_overlap(samples, gen_seconds)}


def _close_step_span(span: trace.Span, samples: Sequence[ScoredSample], metrics: Mapping[str, float]) -> None:
    """The slowest-sample breakdown as attributes (the metrics' own names) and an event naming its trace."""
    if not span.is_recording() or not samples:
        return
    span.set_attributes({k: v for k, v in metrics.items() if k.startswith("timing_s/")})
    slow = slowest_sample(samples)
    parts = slow.trace_context.get("traceparent", "").split("-")
    event: dict[str, AttributeValue] = {"rewardmesh.sample_id": slow.sample_id, "rewardmesh.total_s": slow.total_time}
    if len(parts) == 4:
        event.update({"trace_id": parts[1], "span_id": parts[2]})
    span.set_attribute("rewardmesh.slowest.sample_id", slow.sample_id)
    span.add_event("slowest_sample", event)


def reward_overlap(samples: Sequence[ScoredSample], rollout_seconds: float) -> dict[str, float]:
    """How much reward time hid behind generation, from each sample's arrival and reward wait.

    A sample finished generating at `arrived - reward`; the step's reward time is the union of the
    intervals [generated, arrived]; the exposed part is what ran after the last sample finished generating.
    """
    intervals = sorted((s.arrived - s.timing["reward"], s.arrived) for s in samples if s.timing["reward"] > 0)
    if not intervals:
        return {"timing_s/reward_hidden": 0.0, "timing_s/reward_exposed": 0.0}
    busy, cur_start, cur_end = 0.0, intervals[0][0], intervals[0][1]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    generation_done = max(s.arrived - s.timing["reward"] for s in samples)
    exposed = max(0.0, max(s.arrived for s in samples) - generation_done)
    return {"timing_s/reward_hidden": max(0.0, busy - exposed), "timing_s/reward_exposed": exposed}
