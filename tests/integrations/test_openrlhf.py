"""OpenRLHF 0.11.2's own code (installed without its CUDA-only dependencies): rewardmesh's agent executor loaded
as OpenRLHF loads `--train.agent_func_path`, whose exception stops a step, and OpenRLHF's own remote-reward client
against the reward server's HTTP gateway: scores, failed samples, retries on overload, auth by URL."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("openrlhf")

from openrlhf.utils.agent import AgentExecutorBase, SingleTurnAgentExecutor
from transformers import AutoTokenizer

from rewardmesh.client.integrations.scoring import RewardMeshError
from rewardmesh.demo.tiny_models import TinyModelPaths
from tests.integrations.support import server_thread
from tests.support.ports import refusing_port
from tests.support.servers import fn_pipeline

PROMPT = "What is 2 + 2?"


class CannedEngine:
    """Stands in for OpenRLHF's vLLM engine (no GPU here): always generates the same token ids."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    async def generate(self, prompt_token_ids: list[int], params: Any, multi_modal_data: Any = None) -> Any:
        out = SimpleNamespace(token_ids=self.token_ids, finish_reason="stop", logprobs=None)
        return SimpleNamespace(outputs=[out])


def test_agent_executor_scores_through_the_gateway(tiny_models: TinyModelPaths) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_models.policy))
    params = SimpleNamespace(max_tokens=16, logprobs=None)
    with server_thread(default_pipeline="gsm8k") as server:
        executor = SingleTurnAgentExecutor(remote_rm_url=[f"{server.url}/get_reward"])

        async def run(label: str) -> Any:
            engine = CannedEngine(tok.encode(" #### 4", add_special_tokens=False))
            return await executor.execute(PROMPT, label, params, 64, tok, engine)

        right, wrong = asyncio.run(run("4")), asyncio.run(run("5"))
    # OpenRLHF decodes prompt + response into one query; the gateway strips the prompt and scores the rest.
    assert right["reward"] == [1.0] and right["scores"] == [1.0]
    assert wrong["reward"] == [0.0] and right["extra_logs"]["acc"] == [1.0]


def test_http_client_a_failed_sample_is_a_4xx_its_retries_cannot_hide_or_error_score_when_asked() -> None:
    """OpenRLHF's HTTP client retries any failure 5 times, then its executor logs it at INFO and leaves the sample
    without a reward: the gateway never answers a null it would crash on, and `?error_score=` opts in to a score."""
    pipelines = {"sleepy": fn_pipeline("sleepy")}
    with server_thread(pipelines, default_pipeline="gsm8k") as server:
        executor = SingleTurnAgentExecutor(remote_rm_url=f"{server.url}/get_reward")
        labels = ["4", json.dumps({"ground_truth": "4", "data_source": "openai/gsm8k"})]
        (reply,) = asyncio.run(executor._fetch_rewards_via_http([PROMPT + " #### 4"] * 2, [PROMPT] * 2, labels))
        assert reply["rewards"] == [1.0, 1.0] and reply["extra_logs"]["rewardmesh_error"] == [0.0, 0.0]
        bad = ["p four", "p four"], ["p", "p"], [json.dumps({"extra_info": {"delay": 0}}), '{"extra_info": [1]}']
        with pytest.raises(RuntimeError, match="Request error for 5 times"):
            asyncio.run(asyncio.wait_for(executor._fetch_rewards_via_http(*bad), 30))
        lenient = SingleTurnAgentExecutor(remote_rm_url=f"{server.url}/get_reward?pipeline=sleepy&error_score=-1")
        (reply,) = asyncio.run(lenient._fetch_rewards_via_http(*bad))
    assert reply["rewards"] == [5.0, -1.0]  # " four": the response after the prompt
    assert reply["extra_logs"]["rewardmesh_error"] == [0.0, 1.0]
    assert reply["errors"][1]["code"] == "INVALID_ARGUMENT" and "labels[1]" in reply["errors"][1]["message"]


def test_http_client_sends_the_token_in_the_url() -> None:
    """OpenRLHF takes a URL only: the gateway reads the token from the path."""
    with server_thread(token="s3cret") as server:
        executor = SingleTurnAgentExecutor(remote_rm_url=f"{server.url}/t/s3cret/get_reward")
        (reply,) = asyncio.run(executor._fetch_rewards_via_http([PROMPT + " #### 4"], [PROMPT], ["4"]))
        assert reply["rewards"] == [1.0]
        wrong = SingleTurnAgentExecutor(remote_rm_url=f"{server.url}/t/wrong/get_reward")
        with pytest.raises(RuntimeError, match="Request error"):
            asyncio.run(asyncio.wait_for(wrong._fetch_rewards_via_http(["q"], ["p"], ["1"]), 30))


def test_overload_answers_503_and_openrlhfs_retries_get_every_reward() -> None:
    pipelines = {"sleepy": fn_pipeline("sleepy", max_queue_size=1, max_concurrent_batches=1)}
    with server_thread(pipelines) as server:
        executor = SingleTurnAgentExecutor(remote_rm_url=f"{server.url}/get_reward?pipeline=sleepy")
        label = json.dumps({"extra_info": {"delay": 0.3}})

        async def burst() -> list[Any]:
            calls = [executor._fetch_rewards_via_http([f"p {'x' * i}"], ["p"], [label]) for i in range(1, 4)]
            return await asyncio.gather(*calls)

        replies = asyncio.run(burst())
    assert sorted(r[0]["rewards"][0] for r in replies) == [2.0, 3.0, 4.0]


