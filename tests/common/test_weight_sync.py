"""Weight updates over every data plane (grpc, dist with gloo, shm) between a real trainer client and real rollout
servers on 127.0.0.1 running the tiny policy: applied everywhere, validated before anything is applied, failures
leave the old weights serving and name the server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager, nullcontext
from pathlib import Path
from typing import Any
from unittest.mock import patch

import grpc
import pytest
import torch
from grpc import aio
from transformers import AutoModelForCausalLM

from rewardmesh.client import weight_sync
from rewardmesh.client.trainer import PromptSpec, Sampling, TrainerClient
from rewardmesh.client.weight_sync import WeightSyncError
from rewardmesh.common.planes import dist, grpc_chunks
from rewardmesh.common.planes.grpc_chunks import WeightAssembler, iter_update_requests
from rewardmesh.common.planes.layout import LAYOUT_VERSION, layout
from rewardmesh.common.planes.manifest import WeightsError, check_manifest, manifest
from rewardmesh.common.tensors import ids_tensor
from rewardmesh.demo.server_process import ServerProcess
from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.server.rollout.backends.hf import HFBackend
from rewardmesh.v1 import common_pb2, rollout_pb2
from tests.support.paths import REPO
from tests.support.servers import rollout_server, rollout_stub
from tests.support.waiting import eventually

TRANSPORTS = ["grpc", "dist", "shm"]


def policy_state(tiny_models: TinyModelPaths) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(tiny_models.policy, local_files_only=True)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """New bf16 weights; tied tensors (the tiny policy ties lm_head to the embeddings) stay tied."""
    gen = torch.Generator().manual_seed(seed)
    out = {k: (v.float() + torch.randn(v.shape, generator=gen)).to(torch.bfloat16) for k, v in state.items()}
    if "lm_head.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def weights_of(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """New weights in the model's dtype (fp32 here), so that a dist update is adopted."""
    return {k: v.float() for k, v in perturbed(base, seed).items()}


@asynccontextmanager
async def servers(tiny_models: TinyModelPaths, count: int) -> AsyncIterator[list[Any]]:
    async with AsyncExitStack() as stack:
        out = []
        for _ in range(count):
            backend = HFBackend(str(tiny_models.policy), num_threads=1, batch_wait_ms=1)
            out.append(await stack.enter_async_context(rollout_server(backend)))
        yield out


def model_weights(server: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in server.backend._lm.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].to(torch.float32), b[k].to(torch.float32)) for k in b)


async def generated_version(address: str) -> int:
    async with rollout_stub(address) as stub:
        req = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=ids_tensor([1, 2, 3]))], n=1,
                                          sampling=rollout_pb2.SamplingParams(max_tokens=2))  # fmt: skip
        (r,) = [x async for x in stub.Generate(req)]
        return int(r.sample.policy_version)


# --------------------------------------------------------------------------------------------- pure parts


def test_layout_packs_in_order_aligned_and_bounded() -> None:
    buckets = layout([10, 100, 30, 500, 1], bucket_bytes=256)
    assert [(b.members, b.offsets) for b in buckets] == [((0, 1, 2), (0, 64, 192)), ((4,), (0,)), ((3,), (0,))]
    assert buckets[0].nbytes == 222 and buckets[2].nbytes == 500  # a tensor above the bucket size goes alone


def test_layout_packs_small_tensors_together_wherever_they_lie() -> None:
    """The small norms lying between a model's large matrices share one bucket (one collective call, not one
    each); the large ones go alone, as they lie."""
    mb = 1 << 20
    buckets = layout([2 * mb, 10, 3 * mb, 20, 4 * mb, 30], bucket_bytes=256 << 20)
    assert [b.members for b in buckets] == [(1, 3, 5), (0,), (2,), (4,)]
    assert buckets[0].offsets == (0, 64, 128) and buckets[0].nbytes == 158
    assert [b.nbytes for b in buckets[1:]] == [2 * mb, 3 * mb, 4 * mb]


def test_hand_encoded_chunks_parse_as_update_requests() -> None:
    state = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)}
    msgs = [rollout_pb2.UpdateWeightsRequest.FromString(b) for b in iter_update_requests(state, 9, chunk_bytes=8)]
    assert [m.policy_version for m in msgs] == [9] + [0] * (len(msgs) - 1)
    asm = WeightAssembler({"a": ((2, 3), torch.float32), "b": ((5,), torch.float32)})
    for m in msgs:
        asm.add(m.chunk)
    out = asm.finish()
    assert torch.equal(out["a"], state["a"]) and torch.equal(out["b"], state["b"]) and out["b"].dtype == torch.bfloat16


def test_update_requests_are_parsed_without_copying_chunks_and_read_as_protobuf_does() -> None:
    """The server's UpdateWeights deserializer reads what protobuf reads, from our hand encoding and protobuf's own
    (negative offset, unpacked shape, unknown fields: left to protobuf; garbage: protobuf's error)."""
    from google.protobuf.message import DecodeError

    from rewardmesh.common.planes.grpc_chunks import ChunkView, parse_update_request

    def fields(v: Any) -> tuple[Any, ...]:
        c = v.chunk
        return (c.name, c.dtype, list(c.shape), c.offset, bytes(c.data), v.policy_version, list(v.manifest))

    state = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)}
    listing = manifest(state)
    odd = rollout_pb2.TensorChunk(name="é", dtype=common_pb2.DTYPE_FLOAT16, shape=[3, 0, 7], offset=-5, data=b"xyz")
    proto = rollout_pb2.UpdateWeightsRequest(chunk=odd, policy_version=-3, manifest=listing)
    raws = [*iter_update_requests(state, 9, chunk_bytes=8), proto.SerializeToString(), b""]
    unpacked = b"\x0a\x06\x18\x02\x18\x03\x2a\x00"  # shape as two unpacked varints, empty data
    for raw in [*raws, unpacked]:
        view = parse_update_request(raw)
        assert isinstance(view.chunk, ChunkView) and isinstance(view.chunk.data, memoryview)  # the fast path
        assert fields(view) == fields(rollout_pb2.UpdateWeightsRequest.FromString(raw))
    unknown = raws[0] + b"\x38\x01"  # field 7 (varint): not ours to judge, protobuf keeps it as unknown
    assert fields(parse_update_request(unknown)) == fields(rollout_pb2.UpdateWeightsRequest.FromString(unknown))
    with pytest.raises(DecodeError):
        parse_update_request(b"\x0a\xff")


