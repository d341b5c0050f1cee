"""The planes' server sides: one receiver per case of TransferWeightsRequest.source, kept by that case."""

from __future__ import annotations

import pytest

from rewardmesh.common.planes.base import SOURCES, Receiver, by_source
from rewardmesh.common.planes.cuda_ipc import IpcReceiver
from rewardmesh.common.planes.dist import DistReceiver
from rewardmesh.common.planes.shm import ShmReceiver
from rewardmesh.v1 import rollout_pb2


def test_every_source_in_the_contract_has_one_receiver_with_its_own_transport() -> None:
    receivers: list[Receiver] = [IpcReceiver(), ShmReceiver(), DistReceiver()]
    planes = by_source(receivers)
    assert sorted(planes) == sorted(SOURCES) and list(planes) == ["cuda_ipc", "shm", "dist"]  # the order given
    transports = [r.transport for r in receivers]
    assert len(set(transports)) == 3 and rollout_pb2.WEIGHT_TRANSPORT_GRPC not in transports


def test_a_receiver_for_no_source_or_a_taken_one_is_refused() -> None:
    class Stray(ShmReceiver):
        source = "nfs"

    with pytest.raises(ValueError, match=r"source 'nfs' is not a free case of TransferWeightsRequest\.source"):
        by_source([Stray()])
    with pytest.raises(ValueError, match="source 'shm' is not a free case"):
        by_source([ShmReceiver(), ShmReceiver()])
