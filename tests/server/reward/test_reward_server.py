"""The reward server over real gRPC on 127.0.0.1: streaming, every error case, drain, model and file pipelines."""

from __future__ import annotations

import asyncio
import math
import pickle
from typing import Any

import grpc
import numpy as np
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rewardmesh.common.errors import InvalidInput
from rewardmesh.common.tensors import ids_tensor
from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.reward_engine.sources.reward_model import ModelSource
from rewardmesh.reward_engine.types import RewardInput
from rewardmesh.server.reward.reward_input import to_reward_input
from rewardmesh.server.reward.server import load_tokenizer
from rewardmesh.v1 import common_pb2, reward_pb2
from tests.support.servers import EOF, FNS, fn_pipeline, reward_server, reward_stub, sample
from tests.support.waiting import eventually

CODE = {c.value[0]: c for c in grpc.StatusCode}


def req(s: common_pb2.Sample, reward: str, timeout: float | None = None) -> reward_pb2.ScoreRequest:
    r = reward_pb2.ScoreRequest(sample=s, reward=reward)
    if timeout is not None:
        r.timeout.FromNanoseconds(int(timeout * 1e9))
    return r


async def collect(call: Any, n: int) -> list[reward_pb2.RewardResult]:
    out = []
    for _ in range(n):
        msg = await asyncio.wait_for(call.read(), 10)
        assert msg is not EOF
        out.append(msg.result)
    return out


async def test_results_stream_in_completion_order_matched_by_sample_id() -> None:
    async with reward_server({"sleepy": fn_pipeline("sleepy")}) as server, reward_stub(server.address) as stub:
        call = stub.Score()
        await call.write(req(sample("slow", response="slow one", delay=0.4), "sleepy"))
        await call.write(req(sample("fast", response="quick", delay=0.0), "sleepy"))
        first, second = await collect(call, 2)
        await call.done_writing()
        assert await call.read() is EOF  # the server ends the stream once everything is answered
        assert (first.sample_id, second.sample_id) == ("fast", "slow")
        assert first.score == len("quick") and second.score == len("slow one")
        assert second.extras["delay"] == pytest.approx(0.4)
        assert second.timing.compute >= 0.35 and second.timing.total >= second.timing.compute
        assert first.reward == "sleepy" and first.batch_size >= 1
        assert await call.code() == grpc.StatusCode.OK


