"""Traces and metrics across real gRPC hops (trainer -> rollout -> reward), with in-memory exporters."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rewardmesh.client.trainer import PromptSpec, Sampling, TrainerClient
from rewardmesh.common.otlp_json import OtlpJsonLinesExporter
from rewardmesh.common.telemetry import Telemetry, setup_telemetry
from rewardmesh.v1 import rollout_pb2
from tests.support.scripted_backend import ScriptedBackend
from tests.support.servers import reward_server, rollout_server
from tests.support.waiting import eventually, holds_for

SPANS = InMemorySpanExporter()
METRICS = InMemoryMetricReader()


@pytest.fixture(scope="module")
def telemetry() -> Telemetry:
    t = setup_telemetry("test", span_processors=[SimpleSpanProcessor(SPANS)], metric_readers=[METRICS])
    if not t.tracing:
        pytest.skip("another test installed telemetry without in-memory exporters first")
    return t


def tool_script(text: str, turn: int) -> tuple[str, float]:
    if turn == 0:
        return '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>', 0.01
    return "#### 4", 0.02 if "slow" in text else 0.0


@pytest.fixture
def written(telemetry: Telemetry, tmp_path: Path) -> Iterator[Callable[[], dict[str, Any]]]:
    """An OTLP JSON lines exporter beside the in-memory one for one test, fed kept spans as a deployment's exporter
    is: blocks straight from the flight recorder. Returns a reader: the spans written so far, by span id."""
    from rewardmesh.common.telemetry import serialized

    assert telemetry.recorder is not None
    path = tmp_path / "kept.jsonl"
    exporter = serialized(OtlpJsonLinesExporter(path))
    telemetry.tracer_provider.force_flush()  # type: ignore[union-attr]  # nothing of an earlier test's
    telemetry.recorder.exporters.append(exporter)

    def read() -> dict[str, Any]:
        telemetry.tracer_provider.force_flush()  # type: ignore[union-attr]
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        scopes = [ss for x in lines for rs in x["resourceSpans"] for ss in rs["scopeSpans"]]
        return {s["spanId"]: s for ss in scopes for s in ss["spans"]}

    yield read
    telemetry.recorder.exporters.remove(exporter)
    exporter.shutdown()


def assert_written_as_span_objects(written: dict[str, Any], names: tuple[str, ...]) -> int:
    """Every kept span the in-memory exporter got (span objects built from the recorder's blocks) was written by
    the JSON exporter from the blocks themselves, with exactly the same content; returns how many."""
    from rewardmesh.common.otlp_json import span_to_otlp

    kept = [s for s in SPANS.get_finished_spans() if s.name in names]
    assert {f"{s.context.span_id:016x}" for s in kept} == set(written)
    for s in kept:
        assert written[f"{s.context.span_id:016x}"] == json.loads(json.dumps(span_to_otlp(s)))
    return len(kept)


KEPT_NAMES = ("rollout.sample", "generate", "tool_call", "reward", "reward.queue", "reward.compute", "reward.batch")


def metric_points(name: str) -> list[Any]:
    data = METRICS.get_metrics_data()
    if data is None:  # nothing recorded yet in this process
        return []
    return [p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics if m.name == name
            for p in m.data.data_points]  # fmt: skip


@pytest.fixture
def head_ratio(telemetry: Telemetry) -> Iterator[Callable[[float], None]]:
    """Set the head-sampling ratio for one test (what OTEL_TRACES_SAMPLER_ARG sets for a process)."""
    before = telemetry.trace.head_ratio

    def set_ratio(ratio: float) -> None:
        telemetry.trace.head_ratio = ratio

    yield set_ratio
    telemetry.trace.head_ratio = before


async def test_one_trace_per_step_across_three_services(
    telemetry: Telemetry,
    tok: Any,
    head_ratio: Callable[[float], None],
    written: Callable[[], dict[str, Any]],
) -> None:
    head_ratio(1.0)  # every sample traced in full, RPC spans included
    SPANS.clear()

    def totals() -> tuple[float, float, float]:
        """What the pipeline's histograms and counter hold (other tests of this process recorded there too)."""
        mine = [
            [p for p in metric_points(name) if p.attributes["pipeline"] == "gsm8k_batched"]
            for name in ("rewardmesh.reward.latency", "rewardmesh.reward.batch_size", "rewardmesh.reward.scored")
        ]
        latency, sizes, scored = mine
        return sum(p.count for p in latency), sum(p.sum for p in sizes), sum(p.value for p in scored)

    before = totals()
    pipelines = {"gsm8k_batched": {"sources": [{"type": "rule", "rule": "gsm8k"}],
                                   "batching": {"max_batch_size": 8, "max_queue_delay_ms": 20}}}  # fmt: skip
    agent = rollout_pb2.AgentLoopConfig(max_turns=3, tools=["calculator"])
    async with reward_server(pipelines) as rs, rollout_server(ScriptedBackend(tok, tool_script), [rs.address]) as ro:
        async with TrainerClient([ro.address], reward="gsm8k_batched", agent=agent,
                                 sampling=Sampling(max_tokens=128)) as client:  # fmt: skip
            prompts = [PromptSpec(token_ids=tok.encode(t), ground_truth="4") for t in ("fast one", "slow one")]
            batch = await client.generate_batch(prompts, n=2)
    telemetry.tracer_provider.force_flush()  # type: ignore[union-attr]
    spans: list[Any] = list(SPANS.get_finished_spans())  # attributes are Optional in the SDK's types
    by_id = {s.context.span_id: s for s in spans}
    named: dict[str, list[Any]] = defaultdict(list)
    for s in spans:
        named[s.name].append(s)

    def parent(s: ReadableSpan) -> ReadableSpan | None:
        return by_id.get(s.parent.span_id) if s.parent else None

    def ancestors(s: ReadableSpan) -> list[str]:
        out = []
        while (p := parent(s)) is not None:
            out.append(p.name)
            s = p
        return out

    (step,) = named["trainer.step"]
    samples = named["rollout.sample"]
    assert len(samples) == 4
    for sample in samples:
        assert sample.context.trace_id == step.context.trace_id
        assert ancestors(sample)[-1] == "trainer.step"  # through the Generate client and server spans
        children = [s for s in spans if s.parent and s.parent.span_id == sample.context.span_id]
        assert sorted(c.name for c in children) == ["generate", "generate", "reward", "tool_call"]
        assert next(c for c in children if c.name == "tool_call").attributes["rewardmesh.tool"] == "calculator"
        (reward,) = [c for c in children if c.name == "reward"]
        remote = sorted(s.name for s in spans if s.parent and s.parent.span_id == reward.context.span_id)
        assert remote[-2:] == ["reward.compute", "reward.queue"]  # from the reward server, over the Score stream
        assert sample.attributes["rewardmesh.score"] == 1.0 and sample.attributes["rewardmesh.response_length"] > 0
    # gRPC spans follow the RPC semantic conventions.
    rpc = [s for s in spans if (s.attributes or {}).get("rpc.method") == "Generate"]
    assert rpc and all(s.attributes["rpc.system"] == "grpc" for s in rpc)
    assert {s.attributes["rpc.service"] for s in rpc} == {"rewardmesh.v1.RolloutService"}
    # Batch spans link to exactly the samples they served.
    reward_spans = {s.context.span_id for s in named["reward"]}
    linked = [link.context.span_id for b in named["reward.batch"] for link in b.links]
    assert sorted(linked) == sorted(reward_spans)
    for b in named["reward.batch"]:
        assert len(b.links) == b.attributes["rewardmesh.batch.size"] and b.parent is None
    # The step span carries the slowest-sample breakdown, equal to the trainer's metrics, and names its trace.
    for key, value in batch.metrics.items():
        if key.startswith("timing_s/agent_loop/slowest/"):
            assert step.attributes[key] == pytest.approx(value)
    (event,) = [e for e in step.events if e.name == "slowest_sample"]
    slow = max(batch.samples, key=lambda s: s.total_time)
    assert event.attributes["rewardmesh.sample_id"] == slow.sample_id
    slow_span = next(s for s in samples if s.attributes["rewardmesh.sample_id"] == slow.sample_id)
    assert event.attributes["span_id"] == f"{slow_span.context.span_id:016x}"
    # Histograms count every scored sample; the batch-size histogram sums to the samples served.
    assert [after - was for after, was in zip(totals(), before, strict=True)] == [4, 4, 4]
    # A deployment's exporter wrote the same kept spans from the recorder's blocks (4 samples: 5 spans each on
    # the rollout server, 2 on the reward server, plus the batch spans).
    assert assert_written_as_span_objects(written(), KEPT_NAMES) == 4 * 7 + len(named["reward.batch"])


async def test_failures_are_counted_by_kind(telemetry: Telemetry) -> None:
    from rewardmesh.v1 import reward_pb2
    from tests.support.servers import reward_stub, sample

    async with reward_server() as rs, reward_stub(rs.address) as stub:
        bad = sample("bad")
        bad.response_ids.raw_data = b"\x01"
        await stub.ScoreBatch(reward_pb2.ScoreBatchRequest(reward="format", samples=[bad, sample("ok")]))

    def total(name: str) -> float:
        return sum(p.value for p in metric_points(name) if p.attributes["pipeline"] == "format")

    assert total("rewardmesh.reward.rejected") == 1 and total("rewardmesh.reward.scored") == 1


def test_otlp_json_lines_exporter(tmp_path: Path, telemetry: Telemetry) -> None:
    from rewardmesh.common.telemetry import tracer

    path = tmp_path / "spans.jsonl"
    exporter = OtlpJsonLinesExporter(path)
    SPANS.clear()
    with tracer().start_as_current_span("outer", attributes={"n": 3, "x": 1.5, "ok": True}):
        with tracer().start_as_current_span("inner"):
            pass
    spans = SPANS.get_finished_spans()
    exporter.export(spans)
    exporter.shutdown()
    (line,) = path.read_text().splitlines()
    otlp = json.loads(line)["resourceSpans"][0]
    out = {s["name"]: s for s in otlp["scopeSpans"][0]["spans"]}
    assert out["inner"]["parentSpanId"] == out["outer"]["spanId"] and len(out["outer"]["traceId"]) == 32
    assert {a["key"]: a["value"] for a in out["outer"]["attributes"]}["n"] == {"intValue": "3"}
    assert any(a["key"] == "service.name" for a in otlp["resource"]["attributes"])


def test_span_json_is_span_to_otlp_as_text(telemetry: Telemetry) -> None:
    """The exporter's direct JSON writer says exactly what span_to_otlp says (links, events, odd strings)."""
    from opentelemetry.trace import Link, SpanContext, TraceFlags

    from rewardmesh.common.otlp_json import span_json, span_to_otlp
    from rewardmesh.common.telemetry import tracer

    SPANS.clear()
    target = SpanContext(7, 9, True, TraceFlags(1))
    with tracer().start_as_current_span('outer "quoted" é', links=[Link(target, {"w": 0.5})]) as outer:
        outer.add_event("ev", {"list": [1, 2], "flag": False, "big": 2**40, "nan": float("nan")})
        with tracer().start_as_current_span(
            "inner",
            attributes={"s": "a\nb", "f": 1.25, "t": (True, False), "inf": float("-inf"), "g": 1e300, "b": True},
        ):
            pass
    spans = SPANS.get_finished_spans()
    assert len(spans) == 2
    for span in spans:
        assert json.loads(span_json(span)) == json.loads(json.dumps(span_to_otlp(span)))


def test_a_block_is_written_as_its_span_objects_are() -> None:
    """block_json (the JSON exporter's text for a block of spans, written column by column) says what span_to_otlp
    says of the block's span objects: shared and per-span attributes of every type, errors, links, roots."""
    from rewardmesh.common.flight_recorder import SpanBlock
    from rewardmesh.common.otlp_json import block_json, span_to_otlp
    from rewardmesh.common.telemetry import resource

    res = resource("test")
    t1, t2 = f"{123:032x}", f"{2**127 + 5:032x}"
    blocks = [
        SpanBlock("reward.queue", [t1, t2], [1, 2**64 - 1], [f"{7:016x}", f"{8:016x}"], [10, 20], [15, 20],
                  {"p": "gsm8k", "n": 3}, {"id": ['a"b', "é\n"], "score": [0.5, float("nan")]},
                  errors=[None, "boom \"x\""]),
        SpanBlock("reward.batch", [t2], [3], None, [5], [9], {"size": 2, "flag": True},
                  {"mixed": [[1, 2]]}, links=[[(t1, f"{7:016x}", True), (t2, f"{8:016x}", False)]]),
        SpanBlock("only columns", [t1], [4], [f"{1:016x}"], [1], [2], {}, {"i": [2**40], "f": [float("inf")]}),
        SpanBlock("no attributes", [t1], [5], None, [1], [2], {}),
    ]  # fmt: skip
    for block in blocks:
        spans = block.spans(res)
        assert len(spans) == len(block)
        texts = block_json(block)
        assert [json.loads(t) for t in texts] == [json.loads(json.dumps(span_to_otlp(s))) for s in spans]
    queue = blocks[0].spans(res)
    assert [s.context.span_id for s in queue] == [1, 2**64 - 1] and queue[1].context.trace_id == 2**127 + 5
    assert queue[0].attributes == {"p": "gsm8k", "n": 3, "id": 'a"b', "score": 0.5} and queue[1].status.description


def test_single_span_blocks_merge_into_blocks_of_the_same_spans() -> None:
    """A drain's blocks of one span each (a rollout server's kept trees) are merged by name, kind and attribute
    keys into column blocks that are the same spans, and written as they are."""
    from rewardmesh.common.flight_recorder import FlightRecorder, merge_singles
    from rewardmesh.common.otlp_json import block_json, span_to_otlp
    from rewardmesh.common.telemetry import resource

    rec = FlightRecorder(resource("test"))
    singles = [
        rec.span("rollout.sample", 11, 1, None, 5, 9, {"id": "a", "n": 1}),
        rec.span("rollout.sample", 12, 2, None, 6, 8, {"id": "b", "n": 2.5}, error="boom"),
        rec.span("generate", 11, 3, 1, 5, 6, {"turn": "0"}),
        rec.span("generate", 11, 4, 1, 6, 7, {"turn": "1"}),
        rec.span("generate", 12, 5, 2, 6, 7, {"other": "key"}),
        rec.span("reward", 11, 6, 1, 7, 9, {"id": "a", "n": 1}),
    ]
    merged = merge_singles(singles)
    assert sorted(len(b) for b in merged) == [1, 1, 2, 2]

    def by_id(blocks: list[Any]) -> dict[int, Any]:
        return {s.context.span_id: span_to_otlp(s) for b in blocks for s in b.spans(rec.resource)}

    assert by_id(merged) == by_id(singles)
    written = {json.loads(t)["spanId"]: json.loads(t) for b in merged for t in block_json(b)}
    assert written == {f"{k:016x}": json.loads(json.dumps(v)) for k, v in by_id(singles).items()}


async def test_slowest_sample_tree_is_exported_at_head_ratio_zero(
    telemetry: Telemetry, tok: Any, head_ratio: Callable[[float], None]
) -> None:
    """No group is head-sampled, yet the step's slowest samples (KeepTraces, k=4) have their whole tree."""
    head_ratio(0.0)
    SPANS.clear()

    def scored() -> int:
        points = metric_points("rewardmesh.reward.latency")
        return sum(p.count for p in points if p.attributes["pipeline"] == "gsm8k_batched")

    before = scored()
    pipelines = {"gsm8k_batched": {"sources": [{"type": "rule", "rule": "gsm8k"}],
                                   "batching": {"max_batch_size": 4, "max_queue_delay_ms": 5}}}  # fmt: skip
    agent = rollout_pb2.AgentLoopConfig(max_turns=3, tools=["calculator"])
    async with reward_server(pipelines) as rs, rollout_server(ScriptedBackend(tok, tool_script), [rs.address]) as ro:
        async with TrainerClient([ro.address], reward="gsm8k_batched", agent=agent,
                                 sampling=Sampling(max_tokens=128)) as client:  # fmt: skip
            texts = ["fast a", "fast b", "fast c", "slow one"]
            batch = await client.generate_batch([PromptSpec(token_ids=tok.encode(t), ground_truth="4") for t in texts],
                                                n=2)  # fmt: skip
    telemetry.tracer_provider.force_flush()  # type: ignore[union-attr]
    spans: list[Any] = list(SPANS.get_finished_spans())  # attributes are Optional in the SDK's types
    by_id = {s.context.span_id: s for s in spans}
    kept = sorted(batch.samples, key=lambda s: s.total_time)[-4:]
    samples = {s.attributes["rewardmesh.sample_id"]: s for s in spans if s.name == "rollout.sample"}
    assert set(samples) == {s.sample_id for s in kept}  # only the slowest 4 of 8: nothing else was built
    assert not [s for s in spans if (s.attributes or {}).get("rpc.method") == "Generate"]  # not head-sampled
    (step,) = [s for s in spans if s.name == "trainer.step"]
    (event,) = [e for e in step.events if e.name == "slowest_sample"]
    slowest = samples[event.attributes["rewardmesh.sample_id"]]
    assert event.attributes["span_id"] == f"{slowest.context.span_id:016x}"  # the event points at an exported span
    for sample in samples.values():
        assert sample.parent is not None and by_id[sample.parent.span_id] is step  # hangs under its step
        children = [s for s in spans if s.parent and s.parent.span_id == sample.context.span_id]
        assert sorted(c.name for c in children) == ["generate", "generate", "reward", "tool_call"]
        (reward,) = [c for c in children if c.name == "reward"]
        remote = sorted(s.name for s in spans if s.parent and s.parent.span_id == reward.context.span_id)
        assert remote == ["reward.compute", "reward.queue"]
        batches = [b for b in spans if b.name == "reward.batch" and any(
            link.context.span_id == reward.context.span_id for link in b.links)]  # fmt: skip
        assert len(batches) == 1 and batches[0].attributes["rewardmesh.batch.size"] >= len(batches[0].links)
    # A batch span links exactly the kept samples it served (all of them at ratio 1.0: the first test).
    kept_reward = {c.context.span_id for c in spans if c.name == "reward"}
    for b in (s for s in spans if s.name == "reward.batch"):
        assert {link.context.span_id for link in b.links} <= kept_reward
    # Metrics still count every sample, kept or not.
    assert scored() - before == 8


def test_histograms_fed_per_batch_match_per_value_recording() -> None:
    """Exact counts and bucket shape: batches of timings through the batched view equal the same values recorded
    one by one (latency = queue + compute per sample), flushed on the way as a busy server does."""
    from opentelemetry.sdk.metrics import MeterProvider

    from rewardmesh.common import batched_metrics
    from rewardmesh.common.batched_metrics import SECONDS_BUCKETS, HistogramBatch

    batched_metrics.mark_views_installed()
    readers = InMemoryMetricReader(), InMemoryMetricReader()
    batched = MeterProvider(metric_readers=[readers[0]], views=batched_metrics.views()).get_meter("t")
    plain = MeterProvider(metric_readers=[readers[1]]).get_meter("t")
    names = ("rewardmesh.latency", "rewardmesh.queue", "rewardmesh.compute")
    mine = tuple(batched.create_histogram(n, unit="s", explicit_bucket_boundaries_advisory=SECONDS_BUCKETS)
                 for n in names)  # fmt: skip
    theirs = [plain.create_histogram(n, unit="s", explicit_bucket_boundaries_advisory=SECONDS_BUCKETS) for n in names]
    sizes_mine = batched.create_histogram("rewardmesh.size", explicit_bucket_boundaries_advisory=(1, 4, 16, 64))
    sizes_theirs = plain.create_histogram("rewardmesh.size", explicit_bucket_boundaries_advisory=(1, 4, 16, 64))
    scored_mine, scored_theirs = batched.create_counter("rewardmesh.scored"), plain.create_counter("rewardmesh.scored")
    queue = [0.0001 * (i % 97) + 0.003 * (i % 5) + (2.0 if i % 31 == 0 else 0.0) for i in range(1000)]
    pending = HistogramBatch(max_pending=300)  # flushes on the way, like a busy server between collections
    cuts = [0, 1, 3, 40, 41, 297, 298, 700, 1000]  # batches of several sizes
    attrs = {"pipeline": "p"}
    for k, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        compute = 0.001 * (k + 1)
        pending.add_timings(scored_mine, mine, "p", queue[lo:hi], compute)  # type: ignore[arg-type]
        pending.add(sizes_mine, "p", hi - lo)
        sizes_theirs.record(hi - lo, attrs)
        scored_theirs.add(hi - lo, attrs)
        for q in queue[lo:hi]:
            for h, v in zip(theirs, (q + compute, q, compute), strict=True):
                h.record(v, attrs)
    pending.flush()

    def points(reader: InMemoryMetricReader) -> dict[str, Any]:
        data = reader.get_metrics_data()
        assert data is not None
        return {m.name: m.data.data_points[0] for rm in data.resource_metrics for sm in rm.scope_metrics
                for m in sm.metrics}  # fmt: skip

    a, b = points(readers[0]), points(readers[1])
    assert a["rewardmesh.scored"].value == b["rewardmesh.scored"].value == 1000
    for name in (*names, "rewardmesh.size"):
        x, y = a[name], b[name]
        assert x.count == y.count and x.bucket_counts == y.bucket_counts and x.explicit_bounds == y.explicit_bounds
        assert x.sum == pytest.approx(y.sum) and (x.min, x.max) == pytest.approx((y.min, y.max))
    assert a["rewardmesh.latency"].count == 1000 and len(set(a["rewardmesh.latency"].bucket_counts)) > 3


async def test_keep_traces_exports_a_kept_tree_once(telemetry: Telemetry) -> None:
    """A KeepTraces names unsampled samples after their results: their reward spans hang under the ids their
    traceparents carried, their batch span links them, and naming them again exports nothing twice."""
    import asyncio

    from rewardmesh.client.reward_client import RewardClient
    from rewardmesh.common.flight_recorder import new_span_id, new_trace_id, traceparent
    from tests.support.servers import sample

    parents = {f"k{i}": (new_trace_id(), new_span_id()) for i in range(3)}
    SPANS.clear()
    async with reward_server() as rs, RewardClient([rs.address]) as client:
        futures = [client.submit(sample(sid), "gsm8k", trace_context={"traceparent": traceparent(t, s, False)})
                   for sid, (t, s) in parents.items()]  # fmt: skip
        results = await asyncio.gather(*futures)
        assert not [r for r in results if r.HasField("error")]
        telemetry.tracer_provider.force_flush()  # type: ignore[union-attr]
        assert not [s for s in SPANS.get_finished_spans() if s.name.startswith("reward.")]  # none kept yet
        first = await client.keep_traces(["k0", "k1", "k0", "unknown"])
        again = await client.keep_traces(["k0"])
    telemetry.tracer_provider.force_flush()  # type: ignore[union-attr]
    spans: list[Any] = list(SPANS.get_finished_spans())
    mine = [s for s in spans if s.name in ("reward.queue", "reward.compute")]
    assert sorted((s.attributes["rewardmesh.sample_id"], s.name) for s in mine) == [
        ("k0", "reward.compute"), ("k0", "reward.queue"), ("k1", "reward.compute"), ("k1", "reward.queue")]  # fmt: skip
    for s in mine:
        trace_id, parent_id = parents[s.attributes["rewardmesh.sample_id"]]
        assert (s.context.trace_id, s.parent.span_id) == (trace_id, parent_id)
    linked = {link.context.span_id for b in spans if b.name == "reward.batch" for link in b.links}
    assert linked == {parents["k0"][1], parents["k1"][1]}  # k2 was not kept: no link to a span never exported
    assert first == len([s for s in spans if s.name.startswith("reward.")]) and again == 0


async def test_a_head_sampled_sample_named_again_by_a_keep_decision_is_exported_once(telemetry: Telemetry) -> None:
    """A head-sampled sample's reward spans are exported with its batch; a keep decision naming it later (it was
    among its step's slowest) exports nothing more, while a batch-mate it names is exported."""
    import asyncio

    from rewardmesh.client.reward_client import RewardClient
    from rewardmesh.common.flight_recorder import new_span_id, new_trace_id, traceparent
    from tests.support.servers import sample

    parents = {sid: (new_trace_id(), new_span_id()) for sid in ("head", "other")}
    SPANS.clear()
    async with reward_server() as rs, RewardClient([rs.address]) as client:
        contexts = {sid: traceparent(*parents[sid], sid == "head") for sid in parents}
        futures = [client.submit(sample(sid), "gsm8k", trace_context={"traceparent": tp})
                   for sid, tp in contexts.items()]  # fmt: skip
        assert not [r for r in await asyncio.gather(*futures) if r.HasField("error")]
        telemetry.tracer_provider.force_flush()  # type: ignore[union-attr]
        assert len([s for s in SPANS.get_finished_spans() if s.name.startswith("reward.")]) >= 2  # head's, at once
        assert await client.keep_traces(["head"]) == 0
        assert await client.keep_traces(["head", "other"]) >= 2  # other's two (and its batch span, if its own)
    telemetry.tracer_provider.force_flush()  # type: ignore[union-attr]
    mine: list[Any] = [s for s in SPANS.get_finished_spans() if s.name in ("reward.queue", "reward.compute")]
    assert sorted((s.attributes["rewardmesh.sample_id"], s.name) for s in mine) == [
        ("head", "reward.compute"), ("head", "reward.queue"),
        ("other", "reward.compute"), ("other", "reward.queue"),
    ]  # fmt: skip


async def test_item_trace_contexts_are_read_unless_the_sender_says_none_carries_one(
    telemetry: Telemetry, written: Callable[[], dict[str, Any]]
) -> None:
    """An older sender leaves ScoreRequest.items_untraced unset: each item's traceparent is read and a
    head-sampled one's reward spans are exported under it. A sender that sets it is taken at its word (the
    flag spares the server a map read per sample); RewardClient sets it only on messages with no context."""
    from rewardmesh.common.flight_recorder import new_span_id, new_trace_id, traceparent
    from rewardmesh.v1 import reward_pb2
    from tests.support.servers import reward_stub, sample

    parents = {f"h{i}": (new_trace_id(), new_span_id()) for i in range(3)}

    def message(ids: list[str], untraced: bool) -> reward_pb2.ScoreRequest:
        msg = reward_pb2.ScoreRequest(items_untraced=untraced)
        for sid in ids:
            item = msg.items.add(sample=sample(sid), reward="gsm8k")
            item.trace_context["traceparent"] = traceparent(*parents[sid], True)
        return msg

    SPANS.clear()
    async with reward_server() as rs, reward_stub(rs.address) as stub:
        call = stub.Score(iter([message(["h0", "h1"], False), message(["h2"], True)]))
        results = [r async for resp in call for r in ([resp.result] if resp.HasField("result") else resp.results)]
    assert sorted(r.sample_id for r in results) == ["h0", "h1", "h2"]
    assert not [r for r in results if r.HasField("error")]
    telemetry.tracer_provider.force_flush()  # type: ignore[union-attr]
    mine: list[Any] = [s for s in SPANS.get_finished_spans() if s.name in ("reward.queue", "reward.compute")]
    assert sorted(s.attributes["rewardmesh.sample_id"] for s in mine) == ["h0", "h0", "h1", "h1"]
    for s in mine:
        assert (s.context.trace_id, s.parent.span_id) == parents[s.attributes["rewardmesh.sample_id"]]
    assert assert_written_as_span_objects(written(), KEPT_NAMES) >= 5  # and the batch span(s)


async def test_keep_decisions_ride_on_the_score_stream(telemetry: Telemetry) -> None:
    """announce_kept (a rollout server's path) puts the ids on the open Score stream instead of a call: the named
    samples' trees are exported once, and a target with no open stream gets
    the KeepTraces call instead."""
    import asyncio

    from rewardmesh.client.reward_client import RewardClient
    from rewardmesh.common.flight_recorder import new_span_id, new_trace_id, traceparent
    from tests.support.servers import sample

    parents = {f"a{i}": (new_trace_id(), new_span_id()) for i in range(3)}

    def reward_spans() -> list[Any]:
        telemetry.tracer_provider.force_flush()  # type: ignore[union-attr]
        return [s for s in SPANS.get_finished_spans() if s.name in ("reward.queue", "reward.compute")]

    SPANS.clear()
    async with reward_server() as rs, RewardClient([rs.address]) as client:
        futures = [client.submit(sample(sid), "gsm8k", trace_context={"traceparent": traceparent(t, s, False)})
                   for sid, (t, s) in parents.items()]  # fmt: skip
        assert not [r for r in await asyncio.gather(*futures) if r.HasField("error")]
        (stream,) = client.streams
        calls_before = rs.servicer.messages_in
        await client.announce_kept(["a0", "a2", "unknown"])
        await eventually(lambda: len(reward_spans()) == 4, "the kept samples' spans (no answer comes back)", 10)
        assert rs.servicer.messages_in == calls_before + 1  # one message on the stream, no call of its own
        assert sorted(s.attributes["rewardmesh.sample_id"] for s in reward_spans()) == ["a0", "a0", "a2", "a2"]
        await client.announce_kept(["a0"])  # again: nothing more; a result after it shows it was processed
        assert not (await client.submit(sample("a3"), "gsm8k")).HasField("error")
        assert len(reward_spans()) == 4
        async with RewardClient([rs.address]) as fresh:  # no stream open yet: the KeepTraces call
            await fresh.announce_kept(["a1"])
        assert sorted(s.attributes["rewardmesh.sample_id"] for s in reward_spans()).count("a1") == 2
        assert stream in client.streams


async def test_a_failure_sent_without_its_traceparent_is_exported_when_its_sender_keeps_it(
    telemetry: Telemetry,
) -> None:
    """Samples not head-sampled travel without a trace context: a failed one waits on the reward server until
    the keep decision brings its traceparent, then its error span hangs under the sender's reward span, once."""

    from rewardmesh.client.reward_client import RewardClient
    from rewardmesh.common.flight_recorder import new_span_id, new_trace_id, traceparent
    from tests.support.servers import sample

    trace_id, parent_id = new_trace_id(), new_span_id()

    def errors() -> list[Any]:
        telemetry.tracer_provider.force_flush()  # type: ignore[union-attr]
        return [s for s in SPANS.get_finished_spans() if s.name == "reward.queue" and not s.status.is_ok]

    SPANS.clear()
    async with reward_server() as rs, RewardClient([rs.address]) as client:
        result = await client.submit(sample("f0"), "no_such_pipeline")
        assert result.error.code == grpc.StatusCode.NOT_FOUND.value[0]
        await holds_for(lambda: errors() == [], "no traceparent yet: nothing to hang it under")
        for _ in range(2):  # the second announcement exports nothing more
            await client.announce_kept({"f0": traceparent(trace_id, parent_id, False)})
            assert not (await client.submit(sample("f1"), "gsm8k")).HasField("error")  # the keep was read
        (span,) = errors()
        assert (span.context.trace_id, span.parent.span_id) == (trace_id, parent_id)
        assert "no_such_pipeline" in (span.status.description or "")


async def test_a_member_that_failed_in_its_batch_is_kept_with_that_batch(
    telemetry: Telemetry, written: Callable[[], dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sample that failed inside a batch, kept after the fact: its error span under its sender's span, and the
    batch's span, which the failure exports as the batch's first kept member, links it (a failure drew its
    batch's span id but never built the span); a batch-mate kept later has its own spans."""
    import asyncio

    from rewardmesh.client.reward_client import RewardClient
    from rewardmesh.common.flight_recorder import new_span_id, new_trace_id, traceparent
    from rewardmesh.reward_engine import batcher as batching
    from tests.support.servers import sample

    # An inline batch holds the loop about INLINE_BATCH_S at the measured cost per sample: a second of it fits four
    # of these samples on any host, however slow (at 1 ms, four fit only where a sample costs under 0.25 ms).
    monkeypatch.setattr(batching, "INLINE_BATCH_S", 1.0)
    # A batched source (a rule inline: samples of a per-sample source are each answered apart, as a batch of one);
    # `auto` fails the sample whose data_source it does not know.
    rule = {"type": "rule", "rule": "auto", "isolation": "inline"}
    pipelines = {"some_fail": {"sources": [rule], "batching": {"max_batch_size": 4, "max_queue_delay_ms": 200}}}
    parents = {sid: (new_trace_id(), new_span_id()) for sid in ("m0", "m1", "m2", "m3")}
    async with reward_server(pipelines) as rs, RewardClient([rs.address]) as client:
        # An inline batch is bounded by its measured cost per sample (one sample until that is known, and the first
        # pays the rule's imports): samples first until four fit a batch, so the four go as one.
        batcher = rs.engine.pipelines["some_fail"].batcher
        for k in range(100):
            if batcher.inline_bound() >= 4:
                break
            assert not (await client.submit(sample(f"warm{k}"), "some_fail")).HasField("error")
        assert batcher.inline_bound() >= 4
        SPANS.clear()
        samples = [sample(sid) for sid in ("m0", "m1", "m2", "m3")]
        samples[0].data_source = "no_such_source"
        results = await asyncio.gather(*(client.submit(s, "some_fail") for s in samples))
        assert [r.HasField("error") for r in results] == [True, False, False, False]
        assert {r.batch_size for r in results[1:]} == {4}  # one batch of four
        for sid in ("m0", "m1"):  # the failure first: it owns the batch's span
            await client.announce_kept({sid: traceparent(*parents[sid], False)})
            assert not (await client.submit(sample(f"after-{sid}"), "gsm8k")).HasField("error")  # the keep was read
    telemetry.tracer_provider.force_flush()  # type: ignore[union-attr]
    spans: list[Any] = list(SPANS.get_finished_spans())
    (failed,) = [s for s in spans if s.name == "reward.queue" and not s.status.is_ok]
    assert (failed.context.trace_id, failed.parent.span_id) == parents["m0"]
    (compute,) = [s for s in spans if s.name == "reward.compute"]
    assert compute.attributes["rewardmesh.sample_id"] == "m1"
    (batch,) = [s for s in spans if s.name == "reward.batch"]
    assert batch.attributes["rewardmesh.batch.size"] == 4
    linked = {link.context.span_id for link in batch.links}  # m1 too if it was kept before the span was built
    assert parents["m0"][1] in linked and linked <= {parents["m0"][1], parents["m1"][1]}
    assert assert_written_as_span_objects(written(), KEPT_NAMES) == 4  # the failure's, m1's two, the batch's


def test_recent_batches_stay_bounded_when_sample_ids_repeat() -> None:
    """Clients may reuse sample ids (every step names its samples s0..sN): the batches remembered for a later
    KeepTraces are bounded by samples seen, not distinct ids, and an id finds its latest batch."""
    from rewardmesh.reward_engine.batcher import BatchInfo
    from rewardmesh.reward_engine.types import RewardOutput
    from rewardmesh.server.reward.telemetry import _Batch, _Recent

    recent = _Recent(capacity=10)
    for number in range(1, 101):
        ids = [f"s{i}" for i in range(4)]
        info = BatchInfo(4, 4, 4, 0.001, ids, 0, 1, [None] * 4, [0.0] * 4, [RewardOutput(float(number))] * 4)
        recent.add(_Batch(number, "p", info, [float(number)] * 4), ids)
    assert sorted(recent._batches) == [98, 99, 100]  # 10 samples: the last 2 of 98, all of 99 and 100
    found = recent.find("s2")
    assert found is not None and found[0].number == 100 and found[1] == 2 and found[0].scores[2] == 100.0
    assert recent.find("s9") is None


def test_recent_batches_find_members_of_any_batch_in_the_ring() -> None:
    """Members of older batches still in the ring are found; ones pushed out are not; a failed member's score
    reads as not scored."""
    import math

    from rewardmesh.reward_engine.batcher import BatchInfo
    from rewardmesh.reward_engine.types import RewardOutput
    from rewardmesh.server.reward.telemetry import _Batch, _Recent

    recent = _Recent(capacity=32)
    for number in range(1, 21):
        ids = [f"b{number}-{i}" for i in range(number % 4 + 1)]
        scores = [math.nan if number == 19 else float(number)] * len(ids)
        info = BatchInfo(len(ids), 1, 1, 0.5, ids, 10, 20, [None] * len(ids), [0.1] * len(ids),
                         [RewardOutput(0.0)] * len(ids))  # fmt: skip
        recent.add(_Batch(number, "p", info, scores), ids)
    assert recent.find("b1-0") is None and recent.find("b6-2") is None  # 50 samples in all: the first 18 are gone
    b, i = recent.find("b15-3") or (None, -1)
    assert b is not None and b.number == 15 and i == 3 and b.scored(i)
    b, i = recent.find("b19-2") or (None, -1)
    assert b is not None and not b.scored(i)
    r = recent.find("b20-0")
    assert r is not None and r[0].record(0, "b20-0")[:2] == ("b20-0", "p")
    assert r[0].record(0, "b20-0")[6] == pytest.approx((0.6, 0.1, 0.5))


def test_batch_finds_its_head_sampled_members() -> None:
    """Head-sampled members (odd trace flags) are found with every member traced and with some untraced."""
    from rewardmesh.common.flight_recorder import new_span_id, new_trace_id, traceparent
    from rewardmesh.reward_engine.batcher import BatchInfo
    from rewardmesh.reward_engine.types import RewardOutput
    from rewardmesh.server.reward.telemetry import _Batch

    def batch(contexts: list[str | None]) -> _Batch:
        n = len(contexts)
        ids = [f"s{i}" for i in range(n)]
        info = BatchInfo(n, n, n, 0.1, ids, 0, 1, list(contexts), [0.0] * n, [RewardOutput(1.0)] * n)
        return _Batch(1, "p", info, [1.0] * n)

    tps = [traceparent(new_trace_id(), new_span_id(), i in (3, 7)) for i in range(10)]
    assert batch(list(tps)).sampled() == [3, 7]
    assert batch([traceparent(new_trace_id(), new_span_id(), False)] * 5).sampled() == []
    assert batch([None, *tps[1:]]).sampled() == [3, 7] and batch([None] * 4).sampled() == []
    assert batch([tps[7][:-2] + "03", tps[0]]).sampled() == [0]  # another flag bit set too


def test_batch_places_members_by_id_in_its_joined_ids() -> None:
    """Ids that contain one another, a repeated id (the last wins) and an id holding the separator."""
    from rewardmesh.reward_engine.batcher import BatchInfo
    from rewardmesh.reward_engine.types import RewardOutput
    from rewardmesh.server.reward.telemetry import _Batch

    def batch(ids: list[str]) -> _Batch:
        n = len(ids)
        return _Batch(1, "p", BatchInfo(n, n, n, 0.1, ids, 0, 1, [None] * n, [0.0] * n, [RewardOutput(1.0)] * n),
                      [1.0] * n)  # fmt: skip

    b = batch(["s1", "s11", "x-s1", "s1-x", "s111", "s11"])
    assert [b.index(x) for x in ("s1", "s11", "x-s1", "s1-x", "s111", "s", "1", "")] == [
        0,
        5,
        2,
        3,
        4,
        None,
        None,
        None,
    ]
    assert batch(["a\x1fb", "c"]).index("c") is None and batch([]).index("a") is None


def test_ring_keeps_at_least_capacity_records() -> None:
    from rewardmesh.common.flight_recorder import Ring

    ring = Ring(4)
    for i in range(10):
        ring.put(i, (i,))
    assert [ring.get(i) for i in range(6, 10)] == [(6,), (7,), (8,), (9,)]
    assert ring.get(0) is None and len(ring) <= 8


def test_a_stalled_exporter_costs_dropped_spans_not_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept spans wait for the recorder's builder thread in a queue bounded in spans: while an exporter hangs, the
    queue fills, what does not fit is refused and counted as dropped, and what was taken is exported once the
    exporter answers again. An exporter that is no BlockExporter gets span objects."""
    import threading

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from rewardmesh.common import flight_recorder
    from rewardmesh.common.flight_recorder import FlightRecorder, SpanBlock, new_span_id
    from rewardmesh.common.telemetry import resource

    monkeypatch.setattr(flight_recorder, "MAX_QUEUED_SPANS", 10)
    entered, release = threading.Event(), threading.Event()
    exported: list[ReadableSpan] = []

    class Stalled(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            entered.set()
            release.wait(10)
            exported.extend(spans)
            return SpanExportResult.SUCCESS

    class Tree:
        def spans(self, rec: FlightRecorder) -> list[SpanBlock]:
            return [rec.span("root", 5, new_span_id(), None, 1, 2), rec.span("child", 5, new_span_id(), 7, 1, 2)]

    rec = FlightRecorder(resource("test"), exporters=[Stalled()])
    try:
        assert rec.export_tree(Tree()) == 2
        rec.wake()
        assert entered.wait(5)  # the builder took the first tree and hangs in the exporter
        assert [rec.export_tree(Tree()) for _ in range(6)] == [2, 2, 2, 2, 2, 0]  # 10 spans fit
        assert rec.dropped_spans == 2
    finally:
        release.set()
    rec.flush_deferred(export_all=True)
    assert len(exported) == 12 and rec.exported_spans == 12
    assert all(isinstance(s, ReadableSpan) and s.context.trace_id == 5 for s in exported)
    assert {s.name: s.parent is None for s in exported} == {"root": True, "child": False}
    rec.stop()


def test_a_block_exporter_gets_blocks_and_any_other_exporter_span_objects(tmp_path: Path) -> None:
    """The recorder hands kept spans to a BlockExporter as blocks (no span objects built for it), to any other
    exporter as ReadableSpans; wrapping an exporter to be fed one call at a time keeps what it is."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import SpanExportResult

    from rewardmesh.common.flight_recorder import BlockExporter, FlightRecorder, SpanBlock, new_span_id
    from rewardmesh.common.telemetry import resource, serialized

    got: dict[str, list[Any]] = {"blocks": [], "spans": []}

    class Blocks(BlockExporter):
        def export(self, spans: Any) -> SpanExportResult:
            got["spans"].append(("blocks exporter", list(spans)))
            return SpanExportResult.SUCCESS

        def export_blocks(self, res: Resource, blocks: Any) -> SpanExportResult:
            got["blocks"].extend(blocks)
            return SpanExportResult.SUCCESS

    spans = InMemorySpanExporter()
    exporters = [serialized(Blocks()), serialized(spans)]
    assert isinstance(exporters[0], BlockExporter) and not isinstance(exporters[1], BlockExporter)
    lines = OtlpJsonLinesExporter(tmp_path / "x.jsonl")
    try:
        assert isinstance(serialized(lines), BlockExporter)
    finally:
        lines.shutdown()

    class Tree:
        def spans(self, rec: FlightRecorder) -> list[SpanBlock]:
            return [rec.span("root", 5, new_span_id(), None, 1, 2)]

    rec = FlightRecorder(resource("test"), exporters=exporters)
    assert rec.export_tree(Tree()) == 1
    rec.stop()
    assert [b.name for b in got["blocks"]] == ["root"] and got["spans"] == []
    assert [s.name for s in spans.get_finished_spans()] == ["root"]
