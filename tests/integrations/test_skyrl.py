"""skyrl-gym 0.4.0's own registry and make(), as SkyRLGymGenerator uses them (make, init, step from a thread pool),
with RewardMeshTextEnv against a real reward server. skyrl-train 0.3.1 (the generator) does not import here: it
needs Python 3.12 and ray 2.51, and this environment's ray is 2.60 (verl's). Right answers 1.0 and wrong 0.0 in the
step output; a failed sample raises naming it (or scores error_score when asked); a server that is down raises on
every step at once; every env of the process shares one event loop and one reward client."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym")

from omegaconf import DictConfig  # noqa: E402

from rewardmesh.client.integrations import skyrl as mesh_skyrl  # noqa: E402
from rewardmesh.client.integrations.scoring import RewardMeshError  # noqa: E402
from tests.integrations.support import server_thread  # noqa: E402
from tests.support.ports import refusing_port  # noqa: E402
from tests.support.servers import fn_pipeline  # noqa: E402


def rollout(config: dict[str, Any], question: str, reply: str, truth: str = "", **row: Any) -> Any:
    """What SkyRLGymGenerator does per trajectory: make the row's env, init it with the prompt, step the reply."""
    mesh_skyrl.register()
    extras = {"reward_spec": {"method": "rule", "ground_truth": truth}, **row}
    env = skyrl_gym.make("rewardmesh", env_config=DictConfig(config), extras=extras)
    env.init([{"role": "user", "content": question}])
    out = env.step(reply)
    env.close()
    return out, env


def test_right_and_wrong_answers_in_skyrls_step_output_from_a_thread_pool() -> None:
    with server_thread() as server:
        config = {"target": server.address, "pipeline": "gsm8k", "timeout_s": 20}
        rows = [("What is 2 + 2?", "#### 4", "4"), ("What is 3 + 4?", "#### 8", "7")] * 8
        with ThreadPoolExecutor(8) as pool:  # SkyRL's env executor steps envs from its threads
            outs = list(pool.map(lambda r: rollout(config, *r), rows))
        scorer = outs[0][1].scorer
    assert [o["reward"] for o, _ in outs] == [1.0, 0.0] * 8
    assert all(o["done"] and o["observations"] == [] for o, _ in outs)
    right, env = outs[0]
    assert right["metadata"]["acc"] == 1.0 and env.get_metrics()["rewardmesh_error"] == 0.0
    assert len(scorer._clients) == 1  # one event loop, one reward client, whichever thread stepped


def test_a_failed_sample_raises_naming_it_or_scores_error_score_when_asked() -> None:
    ok, bad = {"delay": 0, "index": 2}, {"delay": "oops", "index": 5}
    with server_thread({"sleepy": fn_pipeline("sleepy")}) as server:
        config = {"target": server.address, "pipeline": "sleepy"}
        out, _ = rollout(config, "count", "four", extra_info=json.dumps(ok))
        assert out["reward"] == 4.0  # the sleepy checker scores the response's length
        with pytest.raises(RewardMeshError, match=r"sample 5 \(prompt 'count'\): INTERNAL.*oops.*error_score"):
            rollout(config, "count", "four", extra_info=json.dumps(bad))
        with pytest.raises(RewardMeshError, match="DEADLINE_EXCEEDED"):  # slow past the 2 s deadline: never 0
            rollout(config, "count", "four", extra_info=json.dumps({"delay": 30}))
        out, env = rollout({**config, "error_score": -1.0}, "count", "four", extra_info=json.dumps(bad))
    assert out["reward"] == -1.0 and out["metadata"]["rewardmesh_error"] == 1.0
    assert env.get_metrics()["rewardmesh_error"] == 1.0


def test_reward_server_down_raises_on_every_step_at_once() -> None:
    took = []
    with refusing_port() as port:
        config = {"target": f"127.0.0.1:{port}", "pipeline": "gsm8k", "timeout_s": 20, "error_score": 0.0}
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(RewardMeshError, match="UNAVAILABLE"):  # error_score never covers a service error
                rollout(config, "What is 2 + 2?", "#### 4", "4")
            took.append(time.monotonic() - start)
    assert max(took) < 30 and max(took[1:]) < took[0] + 10  # no step waits longer than the first did


def test_a_row_without_a_ground_truth_is_refused_by_name() -> None:
    mesh_skyrl.register()
    mesh_skyrl.register()  # again: a no-op
    with pytest.raises(ValueError, match=r"reward_spec\.ground_truth"):
        skyrl_gym.make("rewardmesh", env_config=DictConfig({}), extras={})
