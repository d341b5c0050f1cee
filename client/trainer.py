"""TrainerClient: fans prompts out over rollout servers and turns scored samples into training batches.

The client is the composition of its parts: fan-out with retries (fanout), the prompts and sampling it asks
for (prompts), GRPO groups and batches (batch), bounded staleness (off_policy), the policy's weights on every
server (policy_weights) and the step's telemetry (step_telemetry). Here: the steps a trainer runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence

import torch

from rewardmesh.client.batch import RolloutBatch, ScoredSample, assemble_batch, failure_metrics, set_group_advantages
from rewardmesh.client.fanout import Launched, RolloutFanout, RolloutTarget
from rewardmesh.client.off_policy import drop_stale
from rewardmesh.client.policy_weights import PolicyWeights
from rewardmesh.client.prompts import PromptSpec, Sampling
from rewardmesh.client.step_telemetry import SlowestTraces, reward_overlap, step_metrics
from rewardmesh.client.targets import Resolve, TargetPool
from rewardmesh.client.weight_sync import SyncResult, WeightSync
from rewardmesh.v1 import rollout_pb2

log = logging.getLogger(__name__)

__all__ = ["PromptSpec", "Sampling", "TrainerClient", "reward_overlap"]


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
        step_deadline_s: float | None = None,
    ) -> None:
        """`step_deadline_s`: each step's samples must be scored within this many seconds of the step's start
        (a shared reward fleet serves earlier deadlines first and fails a sample early that cannot make it)."""
        if generate_timeout_s <= 0:
            raise ValueError(f"generate_timeout_s must be > 0, got {generate_timeout_s}")
        self.pool: TargetPool[RolloutTarget] = TargetPool(
            targets,
            RolloutTarget,
            kind="rollout server",
            backoff_s=retry_backoff_s,
            interval_s=resolve_interval_s,
            resolve=resolve,
        )
        self.reward = reward
        self.sampling = sampling or Sampling()
        self.pad_token_id = pad_token_id
        self.normalize_adv_std = normalize_adv_std
        # A failed sample is always masked out of the loss and the group statistics; with this set, its whole
        # group is left out of the batch instead (counted in rewardmesh/dropped_groups).
        self.drop_failed_groups = drop_failed_groups
        self.dropped_failed_samples = 0
        self.retry_backoff_s = retry_backoff_s
        self.dropped_stale_samples = 0
        self.policy = PolicyWeights(self.pool)
        self.fanout = RolloutFanout(
            self.pool,
            agent=agent or rollout_pb2.AgentLoopConfig(),
            reward_timeout=reward_timeout,
            max_attempts=max_attempts,
            generate_timeout_s=generate_timeout_s,
            policy_version=lambda: self.policy.policy_version,
            step_deadline_s=step_deadline_s,
        )
        self.traces = SlowestTraces(lambda: self.targets)
        self.pool.on_join(self._bring_up_to_date)

    async def __aenter__(self) -> TrainerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every channel (calls in flight on a pod that left the pool finish or fail first)."""
        await self.traces.close()
        self.policy.close()
        await self.pool.close()

    @property
    def targets(self) -> list[RolloutTarget]:
        """The rollout servers the pool holds now (a dns:/// target follows its pods)."""
        return self.pool.members

    # -- the parts' state, where a trainer reads it -------------------------------------------

    @property
    def policy_version(self) -> int:
        """The version every rollout server applied last (what update_weights sets)."""
        return self.policy.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.policy.policy_version = version

    @property
    def weight_sync(self) -> WeightSync:
        return self.policy.weight_sync

    @property
    def last_weight_sync(self) -> SyncResult | None:
        return self.policy.last_weight_sync

    @property
    def join_updates(self) -> int:
        return self.policy.join_updates

    @property
    def resent_samples(self) -> int:
        return self.fanout.resent_samples

    @property
    def behind_samples(self) -> int:
        return self.fanout.behind_samples

    @property
    def groups_started(self) -> int:
        return self.fanout.groups_started

    # -- rollouts -----------------------------------------------------------------------------

    def _launch(self, prompts: Sequence[PromptSpec], n: int, reward: str | None, sampling: Sampling | None) -> Launched:
        return self.fanout.launch(prompts, n, self.reward if reward is None else reward, sampling or self.sampling)

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
            async for sample in self.fanout.consume(launched):
                yield sample
        finally:
            launched.span.end()

    async def _groups(self, launched: Launched, n: int) -> AsyncIterator[list[ScoredSample]]:
        """Complete groups, advantages computed the moment the group's last sample arrives."""
        pending: dict[str, list[ScoredSample]] = {}
        async for sample in self.fanout.consume(launched):
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

    async def _collect(self, launched: Launched, n: int) -> RolloutBatch | None:
        """The whole step as one batch; None when every group was dropped for failed samples."""
        try:
            samples = [s async for group in self._groups(launched, n) for s in group]
            if not samples:
                log.warning("every group of a step had a failed sample and was dropped (%d samples)", launched.total)
                return None
            batch = self._batch(samples, time.perf_counter() - launched.started, launched.dropped)
            self.traces.end_step(launched.span, batch.samples, batch.metrics)
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
                self.traces.end_step(launched.span, seen, step_metrics(seen, time.perf_counter() - launched.started))
        finally:
            launched.span.end()

    def _batch(
        self, samples: list[ScoredSample], gen_seconds: float, dropped: Sequence[ScoredSample] = ()
    ) -> RolloutBatch:
        metrics = step_metrics(samples, gen_seconds)
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
        fresh, dropped = drop_stale(batch, policy_version=self.policy_version, bound=bound,
                                    pad_token_id=self.pad_token_id)  # fmt: skip
        self.dropped_stale_samples += dropped
        return fresh

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
        return await self.policy.update(state, version=version, transport=transport, chunk_bytes=chunk_bytes)

    async def _bring_up_to_date(self, target: RolloutTarget) -> None:
        """The pool's join hook: a server behind the current policy version gets the current weights first."""
        await self.policy.bring_up_to_date(target)

    async def info(self) -> list[rollout_pb2.GetInfoResponse]:
        targets = await self.pool.wait_for_members()
        return list(await asyncio.gather(*(t.stub.GetInfo(rollout_pb2.GetInfoRequest()) for t in targets)))
