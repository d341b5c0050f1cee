"""One dtype/device resolver: the policy backend and the reward model agree on every input."""

from __future__ import annotations

import pytest
import torch

from rewardmesh.reward_engine import devices
from rewardmesh.reward_engine.sources import reward_model
from rewardmesh.server.rollout.backends import hf


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_dtype_is_the_same_for_policy_and_reward_model(monkeypatch: pytest.MonkeyPatch, bf16: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    want = torch.bfloat16 if bf16 else torch.float16  # a GPU without bf16 computes in fp16, not fp32
    assert hf.resolve_dtype("auto", cuda) == reward_model._pick_dtype("auto", cuda, "rm") == want
    assert hf.resolve_dtype("auto", cpu) == reward_model._pick_dtype("auto", cpu, "rm") == torch.float32
    for name, dtype in devices.DTYPES.items():
        assert hf.resolve_dtype(name.upper(), cpu) == reward_model._pick_dtype(name, cpu, "rm") == dtype


def test_bad_inputs_name_the_value_and_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"unknown dtype 'int8'"):
        hf.resolve_dtype("int8", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"reward model 'rm': unknown dtype 'int8'"):
        reward_model._pick_dtype("int8", torch.device("cpu"), "rm")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"reward model 'rm': device 'cuda:1' requested but CUDA is not available"):
        reward_model._pick_device("cuda:1", "rm")
    with pytest.raises(ValueError, match="bad device 'gpu'"):
        hf.resolve_device("gpu")
