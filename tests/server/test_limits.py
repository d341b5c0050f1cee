"""Server-side limits: every count and size a client controls is refused over its limit, naming the option."""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc import aio

from rewardmesh.common.planes.grpc_chunks import iter_update_requests
from rewardmesh.common.tensors import ids_tensor
from rewardmesh.server.config import load_yaml, resolve
from rewardmesh.server.reward.server import RewardServer, RewardServerConfig, build_engine
from rewardmesh.server.rollout.server import RolloutServer
from rewardmesh.server.serving import ServerOptions
from rewardmesh.v1 import reward_pb2, rollout_pb2, rollout_pb2_grpc
from tests.support.scripted_backend import ScriptedBackend
from tests.support.servers import reward_stub, sample
from tests.support.waiting import eventually

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@asynccontextmanager
async def limited_reward_server(**limits: Any) -> AsyncIterator[RewardServer]:
    server = RewardServer(build_engine(None), ServerOptions(host="127.0.0.1", port=0, **limits))
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=0.5)


async def test_score_batch_over_the_sample_count_is_refused_naming_the_option() -> None:
    async with limited_reward_server(max_samples_per_request=3) as rs, reward_stub(rs.address) as stub:
        ok = await stub.ScoreBatch(
            reward_pb2.ScoreBatchRequest(reward="gsm8k", samples=[sample(f"{i}") for i in range(3)])
        )
        assert len(ok.results) == 3
        with pytest.raises(aio.AioRpcError) as err:
            await stub.ScoreBatch(
                reward_pb2.ScoreBatchRequest(reward="gsm8k", samples=[sample(f"{i}") for i in range(4)])
            )
    assert err.value.code() == INVALID
    assert "ScoreBatchRequest.samples count is 4" in str(err.value.details())
    assert "max_samples_per_request" in str(err.value.details())


async def test_score_message_over_the_item_count_answers_each_item_and_the_stream_goes_on() -> None:
    async with limited_reward_server(max_samples_per_request=2) as rs, reward_stub(rs.address) as stub:
        items = [reward_pb2.ScoreRequest(sample=sample(f"big{i}"), reward="gsm8k") for i in range(3)]
        requests = [
            reward_pb2.ScoreRequest(items=items),
            reward_pb2.ScoreRequest(sample=sample("after"), reward="gsm8k"),
        ]
        got = {}
        async for response in stub.Score(iter(requests)):
            for result in [response.result] if response.HasField("result") else response.results:
                got[result.sample_id] = result
    assert set(got) == {"big0", "big1", "big2", "after"}
    for sid in ("big0", "big1", "big2"):
        assert got[sid].error.code == INVALID.value[0] and "max_samples_per_request" in got[sid].error.message
    assert not got["after"].HasField("error") and got["after"].score == 1.0


@pytest.mark.parametrize(
    ("mutate", "option", "field"),
    [
        (lambda s: setattr(s, "sample_id", "x" * 65), "max_sample_id_chars", "sample.sample_id"),
        (lambda s: setattr(s, "response_text", "y" * 101), "max_text_chars", "sample.response_text"),
        (lambda s: s.response_ids.CopyFrom(ids_tensor(list(range(50)))), "max_tensor_elements", "sample.response_ids"),
        (lambda s: s.extra_info.update({"blob": "z" * 300}), "max_extra_info_bytes", "sample.extra_info"),
        (
            lambda s: s.extra_info.update({"a": {"b": {"c": {"d": {"e": 1}}}}}),
            "max_extra_info_depth",
            "sample.extra_info",
        ),
    ],
)
async def test_oversized_sample_fields_fail_that_sample_only(mutate: Any, option: str, field: str) -> None:
    limits = {
        "max_sample_id_chars": 64,
        "max_text_chars": 100,
        "max_tensor_elements": 40,
        "max_extra_info_bytes": 200,
        "max_extra_info_depth": 4,
    }
    async with limited_reward_server(**limits) as rs, reward_stub(rs.address) as stub:
        bad = sample("bad")
        mutate(bad)
        reply = await stub.ScoreBatch(reward_pb2.ScoreBatchRequest(reward="gsm8k", samples=[sample("good"), bad]))
    good_result, bad_result = reply.results
    assert not good_result.HasField("error") and good_result.score == 1.0
    assert bad_result.error.code == INVALID.value[0]
    assert field in bad_result.error.message and option in bad_result.error.message


