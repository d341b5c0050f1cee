"""What a rollout server applies is what the trainer sent: digests checked on every data plane, deltas applied
only to the version they were made against, versions and values validated, and an update applied only once it
is complete, whatever its client does afterwards (real servers, in-process and in processes of their own)."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
import torch
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rewardmesh.client import weight_sync
from rewardmesh.client.trainer import TrainerClient
from rewardmesh.client.weight_sync import WeightSyncError
from rewardmesh.common.planes import delta as weight_delta
from rewardmesh.common.planes import dist, grpc_chunks
from rewardmesh.common.planes.digests import check_received, digest, finite, scan
from rewardmesh.common.planes.grpc_chunks import iter_update_requests
from rewardmesh.common.planes.manifest import Entry, WeightsError, check_manifest, manifest
from rewardmesh.common.planes.shm import ShmWriter
from rewardmesh.common.tensors import ids_tensor
from rewardmesh.demo.server_process import ServerProcess
from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from tests.support.waiting import eventually

from .test_weight_sync import (
    generated_version,
    model_weights,
    policy_state,
    same,
    servers,
    sparse_step,
    weights_of,
)

NAME = "model.layers.0.mlp.up_proj.weight"  # the tensor corrupted in flight
_UPDATE = "/rewardmesh.v1.RolloutService/UpdateWeights"


def flipped(t: torch.Tensor) -> torch.Tensor:
    """A copy with its last byte's bits inverted."""
    out = t.detach().clone().contiguous()
    raw = out.reshape(-1).view(torch.uint8)
    raw[-1] ^= 0xFF
    return out


# ------------------------------------------------------------------------------------------- pure parts