def test_manifest_checks_name_shape_dtype_and_total() -> None:
    specs = {"w": ((2, 2), torch.float32)}
    good = manifest({"w": torch.zeros(2, 2, dtype=torch.bfloat16)})
    assert check_manifest(good, specs, 8)[0].nbytes == 8
    for state, text in [
        ({"x": torch.zeros(2, 2)}, "unknown tensor 'x'"),
        ({"w": torch.zeros(2, 3)}, r"tensor 'w': shape \(2, 3\)"),
    ]:
        with pytest.raises(WeightsError, match=text):
            check_manifest(manifest(state), specs)
    bad_dtype = [rollout_pb2.WeightSpec(name="w", dtype=common_pb2.DTYPE_INT32, shape=[2, 2])]
    with pytest.raises(WeightsError, match="tensor 'w': dtype INT32"):
        check_manifest(bad_dtype, specs)
    with pytest.raises(WeightsError, match="total_bytes: 9"):
        check_manifest(good, specs, 9)


_CHURN = """
import resource, sys
from rewardmesh.common.allocator import keep_freed_memory
if sys.argv[1] == "keep" and not keep_freed_memory():
    sys.exit(3)
def churn():  # a few 4 MiB messages in flight, then all freed (one grpc update's pattern)
    held = [b"x" * (4 << 20) for _ in range(8)]
    del held
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_freed_message_buffers_are_recycled_not_faulted_in_again() -> None:
    """glibc by default hands large freed buffers back to the kernel, so every message of the next update faults
    its pages in again; after keep_freed_memory (fresh processes: malloc's state is per process) it reuses them."""
    import subprocess

    if not hasattr(__import__("ctypes").CDLL(None), "mallopt"):
        pytest.skip("not glibc")
    root = REPO
    faults = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", _CHURN, mode], cwd=root, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        faults[mode] = int(out.stdout)
    assert faults["default"] > 20_000  # 10 x 32 MiB: the pattern does fault without it (the test can fail)
    assert faults["keep"] < faults["default"] / 20


async def test_a_grpc_update_recycles_message_buffers_on_both_sides(
    tiny_models: TinyModelPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rewardmesh.server.rollout import weight_receiver

    calls: list[str] = []

    def counted(side: str) -> Callable[[], bool]:
        def keep() -> bool:
            calls.append(side)
            return True

        return keep

    for side, module in (("trainer", weight_sync), ("server", weight_receiver)):
        monkeypatch.setattr(module, "keep_freed_memory", counted(side))
    async with servers(tiny_models, 1) as ros, TrainerClient([ros[0].address]) as client:
        await client.update_weights(perturbed(policy_state(tiny_models), 1), transport="shm")
        assert calls == []  # only grpc churns through message buffers
        await client.update_weights(perturbed(policy_state(tiny_models), 2), transport="grpc")
        assert sorted(calls) == ["server", "trainer"]


# ---------------------------------------------------------------------------------- every transport, for real


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_update_reaches_every_server_and_later_samples_carry_it(
    tiny_models: TinyModelPaths, transport: str
) -> None:
    base = policy_state(tiny_models)
    new = perturbed(base, 1)
    async with servers(tiny_models, 2) as ros, TrainerClient([r.address for r in ros]) as client:
        client.weight_sync.bucket_bytes = 64 << 10  # several buckets even for the tiny model
        assert await client.update_weights(new, transport=transport) == 1
        assert client.last_weight_sync is not None and client.last_weight_sync.transport == transport
        for r in ros:
            assert same(model_weights(r), new) and r.backend.policy_version == 1
            assert await generated_version(r.address) == 1
        newer = perturbed(base, 2)
        assert await client.update_weights(newer, transport=transport) == 2  # dist: the kept group is reused
        assert all(same(model_weights(r), newer) for r in ros)
        assert [i.policy_version for i in await client.info()] == [2, 2]


async def test_auto_picks_shm_on_one_host_and_info_says_what_is_offered(tiny_models: TinyModelPaths) -> None:
    async with servers(tiny_models, 1) as ros, TrainerClient([ros[0].address]) as client:
        (info,) = await client.info()
        assert list(info.weight_transports)[-1] == rollout_pb2.WEIGHT_TRANSPORT_GRPC
        assert rollout_pb2.WEIGHT_TRANSPORT_DIST in info.weight_transports and info.host_id
        await client.update_weights(perturbed(policy_state(tiny_models), 3))
        assert client.last_weight_sync is not None and client.last_weight_sync.transport == "shm"
        client.weight_sync.host_id = "elsewhere"  # as a trainer on another host sees it
        await client.update_weights(perturbed(policy_state(tiny_models), 4))
        assert client.last_weight_sync.transport == "dist"
        older = rollout_pb2.GetInfoResponse()
        older.CopyFrom(info)
        older.dist_layout = 0  # a server of an older release unpacks dist buckets another way: never sent dist bytes
        assert client.weight_sync.choose([older], torch.device("cpu")) == "grpc"


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "bad, text",
    [
        (lambda s: {**s, "model.no_such.weight": torch.zeros(3)}, "unknown tensor 'model.no_such.weight'"),
        (lambda s: {**s, "model.norm.weight": torch.zeros(65)}, "tensor 'model.norm.weight': shape"),
        (lambda s: {**s, "model.norm.weight": torch.zeros(128, dtype=torch.float64)}, "'model.norm.weight': dtype"),
    ],
)
async def test_bad_tensors_are_refused_by_name_and_nothing_is_applied(
    tiny_models: TinyModelPaths, transport: str, bad: Callable[[dict[str, torch.Tensor]], Any], text: str
) -> None:
    base = policy_state(tiny_models)
    async with servers(tiny_models, 2) as ros, TrainerClient([r.address for r in ros]) as client:
        await client.update_weights(perturbed(base, 5), transport=transport)
        before = [model_weights(r) for r in ros]
        with pytest.raises((WeightSyncError, WeightsError)) as info:
            await client.update_weights(bad(perturbed(base, 6)), transport=transport)
        assert text in str(info.value)
        if isinstance(info.value, WeightSyncError):  # refused by the servers: each one is named
            assert set(info.value.failed) == {r.address for r in ros}
            assert all("INVALID_ARGUMENT" in why for why in info.value.failed.values())
        for r, old in zip(ros, before, strict=True):
            assert r.backend.policy_version == 1 and same(model_weights(r), old)
        await client.update_weights(perturbed(base, 7), transport=transport)  # and the next good one works
        assert [r.backend.policy_version for r in ros] == [2, 2]


async def test_transfer_requests_are_checked_before_anything_is_received(tiny_models: TinyModelPaths) -> None:
    state = policy_state(tiny_models)
    async with servers(tiny_models, 1) as (ro,), rollout_stub(ro.address) as stub:
        good = manifest(state)
        total = sum(t.numel() * t.element_size() for t in state.values())
        cases = [
            (rollout_pb2.TransferWeightsRequest(tensors=good, total_bytes=total + 1, shm={"path": "/dev/shm/x"}),
             "total_bytes"),
            (rollout_pb2.TransferWeightsRequest(tensors=good, total_bytes=total), "source: set dist, shm or cuda_ipc"),
            (rollout_pb2.TransferWeightsRequest(tensors=good, shm={"path": "/etc/passwd", "offsets": [0] * len(good)}),
             "shm.path"),
            (rollout_pb2.TransferWeightsRequest(tensors=good, dist={"host": "127.0.0.1", "port": 1, "rank": 0,
                                                                    "world_size": 2, "backend": "gloo",
                                                                    "layout": LAYOUT_VERSION}),
             "dist.rank"),
            (rollout_pb2.TransferWeightsRequest(tensors=good, dist={"host": "127.0.0.1", "port": 1, "rank": 1,
                                                                    "world_size": 2, "backend": "gloo"}),
             "dist.layout: 0 is not this server's bucket layout"),  # a trainer of an older release
            (rollout_pb2.TransferWeightsRequest(tensors=good, dist={"host": "127.0.0.1", "port": 1, "rank": 1,
                                                                    "world_size": 3, "backend": "gloo", "chain": True,
                                                                    "layout": LAYOUT_VERSION, "bucket_bytes": 1 << 20,
                                                                    "share_from_prev": True}),
             "dist.share_from_prev"),  # rank 1's sender is the trainer, which has no file
            (rollout_pb2.TransferWeightsRequest(tensors=good, dist={"host": "127.0.0.1", "port": 1, "rank": 2,
                                                                    "world_size": 3, "backend": "gloo", "chain": True,
                                                                    "layout": LAYOUT_VERSION, "bucket_bytes": 1 << 20,
                                                                    "share_with_next": True}),
             "dist.share_with_next"),
        ]  # fmt: skip
        for request, text in cases:
            with pytest.raises(aio.AioRpcError) as info:
                await stub.TransferWeights(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in (info.value.details() or "")
        assert ro.backend.policy_version == 0


async def test_shm_file_too_short_is_refused(tiny_models: TinyModelPaths, tmp_path: Path) -> None:
    state = policy_state(tiny_models)
    short = Path("/dev/shm") / f"rewardmesh-weights-test-{id(tmp_path)}"
    short.write_bytes(b"\0" * 100)
    try:
        async with servers(tiny_models, 1) as (ro,), rollout_stub(ro.address) as stub:
            (bucket,) = layout([t.numel() * t.element_size() for t in state.values()], 1 << 62)
            shm = rollout_pb2.ShmSource(path=str(short), offsets=bucket.offsets)
            request = rollout_pb2.TransferWeightsRequest(tensors=manifest(state), shm=shm)
            with pytest.raises(aio.AioRpcError) as info:
                await stub.TransferWeights(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "has 100 bytes" in str(
                info.value.details()
            )
            assert ro.backend.policy_version == 0
    finally:
        short.unlink()


async def test_grpc_stream_broken_midway_applies_nothing(tiny_models: TinyModelPaths) -> None:
    state = perturbed(policy_state(tiny_models), 8)
    async with servers(tiny_models, 1) as (ro,), rollout_stub(ro.address) as stub:
        before = model_weights(ro)
        msgs = [rollout_pb2.UpdateWeightsRequest.FromString(b) for b in iter_update_requests(state, 5, 1 << 10)]

        async def half() -> AsyncIterator[rollout_pb2.UpdateWeightsRequest]:
            for m in msgs[: len(msgs) // 2]:
                yield m

        with pytest.raises(aio.AioRpcError) as info:
            await stub.UpdateWeights(half())  # the stream ends early: bytes are missing
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in str(info.value.details())
        assert ro.backend.policy_version == 0 and same(model_weights(ro), before)


async def test_fanout_keeps_a_fast_reader_within_its_window_of_the_slowest() -> None:
    """The trainer holds a bounded number of messages, not everything a lagging server has not read yet; a
    reader that leaves no longer holds the others back; a failing source fails every reader."""
    from rewardmesh.common.planes.grpc_chunks import Fanout

    made: list[int] = []

    def source(n: int) -> Iterator[bytes]:
        for i in range(n):
            made.append(i)
            yield bytes([i])

    fan = Fanout(source(40), ["fast", "slow"], window=3)
    slow_read: list[int] = []
    lead: list[int] = []

    async def read(name: str, pause: float, leave_after: int | None = None) -> list[int]:
        got = []
        async for m in fan.messages(name):
            got.append(m[0])
            if name == "slow":
                slow_read.append(m[0])
                if leave_after is not None and len(got) == leave_after:
                    fan.leave(name)
                    return got
            else:
                lead.append(len(made) - len(slow_read))
            await asyncio.sleep(pause)
        return got

    fast, slow = await asyncio.wait_for(asyncio.gather(read("fast", 0), read("slow", 0.002, leave_after=10)), 10)
    assert fast == list(range(40)) and slow == list(range(10))
    assert max(lead[:8]) <= 3 + 2  # while the slow one reads: its queue (3) plus the message in each hand

    def broken() -> Iterator[bytes]:
        yield b"a"
        raise ValueError("tensor 'w' could not be read")

    fan = Fanout(broken(), ["x", "y"], window=1)

    async def all_of(name: str) -> list[bytes]:
        return [m async for m in fan.messages(name)]

    results = await asyncio.wait_for(asyncio.gather(all_of("x"), all_of("y"), return_exceptions=True), 5)
    assert all(isinstance(r, ValueError) and "'w'" in str(r) for r in results)


async def test_a_server_killed_mid_grpc_update_fails_only_itself_and_the_other_applies_it(
    tiny_models: TinyModelPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpc to two servers, one SIGKILLed after a few messages: the call names it, the other server (no longer
    held back by the dead one's window) applies the whole update."""
    victim = victim_process(tiny_models, tmp_path)
    base = policy_state(tiny_models)
    real = grpc_chunks.iter_update_requests

    def kill_after_three(*args: Any, **kw: Any) -> Iterator[bytes]:
        for i, message in enumerate(real(*args, **kw)):
            if i == 3:
                victim.kill()
            yield message

    try:
        await asyncio.to_thread(victim.start)
        await victim.wait_serving()
        async with servers(tiny_models, 1) as (survivor,):
            async with TrainerClient([victim.address, survivor.address]) as client:
                client.weight_sync.timeout_s = 10.0
                monkeypatch.setattr(grpc_chunks, "iter_update_requests", kill_after_three)
                with pytest.raises(WeightSyncError) as info:
                    await asyncio.wait_for(
                        client.update_weights(perturbed(base, 12), transport="grpc", chunk_bytes=4 << 10), 60
                    )
                assert set(info.value.failed) == {victim.address}
            assert survivor.backend.policy_version == 1 and same(model_weights(survivor), perturbed(base, 12))
    finally:
        victim.stop(timeout_s=10)


# ------------------------------------------------------------------------- a server dies in the middle


def victim_process(tiny_models: TinyModelPaths, tmp_path: Path) -> ServerProcess:
    """An hf rollout server in a process of its own, so that it can really die mid-transfer."""
    argv = [sys.executable, "-m", "rewardmesh.server.cli", "serve", "rollout", "--host", "127.0.0.1", "--port", "0",
            "--model", str(tiny_models.policy), "--backend", "hf", "--device", "cpu"]  # fmt: skip
    return ServerProcess("victim", argv, tmp_path)


async def test_a_server_killed_mid_broadcast_fails_the_call_cleanly_and_the_other_keeps_old_weights(
    tiny_models: TinyModelPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = victim_process(tiny_models, tmp_path)
    base = policy_state(tiny_models)
    real_send = dist.send_buckets

    def send_then_kill(group: Any, tensors: Any, buckets: Any, timeout_s: float, **kw: Any) -> int:
        real_send(group, tensors, buckets[:1], timeout_s, **kw)  # the first bucket reaches both
        victim.kill()
        return real_send(group, tensors, buckets[1:], timeout_s, **kw)

    try:
        await asyncio.to_thread(victim.start)
        await victim.wait_serving()
        async with servers(tiny_models, 1) as (survivor,):
            async with TrainerClient([victim.address, survivor.address]) as client:
                client.weight_sync.bucket_bytes = 32 << 10
                client.weight_sync.timeout_s = 3.0
                await client.update_weights(perturbed(base, 9), transport="dist")
                old = model_weights(survivor)
                monkeypatch.setattr(dist, "send_buckets", send_then_kill)
                with pytest.raises(WeightSyncError) as info:
                    await asyncio.wait_for(client.update_weights(perturbed(base, 10), transport="dist"), 60)
                assert victim.address in info.value.failed and victim.address in str(info.value)
                monkeypatch.setattr(dist, "send_buckets", real_send)
            # The survivor either finished (the broadcast reached it whole) or kept the old weights: never a mix.
            if survivor.backend.policy_version == 1:
                assert same(model_weights(survivor), old) and await generated_version(survivor.address) == 1
            else:
                assert same(model_weights(survivor), perturbed(base, 10))
            async with TrainerClient([survivor.address]) as client:  # a new group without the dead server
                client.policy_version = 2
                client.weight_sync.timeout_s = 10.0
                assert await client.update_weights(perturbed(base, 11), transport="dist") == 3
                assert await generated_version(survivor.address) == 3
    finally:
        victim.stop(timeout_s=10)


async def test_the_last_server_of_the_chain_killed_mid_transfer_leaves_the_first_with_the_new_weights(
    tiny_models: TinyModelPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the gloo chain (trainer -> survivor -> victim) the survivor's own bytes are whole when the server after
    it dies: it applies the update; the call fails naming the victim only."""
    victim = victim_process(tiny_models, tmp_path)
    base = policy_state(tiny_models)
    real_send = dist.send_buckets

    def send_then_kill(group: Any, tensors: Any, buckets: Any, timeout_s: float, **kw: Any) -> int:
        assert kw.get("chain")
        victim.kill()
        victim.proc.wait()  # type: ignore[union-attr]
        return real_send(group, tensors, buckets, timeout_s, **kw)

    try:
        await asyncio.to_thread(victim.start)
        await victim.wait_serving()
        async with servers(tiny_models, 1) as (survivor,):
            async with TrainerClient([survivor.address, victim.address]) as client:
                client.weight_sync.bucket_bytes = 32 << 10
                client.weight_sync.timeout_s = 3.0
                await client.update_weights(perturbed(base, 9), transport="dist")
                monkeypatch.setattr(dist, "send_buckets", send_then_kill)
                with pytest.raises(WeightSyncError) as info:
                    await asyncio.wait_for(client.update_weights(perturbed(base, 10), transport="dist"), 60)
                assert list(info.value.failed) == [victim.address], info.value.failed
            assert survivor.backend.policy_version == 2
            assert same(model_weights(survivor), perturbed(base, 10))
    finally:
        victim.stop(timeout_s=10)


# ------------------------------------------------------------------ servers that restart or join mid-run


async def test_restarted_and_added_servers_get_current_weights_and_no_stale_sample_reaches_a_batch(
    tiny_models: TinyModelPaths,
) -> None:
    """Two servers; after step 2 one is restarted on its address (base weights, version 0), after step 4 a third
    joins behind the dns name, after the last update a fourth. Every batch keeps within the staleness bound, and
    every server gets the current weights."""
    from rewardmesh.server.rollout.server import RolloutServer
    from rewardmesh.server.serving import ServerOptions

    base = policy_state(tiny_models)
    bound = 1
    steps, batches = 7, []
    async with AsyncExitStack() as stack:

        async def start(port: int = 0) -> Any:
            backend = HFBackend(str(tiny_models.policy), num_threads=1, batch_wait_ms=1)
            server = RolloutServer(backend, None, ServerOptions(host="127.0.0.1", port=port, grace_s=1))
            await server.start()
            stack.push_async_callback(server.stop, 0.1)
            return server

        a, b = await start(), await start()
        pods = [a.address, b.address]
        client = TrainerClient("dns:///rollout.test:1", resolve=lambda specs: list(pods), resolve_interval_s=0.05,
                               retry_backoff_s=0.05, sampling=Sampling(max_tokens=4))  # fmt: skip
        await stack.enter_async_context(client)
        prompts = [[PromptSpec(token_ids=[5, 6, 7 + i]) for i in range(4)] for _ in range(steps)]
        step = 0
        async for batch in client.batches(prompts, n=2, off_policy_steps=bound):
            step += 1
            batches.append((client.policy_version, [s.policy_version for s in batch.samples]))
            await client.update_weights(perturbed(base, 100 + step))
            if step == 2:  # restart b on its own address: it comes back with the base weights
                port = int(b.address.rsplit(":", 1)[1])
                await b.stop(0.1)
                b = await start(port)
            if step == 4:  # a third pod appears behind the name
                c = await start()
                pods.append(c.address)
        final = client.policy_version
        # b and c caught up either way (an update that found them reachable, or the join hook first: which one
        # depends on timing). A fourth pod that appears after the last update can only get the weights from the
        # join hook.
        d = await start()
        pods.append(d.address)
        # A server that was down at the last update rejoins on the next pick (its backoff over, the join hook
        # brings it up to date): drive picks until all caught up, or give up after a generous deadline.
        await eventually(
            lambda: (
                min(b.backend.policy_version, c.backend.policy_version) >= final - 1
                and d.backend.policy_version >= final
                and client.join_updates >= 1  # d's join is over once its hook counted it, after d applied it
            ),
            "every server caught up",
            30,
            poke=client.pool.pick,
            every_s=0.05,
        )
        versions = {r.address: r.backend.policy_version for r in (a, b, c, d)}
    assert step == steps
    for at, sample_versions in batches:
        assert min(sample_versions) >= at - bound, (at, sample_versions)  # never beyond the bound
    assert b.backend.policy_version >= final - 1 and c.backend.policy_version >= final - 1, versions
    assert d.backend.policy_version == final and client.join_updates >= 1, versions


async def test_a_server_still_booting_is_left_out_of_an_update_and_joins_with_the_current_weights(
    tiny_models: TinyModelPaths,
) -> None:
    """A restarted pod answers on its port before its model has loaded, and would refuse weights then: GetInfo
    says UNAVAILABLE while it boots, so an update goes to the others, and the join hook brings the booted one to
    the current version before it gets work (found by the chaos test: the update used to fail on it)."""
    from rewardmesh.server.rollout.server import RolloutServer
    from rewardmesh.server.serving import ServerOptions

    gate = asyncio.Event()

    class GatedBoot(HFBackend):  # the real backend; its boot waits for the test
        async def start(self) -> None:
            await gate.wait()
            await super().start()

    base = policy_state(tiny_models)
    async with AsyncExitStack() as stack:
        (a,) = await stack.enter_async_context(servers(tiny_models, 1))
        slow = RolloutServer(GatedBoot(str(tiny_models.policy), num_threads=1, batch_wait_ms=1), None,
                             ServerOptions(host="127.0.0.1", port=0, grace_s=1))  # fmt: skip
        await slow.start(wait_ready=False)
        stack.push_async_callback(slow.stop, 0.1)
        client = TrainerClient([a.address, slow.address], retry_backoff_s=0.05)
        await stack.enter_async_context(client)
        state = perturbed(base, 40)
        assert await client.update_weights(state) == 1  # not a WeightSyncError naming the booting server
        assert a.backend.policy_version == 1 and slow.backend.policy_version == 0
        gate.set()
        await slow.ready()
        # Its backoff over, a pick starts its join; the join is over when its hook has counted the update (the
        # server applies the version before the hook's push returns).
        await eventually(lambda: client.join_updates >= 1, "the late server joined", 30, poke=client.pool.pick)
        assert slow.backend.policy_version == 1 and same(model_weights(slow), state)
        assert client.join_updates == 1


async def test_update_waits_for_a_server_to_come_back_when_none_answers_and_fails_after_timeout(
    tiny_models: TinyModelPaths,
) -> None:
    """Every server down at once (here: the only one, restarting): update_weights asks again as the backoff ends
    and sends to the server once it is back; with nobody back within timeout_s it fails naming the server."""
    from rewardmesh.server.rollout.server import RolloutServer
    from rewardmesh.server.serving import ServerOptions

    base = policy_state(tiny_models)
    async with AsyncExitStack() as stack:

        async def start(port: int = 0) -> Any:
            backend = HFBackend(str(tiny_models.policy), num_threads=1, batch_wait_ms=1)
            server = RolloutServer(backend, None, ServerOptions(host="127.0.0.1", port=port, grace_s=1))
            await server.start()
            stack.push_async_callback(server.stop, 0.1)
            return server

        a = await start()
        port = int(a.address.rsplit(":", 1)[1])
        client = TrainerClient(a.address, retry_backoff_s=0.05)
        await stack.enter_async_context(client)
        await client.update_weights(perturbed(base, 1))
        await a.stop(0.1)
        update = asyncio.ensure_future(client.update_weights(perturbed(base, 2)))
        (member,) = client.pool.members
        await eventually(lambda: member.down or update.done(), "the server found unreachable", 30)
        assert member.down and not update.done()  # found unreachable, and waiting instead of failing
        b = await start(port)
        assert await asyncio.wait_for(update, 60) == 2
        assert b.backend.policy_version == 2
        await b.stop(0.1)
        client.weight_sync.timeout_s = 0.3
        with pytest.raises(WeightSyncError, match="no rollout server was reachable") as caught:
            await asyncio.wait_for(client.update_weights(perturbed(base, 3)), 60)
        assert list(caught.value.failed) == [a.address]


# ------------------------------------------------------------- O(1) swap, joiners and in-place training, shm


def _inside(t: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    ptr = t.data_ptr()
    return any(b.data_ptr() <= ptr < b.data_ptr() + b.numel() for b in buffers)


async def test_dist_swaps_storage_instead_of_copying_and_reuses_the_buffers_the_model_left(
    tiny_models: TinyModelPaths,
) -> None:
    """Whole dist updates are adopted (the parameters live in the received buckets), the buckets the model held
    before receive the next update, and every update still lands whole; a partial update is copied in."""
    base = policy_state(tiny_models)
    async with servers(tiny_models, 1) as (ro,), TrainerClient([ro.address]) as client:
        client.weight_sync.bucket_bytes = 64 << 10
        receiver = ro.servicer.weights
        held: list[set[int]] = []
        for step in range(1, 5):
            new = weights_of(base, 20 + step)  # the model's dtype (fp32 on CPU)
            assert await client.update_weights(new, transport="dist") == step
            assert same(model_weights(ro), new) and await generated_version(ro.address) == step
            assert receiver._held is not None
            buffers = receiver._held
            params = dict(ro.backend._lm.named_parameters())
            assert all(_inside(p, buffers) for p in params.values())  # adopted: no copy into the model
            held.append({b.data_ptr() for b in buffers})
        assert held[2] == held[0] and held[3] == held[1] and held[0] != held[1]  # two sets take turns
        assert receiver._spare is not None and {b.data_ptr() for b in receiver._spare} == held[2]
        # Partial (one tensor over grpc): copied into the parameter where it lies now, the rest unchanged.
        name = "model.norm.weight"
        part = {name: torch.full_like(base[name], 0.5)}
        assert await client.update_weights(part, transport="grpc") == 5
        now = model_weights(ro)
        assert torch.equal(now[name], part[name]) and _inside(ro.backend._lm.get_parameter(name), receiver._held)
        assert same({k: v for k, v in now.items() if k != name}, {k: v for k, v in new.items() if k != name})
        # Whole grpc updates are adopted too, and the tensors the model left receive the one after next.
        grpc_held = []
        for step in range(6, 9):
            new = weights_of(base, 20 + step)
            assert await client.update_weights(new, transport="grpc") == step
            assert same(model_weights(ro), new) and await generated_version(ro.address) == step
            params = dict(ro.backend._lm.named_parameters())
            assert receiver._held is not None and all(_inside(p, receiver._held) for p in params.values())
            grpc_held.append({b.data_ptr() for b in receiver._held})
        assert grpc_held[2] == grpc_held[0] != grpc_held[1]


async def test_buffers_the_model_left_are_reused_whichever_plane_filled_them(tiny_models: TinyModelPaths) -> None:
    """dist, grpc, grpc, dist: each update lands in the buffers the model left two updates before, though the
    other data plane filled them (every tensor here is a bucket of its own: a bucket and that tensor over grpc
    are the same size), so switching planes allocates nothing new."""
    base = policy_state(tiny_models)
    async with servers(tiny_models, 1) as (ro,), TrainerClient([ro.address]) as client:
        client.weight_sync.bucket_bytes = 1  # every tensor alone
        receiver = ro.servicer.weights
        where = []
        for step, transport in enumerate(["dist", "grpc", "grpc", "dist", "grpc"], start=1):
            new = weights_of(base, 40 + step)
            assert await client.update_weights(new, transport=transport) == step
            assert same(model_weights(ro), new) and await generated_version(ro.address) == step
            assert receiver._held is not None
            assert all(_inside(p, receiver._held) for p in ro.backend._lm.parameters())  # adopted
            where.append({b.data_ptr() for b in receiver._held})
        assert where[2] == where[0] and where[3] == where[1] and where[4] == where[2]
        assert not where[0] & where[1]


async def test_a_joiner_never_gets_weights_changed_in_place_under_an_old_version(tiny_models: TinyModelPaths) -> None:
    """The trainer keeps a reference to the last state it sent; once training changes it in place, a server
    that joins is refused those tensors (and waits for the next update); an unchanged state is sent."""
    base = policy_state(tiny_models)
    async with AsyncExitStack() as stack:
        a, b, c = [await stack.enter_async_context(servers(tiny_models, 1)) for _ in range(3)]
        pods = [a[0].address]
        client = TrainerClient("dns:///rollout.test:1", resolve=lambda specs: list(pods), resolve_interval_s=0.05,
                               retry_backoff_s=0.05)  # fmt: skip
        await stack.enter_async_context(client)
        state = perturbed(base, 30)
        assert await client.update_weights(state) == 1
        with torch.no_grad():
            state["model.norm.weight"].add_(1.0)  # an optimizer step, in place

        async def member(address: str) -> Any:
            pods.append(address)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                await client.pool.refresh_now()
                found = [m for m in client.pool.members if m.address == address]
                if found:
                    return found[0]
                await asyncio.sleep(0.05)
            raise AssertionError(f"{address} never joined the pool")

        mb = await member(b[0].address)
        with pytest.raises(RuntimeError, match="changed in place"):
            await client._bring_up_to_date(mb)
        assert b[0].backend.policy_version == 0 and client.join_updates == 0
        newer = perturbed(base, 31)
        assert await client.update_weights(newer) == 2  # b is a member: it gets this one
        assert b[0].backend.policy_version == 2 and same(model_weights(b[0]), newer)
        mc = await member(c[0].address)
        await client._bring_up_to_date(mc)  # unchanged since sent: the joiner gets it (here or from the pool)
        assert c[0].backend.policy_version == 2 and same(model_weights(c[0]), newer) and client.join_updates == 1


@contextmanager
def process_making(make: str) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A process that makes a weights file under /dev/shm (`make` binds it to `f`) and sleeps until killed."""
    from rewardmesh.common.planes.shm import SHM_DIR

    imports = "from rewardmesh.common.planes.dist import SharedWeights\n"
    imports += "from rewardmesh.common.planes.shm import ShmWriter"
    code = f"import time, torch\n{imports}\n{make}\n"
    code += "print(f.path, flush=True); time.sleep(120)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        path = Path(proc.stdout.readline().strip())
        assert path.parent == SHM_DIR
        yield proc, path
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def test_shm_files_of_a_killed_trainer_are_removed_by_the_next_one() -> None:
    from rewardmesh.common.planes.shm import ShmWriter, sweep_stale_shm

    if not weight_sync.host_id():
        pytest.skip("no usable /dev/shm")
    with process_making("f = ShmWriter(); f.write([torch.ones(1000)], [0], 4000)") as (proc, path):
        assert path.exists()
        mine = ShmWriter()  # sweeps: the live writer's file stays
        mine.write([torch.zeros(10)], [0], 40)
        assert path.exists() and mine.path.exists()
        proc.kill()
        proc.wait(timeout=30)
        assert path.exists()  # killed: nothing removed it
        assert path in sweep_stale_shm() and not path.exists()
        assert mine.path.exists()  # a live writer's file (this process holds its lock) is never swept
        mine.close()
        assert not mine.path.exists()


def test_the_shm_file_stays_mapped_between_updates_and_a_new_size_gets_a_new_file() -> None:
    """The second write of the same layout lands in pages already mapped (a new mapping per update faulted every
    page in again); what a server maps is the latest write; another size goes to a fresh file."""
    import resource

    from rewardmesh.common.planes.manifest import Entry
    from rewardmesh.common.planes.shm import ShmWriter, map_shm

    if not weight_sync.host_id():
        pytest.skip("no usable /dev/shm")
    n = 32 << 20
    writer = ShmWriter()
    try:
        writer.write([torch.full((n,), 1, dtype=torch.uint8)], [0], n)
        first, twos = writer.path, torch.full((n,), 2, dtype=torch.uint8)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        writer.write([twos], [0], n)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < (n >> 12) // 10, faults  # a fresh mapping: one fault per 4 KiB page written (8192)
        seen = map_shm(str(writer.path), [Entry("w", (n,), torch.uint8, n)], [0])["w"]
        assert writer.path == first and int(seen[0]) == 2 and int(seen[-1]) == 2
        writer.write([torch.full((10,), 3, dtype=torch.uint8)], [0], 10)
        assert writer.path != first and not first.exists()  # never truncated under a reader: a new file
        assert int(map_shm(str(writer.path), [Entry("w", (10,), torch.uint8, 10)], [0])["w"][9]) == 3
    finally:
        writer.close()


# ------------------------------------------------------------ dist servers on one host share one copy


async def _all_have(ros: list[Any], state: dict[str, torch.Tensor], version: int) -> bool:
    """Every server holds exactly `state` and labels what it generates with `version`."""
    return all([same(model_weights(r), state) and await generated_version(r.address) == version for r in ros])


def _served_from(server: Any) -> Path | None:
    held = server.servicer.weights._held_file
    if held is None:
        return None
    file = held[0]
    assert all(_inside(p, [file.data]) for p in server.backend._lm.parameters())  # no copy of its own
    return Path(file.path)


async def test_dist_servers_on_one_host_serve_one_copy_and_a_file_still_served_is_never_written(
    tiny_models: TinyModelPaths,
) -> None:
    """Three servers on this host: the first receives the bytes into a file, the others map it and serve from it.
    Two files take turns; a server left out of an update keeps serving its file, which is then never written
    again (a new file is made), and its weights stay exactly what it was sent."""
    if not weight_sync.host_id():
        pytest.skip("no usable /dev/shm")
    base = policy_state(tiny_models)
    weights = {step: weights_of(base, 60 + step) for step in range(1, 7)}
    async with servers(tiny_models, 3) as ros, TrainerClient([r.address for r in ros]) as client:
        client.weight_sync.bucket_bytes = 64 << 10
        files = []
        for step in (1, 2, 3):
            assert await client.update_weights(weights[step], transport="dist") == step
            where = {_served_from(r) for r in ros}
            assert len(where) == 1 and None not in where  # one copy on the host
            assert await _all_have(ros, weights[step], step)
            files.append(where.pop())
        assert files[2] == files[0] != files[1]  # two files take turns: nothing new is made or faulted in
        assert ros[0].servicer.weights._held_file[0].owner and not ros[1].servicer.weights._held_file[0].owner
        # Step 4 reaches the first two only: the third keeps serving step 3's file, which the first then holds
        # as its spare; step 5 must not be written into it.
        async with TrainerClient([r.address for r in ros[:2]]) as two:
            two.policy_version = 3
            two.weight_sync.bucket_bytes = 64 << 10
            assert await two.update_weights(weights[4], transport="dist") == 4
        assert _served_from(ros[2]) == files[2] and _served_from(ros[1]) == _served_from(ros[0]) == files[1]
        lagging = {n: p.detach() for n, p in ros[2].backend._lm.named_parameters()}  # views into step 3's file
        client.policy_version = 4
        assert await client.update_weights(weights[5], transport="dist") == 5
        now = {_served_from(r) for r in ros}
        assert len(now) == 1 and now.isdisjoint({files[0], files[1]})  # a new file: the old one was still served
        assert same(weights[3], lagging)  # never written under the server that served it
        assert await _all_have(ros, weights[5], 5)


async def test_copies_into_a_model_served_from_a_shared_file_go_to_private_memory(tiny_models: TinyModelPaths) -> None:
    """After a shared dist update, updates the model copies rather than adopts (shm; one tensor over grpc; another
    dtype over dist) land in buffers of the server's own: the file is never written (the second server maps it
    read-only, a write would crash it) and each server ends with exactly what it was sent."""
    if not weight_sync.host_id():
        pytest.skip("no usable /dev/shm")
    base = policy_state(tiny_models)
    async with servers(tiny_models, 2) as ros, TrainerClient([r.address for r in ros]) as client:
        client.weight_sync.bucket_bytes = 64 << 10
        client.weight_sync.delta = False  # whole updates only: each is shared
        shared = weights_of(base, 71)
        assert await client.update_weights(shared, transport="dist") == 1
        file = ros[0].servicer.weights._held_file[0]
        snapshot = file.data.clone()
        name = "model.norm.weight"
        part = {name: torch.full_like(shared[name], 0.25)}
        assert await client.update_weights(part, transport="grpc") == 2  # partial: the rest is kept
        expected = {**shared, **part}
        assert all(same(model_weights(r), expected) for r in ros)
        assert all(_served_from(r) is None for r in ros) and torch.equal(file.data, snapshot)
        assert await client.update_weights(shared, transport="dist") == 3
        assert {_served_from(r) for r in ros} != {None}
        for step, (transport, state) in enumerate([("shm", perturbed(base, 72)), ("dist", perturbed(base, 73))], 4):
            assert await client.update_weights(state, transport=transport) == step  # bf16 into an fp32 model: copied
            assert await _all_have(ros, state, step)
            assert all(_served_from(r) is None for r in ros)


class LiveFleet:
    """Five hf rollout servers on an event loop of their own in a thread, reused by every example of a property
    test (hypothesis' tests are synchronous)."""

    def __init__(self, tiny_models: TinyModelPaths, count: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="weight-fleet", daemon=True)
        self.thread.start()
        self._stack = AsyncExitStack()
        self.servers: list[Any] = self.run(self._start(tiny_models, count))
        self.version = 0

    async def _start(self, tiny_models: TinyModelPaths, count: int) -> list[Any]:
        return await self._stack.enter_async_context(servers(tiny_models, count))

    def run(self, coro: Any, timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self._stack.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture(scope="module")
def fleet(tiny_models: TinyModelPaths) -> Iterator[LiveFleet]:
    live = LiveFleet(tiny_models, 5)
    try:
        yield live
    finally:
        live.close()


def _no_room(size: int) -> Any:
    raise OSError(28, "No space left on device")


def sparse_step(state: dict[str, torch.Tensor], seed: int, fraction: float = 0.01) -> dict[str, torch.Tensor]:
    """A few elements of every tensor changed (what a small-learning-rate step does to bf16 weights)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        flat = t.clone().reshape(-1)
        picked = torch.rand(flat.numel(), generator=gen) < fraction
        flat[picked] = flat[picked] + 1
        out[name] = flat.reshape(t.shape)
    if "lm_head.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


async def _push(
    fleet: LiveFleet, members: list[Any], sync: weight_sync.WeightSync, state: dict[str, torch.Tensor]
) -> None:
    """One update to `members` in that order: each ends bitwise equal to `state`, or the call names it."""
    fleet.version += 1
    targets = []
    async with AsyncExitStack() as stack:
        for r in members:
            targets.append((r.address, await stack.enter_async_context(aio.insecure_channel(r.address))))
        try:
            await sync.push(targets, state, fleet.version, "dist")
            named: set[str] = set()
        except WeightSyncError as exc:
            named = set(exc.failed)
    for r in members:
        held = model_weights(r)
        exact = all(torch.equal(held[k].to(v.dtype).view(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
                    for k, v in state.items())  # fmt: skip
        assert exact or r.address in named, f"{r.address} serves weights that were not sent and was not named"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_dist_chain_ends_bitwise_equal_or_names_the_server(fleet: LiveFleet, tiny_models: TinyModelPaths) -> None:
    """Any number of servers (2-5) on 1-3 hosts in any order, host sharing on or off, room under /dev/shm or none,
    any bucket size, whole updates and deltas, digests on or off: every server ends bitwise equal to what was
    sent, or the call fails naming it. Hosts are labels the test gives the servers, in every order, never this
    machine's id."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from rewardmesh.common.planes.dist import SharedWeights

    base = policy_state(tiny_models)
    labels = ["0-host", "m-host", "z-host"]

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(
        order=st.permutations(range(5)),
        count=st.integers(2, 5),
        hosts=st.lists(st.integers(0, 2), min_size=5, max_size=5),
        names=st.permutations(labels),
        share=st.booleans(),
        room=st.booleans(),
        bucket=st.sampled_from([1 << 10, 64 << 10, 256 << 20]),
        whole_dtype=st.booleans(),
        verify=st.booleans(),
        seed=st.integers(0, 1000),
    )
    def check(order: list[int], count: int, hosts: list[int], names: list[str], share: bool, room: bool,
              bucket: int, whole_dtype: bool, verify: bool, seed: int) -> None:  # fmt: skip
        members = [fleet.servers[i] for i in order[:count]]
        for r, h in zip(members, hosts, strict=False):
            r.servicer.weights.host_id = names[h]
        sync = weight_sync.WeightSync(bucket_bytes=bucket, share_host=share, verify=verify, timeout_s=60, delta=True)
        state = weights_of(base, seed) if whole_dtype else perturbed(base, seed)
        try:
            with patch.object(SharedWeights, "create", staticmethod(_no_room)) if not room else nullcontext():
                fleet.run(_push(fleet, members, sync, state))
                fleet.run(_push(fleet, members, sync, sparse_step(state, seed)))  # a delta, over the same chain
        finally:
            sync.close()

    check()


def test_a_shared_file_is_reused_only_when_nobody_serves_from_it_and_outlives_a_killed_maker() -> None:
    from rewardmesh.common.errors import InvalidInput
    from rewardmesh.common.planes.dist import SharedWeights
    from rewardmesh.common.planes.shm import sweep_stale_shm

    if not weight_sync.host_id():
        pytest.skip("no usable /dev/shm")
    mine = SharedWeights.create(4096)
    try:
        reader = SharedWeights.open(str(mine.path), 4096)
        assert not mine.reusable()  # someone serves from it
        reader.close()
        mine2 = SharedWeights.create(4096)
        try:
            assert mine2.reusable() and mine2.reusable()  # nobody else: again and again
        finally:
            mine2.close()
        with pytest.raises(InvalidInput, match="not a rewardmesh weights file"):
            SharedWeights.open("/etc/passwd", 1)
        with pytest.raises(InvalidInput, match="has 4096 bytes"):
            SharedWeights.open(str(mine.path), 8192)
    finally:
        mine.close()
    assert not mine.path.exists()
    # A maker killed while another server serves from its file: the file stays until that server lets go.
    with process_making("f = SharedWeights.create(4096); f.data.fill_(7)") as (proc, path):
        served = SharedWeights.open(str(path), 4096)
        proc.kill()
        proc.wait(timeout=30)
        assert path not in sweep_stale_shm() and path.exists() and int(served.data[4095]) == 7
        served.close()
        assert path not in sweep_stale_shm()  # a tensor still maps it: still served
        del served  # the last view of it
        assert path in sweep_stale_shm() and not path.exists()
