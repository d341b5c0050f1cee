"""The TRL reward callable against a real reward server, without TRL installed (its trainer is tested in
tests/integrations/): scores, None for a failed sample, and a clear end when the server is down."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from rewardmesh.client.integrations.trl import RewardMeshReward
from tests.support.servers import fn_pipeline, reward_server


async def test_scores_every_completion_and_a_failed_sample_is_none(caplog: pytest.LogCaptureFixture) -> None:
    pipelines = {"sleepy": fn_pipeline("sleepy")}
    async with reward_server(pipelines) as server:
        reward = RewardMeshReward(server.address, "gsm8k")
        assert reward.__name__ == "rewardmesh_gsm8k"
        conversational = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]] * 2
        got = await reward(
            prompts=conversational,
            completions=[[{"role": "assistant", "content": "#### 4"}], [{"role": "assistant", "content": "#### 3"}]],
            completion_ids=[[7, 8], [7, 9]],
            solution=["4", "4"],
            trainer_state=None,
        )
        assert got == [1.0, 0.0]
        # One sample's checker fails (float("oops")): that sample is None and the error is logged.
        slow = RewardMeshReward(server.address, "sleepy")
        with caplog.at_level(logging.WARNING):
            got = await slow(
                prompts=["p", "p"], completions=["four", "4"], extra_info=[{"delay": 0}, {"delay": "oops"}]
            )
        assert got == [4.0, None]
        assert "oops" in caplog.text
        missing = RewardMeshReward(server.address, "no_such_pipeline")
        with caplog.at_level(logging.WARNING):
            got = await missing(prompts=["p"], completions=["#### 4"], ground_truth=["4"])
        assert got == [None]
        assert "NOT_FOUND" in caplog.text and "no_such_pipeline" in caplog.text
        await reward.scorer.close()


async def test_server_down_gives_none_quickly_not_a_hang(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reward = RewardMeshReward(f"127.0.0.1:{port}", "gsm8k")
    with caplog.at_level(logging.WARNING):
        got = await asyncio.wait_for(reward(prompts=["p"], completions=["#### 4"], ground_truth=["4"]), 30)
    assert got == [None]
    assert "UNAVAILABLE" in caplog.text
    await reward.scorer.close()