def test_limits_come_from_env_and_yaml_like_every_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg_file = tmp_path / "reward.yaml"
    cfg_file.write_text("server:\n  max_samples_per_request: 17\n  max_n: 9\n")
    monkeypatch.setenv("REWARDMESH_MAX_N", "5")
    cfg = resolve(RewardServerConfig, argparse.Namespace(), load_yaml(cfg_file)["server"])
    assert cfg.max_samples_per_request == 17 and cfg.max_n == 5  # the environment wins over the file


# --------------------------------------------------------------------------------------------- rollout


@asynccontextmanager
async def limited_rollout(tok: Any, **limits: Any) -> AsyncIterator[Any]:
    backend = ScriptedBackend(tok, lambda text, turn: ("#### 4", 0.0))
    server = RolloutServer(backend, None, ServerOptions(host="127.0.0.1", port=0, **limits))
    await server.start()
    try:
        async with aio.insecure_channel(server.address) as channel:
            yield rollout_pb2_grpc.RolloutServiceStub(channel), backend
    finally:
        await server.stop(grace=0.5)


def _prompt(tok: Any, **kw: Any) -> rollout_pb2.Prompt:
    return rollout_pb2.Prompt(token_ids=ids_tensor(tok.encode("hello")), **kw)


@pytest.mark.parametrize(
    ("request_kw", "option", "what"),
    [
        ({"n": 10**9}, "max_n", "n is 1000000000"),
        ({"n": 1, "prompts": 5}, "max_prompts_per_request", "prompts count is 5"),
        ({"n": 3, "prompts": 3}, "max_samples_per_generate", "prompts x n is 9"),
        ({"n": 1, "max_tokens": 10**6}, "max_tokens_limit", "sampling.max_tokens is 1000000"),
        ({"n": 1, "sample_ids": ["s" * 100]}, "max_sample_id_chars", "prompts[0].sample_ids[0] length is 100"),
    ],
)
async def test_generate_over_a_limit_is_refused_at_once(
    tok: Any, request_kw: dict[str, Any], option: str, what: str
) -> None:
    limits = {"max_n": 4, "max_prompts_per_request": 4, "max_samples_per_generate": 8, "max_tokens_limit": 1000,
              "max_sample_id_chars": 64}  # fmt: skip
    async with limited_rollout(tok, **limits) as (stub, _):
        ids = request_kw.get("sample_ids")
        prompts = [_prompt(tok, sample_ids=ids) if ids else _prompt(tok) for _ in range(request_kw.get("prompts", 1))]
        sampling = rollout_pb2.SamplingParams(max_tokens=request_kw.get("max_tokens", 8))
        with pytest.raises(aio.AioRpcError) as err:
            _ = [r async for r in stub.Generate(rollout_pb2.GenerateRequest(prompts=prompts, n=request_kw["n"],
                                                                              sampling=sampling))]  # fmt: skip
        # The server keeps serving: a request within the limits is answered.
        fine = [
            r
            async for r in stub.Generate(
                rollout_pb2.GenerateRequest(
                    prompts=[_prompt(tok)], n=2, sampling=rollout_pb2.SamplingParams(max_tokens=8)
                )
            )
        ]
    assert err.value.code() == INVALID
    assert what in str(err.value.details()) and option in str(err.value.details())
    assert len(fine) == 2


async def test_update_weights_chunk_count_is_limited(tok: Any) -> None:
    async with limited_rollout(tok, max_weight_chunks=3) as (stub, backend):
        state = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in backend.weight_specs().items()}
        messages = [rollout_pb2.UpdateWeightsRequest.FromString(m) for m in iter_update_requests(state, chunk_bytes=4)]
        assert len(messages) > 3
        with pytest.raises(aio.AioRpcError) as err:
            await stub.UpdateWeights(iter(messages))
    assert err.value.code() == INVALID and "UpdateWeights chunk count is 4" in str(err.value.details())
    assert "max_weight_chunks" in str(err.value.details())


