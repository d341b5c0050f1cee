"""The TRL reward callable against a real reward server, without TRL installed (its trainer is tested in
tests/integrations/): scores, a failed sample raising (or scored / masked when asked), a server that is down."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from rewardmesh.client.integrations.scoring import RewardMeshError
from rewardmesh.client.integrations.trl import RewardMeshReward
from tests.support.ports import refusing_port
from tests.support.servers import fn_pipeline, reward_server


async def test_scores_every_completion_and_a_failed_sample_raises_naming_it() -> None:
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
        # One sample's checker fails (float("oops")): the call raises, naming that sample and the cause.
        kwargs: dict[str, Any] = {
            "prompts": ["p", "q"],
            "completions": ["four", "4"],
            "extra_info": [{"delay": 0}, {"delay": "oops"}],
        }
        with pytest.raises(RewardMeshError, match=r"sample 1 \(prompt 'q'\): INTERNAL: .*oops.*error_score"):
            await RewardMeshReward(server.address, "sleepy")(**kwargs)
        assert await RewardMeshReward(server.address, "sleepy", error_score=-1.0)(**kwargs) == [4.0, -1.0]
        assert await RewardMeshReward(server.address, "sleepy", mask_errors=True)(**kwargs) == [4.0, None]
        # A missing pipeline is the service's error: it raises even when failed samples are masked.
        missing = RewardMeshReward(server.address, "no_such_pipeline", mask_errors=True)
        with pytest.raises(RewardMeshError, match=r"NOT_FOUND.*no_such_pipeline"):
            await missing(prompts=["p"], completions=["#### 4"], ground_truth=["4"])
        await reward.scorer.close()
    with pytest.raises(ValueError, match="not both"):
        RewardMeshReward("x:1", "gsm8k", error_score=0.0, mask_errors=True)


async def test_server_down_raises_within_seconds_even_with_mask_errors() -> None:
    with refusing_port() as port:
        reward = RewardMeshReward(f"127.0.0.1:{port}", "gsm8k", mask_errors=True)
        start = time.monotonic()
        with pytest.raises(RewardMeshError, match="UNAVAILABLE"):
            await asyncio.wait_for(reward(prompts=["p"], completions=["#### 4"], ground_truth=["4"]), 30)
        assert time.monotonic() - start < 30
        await reward.scorer.close()


@pytest.mark.slow
async def test_every_call_on_a_down_server_raises_as_fast_as_the_first() -> None:
    """One reward callable (one client, as TRL keeps it across steps): the server's backoff grows with every failed
    call, but each call's samples try on their own schedule, so no later call waits longer than the first."""
    with refusing_port() as port:
        reward = RewardMeshReward(f"127.0.0.1:{port}", "gsm8k")
        try:
            for call in range(4):
                start = time.monotonic()
                with pytest.raises(RewardMeshError, match="UNAVAILABLE"):
                    await asyncio.wait_for(reward(prompts=["p"], completions=["#### 4"], ground_truth=["4"]), 60)
                # The first takes about 0.2 x (1 + 2 + 4 + 8) x 0.75 s; once the server's backoff reached its 5 s cap,
                # waiting on it would take 10-20 s a call.
                assert time.monotonic() - start < 9.0, call
            (stream,) = reward.scorer.client().streams
            assert stream.failures >= 15  # the server's own backoff is at its cap
        finally:
            await reward.scorer.close()