def test_reward_server_down_is_a_clear_error_after_openrlhfs_retries() -> None:
    with refusing_port() as port:
        executor = SingleTurnAgentExecutor(remote_rm_url=f"http://127.0.0.1:{port}/get_reward")

        async def call() -> Any:
            return await asyncio.wait_for(executor._fetch_rewards_via_http(["q"], ["p"], ["1"]), 60)

        with pytest.raises(RuntimeError, match="Request error for 5 times"):
            asyncio.run(call())


def load_agent_executor() -> Any:
    """rewardmesh's executor loaded as OpenRLHF's vllm_engine._load_agent_executor loads --train.agent_func_path."""
    import importlib.util

    import rewardmesh.client.integrations.openrlhf as module

    spec = importlib.util.spec_from_file_location("agent_module", module.__file__)
    assert spec is not None and spec.loader is not None
    agent_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent_module)
    assert issubclass(agent_module.AgentExecutor, AgentExecutorBase)
    return agent_module.AgentExecutor


def rollout(executor: Any, tok: Any, pairs: list[tuple[str, str, Any]]) -> list[Any]:
    """OpenRLHF's rollout actor gathers execute() for each sample; an exception there reaches its trainer."""
    params = SimpleNamespace(max_tokens=16, logprobs=None)

    async def run() -> list[Any]:
        calls = [
            executor.execute(prompt, label, params, 64, tok, CannedEngine(tok.encode(reply, add_special_tokens=False)))
            for prompt, reply, label in pairs
        ]
        try:
            return list(await asyncio.wait_for(asyncio.gather(*calls), 30))
        finally:
            await executor.scorer.close()  # this loop's channel, before the loop closes

    return asyncio.run(run())


def test_agent_executor_scores_over_grpc_and_a_failed_sample_stops_the_step(
    tiny_models: TinyModelPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_models.policy))
    executor_cls = load_agent_executor()
    math_label = json.dumps({"ground_truth": "1", "data_source": "lighteval/MATH"})
    with server_thread() as server:
        monkeypatch.setenv("REWARDMESH_REWARD_TARGET", server.address)
        monkeypatch.setenv("REWARDMESH_PIPELINE", "auto")
        executor = executor_cls()  # as OpenRLHF builds it: no arguments
        out = rollout(executor, tok, [(PROMPT, " #### 4", json.dumps({"ground_truth": "4",
                      "data_source": "openai/gsm8k"})), ("1/2+1/2?", " \\boxed{1}", math_label)])  # fmt: skip
        assert [o["reward"] for o in out] == [1.0, 1.0] and [o["scores"] for o in out] == [1.0, 1.0]
        # Every sample's extra_logs carry the pipeline's announced keys (OpenRLHF stacks them), NaN where missing.
        assert (
            list(out[0]["extra_logs"]) == list(out[1]["extra_logs"]) == ["acc", "format", "parsed", "rewardmesh_error"]
        )
        assert out[0]["extra_logs"]["format"] == 1.0 and math.isnan(out[1]["extra_logs"]["format"])
        assert out[0]["observation_tokens"][-len(tok.encode(" #### 4", add_special_tokens=False)) :]
        bad = ("What is 5 + 5?", " #### 10", json.dumps({"data_source": "unknown/source", "extra_info": {"index": 7}}))
        with pytest.raises(RewardMeshError, match=r"sample 7 \(prompt 'What is 5 \+ 5\?'\): NOT_FOUND.*unknown"):
            rollout(
                executor, tok, [(PROMPT, " #### 4", json.dumps({"ground_truth": "4", "data_source": "gsm8k"})), bad]
            )
        monkeypatch.setenv("REWARDMESH_PIPELINE", "sleepy_like")
        with pytest.raises(RewardMeshError, match=r"NOT_FOUND.*sleepy_like"):
            rollout(executor_cls(error_score=0.0), tok, [(PROMPT, " #### 4", "4")])  # a service error always raises


def test_agent_executor_error_score_and_server_down(
    tiny_models: TinyModelPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_models.policy))
    executor_cls = load_agent_executor()
    with server_thread({"sleepy": fn_pipeline("sleepy")}) as server:
        monkeypatch.setenv("REWARDMESH_REWARD_TARGET", server.address)
        monkeypatch.setenv("REWARDMESH_PIPELINE", "sleepy")
        monkeypatch.setenv("REWARDMESH_ERROR_SCORE", "-1")
        out = rollout(executor_cls(), tok, [("p", "four", '{"extra_info": {"delay": "oops"}}')])
    assert out[0]["reward"] == -1.0 and out[0]["extra_logs"] == {"rewardmesh_error": 1.0}
    with refusing_port() as port:
        monkeypatch.setenv("REWARDMESH_REWARD_TARGET", f"127.0.0.1:{port}")
        start = time.monotonic()
        with pytest.raises(RewardMeshError, match="UNAVAILABLE"):  # never a missing reward, error_score or not
            rollout(executor_cls(), tok, [("p", "four", "4")])
    assert time.monotonic() - start < 30


def test_agent_executor_with_a_wrong_token_stops_at_once(
    tiny_models: TinyModelPaths, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_models.policy))
    (tmp_path / "token").write_text("right\n")
    with server_thread(grpc_token_file=str(tmp_path / "token")) as server:
        monkeypatch.setenv("REWARDMESH_REWARD_TARGET", server.address)
        monkeypatch.setenv("REWARDMESH_PIPELINE", "gsm8k")
        monkeypatch.setenv("REWARDMESH_AUTH_TOKEN", "wrong")
        start = time.monotonic()
        with pytest.raises(RewardMeshError, match=r"UNAUTHENTICATED.*REWARDMESH_AUTH_TOKEN"):
            rollout(load_agent_executor()(error_score=0.0), tok, [(PROMPT, " #### 4", "4")])
    assert time.monotonic() - start < 10  # one refused attempt, no retries
