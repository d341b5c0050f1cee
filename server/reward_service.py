"""RewardService servicer: thin; validation and decoding here, all scoring in reward_engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf import json_format
from grpc import aio

from client.telemetry import extract, span_context_in
from client.tensors import ids_from
from reward_engine.engine import RewardEngine
from reward_engine.errors import InvalidInput, RewardError, Unavailable
from reward_engine.types import RewardInput
from rewardmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from server.reward_telemetry import RewardTelemetry
from server.status import status_proto

log = logging.getLogger(__name__)

_KINDS = {
    "rule": reward_pb2.REWARD_SOURCE_KIND_RULE,
    "function": reward_pb2.REWARD_SOURCE_KIND_FUNCTION,
    "model": reward_pb2.REWARD_SOURCE_KIND_MODEL,
    "judge": reward_pb2.REWARD_SOURCE_KIND_JUDGE,
}


def to_reward_input(sample: common_pb2.Sample, tokenizer: Any = None) -> RewardInput:
    """Decode and validate a Sample; ValueError/InvalidInput name the offending field."""
    prompt_ids = ids_from(sample.prompt_ids, "sample.prompt_ids")
    response_ids = ids_from(sample.response_ids, "sample.response_ids")
    mask = None
    if sample.HasField("response_mask"):
        mask = ids_from(sample.response_mask, "sample.response_mask")
        if mask.shape != response_ids.shape:
            raise InvalidInput(
                f"sample.response_mask has shape {list(mask.shape)}, "
                f"but sample.response_ids has {list(response_ids.shape)}"
            )
    prompt_text, response_text = sample.prompt_text, sample.response_text
    if tokenizer is not None:
        if not prompt_text and prompt_ids.size:
            prompt_text = tokenizer.decode(prompt_ids.tolist(), skip_special_tokens=True)
        if not response_text and response_ids.size:
            response_text = tokenizer.decode(response_ids.tolist(), skip_special_tokens=True)
    extra = json_format.MessageToDict(sample.extra_info) if sample.HasField("extra_info") else {}
    return RewardInput(
        sample_id=sample.sample_id,
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        prompt_text=prompt_text,
        response_text=response_text,
        data_source=sample.data_source,
        ground_truth=sample.ground_truth,
        extra_info=extra,
        response_mask=mask,
    )


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Scores samples on a long-lived stream; one bad sample is that sample's error, never the stream's."""

    def __init__(self, engine: RewardEngine, tokenizer: Any = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.telemetry = RewardTelemetry(engine)
        self._in_flight: set[str] = set()
        self._draining = asyncio.Event()
        self.results_sent = 0

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def drain(self) -> None:
        """Refuse new samples (UNAVAILABLE, so clients resend elsewhere) and wait for those in flight."""
        self._draining.set()
        while self._in_flight:
            await asyncio.sleep(0.01)

    async def score_one(
        self,
        sample: common_pb2.Sample,
        reward: str,
        timeout_s: float | None,
        trace_context: dict[str, str] | None = None,
    ) -> reward_pb2.RewardResult:
        arrived = time.monotonic()
        arrival_ns = time.time_ns()
        # Parsed once: the parent of this sample's queue/compute spans and the target of its batch span's link.
        parent = extract(trace_context) if trace_context else None
        sid = sample.sample_id
        result = reward_pb2.RewardResult(sample_id=sid, reward=reward)
        added = False
        try:
            if not sid:
                raise InvalidInput("sample.sample_id is empty; give every sample a unique id")
            if sid in self._in_flight:
                raise InvalidInput(f"sample.sample_id '{sid}' is already in flight on this server; ids must be unique")
            if self._draining.is_set():
                raise Unavailable("reward server is draining; send the sample to another reward target")
            pipeline = self.engine.get(reward)
            inp = to_reward_input(sample, self.tokenizer)
            deadline = arrived + timeout_s if timeout_s is not None else None
            self._in_flight.add(sid)
            added = True
            scored = await pipeline.score(inp, deadline=deadline, context=span_context_in(parent))
            result.score = scored.output.score
            result.extras.update(scored.output.extras)
            result.batch_size = scored.batch_size
            result.timing.queue = scored.queue_s
            result.timing.compute = scored.compute_s
        except (RewardError, ValueError) as exc:
            result.error.CopyFrom(status_proto(exc))
        finally:
            if added:
                self._in_flight.discard(sid)
        result.timing.total = time.monotonic() - arrived
        self.telemetry.on_result(result, parent, arrival_ns)
        return result

    @staticmethod
    def _timeout(msg: reward_pb2.ScoreRequest | reward_pb2.ScoreBatchRequest) -> float | None:
        return msg.timeout.ToTimedelta().total_seconds() if msg.HasField("timeout") else None

    async def Score(
        self, request_iterator: AsyncIterator[reward_pb2.ScoreRequest], context: aio.ServicerContext
    ) -> AsyncIterator[reward_pb2.ScoreResponse]:
        out: asyncio.Queue[reward_pb2.RewardResult | None] = asyncio.Queue()
        pending: set[asyncio.Task[reward_pb2.RewardResult]] = set()

        def deliver(task: asyncio.Task[reward_pb2.RewardResult]) -> None:
            pending.discard(task)
            if not task.cancelled():
                out.put_nowait(task.result())

        async def read() -> None:
            async for req in request_iterator:
                task = asyncio.create_task(
                    self.score_one(req.sample, req.reward, self._timeout(req), dict(req.trace_context))
                )
                pending.add(task)
                task.add_done_callback(deliver)
            out.put_nowait(None)  # the client half-closed: finish what is pending, then end

        reader = asyncio.create_task(read())
        drained = asyncio.create_task(self._draining.wait())
        reader_done = False
        try:
            while True:
                if not out.empty():  # under load results queue up: take them without the wait machinery
                    item = out.get_nowait()
                else:
                    if not pending and (reader_done or self._draining.is_set()):
                        break  # half-closed and answered, or draining: end with OK; the client resends elsewhere
                    getter = asyncio.create_task(out.get())
                    waiters: set[asyncio.Task[Any]] = {getter}
                    waiters |= {t for t in (reader, drained) if not t.done()}
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                    if reader.done() and not reader.cancelled() and reader.exception() is not None:
                        raise reader.exception()  # type: ignore[misc]
                    if not getter.done():
                        getter.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await getter
                        continue
                    item = getter.result()
                if item is None:
                    reader_done = True
                    continue
                self.results_sent += 1
                yield reward_pb2.ScoreResponse(result=item)
        finally:
            reader.cancel()
            drained.cancel()
            for task in pending:
                task.cancel()

    async def ScoreBatch(
        self, request: reward_pb2.ScoreBatchRequest, context: aio.ServicerContext
    ) -> reward_pb2.ScoreBatchResponse:
        timeout = self._timeout(request)
        results = await asyncio.gather(*(self.score_one(s, request.reward, timeout) for s in request.samples))
        self.results_sent += len(results)
        return reward_pb2.ScoreBatchResponse(results=results)

    async def ListRewards(
        self, request: reward_pb2.ListRewardsRequest, context: aio.ServicerContext
    ) -> reward_pb2.ListRewardsResponse:
        response = reward_pb2.ListRewardsResponse()
        for name in sorted(self.engine.pipelines):
            p = self.engine.pipelines[name]
            cfg = p.batcher.config
            response.pipelines.add(
                name=name,
                description=p.description,
                sources=[
                    reward_pb2.RewardSource(
                        name=ws.source.name,
                        kind=_KINDS.get(ws.source.kind, reward_pb2.REWARD_SOURCE_KIND_UNSPECIFIED),
                        weight=ws.weight,
                        target=ws.source.target,
                    )
                    for ws in p.sources
                ],
                batching=reward_pb2.BatchingConfig(
                    max_batch_size=cfg.max_batch_size,
                    max_batch_tokens=cfg.max_batch_tokens,
                    max_queue_delay_ms=cfg.max_queue_delay_ms,
                    max_queue_size=cfg.max_queue_size,
                    max_concurrent_batches=cfg.max_concurrent_batches,
                ),
            )
        return response
