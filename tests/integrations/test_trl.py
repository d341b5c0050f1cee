"""TRL 1.16.0's own GRPOTrainer, two steps on the tiny policy on a CPU, rewarded by RewardMeshReward against a
real reward server: the scores it trains on, a failed sample stopping training (or masked when asked), a
server that is down and a wrong token stopping it at once."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from rewardmesh.client.integrations.scoring import RewardMeshError  # noqa: E402
from rewardmesh.client.integrations.trl import RewardMeshReward  # noqa: E402
from rewardmesh.demo.tiny_models import TinyModelPaths  # noqa: E402
from tests.integrations.support import server_thread  # noqa: E402
from tests.support.ports import refusing_port  # noqa: E402
from tests.support.servers import fn_pipeline  # noqa: E402


class Recorded(RewardMeshReward):
    """RewardMeshReward, keeping what TRL passed and what it got back."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[Any], list[Any], list[float | None]]] = []

    async def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **kw: Any
    ) -> list[float | None]:
        rewards = await super().__call__(prompts, completions, completion_ids, **kw)
        self.calls.append((completions, kw.get("extra_info") or [], rewards))
        return rewards


def train(policy: Path, out: Path, reward: Recorded, extra_info: list[str]) -> GRPOTrainer:
    data = Dataset.from_dict(
        {
            "prompt": ["What is 2 + 2?", "Compute 3 + 4.", "1+1=", "Add 5 and 2."],
            "ground_truth": ["4", "7", "2", "7"],
            "extra_info": extra_info,
        }
    )
    args = GRPOConfig(
        output_dir=str(out),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    trainer = GRPOTrainer(model=str(policy), reward_funcs=[reward], args=args, train_dataset=data)
    trainer.train()
    return trainer


def test_grpo_trainer_trains_two_steps_masking_a_failed_sample_when_asked(
    tiny_models: TinyModelPaths, tmp_path: Path
) -> None:
    ok, bad = json.dumps({"delay": 0}), json.dumps({"delay": "oops"})  # the checker raises on "oops"
    with server_thread({"sleepy": fn_pipeline("sleepy")}) as server:
        reward = Recorded(server.address, "sleepy", mask_errors=True)
        trainer = train(tiny_models.policy, tmp_path, reward, [ok, ok, bad, ok])
    assert trainer.state.global_step == 2
    assert reward.calls, "TRL never called the reward function"
    failed = 0
    for completions, extras, rewards in reward.calls:
        for completion, extra, got in zip(completions, extras, rewards, strict=True):
            if extra == bad:
                assert got is None  # masked: TRL gives it advantage 0 and leaves it out of the group's baseline
                failed += 1
            else:
                assert got == float(len(completion))  # the sleepy checker scores the response's length
    assert failed > 0
    logged = [h for h in trainer.state.log_history if "rewards/rewardmesh_sleepy/mean" in h]
    assert len(logged) == 2 and all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


def test_a_failed_sample_stops_training_naming_it(tiny_models: TinyModelPaths, tmp_path: Path) -> None:
    ok, bad = json.dumps({"delay": 0}), json.dumps({"delay": "oops"})
    with server_thread({"sleepy": fn_pipeline("sleepy")}) as server:
        reward = Recorded(server.address, "sleepy", timeout_s=20)
        start = time.monotonic()
        with pytest.raises(RewardMeshError, match=r"sample \d+ \(prompt '1\+1='\): INTERNAL.*oops"):
            train(tiny_models.policy, tmp_path, reward, [ok, ok, bad, ok])
    assert time.monotonic() - start < 60  # model load and a first generation, then the first reward call


def test_reward_server_down_stops_training_within_seconds(tiny_models: TinyModelPaths, tmp_path: Path) -> None:
    with refusing_port() as port:
        reward = Recorded(f"127.0.0.1:{port}", "gsm8k", timeout_s=20, mask_errors=True)
        with pytest.raises(RewardMeshError, match="UNAVAILABLE"):
            train(tiny_models.policy, tmp_path, reward, [json.dumps({})] * 4)
    assert not reward.calls  # never a NaN reward, even with mask_errors


def test_a_wrong_token_stops_training_with_unauthenticated(
    tiny_models: TinyModelPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "token").write_text("right\n")
    with server_thread(grpc_token_file=str(tmp_path / "token")) as server:
        monkeypatch.setenv("REWARDMESH_AUTH_TOKEN", "wrong")
        reward = Recorded(server.address, "gsm8k", timeout_s=20)
        with pytest.raises(RewardMeshError, match=r"UNAUTHENTICATED.*REWARDMESH_AUTH_TOKEN"):
            train(tiny_models.policy, tmp_path, reward, [json.dumps({})] * 4)
