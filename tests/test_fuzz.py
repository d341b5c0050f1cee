"""Fuzzing live servers: hypothesis-generated Sample, ScoreRequest, GenerateRequest and TensorChunk messages,
and raw garbage bytes on every method, against a real reward server and a real rollout server.

Every message is answered (a result per sample, or a status) with a code from the documented set and a
message naming the field; nothing crashes; the servers keep serving a known-good request after each run;
memory stays bounded. Deterministic (derandomized, no example database) and bounded in examples.
"""

from __future__ import annotations

import asyncio
import math
import resource
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.server.reward.server import RewardServer, build_engine, load_tokenizer
from rewardmesh.server.rollout.server import RolloutServer
from rewardmesh.server.serving import ServerOptions
from rewardmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from tests.support.scripted_backend import ScriptedBackend
from tests.support.servers import sample as good_sample

FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
# Codes a per-sample error or a refused call may carry; INTERNAL, UNKNOWN or a crash would be a bug.
SAMPLE_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
}
CODE_OF = {code.value[0]: code for code in grpc.StatusCode}
FIELD_WORDS = (
    *("request", "sample", "reward", "prompts", "n ", "n is", "n must", "sampling", "agent", "tensor", "timeout"),
    *("items", "chunk", "UpdateWeights", "manifest", "dtype", "shape", "deadline", "ScoreBatch"),
)
REWARDS = ["gsm8k", "gsm8k_flexible", "format", "first_number", "length", "noop", "", "no-such-pipeline"]


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class LiveServers:
    """A reward server and a rollout server (scripted backend, scoring on the reward server) on an event loop
    of their own in a thread, so hypothesis' synchronous tests talk to them over real sockets."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-servers", daemon=True)
        self.thread.start()
        self.reward: RewardServer | None = None
        self.rollout: RolloutServer | None = None
        self._run(self._start())

    def _run(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(120)

    async def _start(self) -> None:
        options = ServerOptions(host="127.0.0.1", port=0, max_text_chars=4096, max_tensor_elements=4096)
        self.reward = RewardServer(build_engine(None), options)
        await self.reward.start()
        backend = ScriptedBackend(self.tok, lambda text, turn: ("so #### 4", 0.0))
        self.rollout = RolloutServer(backend, [self.reward.address], ServerOptions(host="127.0.0.1", port=0, max_n=64))
        await self.rollout.start()

    async def _stop(self) -> None:
        if self.rollout is not None:
            await self.rollout.stop(grace=0.5)
        if self.reward is not None:
            await self.reward.stop(grace=0.5)

    def close(self) -> None:
        self._run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def live(tiny_models: TinyModelPaths) -> Iterator[LiveServers]:
    servers = LiveServers(load_tokenizer(str(tiny_models.policy)))
    try:
        yield servers
    finally:
        servers.close()


@pytest.fixture(scope="module")
def reward_stub(live: LiveServers) -> Iterator[reward_pb2_grpc.RewardServiceStub]:
    assert live.reward is not None
    with grpc.insecure_channel(live.reward.address) as channel:
        yield reward_pb2_grpc.RewardServiceStub(channel)


@pytest.fixture(scope="module")
def rollout_stub(live: LiveServers) -> Iterator[rollout_pb2_grpc.RolloutServiceStub]:
    assert live.rollout is not None
    with grpc.insecure_channel(live.rollout.address) as channel:
        yield rollout_pb2_grpc.RolloutServiceStub(channel)


def still_serving(stub: reward_pb2_grpc.RewardServiceStub) -> None:
    reply = stub.ScoreBatch(
        reward_pb2.ScoreBatchRequest(reward="gsm8k", samples=[good_sample("ok", "#### 4")]), timeout=30
    )
    assert reply.results[0].score == 1.0 and not reply.results[0].HasField("error")


def check_error(status: common_pb2.Status) -> None:
    code = CODE_OF.get(status.code)
    assert code in SAMPLE_CODES, f"unexpected {code}: {status.message}"
    assert status.message
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert any(word in status.message for word in FIELD_WORDS), status.message


def check_rpc_error(err: grpc.RpcError) -> None:
    code = err.code()
    assert code in SAMPLE_CODES, f"unexpected {code}: {err.details()}"
    assert err.details()


# ------------------------------------------------------------------------------------------- strategies

small_text = st.text(max_size=40)
json_leaf = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False, allow_infinity=False), small_text)


def json_containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Lists and objects of `inner`: how json_value recurses (a def, whose source hypothesis can always read to
    check that it uses `inner`; a lambda inside a wrapped call it sometimes cannot, and then warns)."""
    return st.one_of(st.lists(inner, max_size=3), st.dictionaries(small_text, inner, max_size=3))