async def test_every_bad_sample_gets_its_own_status_and_the_stream_goes_on() -> None:
    pipelines = {
        "sleepy": fn_pipeline("sleepy"),
        "explode": {"sources": [{"type": "function", "function": f"{FNS}:explode", "executor": "thread"}]},
        "too_slow": {
            "sources": [{"type": "function", "function": f"{FNS}:sleepy", "timeout_s": 0.1}],
        },
    }
    bad_bytes = sample("bad-bytes")
    bad_bytes.response_ids.raw_data = b"\x01\x02\x03"  # 3 bytes cannot be int32s
    bad_dtype = sample("bad-dtype")
    bad_dtype.prompt_ids.dtype = common_pb2.DTYPE_FLOAT32
    bad_shape = sample("bad-shape")
    bad_shape.prompt_ids.shape[:] = [1, 3]
    bad_mask = sample("bad-mask")
    bad_mask.response_mask.CopyFrom(ids_tensor([1, 1, 1]))
    cases = [
        (req(sample("unknown-pipeline"), "no_such_reward"), grpc.StatusCode.NOT_FOUND, "no_such_reward"),
        (req(sample("no-reward"), ""), grpc.StatusCode.NOT_FOUND, "reward: empty"),
        (req(bad_bytes, "gsm8k"), grpc.StatusCode.INVALID_ARGUMENT, "sample.response_ids.raw_data"),
        (req(bad_dtype, "gsm8k"), grpc.StatusCode.INVALID_ARGUMENT, "sample.prompt_ids.dtype must be INT32"),
        (req(bad_shape, "gsm8k"), grpc.StatusCode.INVALID_ARGUMENT, "sample.prompt_ids.shape"),
        (req(bad_mask, "gsm8k"), grpc.StatusCode.INVALID_ARGUMENT, "sample.response_mask"),
        (req(sample(""), "gsm8k"), grpc.StatusCode.INVALID_ARGUMENT, "sample.sample_id is empty"),
        (req(sample("raises"), "explode"), grpc.StatusCode.INTERNAL, "ZeroDivisionError"),
        (req(sample("times-out", delay=5), "too_slow"), grpc.StatusCode.DEADLINE_EXCEEDED, "timed out"),
    ]
    async with reward_server(pipelines) as server, reward_stub(server.address) as stub:
        call = stub.Score()
        await call.write(req(sample("dup", delay=0.3), "sleepy"))
        await call.write(req(sample("dup"), "sleepy"))  # same id while the first is in flight
        for r, _, _ in cases:
            await call.write(r)
        await call.write(req(sample("good", response="#### 4", truth="4"), "gsm8k"))
        await call.done_writing()
        results = await collect(call, len(cases) + 3)
        assert await call.read() is EOF
    by_id: dict[str, list[reward_pb2.RewardResult]] = {}
    for result in results:
        by_id.setdefault(result.sample_id, []).append(result)
    for r, code, text in cases:
        (res,) = by_id[r.sample.sample_id]
        assert res.HasField("error"), r.sample.sample_id
        assert CODE[res.error.code] == code, (r.sample.sample_id, res.error)
        assert text in res.error.message, (text, res.error.message)
    dup_ok, dup_err = sorted(by_id["dup"], key=lambda r: r.HasField("error"))
    assert not dup_ok.HasField("error") and CODE[dup_err.error.code] == grpc.StatusCode.INVALID_ARGUMENT
    assert "already in flight" in dup_err.error.message
    (good,) = by_id["good"]
    assert not good.HasField("error") and good.score == 1.0 and good.extras["acc"] == 1.0


async def test_full_queue_is_resource_exhausted_and_the_rest_are_scored() -> None:
    pipelines = {
        "narrow": fn_pipeline(
            "sleepy", max_batch_size=1, max_queue_size=2, max_queue_delay_ms=0, max_concurrent_batches=1
        )
    }
    async with reward_server(pipelines) as server, reward_stub(server.address) as stub:
        call = stub.Score()
        for i in range(8):
            await call.write(req(sample(f"s{i}", delay=0.1), "narrow"))
        await call.done_writing()
        results = await collect(call, 8)
    errors = [r for r in results if r.HasField("error")]
    assert sorted(r.sample_id for r in results) == [f"s{i}" for i in range(8)]
    assert errors and all(CODE[r.error.code] == grpc.StatusCode.RESOURCE_EXHAUSTED for r in errors)
    assert "queue is full" in errors[0].error.message
    assert len(results) - len(errors) >= 3  # one computing + two queued


async def test_deadline_passed_in_queue_is_deadline_exceeded() -> None:
    pipelines = {"narrow": fn_pipeline("sleepy", max_batch_size=1, max_queue_delay_ms=0, max_concurrent_batches=1)}
    async with reward_server(pipelines) as server, reward_stub(server.address) as stub:
        call = stub.Score()
        await call.write(req(sample("hog", delay=0.3), "narrow", timeout=5))
        await call.write(req(sample("impatient", delay=0), "narrow", timeout=0.05))
        await call.done_writing()
        results = {r.sample_id: r for r in await collect(call, 2)}
    assert not results["hog"].HasField("error")
    assert CODE[results["impatient"].error.code] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert results["impatient"].batch_size == 0  # dropped before compute


