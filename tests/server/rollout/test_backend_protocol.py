"""The backend protocol: what every engine must implement, and the weight capabilities' defaults that the rollout
server's weight receiver relies on instead of asking each engine what it has."""

from __future__ import annotations

import pytest
import torch

from rewardmesh.common.planes.dist import dist_available
from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.server.rollout.backends.base import Backend, GenerationOutput, GenerationRequest
from rewardmesh.server.rollout.backends.hf import HFBackend
from rewardmesh.server.rollout.weight_receiver import WeightReceiver
from rewardmesh.v1 import rollout_pb2
from tests.support.scripted_backend import ScriptedBackend


def test_an_engine_without_a_required_method_cannot_be_built() -> None:
    class NoGenerate(Backend):
        name = "partial"

        async def start(self) -> None:
            return None

        def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
            return {}

        async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
            return None

        @property
        def running(self) -> int:
            return 0

        async def close(self) -> None:
            return None

    with pytest.raises(TypeError, match="generate"):
        NoGenerate()  # type: ignore[abstract]

    class Complete(NoGenerate):
        async def generate(self, request: GenerationRequest) -> GenerationOutput:
            return GenerationOutput([], "stop")

    assert Complete().running == 0


async def test_the_defaults_copy_every_update_in_and_offer_no_engine_plane() -> None:
    backend = ScriptedBackend(None, lambda text, turn: ("", 0.0))
    assert backend.device is None and backend.cuda_device_uuid == "" and backend.unusable is None
    assert not backend.loads_cuda_ipc
    new = torch.ones(2, 2)
    assert not backend.adoptable({"w": new})
    assert await backend.adopt_weights({"w": new}, 3) is False  # copied in through update_weights
    assert backend.policy_version == 3 and torch.equal(backend.weights["w"], new)
    with pytest.raises(NotImplementedError, match="scripted"):
        await backend.update_weights_ipc([], rollout_pb2.CudaIpcSource(), 4)
    backend.check_engine_args()  # nothing to check: no error


async def test_the_receiver_offers_the_planes_each_engine_supports(tiny_models: TinyModelPaths) -> None:
    """An engine with no weights in this process is offered no dist plane; the hf backend, whose weights are on
    a device here, is (where torch.distributed is available). Neither takes CUDA IPC without a GPU."""
    scripted = WeightReceiver(ScriptedBackend(None, lambda text, turn: ("", 0.0))).transports()
    assert rollout_pb2.WEIGHT_TRANSPORT_DIST not in scripted and rollout_pb2.WEIGHT_TRANSPORT_GRPC in scripted
    hf = HFBackend(str(tiny_models.policy), device="cpu")
    offered = WeightReceiver(hf).transports()
    assert (rollout_pb2.WEIGHT_TRANSPORT_DIST in offered) == dist_available()
    assert rollout_pb2.WEIGHT_TRANSPORT_CUDA_IPC not in offered and hf.cuda_device_uuid == ""
    await hf.close()