json_value = st.recursive(json_leaf, json_containers, max_leaves=12)


@st.composite
def tensors(draw: st.DrawFn) -> common_pb2.Tensor:
    dtype = draw(st.sampled_from([0, 1, 1, 1, 2, 3, 4, 5, 99]))
    shape = draw(st.lists(st.integers(min_value=-3, max_value=2**40), max_size=3))
    if draw(st.booleans()):  # consistent raw bytes for a small valid-looking shape
        shape = draw(st.lists(st.integers(min_value=0, max_value=8), min_size=1, max_size=2))
        raw = draw(st.binary(min_size=4 * math.prod(shape), max_size=4 * math.prod(shape)))
    else:
        raw = draw(st.binary(max_size=64))
    return common_pb2.Tensor(
        dtype=dtype,  # type: ignore[arg-type]
        shape=shape,
        raw_data=raw,
    )


@st.composite
def samples(draw: st.DrawFn) -> common_pb2.Sample:
    s = common_pb2.Sample(
        sample_id=draw(st.one_of(st.just(""), small_text, st.text(min_size=600, max_size=700))),
        group_id=draw(small_text),
        prompt_text=draw(small_text),
        response_text=draw(st.one_of(small_text, st.just("#### 4"), st.text(min_size=5000, max_size=5001))),
        data_source=draw(small_text),
        ground_truth=draw(small_text),
        policy_version=draw(st.integers(min_value=-(2**63), max_value=2**63 - 1)),
    )
    if draw(st.booleans()):
        s.prompt_ids.CopyFrom(draw(tensors()))
    if draw(st.booleans()):
        s.response_ids.CopyFrom(draw(tensors()))
    if draw(st.booleans()):
        s.response_mask.CopyFrom(draw(tensors()))
    if draw(st.booleans()):
        s.extra_info.update(draw(st.dictionaries(small_text, json_value, max_size=4)))
    return s


durations = st.builds(
    duration_pb2.Duration,
    seconds=st.integers(min_value=-(2**63), max_value=2**63 - 1),
    nanos=st.integers(min_value=-999_999_999, max_value=999_999_999),
)


@st.composite
def score_requests(draw: st.DrawFn, unique: Iterator[int]) -> reward_pb2.ScoreRequest:
    def one() -> reward_pb2.ScoreRequest:
        req = reward_pb2.ScoreRequest(sample=draw(samples()), reward=draw(st.sampled_from(REWARDS)))
        if req.sample.sample_id and len(req.sample.sample_id) < 500:
            req.sample.sample_id = f"{next(unique)}-{req.sample.sample_id}"  # unique on the stream
        if draw(st.booleans()):
            req.timeout.CopyFrom(draw(durations))
        for key, value in draw(st.dictionaries(small_text, small_text, max_size=2)).items():
            req.trace_context[key] = value
        return req

    if draw(st.booleans()):
        msg = reward_pb2.ScoreRequest(items=[one() for _ in range(draw(st.integers(min_value=1, max_value=4)))])
    else:
        msg = one()
    msg.cancel_sample_ids.extend(draw(st.lists(small_text, max_size=2)))
    msg.max_results_per_message = draw(st.integers(min_value=-5, max_value=300))
    return msg


