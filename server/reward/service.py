"""RewardService servicer: thin. It reads who is calling and hands each stream or call to the data plane
(`Scoring`: queueing, flow control, results), which scores on the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from rewardmesh.reward_engine.engine import RewardEngine
from rewardmesh.reward_engine.types import SourceKind
from rewardmesh.server.limits import DEFAULT_LIMITS, Limits, keep_traces
from rewardmesh.server.reward.sample_split import ParsedBatch, ParsedScore
from rewardmesh.server.reward.scoring import DEFAULT_MAX_STREAM_UNANSWERED, Scoring
from rewardmesh.server.reward.telemetry import RewardTelemetry
from rewardmesh.server.reward.tenants import TenantTable
from rewardmesh.v1 import reward_pb2, reward_pb2_grpc


def wire_kind(kind: SourceKind) -> str:
    """A source's kind as ListRewards reports it: the RewardSourceKind value named REWARD_SOURCE_KIND_ and the
    kind's name (RULE, MODEL ...); a message field set from it takes the name."""
    return f"REWARD_SOURCE_KIND_{kind.name}"


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Score (a long-lived stream) and ScoreBatch over the data plane; KeepTraces and ListRewards itself."""

    def __init__(
        self,
        engine: RewardEngine,
        tokenizer: Any = None,
        *,
        max_stream_unanswered: int = DEFAULT_MAX_STREAM_UNANSWERED,
        limits: Limits = DEFAULT_LIMITS,
        tenants: TenantTable | None = None,
    ) -> None:
        self.engine = engine
        self.limits = limits
        self.tenants = tenants or TenantTable()  # who each call is (its token), for fair share and limits
        self.telemetry = RewardTelemetry(engine, self.tenants.tenants)
        self.scoring = Scoring(engine, self.telemetry, tokenizer,
                               max_stream_unanswered=max_stream_unanswered, limits=limits)  # fmt: skip

    async def drain(self) -> None:
        """Refuse new samples (UNAVAILABLE, so clients resend elsewhere) and wait for those in flight."""
        await self.scoring.drain()

    # What the data plane counts, as the server reports it.

    @property
    def in_flight(self) -> int:
        return self.scoring.in_flight

    @property
    def held(self) -> int:
        return self.scoring.held

    @property
    def results_sent(self) -> int:
        return self.scoring.results_sent

    @property
    def messages_in(self) -> int:
        return self.scoring.messages_in

    @property
    def messages_out(self) -> int:
        return self.scoring.messages_out

    # -- RPCs ---------------------------------------------------------------------------------

    async def Score(
        self, request_iterator: AsyncIterator[ParsedScore], context: aio.ServicerContext
    ) -> AsyncIterator[reward_pb2.ScoreResponse]:
        async for message in self.scoring.stream(request_iterator, self.tenants.of(context)):
            yield message

    async def ScoreBatch(self, request: ParsedBatch, context: aio.ServicerContext) -> reward_pb2.ScoreBatchResponse:
        return await self.scoring.batch(request, self.tenants.of(context))

    async def KeepTraces(
        self, request: reward_pb2.KeepTracesRequest, context: aio.ServicerContext
    ) -> reward_pb2.KeepTracesResponse:
        keep_traces(request, self.limits)
        contexts = dict.fromkeys(request.sample_ids, "")
        contexts.update(request.traceparents)
        kept, exported = self.telemetry.keep(contexts)
        return reward_pb2.KeepTracesResponse(kept_samples=kept, exported_spans=exported)

    async def ListRewards(
        self, request: reward_pb2.ListRewardsRequest, context: aio.ServicerContext
    ) -> reward_pb2.ListRewardsResponse:
        response = reward_pb2.ListRewardsResponse()
        for name in sorted(self.engine.pipelines):
            p = self.engine.pipelines[name]
            cfg = p.effective_batching()  # what the pipeline really runs, not the knobs as configured
            response.pipelines.add(
                name=name,
                description=p.description,
                extra_keys=p.extra_keys,
                sources=[
                    reward_pb2.RewardSource(
                        name=ws.source.name,
                        kind=wire_kind(ws.source.kind),
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
