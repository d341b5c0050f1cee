"""RolloutService servicer: decode and validate a request, hand each sample to the `RolloutWorker`, encode.

The data plane (agent loop, reward stream, timing, load counters) is `server/rollout/worker.py`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from rewardmesh.common.errors import Unavailable
from rewardmesh.common.planes.layout import LAYOUT_VERSION
from rewardmesh.server.limits import DEFAULT_LIMITS, Limits, check, keep_traces
from rewardmesh.server.rollout.rollout_input import RolloutInput
from rewardmesh.server.rollout.tools import TOOLS
from rewardmesh.server.rollout.weight_receiver import WeightReceiver
from rewardmesh.server.rollout.worker import Job, RolloutWorker, RunSettings
from rewardmesh.server.status import status_proto
from rewardmesh.v1 import common_pb2, reward_pb2, rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(
        self,
        worker: RolloutWorker,
        *,
        default_max_tokens: int = 256,
        limits: Limits = DEFAULT_LIMITS,
        max_call_unsent: int = 4096,
    ) -> None:
        if max_call_unsent < 1:
            raise ValueError(f"max_call_unsent must be >= 1, got {max_call_unsent}")
        self.worker = worker
        self.limits = limits
        self.backend = worker.backend
        self.input = RolloutInput(worker, limits, default_max_tokens)  # a request's checks and decoding
        # Backpressure: a Generate call has at most this many samples running or finished-but-unsent; the
        # next start only as the client reads, so a client that never reads holds a bounded amount.
        self.max_call_unsent = max_call_unsent
        self.weights = WeightReceiver(worker.backend)
        # Set while the backend boots: GetInfo answers UNAVAILABLE, as a server that is not up yet would, so a
        # trainer leaves it out of a weight update (it would refuse the weights) and its join hook brings it to
        # the current weights once it serves.
        self.booting = ""

    async def _plan(self, request: rollout_pb2.GenerateRequest) -> tuple[list[Job], RunSettings]:
        """Checks first (cheap, on the loop), then the decoding work (in a thread when a prompt is a chat)."""
        settings = self.input.settings(request)
        max_tokens = settings.sampling.max_tokens
        if self.input.tokenizes(request):
            jobs = await asyncio.to_thread(self.input.jobs, request, max_tokens)
        else:
            jobs = self.input.jobs(request, max_tokens)
        return jobs, settings

    # -- RPCs ---------------------------------------------------------------------------------

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateResponse]:
        """Samples stream out as they finish; what finished together shares a message when the client asks."""
        if reason := self.backend.unusable:  # UNAVAILABLE: the trainer asks another server
            raise Unavailable(reason)
        jobs, settings = await self._plan(request)
        per_message = max(1, request.max_samples_per_message)
        loop = asyncio.get_running_loop()
        finished: collections.deque[asyncio.Future[rollout_pb2.GenerateResponse]] = collections.deque()
        wake: list[asyncio.Future[None] | None] = [None]
        job_of: dict[asyncio.Future[rollout_pb2.GenerateResponse], Job] = {}
        started = sent = 0

        def on_done(answer: asyncio.Future[rollout_pb2.GenerateResponse]) -> None:
            finished.append(answer)
            w = wake[0]
            if w is not None and not w.done():
                w.set_result(None)

        def start() -> None:
            """Start what the bound leaves room for, whole prompt groups (one engine request each) where they fit."""
            nonlocal started
            end = _room_end(started, sent + self.max_call_unsent, request.n, len(jobs), self.max_call_unsent)
            if end > started:
                batch = jobs[started:end]
                for job, answer in zip(batch, self.worker.start(batch, settings), strict=True):
                    job_of[answer] = job
                    answer.add_done_callback(on_done)
                started = end

        with self.worker.request():
            start()
            try:
                while sent < len(jobs):
                    if not finished:
                        waiter = wake[0] = loop.create_future()
                        await waiter
                        wake[0] = None
                    ready = [self._response(job_of.pop(t), t) for t in _drain(finished)]
                    for lo in range(0, len(ready), per_message):
                        chunk = ready[lo : lo + per_message]
                        yield chunk[0] if len(chunk) == 1 else rollout_pb2.GenerateResponse(items=chunk)
                        sent += len(chunk)
                        start()  # room for as many as the client just took
            finally:
                # The client went away (or we are done): abort whatever is still generating or waiting.
                for answer in job_of:
                    answer.cancel()

    @staticmethod
    def _response(job: Job, answer: asyncio.Future[rollout_pb2.GenerateResponse]) -> rollout_pb2.GenerateResponse:
        """The sample's response; anything it raised is that sample's INTERNAL error, never a lost sample."""
        exc = answer.exception() if not answer.cancelled() else asyncio.CancelledError("sample cancelled")
        if exc is None:
            return answer.result()
        return rollout_pb2.GenerateResponse(
            sample=common_pb2.Sample(sample_id=job.sample_id, group_id=job.prompt.group_id),
            result=reward_pb2.RewardResult(sample_id=job.sample_id, error=status_proto(exc)),
        )

    async def UpdateWeights(
        self, request_iterator: AsyncIterator[rollout_pb2.UpdateWeightsRequest], context: aio.ServicerContext
    ) -> rollout_pb2.UpdateWeightsResponse:
        return await self.weights.receive_chunks(self._limited_chunks(request_iterator))

    async def _limited_chunks(
        self, requests: AsyncIterator[rollout_pb2.UpdateWeightsRequest]
    ) -> AsyncIterator[rollout_pb2.UpdateWeightsRequest]:
        """The stream's messages, refused past max_weight_chunks (resending chunks would grow the books for ever)."""
        count = 0
        async for msg in requests:
            count += 1
            check(count, self.limits.max_weight_chunks, "UpdateWeights chunk count", "max_weight_chunks")
            yield msg

    async def TransferWeights(
        self, request: rollout_pb2.TransferWeightsRequest, context: aio.ServicerContext
    ) -> rollout_pb2.TransferWeightsResponse:
        return await self.weights.transfer(request)

    async def KeepTraces(self, request: reward_pb2.KeepTracesRequest, context: aio.ServicerContext) -> Any:
        """Export these samples' trees here and on every reward target (a step's slowest, named by the trainer)."""
        keep_traces(request, self.limits)
        kept, exported = await self.worker.keep_traces(request.sample_ids)
        return reward_pb2.KeepTracesResponse(kept_samples=kept, exported_spans=exported)

    async def GetInfo(self, request: rollout_pb2.GetInfoRequest, context: aio.ServicerContext) -> Any:
        if self.booting:
            raise Unavailable(self.booting)
        rewards = self.worker.rewards
        return rollout_pb2.GetInfoResponse(
            model=self.backend.model,
            backend=self.backend.name,
            policy_version=self.backend.policy_version,
            load=self.worker.load(),
            max_model_len=self.backend.max_model_len,
            tools=sorted(TOOLS),
            reward_targets=[s.address for s in rewards.streams] if rewards else [],
            weight_transports=self.weights.transports(),
            host_id=self.weights.host_id,
            instance_id=self.weights.instance_id,
            dist_chain=True,
            dist_layout=LAYOUT_VERSION,
            dist_host_share=bool(self.weights.host_id),
            cuda_device_uuid=self.weights.cuda_uuid(),
            weight_delta=self.weights.takes_deltas(),
        )


def _room_end(started: int, limit: int, n: int, total: int, bound: int) -> int:
    """Where the next start ends: up to `limit` (started samples not yet sent stay within the bound), in whole
    groups of `n` (a group larger than the bound in pieces, else it waits until the whole group fits)."""
    end = started
    while end < total:
        group_end = min(total, (end // n + 1) * n)
        if group_end <= limit:
            end = group_end
        elif group_end - end > bound:  # never fits whole: as much as there is room for
            return max(end, limit)
        else:
            break
    return end


def _drain(queue: collections.deque[Any]) -> list[Any]:
    out = list(queue)
    queue.clear()
    return out