def _ids(msg: reward_pb2.ScoreRequest) -> list[str]:
    return [m.sample.sample_id for m in (msg.items or [msg]) if m.HasField("sample")]


# ------------------------------------------------------------------------------------------------ tests


@FUZZ
@given(batch=st.lists(samples(), min_size=1, max_size=4), reward=st.sampled_from(REWARDS))
def test_fuzzed_samples_on_score_batch_are_each_answered(
    reward_stub: reward_pb2_grpc.RewardServiceStub, batch: list[common_pb2.Sample], reward: str
) -> None:
    reply = reward_stub.ScoreBatch(reward_pb2.ScoreBatchRequest(reward=reward, samples=batch), timeout=30)
    assert len(reply.results) == len(batch)
    for sent, result in zip(batch, reply.results, strict=True):
        assert result.sample_id == sent.sample_id
        if result.HasField("error"):
            check_error(result.error)
        else:
            assert math.isfinite(result.score)


@FUZZ
@given(data=st.data())
def test_fuzzed_score_streams_answer_every_sample_once(
    reward_stub: reward_pb2_grpc.RewardServiceStub, data: st.DataObject
) -> None:
    counter = iter(range(10**9))
    messages = data.draw(st.lists(score_requests(counter), min_size=1, max_size=4))
    sent = [sid for m in messages for sid in _ids(m)]
    got: dict[str, int] = {}
    try:
        for response in reward_stub.Score(iter(messages), timeout=30):
            for result in [response.result] if response.HasField("result") else list(response.results):
                got[result.sample_id] = got.get(result.sample_id, 0) + 1
                if result.HasField("error"):
                    check_error(result.error)
    except grpc.RpcError as err:
        check_rpc_error(err)
        return
    # Every sample with a usable id answered exactly once (an empty or duplicate id is answered by its error).
    for sid in {s for s in sent if s}:
        assert got.get(sid) == sent.count(sid), (sid, got.get(sid))


@FUZZ
@given(
    prompts=st.lists(
        st.one_of(
            st.builds(lambda t, g: rollout_pb2.Prompt(token_ids=t, group_id=g), tensors(), small_text),
            st.builds(
                lambda msgs: rollout_pb2.Prompt(chat=rollout_pb2.ChatPrompt(messages=msgs)),
                st.lists(
                    st.builds(
                        rollout_pb2.ChatMessage, role=st.sampled_from(["user", "system", "x", ""]), content=small_text
                    ),
                    max_size=2,
                ),
            ),
            st.builds(
                lambda ids: rollout_pb2.Prompt(
                    token_ids=common_pb2.Tensor(
                        dtype=common_pb2.DTYPE_INT32,
                        shape=[len(ids)],
                        raw_data=b"".join(i.to_bytes(4, "little", signed=True) for i in ids),
                    ),
                    sample_ids=["a"],
                ),
                st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), min_size=1, max_size=4),
            ),
        ),
        max_size=3,
    ),
    n=st.sampled_from([-1, 0, 1, 2, 65, 10**9]),
    max_tokens=st.one_of(st.none(), st.integers(min_value=-(2**31), max_value=2**31 - 1)),
    temperature=st.one_of(st.none(), st.floats(width=32)),
    top_p=st.one_of(st.none(), st.floats(width=32)),
    tools=st.lists(st.sampled_from(["calculator", "nope", ""]), max_size=2),
    reward=st.sampled_from(["", "gsm8k", "no-such-pipeline"]),
)
def test_fuzzed_generate_requests_are_refused_with_a_field_or_served(
    rollout_stub: rollout_pb2_grpc.RolloutServiceStub,
    prompts: list[rollout_pb2.Prompt],
    n: int,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    tools: list[str],
    reward: str,
) -> None:
    sampling = rollout_pb2.SamplingParams()
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    request = rollout_pb2.GenerateRequest(prompts=prompts, n=n, sampling=sampling, reward=reward,
                                          agent=rollout_pb2.AgentLoopConfig(tools=tools, max_turns=1))  # fmt: skip
    try:
        got = list(rollout_stub.Generate(request, timeout=60))
    except grpc.RpcError as err:
        check_rpc_error(err)
        assert err.code() != grpc.StatusCode.INVALID_ARGUMENT or any(w in str(err.details()) for w in FIELD_WORDS), (
            err.details()
        )
        return
    items = [i for r in got for i in (r.items or [r])]
    assert len(items) == len(prompts) * n
    for item in items:
        if item.HasField("result") and item.result.HasField("error"):
            check_error(item.result.error)


