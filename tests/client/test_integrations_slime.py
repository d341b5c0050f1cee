"""slime's custom_rm hook against a real reward server, without slime (tests/integrations/ drives it with slime's
own code): its Sample is the dataclass contract read from slime's source (prompt, tokens, response,
response_length, label, loss_mask, metadata, index, remove_sample)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from rewardmesh.client.integrations.scoring import RewardMeshError
from rewardmesh.client.integrations.slime import custom_rm
from tests.support.ports import refusing_port
from tests.support.servers import fn_pipeline, reward_server


@dataclass
class SlimeSample:
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    loss_mask: list[int] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    index: int | None = None
    remove_sample: bool = False


def args(target: str, pipeline: str, reward_key: str | None = None, error_score: float | None = None) -> Any:
    return SimpleNamespace(
        rewardmesh_target=target,
        rewardmesh_pipeline=pipeline,
        reward_key=reward_key,
        rewardmesh_error_score=error_score,
    )


async def test_single_and_group_forms_score_on_the_stream() -> None:
    async with reward_server() as server:
        one = SlimeSample(prompt="2+2?", tokens=[5, 6, 7, 8], response="#### 4", response_length=2, label="4")
        assert await custom_rm(args(server.address, "gsm8k"), one) == 1.0
        chat = SlimeSample(prompt=[{"role": "user", "content": "3+4?"}], response="#### 8", label="7", loss_mask=[1])
        group = await custom_rm(args(server.address, "gsm8k"), [one, chat])
        assert group == [1.0, 0.0]
        keyed = await custom_rm(args(server.address, "gsm8k", reward_key="score"), one)
        assert keyed["score"] == 1.0 and keyed["acc"] == 1.0


async def test_a_failed_sample_raises_naming_it_or_is_masked_when_asked() -> None:
    async with reward_server({"sleepy": fn_pipeline("sleepy")}) as server:
        good = SlimeSample(response="four", metadata={"delay": 0})
        bad = SlimeSample(prompt="q", response="four", metadata={"delay": "oops"}, index=7)
        assert await custom_rm(args(server.address, "sleepy"), good) == 4.0
        with pytest.raises(RewardMeshError, match=r"sample 7 \(prompt 'q'\): INTERNAL.*oops"):
            await custom_rm(args(server.address, "sleepy"), [good, bad])
        assert not bad.remove_sample
        lenient = args(server.address, "sleepy", error_score=0.0)
        assert await custom_rm(lenient, [good, bad]) == [4.0, 0.0]
        assert bad.remove_sample and not good.remove_sample  # slime zeroes its loss mask


async def test_reward_server_down_is_a_clear_error_not_a_hang() -> None:
    with refusing_port() as port, pytest.raises(RewardMeshError, match="UNAVAILABLE"):
        await asyncio.wait_for(custom_rm(args(f"127.0.0.1:{port}", "gsm8k"), SlimeSample(response="x")), 30)