async def test_score_batch_answers_per_sample_in_request_order() -> None:
    async with reward_server() as server, reward_stub(server.address) as stub:
        bad = sample("bad")
        bad.response_ids.raw_data = b"\x00"
        response = await stub.ScoreBatch(
            reward_pb2.ScoreBatchRequest(
                reward="gsm8k",
                samples=[sample("right", "#### 4"), bad, sample("wrong", "#### 5"), sample("flex", "it is 4")],
            )
        )
    ids = [r.sample_id for r in response.results]
    assert ids == ["right", "bad", "wrong", "flex"]
    right, bad_r, wrong, flex = response.results
    assert right.score == 1.0 and wrong.score == 0.0 and flex.score == 0.0  # strict gsm8k needs "#### N"
    assert CODE[bad_r.error.code] == grpc.StatusCode.INVALID_ARGUMENT


async def test_list_rewards_health_and_reflection(tiny_models: TinyModelPaths) -> None:
    pipelines = {
        "mixed": {
            "description": "rule plus model",
            "sources": [
                {"type": "rule", "name": "acc", "rule": "gsm8k", "weight": 1.0},
                {"type": "model", "name": "rm", "path": str(tiny_models.reward_model), "weight": 0.5},
            ],
            "batching": {"max_batch_size": 16},
        },
        "threads": {  # a per-sample source: 3 threads, whatever the batching asks
            "sources": [{"type": "function", "function": f"{FNS}:exact_match", "executor": "thread", "max_workers": 3}],
            "batching": {"max_batch_size": 16, "max_queue_delay_ms": 2, "max_concurrent_batches": 4},
        },
    }
    async with reward_server(pipelines) as server, reward_stub(server.address) as stub:
        listing = await stub.ListRewards(reward_pb2.ListRewardsRequest())
        async with aio.insecure_channel(server.address) as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="rewardmesh.v1.RewardService")
            )
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            services: list[str] = []
            async for resp in refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            ):
                services += [s.name for s in resp.list_services_response.service]
    names = [p.name for p in listing.pipelines]
    assert names == sorted(names) and {"mixed", "gsm8k", "math", "noop"} <= set(names)
    mixed = next(p for p in listing.pipelines if p.name == "mixed")
    assert [(s.name, s.kind, s.weight) for s in mixed.sources] == [
        ("acc", reward_pb2.REWARD_SOURCE_KIND_RULE, 1.0),
        ("rm", reward_pb2.REWARD_SOURCE_KIND_MODEL, 0.5),
    ]
    assert mixed.batching.max_batch_size == 16 and mixed.description == "rule plus model"
    # The batching each pipeline really runs, not its knobs: the model's 2 batches clamped to its one in flight on
    # the CPU; each sample of a per-sample source started and answered apart, as many at once as its threads;
    # an inline rule's batches one at a time, each within its bound.
    assert mixed.batching.max_concurrent_batches == 1
    threads = next(p for p in listing.pipelines if p.name == "threads").batching
    assert (threads.max_batch_size, threads.max_concurrent_batches, threads.max_queue_delay_ms) == (1, 3, 0.0)
    gsm8k = next(p for p in listing.pipelines if p.name == "gsm8k").batching
    assert gsm8k.max_concurrent_batches == 1 and 1 <= gsm8k.max_batch_size <= 256
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert {"rewardmesh.v1.RewardService", "grpc.health.v1.Health"} <= set(services)


async def test_drain_finishes_in_flight_refuses_new_and_reports_not_serving() -> None:
    async with reward_server({"sleepy": fn_pipeline("sleepy")}) as server, reward_stub(server.address) as stub:
        call = stub.Score()
        for i in range(3):
            await call.write(req(sample(f"inflight{i}", delay=0.4), "sleepy"))
        await eventually(lambda: server.servicer.in_flight == 3, "the server holds the three samples")
        stopping = asyncio.create_task(server.stop(grace=5))
        await eventually(lambda: server.servicer.scoring.draining, "the server is draining")
        async with aio.insecure_channel(server.address) as ch:
            status = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        await call.write(req(sample("late"), "gsm8k"))
        results = {r.sample_id: r for r in await collect(call, 4)}
        assert await call.read() is EOF  # drained: the server ended the stream cleanly
        await stopping
    for i in range(3):
        r = results[f"inflight{i}"]
        assert not r.HasField("error") and r.extras["delay"] == pytest.approx(0.4)
    assert CODE[results["late"].error.code] == grpc.StatusCode.UNAVAILABLE
    assert "draining" in results["late"].error.message