@FUZZ
@given(
    chunks=st.lists(
        st.builds(
            rollout_pb2.TensorChunk,
            name=st.one_of(small_text, st.sampled_from(["lm_head.weight", "model.embed_tokens.weight"])),
            dtype=st.integers(min_value=0, max_value=8),
            shape=st.lists(st.integers(min_value=-2, max_value=2**33), max_size=3),
            offset=st.integers(min_value=-(2**40), max_value=2**40),
            data=st.binary(max_size=64),
        ),
        max_size=4,
    )
)
def test_fuzzed_weight_chunks_are_refused_naming_the_tensor(
    rollout_stub: rollout_pb2_grpc.RolloutServiceStub, chunks: list[rollout_pb2.TensorChunk]
) -> None:
    requests = [rollout_pb2.UpdateWeightsRequest(chunk=c) for c in chunks]
    try:
        rollout_stub.UpdateWeights(iter(requests), timeout=30)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        return
    raise AssertionError("random chunks were applied as weights")


METHODS = [
    ("/rewardmesh.v1.RewardService/ScoreBatch", "unary"),
    ("/rewardmesh.v1.RewardService/ListRewards", "unary"),
    ("/rewardmesh.v1.RewardService/KeepTraces", "unary"),
    ("/rewardmesh.v1.RewardService/Score", "stream"),
    ("/rewardmesh.v1.RolloutService/Generate", "unary_stream"),
    ("/rewardmesh.v1.RolloutService/GetInfo", "unary"),
    ("/rewardmesh.v1.RolloutService/TransferWeights", "unary"),
    ("/rewardmesh.v1.RolloutService/UpdateWeights", "stream_unary"),
]


@FUZZ
@given(method=st.sampled_from(METHODS), garbage=st.lists(st.binary(max_size=200), min_size=1, max_size=3))
def test_garbage_bytes_on_every_method_get_a_status_and_the_servers_keep_serving(
    live: LiveServers, reward_stub: reward_pb2_grpc.RewardServiceStub, method: tuple[str, str], garbage: list[bytes]
) -> None:
    name, kind = method
    server = live.reward if "RewardService" in name else live.rollout
    assert server is not None
    with grpc.insecure_channel(server.address) as channel:
        try:
            if kind == "unary":
                channel.unary_unary(name, None, None)(garbage[0], timeout=30)
            elif kind == "unary_stream":
                list(channel.unary_stream(name, None, None)(garbage[0], timeout=30))
            elif kind == "stream_unary":
                channel.stream_unary(name, None, None)(iter(garbage), timeout=30)
            else:
                list(channel.stream_stream(name, None, None)(iter(garbage), timeout=30))
        except grpc.RpcError as err:
            # Bytes that do not parse: INVALID_ARGUMENT "request: not a valid protobuf message"; bytes that do
            # parse are a (mostly empty) message, refused like any other.
            check_rpc_error(err)
    still_serving(reward_stub)


def test_servers_survive_the_fuzzing_with_bounded_memory(
    live: LiveServers, reward_stub: reward_pb2_grpc.RewardServiceStub
) -> None:
    """Runs after the fuzz tests in this module: both servers answer, nothing is left in flight, RSS is sane."""
    still_serving(reward_stub)
    assert live.reward is not None and live.rollout is not None
    assert live.reward.servicer.in_flight == 0
    assert rss_mb() < 3000  # the whole test process, servers and tiny models included