@pytest.mark.parametrize(
    ("sampling", "option", "what"),
    [
        ({"stop": ["x"] * 5}, "max_stop_strings", "sampling.stop count is 5"),
        ({"stop": ["y" * 9]}, "max_stop_chars", "sampling.stop[0] length is 9"),
        ({"stop_token_ids": list(range(5))}, "max_stop_token_ids", "sampling.stop_token_ids count is 5"),
    ],
)
async def test_stop_lists_over_their_limits_are_refused(
    tok: Any, sampling: dict[str, Any], option: str, what: str
) -> None:
    async with limited_rollout(tok, max_stop_strings=4, max_stop_chars=8, max_stop_token_ids=4) as (stub, _):
        request = rollout_pb2.GenerateRequest(
            prompts=[_prompt(tok)], n=1, sampling=rollout_pb2.SamplingParams(max_tokens=8, **sampling)
        )
        with pytest.raises(aio.AioRpcError) as err:
            _ = [r async for r in stub.Generate(request)]
    assert err.value.code() == INVALID
    assert what in str(err.value.details()) and option in str(err.value.details())


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
async def test_non_finite_sampling_parameters_are_refused_naming_the_field(tok: Any, field: str, value: float) -> None:
    async with limited_rollout(tok) as (stub, _):
        sampling = rollout_pb2.SamplingParams(max_tokens=8)
        setattr(sampling, field, value)
        request = rollout_pb2.GenerateRequest(prompts=[_prompt(tok)], n=1, sampling=sampling)
        with pytest.raises(aio.AioRpcError) as err:
            _ = [r async for r in stub.Generate(request)]
    assert err.value.code() == INVALID and f"sampling.{field} must be a finite number" in str(err.value.details())


def _nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def test_the_deepest_accepted_extra_info_parses_in_every_message_that_carries_it() -> None:
    """The depth limit accounts for the envelopes: a sample at the limit still parses batched in
    ScoreRequest.items and GenerateResponse.items; one level more does not, so it must be refused at the edge."""
    from rewardmesh.server.limits import WIRE_MAX_EXTRA_INFO_DEPTH, Limits

    def envelopes(levels: int) -> list[Any]:
        s = sample("deep")
        s.extra_info.update(_nested(levels))
        prompt = rollout_pb2.Prompt(extra_info=s.extra_info)
        return [
            reward_pb2.ScoreRequest(items=[reward_pb2.ScoreRequest(sample=s)]),
            reward_pb2.ScoreBatchRequest(samples=[s]),
            rollout_pb2.GenerateResponse(items=[rollout_pb2.GenerateResponse(sample=s)]),
            rollout_pb2.GenerateRequest(prompts=[prompt]),
        ]

    for message in envelopes(WIRE_MAX_EXTRA_INFO_DEPTH):
        type(message).FromString(message.SerializeToString())
    deepest = envelopes(WIRE_MAX_EXTRA_INFO_DEPTH + 1)[0]
    with pytest.raises(Exception, match=r"(?i)depth"):
        type(deepest).FromString(deepest.SerializeToString())
    with pytest.raises(ValueError, match="max_extra_info_depth"):
        Limits(max_extra_info_depth=WIRE_MAX_EXTRA_INFO_DEPTH + 1)


async def test_generate_refuses_a_prompt_extra_info_past_the_depth_limit_and_keeps_serving(tok: Any) -> None:
    async with limited_rollout(tok) as (stub, _):
        deep = _prompt(tok)
        deep.extra_info.update(_nested(33))
        with pytest.raises(aio.AioRpcError) as err:
            _ = [r async for r in stub.Generate(rollout_pb2.GenerateRequest(prompts=[deep], n=1))]
        at_limit = _prompt(tok)
        at_limit.extra_info.update(_nested(32))
        fine = [r async for r in stub.Generate(rollout_pb2.GenerateRequest(prompts=[at_limit], n=2))]
    assert err.value.code() == INVALID
    assert "prompts[0].extra_info nesting depth is 33" in str(err.value.details())
    assert len(fine) == 2 and all(not r.result.HasField("error") for r in fine)


async def test_a_huge_chat_prompt_is_refused_before_tokenizing(tok: Any) -> None:
    async with limited_rollout(tok, max_prompt_chars=1000) as (stub, _):
        chat = rollout_pb2.ChatPrompt(messages=[rollout_pb2.ChatMessage(role="user", content="z" * 2000)])
        with pytest.raises(aio.AioRpcError) as err:
            _ = [
                r
                async for r in stub.Generate(rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(chat=chat)], n=1))
            ]
    assert err.value.code() == INVALID
    assert "prompts[0].chat length (characters) is 2004" in str(err.value.details())
    assert "max_prompt_chars" in str(err.value.details())