async def test_reward_model_pipeline_batches_concurrent_samples(tiny_models: TinyModelPaths) -> None:
    tok = load_tokenizer(str(tiny_models.policy))
    pipelines = {
        "rm": {
            "sources": [{"type": "model", "path": str(tiny_models.reward_model)}],
            "batching": {"max_batch_size": 8, "max_queue_delay_ms": 20},
        }
    }
    texts = [("What is 2+2?", "It is 4. " * (i + 1)) for i in range(12)]
    samples = [
        common_pb2.Sample(
            sample_id=f"rm{i}", prompt_ids=ids_tensor(tok.encode(p)), response_ids=ids_tensor(tok.encode(r))
        )
        for i, (p, r) in enumerate(texts)
    ]
    async with reward_server(pipelines) as server, reward_stub(server.address) as stub:
        call = stub.Score()
        for s in samples:
            await call.write(req(s, "rm"))
        await call.done_writing()
        results = {r.sample_id: r for r in await collect(call, len(samples))}
    direct = ModelSource(name="rm", path=str(tiny_models.reward_model))
    expected = direct.score_tokens([list(tok.encode(p)) + list(tok.encode(r)) for p, r in texts])
    for i, s in enumerate(samples):
        r = results[s.sample_id]
        assert not r.HasField("error") and math.isfinite(r.score)
        assert r.score == pytest.approx(expected[i], abs=1e-4)
    assert max(r.batch_size for r in results.values()) > 1  # concurrent samples shared a batch


async def test_custom_function_from_file_and_decoding_ids_with_tokenizer(tok: Any) -> None:
    pipelines = {"exact": {"sources": [{"type": "function", "function": f"{FNS}:exact_match", "executor": "thread"}]}}
    ids_only = common_pb2.Sample(
        sample_id="ids-only",
        prompt_ids=ids_tensor(tok.encode("What is 2+2?")),
        response_ids=ids_tensor(tok.encode("#### 4")),
        ground_truth="4",
    )
    async with reward_server(pipelines, tokenizer=tok) as server, reward_stub(server.address) as stub:
        response = await stub.ScoreBatch(
            reward_pb2.ScoreBatchRequest(reward="exact", samples=[sample("yes", "42", "42"), sample("no", "41", "42")])
        )
        decoded = await stub.ScoreBatch(reward_pb2.ScoreBatchRequest(reward="gsm8k", samples=[ids_only]))
    assert [r.score for r in response.results] == [1.0, 0.0]
    assert decoded.results[0].score == 1.0  # the rule read text the server decoded from ids


def test_wire_sample_ids_stay_bytes_until_a_source_reads_them() -> None:
    """Rules never read token ids, so the server checks them and leaves the arrays to be made on first read."""
    s = common_pb2.Sample(
        sample_id="a", prompt_ids=ids_tensor([1, 2, 3]), response_ids=ids_tensor([4, 5]), response_text="x"
    )
    inp = to_reward_input(s)
    assert inp.num_tokens == 5 and type(inp.__dict__["prompt_ids"]) is bytes  # counted without an array
    assert inp.prompt_ids.tolist() == [1, 2, 3] and inp.response_ids.dtype == np.int32
    back = pickle.loads(pickle.dumps(inp))  # as a worker process would receive it: a plain RewardInput
    assert type(back) is RewardInput and back.response_ids.tolist() == [4, 5] and back.response_text == "x"
    with pytest.raises(InvalidInput, match=r"sample\.response_ids\[1\] is -2"):
        to_reward_input(common_pb2.Sample(sample_id="b", response_ids=ids_tensor([1, -2])))
    masked = common_pb2.Sample(sample_id="c", response_ids=ids_tensor([4, 5]), response_mask=ids_tensor([1]))
    with pytest.raises(InvalidInput, match=r"response_mask has shape \[1\], but sample\.response_ids has \[2\]"):
        to_reward_input(masked)
