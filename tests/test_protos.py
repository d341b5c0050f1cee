"""The committed stubs must be exactly what `make protos` generates from the committed .proto files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
V1 = ROOT / "protos" / "rewardmesh" / "v1"


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    src = tmp_path / "protos" / "rewardmesh" / "v1"
    src.mkdir(parents=True)
    for proto in V1.glob("*.proto"):
        shutil.copy(proto, src / proto.name)
    plugin = Path(sys.executable).parent / "protoc-gen-mypy_grpc"
    protos = sorted(str(p.relative_to(tmp_path)) for p in src.glob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", "--python_out=protos", "--pyi_out=protos",
         "--grpc_python_out=protos", f"--plugin=protoc-gen-mypy_grpc={plugin}", "--mypy_grpc_out=protos", *protos],
        cwd=tmp_path, check=True, capture_output=True,
    )  # fmt: skip
    generated = sorted(p.name for p in src.iterdir() if p.suffix in (".py", ".pyi"))
    committed = sorted(
        p.name for p in V1.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_grpc.py", "_grpc.pyi"))
    )
    assert generated == committed
    stale = [name for name in generated if (src / name).read_bytes() != (V1 / name).read_bytes()]
    assert not stale, f"stubs are stale, run `make protos`: {stale}"


def test_contract_names_other_tools_rely_on() -> None:
    from rewardmesh.v1 import common_pb2, reward_pb2, rollout_pb2

    sample = common_pb2.Sample.DESCRIPTOR.fields_by_name
    for name in ["sample_id", "group_id", "prompt_ids", "response_ids", "prompt_text", "response_text",
                 "data_source", "ground_truth", "extra_info", "policy_version", "response_mask", "timing"]:  # fmt: skip
        assert name in sample, name
    prompt_ids_type = sample["prompt_ids"].message_type
    assert prompt_ids_type is not None and prompt_ids_type.full_name == "rewardmesh.v1.Tensor"
    result = reward_pb2.RewardResult.DESCRIPTOR.fields_by_name
    for name in ["sample_id", "score", "extras", "timing", "batch_size", "error"]:
        assert name in result, name
    assert set(common_pb2.Status.DESCRIPTOR.fields_by_name) == {"code", "message"}
    assert {"sample", "reward"} <= set(reward_pb2.ScoreRequest.DESCRIPTOR.fields_by_name)
    assert {"ScoreBatchRequest", "ListRewardsRequest"} <= set(reward_pb2.DESCRIPTOR.message_types_by_name)
    rollout = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].methods_by_name
    assert set(rollout) == {"Generate", "UpdateWeights", "GetInfo", "TransferWeights", "KeepTraces"}
    # Every enum starts with an _UNSPECIFIED zero value (buf's rule).
    for module in (common_pb2, reward_pb2, rollout_pb2):
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            assert enum.values_by_number[0].name.endswith("_UNSPECIFIED"), enum.name