async def test_keep_traces_id_lists_are_refused_alike_on_both_services(tok: Any) -> None:
    over = [reward_pb2.KeepTracesRequest(sample_ids=list("abcd")),
            reward_pb2.KeepTracesRequest(traceparents=dict.fromkeys("abcd", ""))]  # fmt: skip
    async with limited_reward_server(max_ids_per_message=3) as rs, reward_stub(rs.address) as reward:
        async with limited_rollout(tok, max_ids_per_message=3) as (rollout, _):
            for stub in (reward, rollout):
                for request, field in zip(over, ("sample_ids", "traceparents"), strict=True):
                    with pytest.raises(aio.AioRpcError) as err:
                        await stub.KeepTraces(request)
                    assert err.value.code() == INVALID
                    assert f"KeepTracesRequest.{field} count is 4" in str(err.value.details())


async def test_id_lists_over_the_limit_are_refused() -> None:
    async with limited_reward_server(max_ids_per_message=3) as rs, reward_stub(rs.address) as stub:
        with pytest.raises(aio.AioRpcError) as err:
            await stub.KeepTraces(reward_pb2.KeepTracesRequest(sample_ids=["a", "b", "c", "d"]))
        assert err.value.code() == INVALID and "KeepTracesRequest.sample_ids count is 4" in str(err.value.details())
        for too_many in (
            reward_pb2.ScoreRequest(cancel_sample_ids=["a", "b", "c", "d"]),
            reward_pb2.ScoreRequest(keep_traces=dict.fromkeys("abcd", "")),
        ):
            call = stub.Score(iter([too_many]))
            with pytest.raises(aio.AioRpcError) as err:
                _ = [r async for r in call]
            assert err.value.code() == INVALID and "max_ids_per_message" in str(err.value.details())
        # Within the limit, and the server goes on serving.
        ok = await stub.ScoreBatch(reward_pb2.ScoreBatchRequest(reward="gsm8k", samples=[sample("fine")]))
        assert ok.results[0].score == 1.0


class HeldChatTemplate:
    """The policy's tokenizer, whose chat template waits for the test's release and records the thread it ran on."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[int] = []

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.get_ident())
        self.entered.set()
        # Had it run on the event loop, nothing could set `release`: the test fails here instead of hanging.
        if not self.release.wait(30):
            raise TimeoutError("the chat template was never released: it held the event loop")
        return self._tok.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


async def test_a_chat_prompt_is_tokenized_off_the_event_loop(tok: Any) -> None:
    """Tokenizing a chat prompt (a long one takes a while) runs on a worker thread: while the test holds the chat
    template open, the server's event loop (the test's own) answers other calls, and the prompt is generated
    from once released."""
    held = HeldChatTemplate(tok)
    async with limited_rollout(held) as (stub, _):
        chat = rollout_pb2.ChatPrompt(messages=[rollout_pb2.ChatMessage(role="user", content="hello world")])
        request = rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(chat=chat)], n=1, sampling=rollout_pb2.SamplingParams(max_tokens=8)
        )
        call = asyncio.ensure_future(_collect(stub.Generate(request)))
        try:
            await eventually(held.entered.is_set, "the chat template is entered")
            for _ in range(3):  # a heartbeat through the server while the template is held open
                await asyncio.wait_for(stub.GetInfo(rollout_pb2.GetInfoRequest()), 60)
            assert not call.done() and not held.release.is_set()
        finally:
            held.release.set()
        replies = await asyncio.wait_for(call, 60)
    assert held.threads and threading.get_ident() not in held.threads
    assert len(replies) == 1 and not replies[0].result.HasField("error")


async def test_a_chat_prompt_over_the_model_context_is_refused_naming_it(tok: Any) -> None:
    async with limited_rollout(tok) as (stub, _):
        chat = rollout_pb2.ChatPrompt(messages=[rollout_pb2.ChatMessage(role="user", content="hello world " * 600)])
        with pytest.raises(aio.AioRpcError) as err:
            await _collect(stub.Generate(rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(chat=chat)], n=1)))
    assert err.value.code() == INVALID and "exceeds the model's context" in str(err.value.details())


async def _collect(call: Any) -> list[Any]:
    return [reply async for reply in call]