def test_digest_and_finiteness_checks_name_the_tensor() -> None:
    t = torch.randn(1000, dtype=torch.float32).to(torch.bfloat16)
    entry = Entry("w", (1000,), torch.bfloat16, 2000, digest(t))
    check_received({"w": t}, [entry])
    with pytest.raises(WeightsError, match="'w': digest mismatch"):
        check_received({"w": flipped(t)}, [entry])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(70_000).to(dtype)
        assert finite(x) and finite(x.reshape(70, 1000))
        for bad in (float("nan"), float("inf"), -float("inf")):
            y = x.clone()
            y[69_999] = bad
            assert not finite(y)
            assert scan(y) == (digest(y), False)
        assert scan(x) == (digest(x), True)
    big = torch.full((10,), 65504.0, dtype=torch.float16)  # the largest finite fp16 value is finite
    assert finite(big)
    with pytest.raises(WeightsError, match="'w': holds NaN"):
        check_received({"w": torch.tensor([1.0, float("nan")])}, [Entry("w", (2,), torch.float32, 8)])


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.02, 0.2, 1.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_delta_rebuilds_the_new_tensor_bitwise_and_picks_the_smallest_encoding(
    fraction: float, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(100_003, generator=gen).to(dtype)
    new = old.clone()
    picked = torch.rand(old.numel(), generator=gen) < fraction
    new[picked] = torch.randn(int(picked.sum()), generator=gen).to(dtype)
    a, b = weight_delta.bits(old), weight_delta.bits(new)
    change = weight_delta.diff(a, b)
    assert change.positions.size == int((a != b).sum())
    encoded = weight_delta.encode(a, change)
    n, size, k = a.size, a.itemsize, change.positions.size
    if min(k * (4 + size), (n + 7) // 8 + k * size) >= n * size:
        assert encoded is None  # dense: the whole tensor goes
        return
    assert encoded is not None
    encoding, payload = encoded
    assert payload.size == min(k * (4 + size), (n + 7) // 8 + k * size)
    entry = Entry("w", (n,), dtype, n * size, None, encoding, payload.size)
    back = a.copy()
    weight_delta.apply(back, weight_delta.decode(entry, torch.from_numpy(payload), a))
    assert (back == b).all()


def test_a_delta_that_does_not_fit_its_tensor_is_refused_naming_it() -> None:
    base = weight_delta.bits(torch.zeros(16, dtype=torch.bfloat16))
    positions = torch.tensor([3, 2], dtype=torch.int32).view(torch.uint8)
    values = torch.ones(2, dtype=torch.bfloat16).view(torch.uint8)
    entry = Entry("w", (16,), torch.bfloat16, 32, None, weight_delta.SPARSE, 12)
    with pytest.raises(WeightsError, match="'w': delta positions"):
        weight_delta.decode(entry, torch.cat([positions, values]), base)
    bitmap = torch.tensor([0, 0x80], dtype=torch.uint8)  # element 15 changed, and no value follows
    with pytest.raises(WeightsError, match="'w': delta bitmap marks 1 elements, 0 follow"):
        weight_delta.decode(Entry("w", (16,), torch.bfloat16, 32, None, weight_delta.XOR, 2), bitmap, base)
    odd = weight_delta.bits(torch.zeros(13, dtype=torch.bfloat16))
    with pytest.raises(WeightsError, match="'w': delta bitmap marks elements past"):
        weight_delta.decode(Entry("w", (13,), torch.bfloat16, 26, None, weight_delta.XOR, 2), bitmap, odd)
    spec = rollout_pb2.WeightSpec(name="w", dtype=common_pb2.DTYPE_BFLOAT16, shape=[16],
                                  encoding=weight_delta.SPARSE, encoded_bytes=7)  # fmt: skip
    with pytest.raises(WeightsError, match="'w': encoded_bytes 7"):
        check_manifest([spec], {"w": ((16,), torch.bfloat16)})


# ------------------------------------------------------------------------ a byte corrupted in flight


def _corrupt(monkeypatch: pytest.MonkeyPatch, plane: str, state: dict[str, torch.Tensor]) -> None:
    """Flip a byte of NAME's bytes after the trainer computed its digest, on the way to the servers."""
    index = list(state).index(NAME)
    if plane == "grpc":
        real = grpc_chunks.iter_update_requests

        def corrupted(wire: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Iterator[bytes]:
            return real({**wire, NAME: flipped(wire[NAME])}, *args, **kwargs)

        monkeypatch.setattr(grpc_chunks, "iter_update_requests", corrupted)
    elif plane == "shm":
        real_write = ShmWriter.write

        def write(self: ShmWriter, tensors: list[torch.Tensor], offsets: list[int], size: int) -> None:
            real_write(self, [flipped(t) if i == index else t for i, t in enumerate(tensors)], offsets, size)

        monkeypatch.setattr(ShmWriter, "write", write)
    else:
        real_send = dist.send_buckets

        def send(group: Any, tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> int:
            return real_send(group, [flipped(t) if i == index else t for i, t in enumerate(tensors)], *args, **kwargs)

        monkeypatch.setattr(dist, "send_buckets", send)


@pytest.mark.parametrize("plane", ["grpc", "shm", "dist", "dist-shared", "grpc-delta", "shm-delta", "dist-delta"])
async def test_a_byte_corrupted_in_flight_is_refused_and_the_old_weights_keep_serving(
    tiny_models: TinyModelPaths, plane: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each server recomputes every tensor's digest over what it is about to serve (a delta's result included):
    one flipped byte fails the call naming every server and the tensor; the version and weights stay."""
    transport, _, kind = plane.partition("-")
    if transport == "shm" or kind == "shared":
        if not weight_sync.host_id():
            pytest.skip("no usable /dev/shm")
    base = policy_state(tiny_models)
    async with servers(tiny_models, 2) as ros, TrainerClient([r.address for r in ros]) as client:
        client.weight_sync.bucket_bytes = 64 << 10
        client.weight_sync.share_host = kind == "shared"
        client.weight_sync.delta = kind == "delta"
        good = weights_of(base, 91)
        assert await client.update_weights(good, transport=transport) == 1
        bad = sparse_step(good, 92) if kind == "delta" else weights_of(base, 92)
        _corrupt(monkeypatch, transport, bad)
        with pytest.raises(WeightSyncError) as info:
            await client.update_weights(bad, transport=transport)
        if kind == "delta":
            assert client.last_weight_sync is not None
        assert set(info.value.failed) == {r.address for r in ros}
        assert all(NAME in why and "digest mismatch" in why for why in info.value.failed.values()), info.value
        for r in ros:
            assert r.backend.policy_version == 1 and same(model_weights(r), good)
            assert await generated_version(r.address) == 1
        monkeypatch.undo()
        client.policy_version = 1
        assert await client.update_weights(bad, transport=transport) == 2  # the same update, uncorrupted
        assert all(same(model_weights(r), bad) for r in ros)


# ----------------------------------------------------------------------------------------------- deltas


@pytest.mark.parametrize("transport", ["grpc", "shm", "dist"])
async def test_deltas_carry_only_the_changed_elements_and_end_bitwise_equal(
    tiny_models: TinyModelPaths, transport: str
) -> None:
    """Three small steps: each update after the first sends a small fraction of the bytes, and every server ends
    bitwise equal to the trainer's bf16 weights (copied into an fp32 model or adopted by a bf16 one alike)."""
    if transport == "shm" and not weight_sync.host_id():
        pytest.skip("no usable /dev/shm")
    state = weights_of(policy_state(tiny_models), 101)
    async with servers(tiny_models, 2) as ros, TrainerClient([r.address for r in ros]) as client:
        client.weight_sync.bucket_bytes = 64 << 10
        client.weight_sync.delta = True
        assert await client.update_weights(state, transport=transport) == 1
        whole = client.last_weight_sync
        assert whole is not None and whole.sent_bytes == whole.num_bytes
        for step in range(2, 5):
            state = sparse_step(state, step, fraction=0.005)
            assert await client.update_weights(state, transport=transport) == step
            sync = client.last_weight_sync
            assert sync is not None and 0 < sync.changed < 0.02 and sync.sent_bytes < whole.num_bytes / 5
            for r in ros:
                assert same(model_weights(r), state) and await generated_version(r.address) == step


async def test_a_server_that_missed_a_version_gets_the_whole_weights_and_a_stale_delta_is_refused(
    tiny_models: TinyModelPaths,
) -> None:
    base = policy_state(tiny_models)
    async with servers(tiny_models, 2) as ros:
        async with TrainerClient([r.address for r in ros]) as client:
            client.weight_sync.delta = True
            one = weights_of(base, 111)
            assert await client.update_weights(one, transport="dist") == 1
            async with TrainerClient([ros[0].address]) as other:  # another trainer moves the first server on
                other.policy_version = 1
                assert await other.update_weights(weights_of(base, 112), transport="grpc") == 2
            client.policy_version = 2
            three = sparse_step(one, 113)
            assert await client.update_weights(three, transport="dist") == 3  # the first: whole; the second: delta
            assert all(same(model_weights(r), three) for r in ros)
        # A delta made against a version the server does not serve: FAILED_PRECONDITION naming the field.
        specs = manifest(three)
        for s in specs:
            s.encoding, s.encoded_bytes = weight_delta.SPARSE, 0  # (an empty delta: nothing changed)
        async with aio.insecure_channel(ros[1].address) as channel:
            call = channel.stream_unary(_UPDATE, request_serializer=None, response_deserializer=None)
            messages = iter_update_requests({n: torch.empty(0, dtype=torch.uint8) for n in three}, 4, specs=specs,
                                            delta_base=2)  # fmt: skip
            with pytest.raises(aio.AioRpcError) as err:
                await call(_aiter(list(messages)), timeout=30)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "delta_base_version: 2" in (err.value.details() or "")
        assert ros[1].backend.policy_version == 3


async def _aiter(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


# ----------------------------------------------------------------------------- versions and values


async def test_versions_only_go_up_within_int64_and_nan_weights_are_refused(tiny_models: TinyModelPaths) -> None:
    base = policy_state(tiny_models)
    async with servers(tiny_models, 1) as (ro,), aio.insecure_channel(ro.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)

        async def send(state: dict[str, torch.Tensor], version: int) -> Any:
            call = channel.stream_unary(_UPDATE, request_serializer=None,
                                        response_deserializer=rollout_pb2.UpdateWeightsResponse.FromString)  # fmt: skip
            return await call(_aiter(list(iter_update_requests(state, version))), timeout=30)

        good = weights_of(base, 121)
        assert (await send(good, 5)).policy_version == 5
        for version, why in [(-3, "policy_version: -3 is negative"), (4, "policy_version: 4 is not above"),
                             (5, "policy_version: 5 is not above")]:  # fmt: skip
            with pytest.raises(aio.AioRpcError) as err:
                await send(good, version)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in (err.value.details() or "")
        nan = {**good, NAME: good[NAME].clone()}
        nan[NAME][0] = float("nan")
        for poison in (float("nan"), float("inf")):
            nan[NAME][0] = poison
            with pytest.raises(aio.AioRpcError) as err:
                await send(nan, 6)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"{NAME!r}: holds NaN or infinity" in (err.value.details() or "")
        no_manifest = rollout_pb2.UpdateWeightsRequest(
            chunk=rollout_pb2.TensorChunk(name=NAME, dtype=common_pb2.DTYPE_FLOAT32, shape=[8])
        )
        with pytest.raises(aio.AioRpcError) as err:
            await stub.UpdateWeights(_aiter([no_manifest]), timeout=30)
        assert "manifest: required" in (err.value.details() or "")
        top = (1 << 63) - 1
        assert (await send(good, top)).policy_version == top
        with pytest.raises(aio.AioRpcError) as err:
            await send(good, 0)  # "the next version" has none
        assert "past int64" in (err.value.details() or "")
        info = await stub.GetInfo(rollout_pb2.GetInfoRequest())
        assert info.policy_version == top and same(model_weights(ro), good)
        assert await generated_version(ro.address) == top


async def test_a_dead_decode_loop_turns_health_to_not_serving(tiny_models: TinyModelPaths) -> None:
    async with servers(tiny_models, 1) as (ro,), aio.insecure_channel(ro.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING

        def broken(*, block: bool) -> bool:
            raise RuntimeError("a bug in the decode loop")

        ro.backend._drain_inbox = broken
        await generate_once(ro.address, expect_ok=False)

        async def not_serving() -> bool:
            reply = await health.Check(health_pb2.HealthCheckRequest(service="rewardmesh.v1.RolloutService"))
            return reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

        await eventually(not_serving, "health NOT_SERVING once the decode loop died", timeout_s=30)


async def generate_once(address: str, *, expect_ok: bool = True) -> bool:
    async with aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        req = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=ids_tensor([1, 2, 3]))], n=1,
                                          sampling=rollout_pb2.SamplingParams(max_tokens=2))  # fmt: skip
        try:
            replies = [r async for r in stub.Generate(req, timeout=30)]
        except aio.AioRpcError:
            assert not expect_ok
            return False
        items = [i for r in replies for i in (r.items or [r])]
        ok = bool(items) and all(not i.result.HasField("error") or i.result.error.code == 0 for i in items)
        assert ok or not expect_ok
        return ok


# ------------------------------------------------------------------- interrupted updates, real processes


@pytest.fixture(scope="module")
def server_process(tiny_models: TinyModelPaths, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    argv = [sys.executable, "-m", "rewardmesh.server.cli", "serve", "rollout", "--host", "127.0.0.1", "--port", "0",
            "--model", str(tiny_models.policy), "--backend", "hf", "--device", "cpu"]  # fmt: skip
    proc = ServerProcess("rollout", argv, tmp_path_factory.mktemp("rollout"))
    proc.start()
    try:
        yield proc
    finally:
        proc.stop(timeout_s=10)


async def _version(address: str) -> int:
    async with aio.insecure_channel(address) as channel:
        info = await rollout_pb2_grpc.RolloutServiceStub(channel).GetInfo(rollout_pb2.GetInfoRequest(), timeout=10)
        return int(info.policy_version)


async def _serving(address: str) -> bool:
    async with aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.slow
async def test_an_update_cancelled_at_every_point_of_its_stream_never_breaks_the_server(
    server_process: ServerProcess, tiny_models: TinyModelPaths
) -> None:
    """Cut after each message (and right after the last one): the version moves only for a whole stream, the
    server keeps generating (another client's samples are answered all along) and stays SERVING."""
    await server_process.wait_serving()
    address = server_process.address
    state = weights_of(policy_state(tiny_models), 131)
    stop = asyncio.Event()
    answered: list[bool] = []

    async def bystander() -> None:
        while not stop.is_set():
            answered.append(await generate_once(address))

    others = asyncio.create_task(bystander())
    try:
        version = await _version(address)
        messages = list(iter_update_requests(state, version + 1, chunk_bytes=64 << 10))
        async with aio.insecure_channel(address) as channel:
            for cut in [*range(len(messages) + 1), *[len(messages)] * 10]:  # the last point, where races lie, often
                target = (await _version(address)) + 1
                messages = list(iter_update_requests(state, target, chunk_bytes=64 << 10))
                sent = asyncio.Event()

                async def stream(cut: int = cut, messages: list[bytes] = messages, sent: asyncio.Event = sent) -> Any:
                    for m in messages[:cut]:
                        yield m
                    sent.set()
                    if cut < len(messages):
                        await asyncio.Event().wait()  # a client that stops sending mid-stream

                call = channel.stream_unary(_UPDATE, request_serializer=None, response_deserializer=None)(stream())
                await sent.wait()
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                now = await _version(address)
                assert now == target - 1 or (cut == len(messages) and now == target), (cut, now, target)
                assert await generate_once(address) and await _serving(address)
    finally:
        stop.set()
        await others
    assert answered and all(answered)


@pytest.mark.slow
async def test_a_client_killed_mid_update_changes_nothing(server_process: ServerProcess) -> None:
    """A trainer process killed mid-stream, with and without a manifest on its first message: the server keeps its
    version and generating."""
    await server_process.wait_serving()
    address = server_process.address
    before = await _version(address)
    for with_manifest in (False, True):
        script = textwrap.dedent(f"""
            import sys, time, grpc, torch
            from rewardmesh.common.planes.grpc_chunks import iter_update_requests
            from rewardmesh.v1 import rollout_pb2
            state = {{"model.norm.weight": torch.ones(64) * 3, "lm_head.weight": torch.ones(1000, 64)}}
            msgs = list(iter_update_requests(state, 999, chunk_bytes=4096))
            if not {with_manifest}:
                msgs = [rollout_pb2.UpdateWeightsRequest(chunk=rollout_pb2.UpdateWeightsRequest.FromString(m).chunk)
                        .SerializeToString() for m in msgs]
            def gen():
                yield from msgs[:3]
                print("sent", flush=True)
                time.sleep(600)
            ch = grpc.insecure_channel("{address}")
            ch.stream_unary("{_UPDATE}", request_serializer=None, response_deserializer=None)(gen())
        """)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE)
        try:
            assert proc.stdout is not None and await asyncio.wait_for(proc.stdout.readline(), 60) == b"sent\n"
        finally:
            proc.kill()
            await asyncio.wait_for(proc.wait(), 30)
        assert await _version(address) == before
        assert await generate_once(address) and await _serving(address)


def test_cuda_ipc_updates_are_checked_before_an_engine_loads_them() -> None:
    """The vLLM engine reads CUDA IPC tensors itself: the server checks digests over the tensors the handles open
    first (`check_ipc`). Needs a CUDA GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from rewardmesh.common.planes.cuda_ipc import check_ipc, handles

    t = torch.randn(256, device="cuda").to(torch.bfloat16)
    source = handles([t])
    source.device_uuid = ""
    entry = Entry("w", (256,), torch.bfloat16, 512, digest(t))
    check_ipc(source, [entry], t.device)
    with pytest.raises(WeightsError, match="digest mismatch"):
        check_ipc(source, [Entry("w", (256,), torch.bfloat16, 512, digest(t) ^ 1)], t.device)
