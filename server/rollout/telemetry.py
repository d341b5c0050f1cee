"""Rollout-side sample traces: rollout.sample with its generate, tool_call and reward spans, from the flight recorder.

A sample's span ids are drawn when it starts; its phases are tuples appended as they end. Its spans are built
and exported only when it is kept: its group was head-sampled (the trace flags the trainer sent), it failed,
or the trainer names it later (`keep`, from KeepTraces: a step's slowest samples). The reward span's id goes
to the reward server in the sample's traceparent, so the reward server's reward.queue / reward.compute spans
hang under it when that server exports its part.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import SpanContext, get_current_span
from opentelemetry.util.types import AttributeValue

from rewardmesh.common.flight_recorder import FlightRecorder, SpanBlock, new_span_id, new_trace_id, traceparent
from rewardmesh.common.telemetry import STEP_KEY, recorder, trace_config
from rewardmesh.v1 import reward_pb2, rollout_pb2


class SampleTrace:
    """One sample's timeline on this rollout server (ids agreed up front, phases as tuples)."""

    __slots__ = (
        "attrs",
        "end_ns",
        "error",
        "exported",
        "parent_id",
        "phases",
        "reward_attrs",
        "reward_end_ns",
        "reward_error",
        "reward_span_id",
        "reward_start_ns",
        "sample_id",
        "sampled",
        "span_id",
        "start_ns",
        "trace_id",
    )  # fmt: skip

    def __init__(
        self, sample_id: str, trace_id: int, parent_id: int | None, sampled: bool, attrs: dict[str, AttributeValue]
    ) -> None:
        self.sample_id = sample_id
        self.trace_id = trace_id
        self.parent_id = parent_id
        self.span_id = new_span_id()
        self.sampled = sampled
        self.start_ns = time.time_ns()
        self.end_ns = 0
        self.attrs = attrs  # the caller's dict, owned from here on
        self.phases: list[tuple[str, str, int, int]] = []
        self.reward_span_id = 0
        self.reward_start_ns = self.reward_end_ns = 0
        self.reward_attrs: dict[str, AttributeValue] = {}
        self.reward_error: str | None = None
        self.error: str | None = None
        self.exported = False

    # -- hot path: plain appends ---------------------------------------------------------------

    def turn(self, kind: str, name: str, start_ns: int, end_ns: int) -> None:
        self.phases.append((kind, name, start_ns, end_ns))

    def reward_context(self, pipeline: str) -> dict[str, str] | None:
        """The reward phase starts: the W3C context the reward server's spans hang under, sent with the sample
        only when its group is head-sampled. Any other sample's context reaches the reward server only if the
        sample is kept (`reward_traceparent`, with the keep decision): most never need it."""
        self.reward_span_id = new_span_id()
        self.reward_start_ns = time.time_ns()
        self.reward_attrs["rewardmesh.pipeline"] = pipeline
        return {"traceparent": self.reward_traceparent()} if self.sampled else None

    def reward_traceparent(self) -> str:
        return traceparent(self.trace_id, self.reward_span_id, self.sampled)

    def reward_done(self, result: reward_pb2.RewardResult) -> None:
        self.reward_end_ns = time.time_ns()
        self.reward_attrs["rewardmesh.score"] = result.score
        self.reward_attrs["rewardmesh.batch.size"] = result.batch_size
        if result.HasField("error"):
            self.reward_error = result.error.message
        self.attrs["rewardmesh.score"] = result.score

    def failed(self, message: str) -> None:
        self.error = message

    def annotate(self, attributes: dict[str, AttributeValue]) -> None:
        self.attrs.update(attributes)

    def traceparent(self) -> str:
        return traceparent(self.trace_id, self.span_id, self.sampled)

    # -- kept: spans ---------------------------------------------------------------------------

    def spans(self, rec: FlightRecorder) -> list[SpanBlock]:
        tid, sid = self.trace_id, self.span_id
        out = [rec.span("rollout.sample", tid, sid, self.parent_id, self.start_ns, self.end_ns, self.attrs,
                        error=self.error)]  # fmt: skip
        for kind, name, start, end in self.phases:
            attrs = {"rewardmesh.tool": name} if kind == "tool_call" else {"rewardmesh.turn": name}
            out.append(rec.span(kind, tid, new_span_id(), sid, start, end, attrs))
        if self.reward_span_id:
            end = self.reward_end_ns or self.end_ns
            out.append(rec.span("reward", tid, self.reward_span_id, sid, self.reward_start_ns, end, self.reward_attrs,
                                error=self.reward_error))  # fmt: skip
        return out


