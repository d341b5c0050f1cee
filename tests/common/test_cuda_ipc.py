"""The CUDA IPC data plane: what the server checks before it opens a handle (everywhere), a real server without a
GPU refusing it by name, the trainer refusing CPU tensors; the end-to-end transfer needs a CUDA GPU."""

from __future__ import annotations

import asyncio
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from grpc import aio

from rewardmesh.client.trainer import TrainerClient
from rewardmesh.common.errors import InvalidInput
from rewardmesh.common.planes import cuda_ipc
from rewardmesh.common.planes.manifest import Entry, manifest
from rewardmesh.demo.server_process import ServerProcess
from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.server.rollout.backends.hf import HFBackend
from rewardmesh.v1 import rollout_pb2
from tests.support.servers import rollout_server, rollout_stub

from .test_weight_sync import perturbed, policy_state  # beside it wherever the two sit

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA GPU")


def source_for(entries: list[Entry], uuid: str = "GPU-1") -> rollout_pb2.CudaIpcSource:
    """Well-formed handles for contiguous tensors of these shapes (storage exactly their size)."""
    source = rollout_pb2.CudaIpcSource(device_uuid=uuid)
    for e in entries:
        stride = [int(s) for s in torch.empty(e.shape).stride()]
        source.handles.add(storage_handle=b"h", storage_size_bytes=e.nbytes, stride=stride, ref_counter_handle=b"r")
    return source


ENTRIES = [Entry("w", (4, 8), torch.bfloat16, 64), Entry("b", (8,), torch.float32, 32)]


def test_the_server_checks_every_handle_against_the_manifest_before_opening_one() -> None:
    cuda_ipc.check_source(source_for(ENTRIES), ENTRIES, "GPU-1")  # well formed: passes

    Change = Callable[[rollout_pb2.CudaIpcSource], object]

    def first(**fields: object) -> Change:
        def change(s: rollout_pb2.CudaIpcSource) -> None:
            for k, v in fields.items():
                setattr(s.handles[0], k, v)

        return change

    def strides(s: rollout_pb2.CudaIpcSource) -> None:
        del s.handles[0].stride[1:]

    cases: list[tuple[str, str, Change]] = [
        ("", "not on a GPU", lambda s: None),
        ("GPU-1", "cuda_ipc.device_uuid: 'GPU-2' is not this server's", lambda s: setattr(s, "device_uuid", "GPU-2")),
        ("GPU-1", "cuda_ipc.handles: 1 handles for 2 tensors", lambda s: s.handles.pop()),
        ("GPU-1", "tensor 'w': empty storage", first(storage_handle=b"")),
        ("GPU-1", "tensor 'w': strides [8] and offset 0 do not fit shape (4, 8)", strides),
        ("GPU-1", "tensor 'w': its elements reach past the shared storage of 63 bytes", first(storage_size_bytes=63)),
        ("GPU-1", "tensor 'w': its elements reach past", first(offset=1)),
        ("GPU-1", "tensor 'w': strides", first(offset=-1)),
    ]  # fmt: skip
    for own, text, change in cases:
        source = source_for(ENTRIES)
        change(source)
        with pytest.raises(InvalidInput, match=re.escape(text)):
            cuda_ipc.check_source(source, ENTRIES, own)


def test_rebuild_arguments_follow_torchs_rebuild_function() -> None:
    """The server calls torch's own rebuild function with arguments it builds from fields: the order must be
    torch's (a torch release that changed it would fail here, on any machine, before a GPU ever sees it)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    h = source_for(ENTRIES).handles[0]
    h.storage_offset_bytes, h.ref_counter_offset, h.event_handle, h.event_sync_required = 128, 3, b"e", True
    args = dict(zip(params, cuda_ipc.rebuild_args(h, ENTRIES[0], 2), strict=True))
    assert args["tensor_size"] == torch.Size((4, 8)) and args["tensor_stride"] == (8, 1) and args["tensor_offset"] == 0
    assert args["dtype"] == torch.bfloat16 and args["storage_device"] == 2 and args["storage_handle"] == b"h"
    assert (args["storage_size_bytes"], args["storage_offset_bytes"]) == (64, 128)
    assert (args["ref_counter_handle"], args["ref_counter_offset"]) == (b"r", 3)
    assert (args["event_handle"], args["event_sync_required"], args["requires_grad"]) == (b"e", True, False)


async def test_a_server_without_a_gpu_refuses_cuda_ipc_by_name_and_the_trainer_refuses_cpu_tensors(
    tiny_models: TinyModelPaths,
) -> None:
    state = policy_state(tiny_models)
    backend = HFBackend(str(tiny_models.policy), num_threads=1, batch_wait_ms=1, device="cpu")  # a GPU may be here
    async with rollout_server(backend) as ro, rollout_stub(ro.address) as stub:
        info = await stub.GetInfo(rollout_pb2.GetInfoRequest())
        assert info.cuda_device_uuid == "" and rollout_pb2.WEIGHT_TRANSPORT_CUDA_IPC not in info.weight_transports
        entries = [Entry(n, tuple(t.shape), t.dtype, t.numel() * t.element_size()) for n, t in state.items()]
        request = rollout_pb2.TransferWeightsRequest(tensors=manifest(state), cuda_ipc=source_for(entries))
        with pytest.raises(aio.AioRpcError) as caught:
            await stub.TransferWeights(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cuda_ipc: this server's model is not on a GPU" in (caught.value.details() or "")
        async with TrainerClient([ro.address]) as client:
            with pytest.raises(ValueError, match="move the state dict to the servers' GPU"):
                await client.update_weights(perturbed(state, 1), transport="ipc")
            assert await client.update_weights(perturbed(state, 2)) == 1  # auto: not ipc for CPU tensors
            assert client.last_weight_sync is not None and client.last_weight_sync.transport != "ipc"
        assert backend.policy_version == 1


@needs_cuda
async def test_a_colocated_trainer_updates_a_gpu_server_over_cuda_ipc(
    tiny_models: TinyModelPaths, tmp_path: Path
) -> None:
    """The trainer's CUDA tensors, shared by handle, land in a rollout server of another process on the same GPU
    (CUDA opens no IPC handle in the process that made it): auto picks ipc, and the server's digest check of what
    the handles opened is what lets the update commit."""
    argv = [sys.executable, "-m", "rewardmesh.server.cli", "serve", "rollout", "--host", "127.0.0.1", "--port", "0",
            "--model", str(tiny_models.policy), "--backend", "hf", "--device", "cuda"]  # fmt: skip
    server = ServerProcess("rollout-cuda", argv, tmp_path)
    try:
        await asyncio.to_thread(server.start)
        await server.wait_serving()
        new = {k: v.to("cuda") for k, v in perturbed(policy_state(tiny_models), 3).items()}
        async with TrainerClient([server.address]) as client:
            assert await client.update_weights(new) == 1
            assert client.last_weight_sync is not None and client.last_weight_sync.transport == "ipc"
        async with rollout_stub(server.address) as stub:
            assert (await stub.GetInfo(rollout_pb2.GetInfoRequest())).policy_version == 1
    finally:
        server.stop(timeout_s=10)
