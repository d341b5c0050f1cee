"""OpenRLHF 0.11.2's own remote-reward client (SingleTurnAgentExecutor, installed without its CUDA-only
dependencies) against the reward server's HTTP gateway: scores, per-sample errors, retries on overload,
and a clear error when the server is down."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("openrlhf")

from openrlhf.utils.agent import SingleTurnAgentExecutor
from transformers import AutoTokenizer

from rewardmesh.demo.tiny_models import TinyModelPaths
from tests.integrations.support import closed_port, server_thread
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


def test_http_client_per_sample_errors_and_json_labels() -> None:
    pipelines = {"sleepy": fn_pipeline("sleepy")}
    with server_thread(pipelines, default_pipeline="gsm8k") as server:
        executor = SingleTurnAgentExecutor(remote_rm_url=f"{server.url}/get_reward")
        labels = ["4", json.dumps({"ground_truth": "4", "data_source": "openai/gsm8k"}), ["not", "a", "label"]]
        queries = [PROMPT + " #### 4", PROMPT + " #### 4", PROMPT + " #### 4"]
        (reply,) = asyncio.run(executor._fetch_rewards_via_http(queries, [PROMPT] * 3, labels))
        assert reply["rewards"] == [1.0, 1.0, None]
        assert reply["errors"][2]["code"] == "INVALID_ARGUMENT" and "labels[2]" in reply["errors"][2]["message"]
        # Another pipeline by query string; the checker fails one sample, the other is scored.
        executor = SingleTurnAgentExecutor(remote_rm_url=f"{server.url}/get_reward?pipeline=sleepy")
        extra = [json.dumps({"extra_info": {"delay": 0}}), json.dumps({"extra_info": {"delay": "oops"}})]
        (reply,) = asyncio.run(executor._fetch_rewards_via_http(["p four", "p four"], ["p", "p"], extra))
    assert reply["rewards"] == [5.0, None]  # " four": the response after the prompt
    assert reply["errors"][1]["code"] == "INTERNAL"


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
    executor = SingleTurnAgentExecutor(remote_rm_url=f"http://127.0.0.1:{closed_port()}/get_reward")

    async def call() -> Any:
        return await asyncio.wait_for(executor._fetch_rewards_via_http(["q"], ["p"], ["1"]), 60)

    with pytest.raises(RuntimeError, match="Request error for 5 times"):
        asyncio.run(call())