class NoTrace:
    """What the hooks get when tracing is off: every call does nothing."""

    sampled = False

    def turn(self, kind: str, name: str, start_ns: int, end_ns: int) -> None:
        pass

    def reward_context(self, pipeline: str) -> dict[str, str] | None:
        return None

    def reward_done(self, result: reward_pb2.RewardResult) -> None:
        pass

    def failed(self, message: str) -> None:
        pass

    def annotate(self, attributes: dict[str, AttributeValue]) -> None:
        pass


NO_TRACE = NoTrace()


def traces_on() -> bool:
    """Whether sample traces are recorded in this process (off: a sample needs no attributes built for them)."""
    return recorder() is not None


def _parent_of(ctx: SpanContext) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, head-sampled) for the samples started under `ctx`."""
    if not ctx.is_valid:
        return None
    if ctx.trace_flags & 1:  # a head-sampled group: under the Generate server span, exported too
        return ctx.trace_id, ctx.span_id, True
    # The Generate spans are not recorded: hang a kept sample under its step span.
    step = ctx.trace_state.get(STEP_KEY) if ctx.trace_state else None
    return ctx.trace_id, int(step, 16) if step else ctx.span_id, False


class RolloutTelemetry:
    """Starts, finishes and keeps sample traces on a rollout server (hook points for the servicer)."""

    def __init__(self) -> None:
        self._context: object = None  # the last OpenTelemetry context seen, and what it says
        self._parent: tuple[int, int, bool] | None = None
        self._key = id(self)  # this server's records in the process's ring

    def begin(self, sample_id: str, attributes: dict[str, AttributeValue]) -> SampleTrace | NoTrace:
        """A sample starts, under the current context (the Generate call's, carrying the trainer's decision)."""
        if recorder() is None:
            return NO_TRACE
        current = otel_context.get_current()  # the same object for every sample of one Generate call
        if current is not self._context:
            self._context, self._parent = current, _parent_of(get_current_span(current).get_span_context())
        parent = self._parent
        if parent is None:  # no trainer context: this server is the root, and samples with its own ratio
            return SampleTrace(sample_id, new_trace_id(), None, random.random() < trace_config().head_ratio, attributes)
        return SampleTrace(sample_id, parent[0], parent[1], parent[2], attributes)

    def finish(self, st: SampleTrace | NoTrace, response: rollout_pb2.GenerateResponse | None = None) -> None:
        """The sample is done: tell the trainer its span, export it if kept, else remember it for a KeepTraces."""
        rec = recorder()
        if not isinstance(st, SampleTrace) or rec is None:
            return
        st.end_ns = time.time_ns()
        if response is not None:
            response.trace_context["traceparent"] = st.traceparent()
        if st.sampled or st.error is not None or st.reward_error is not None:
            st.exported = True
            rec.export_tree(st)
        else:
            rec.remember((self._key, st.sample_id), st)

    def keep(self, sample_ids: Iterable[str]) -> tuple[int, int, dict[str, str]]:
        """Export the trees of these samples still in the ring: (samples known, spans exported, and the reward
        traceparents of those newly kept that were scored, for their reward servers)."""
        rec = recorder()
        if rec is None:
            return 0, 0, {}
        found: list[Any] = rec.recall((self._key, sid) for sid in sample_ids)
        exported, rewards = 0, {}
        for st in found:
            if not st.exported:
                st.exported = True
                exported += rec.export_tree(st)
                if st.reward_span_id:
                    rewards[st.sample_id] = st.reward_traceparent()
        return len(found), exported, rewards
