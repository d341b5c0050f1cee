"""AReaL 1.0.4's own RLVRWorkflow.arun_episode, rewarded through RewardMeshRLVRWorkflow against a real reward server:
the only stand-in is the inference engine, which answers each prompt with a canned response. The rewards land
in AReaL's trajectory tensors; a failed sample raises naming it (or is rejected when asked); a server that is down
fails every episode at once; a slow sample is an error past its deadline, never AsyncRewardWrapper's 0."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest

pytest.importorskip("areal.workflow.rlvr")

from areal.api import ModelRequest, ModelResponse
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.reward_api import AsyncRewardWrapper
from areal.infra.workflow_executor import WorkflowExecutor

from rewardmesh.client.integrations.areal import RewardMeshRLVRWorkflow
from rewardmesh.client.integrations.scoring import RewardMeshError
from tests.integrations.support import server_thread
from tests.support.ports import refusing_port
from tests.support.servers import fn_pipeline


class CannedEngine:
    """AReaL's InferenceEngine as RLVRWorkflow uses it (agenerate): the response for each prompt, canned."""

    def __init__(self, tok: Any, answers: dict[str, str]) -> None:
        self.tok, self.answers, self.requests = tok, answers, 0
        self.workflow_executor: Any = None

    def get_version(self) -> int:  # what AReaL's WorkflowExecutor reads for staleness
        return 0

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests += 1
        prompt = self.tok.decode(req.input_ids)
        text = next(a for q, a in self.answers.items() if q in prompt)
        out = self.tok.encode(text, add_special_tokens=False)
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=out,
            output_logprobs=[-0.5] * len(out),
            output_versions=[3] * len(out),
            stop_reason="stop",
            tokenizer=self.tok,
        )


def row(question: str, answer: str = "", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question}], "answer": answer, **extra}


def workflow(tok: Any, target: str, pipeline: str, **kw: Any) -> RewardMeshRLVRWorkflow:
    return RewardMeshRLVRWorkflow(
        GenerationHyperparameters(max_new_tokens=8), tok, target=target, pipeline=pipeline, **kw
    )


def episode(wf: RewardMeshRLVRWorkflow, engine: CannedEngine, data: dict[str, Any]) -> Any:
    """One arun_episode on a uvloop loop, as AReaL's rollout thread runs it, bounded at 60 s."""
    import uvloop

    async def run() -> Any:
        try:
            return await asyncio.wait_for(wf.arun_episode(engine, data), 60)
        finally:
            await wf.scorer.close()

    return uvloop.run(run())


@pytest.fixture(autouse=True)
def no_reward_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    """AsyncRewardWrapper (a process pool, and 0 after its timeout) must never be on the reward path."""

    async def refuse(self: Any, *args: Any, **kwargs: Any) -> float:
        raise AssertionError("AsyncRewardWrapper was called")

    monkeypatch.setattr(AsyncRewardWrapper, "__call__", refuse)


def test_right_and_wrong_answers_land_in_areals_trajectory(tok: Any) -> None:
    engine = CannedEngine(tok, {"2 + 2": "#### 4", "3 + 4": "#### 8"})
    with server_thread() as server:
        wf = workflow(tok, server.address, "gsm8k")
        right = episode(wf, engine, row("What is 2 + 2?", "4"))
        wrong = episode(wf, engine, row("What is 3 + 4?", "7"))
    assert right["rewards"].tolist() == [1.0] and wrong["rewards"].tolist() == [0.0]
    # RLVRWorkflow's own trajectory: prompt + response ids, the response alone in the loss mask
    n_out = len(tok.encode("#### 4", add_special_tokens=False))
    assert right["loss_mask"][0].tolist()[-n_out:] == [1] * n_out and right["loss_mask"][0, 0].item() == 0
    assert right["input_ids"].shape == right["logprobs"].shape == right["versions"].shape
    assert engine.requests == 2


def test_a_failed_sample_raises_naming_it_or_is_rejected_when_asked(tok: Any) -> None:
    engine = CannedEngine(tok, {"q": "four"})
    good = row("q: count", extra_info=json.dumps({"delay": 0, "index": 6}))
    bad = row("q: break", extra_info=json.dumps({"delay": "oops", "index": 7}))
    with server_thread({"sleepy": fn_pipeline("sleepy")}) as server:
        wf = workflow(tok, server.address, "sleepy")
        assert episode(wf, engine, good)["rewards"].tolist() == [4.0]  # the sleepy checker: the response's length
        with pytest.raises(RewardMeshError, match=r"sample 7 \(prompt 'q: break'\): INTERNAL.*oops.*mask_errors"):
            episode(wf, engine, bad)
        masked = workflow(tok, server.address, "sleepy", mask_errors=True)
        assert episode(masked, engine, bad) is None  # AReaL counts a None episode as rejected
        assert episode(masked, engine, good)["rewards"].tolist() == [4.0]


def executor_for(engine: CannedEngine, batch: int) -> WorkflowExecutor:
    """AReaL's own WorkflowExecutor (its rollout thread, its uvloop loop) on the stand-in engine, which holds it as
    AReaL's RemoteInfEngine holds its executor."""
    config = InferenceEngineConfig(consumer_batch_size=batch, max_head_offpolicyness=0, max_concurrent_rollouts=batch)
    executor = WorkflowExecutor(config, engine)
    engine.workflow_executor = executor
    executor.initialize(logger=logging.getLogger("areal-executor"))
    return executor


def rollouts(executor: WorkflowExecutor, wf: RewardMeshRLVRWorkflow, rows: list[dict[str, Any]]) -> list[Any]:
    """As prepare_batch does: submit, wait for results, again while the batch is short (3 rounds at most)."""
    results: list[Any] = []
    for _ in range(3):
        for data in rows:
            executor.submit(data, wf)
        results += executor.wait(len(rows), timeout=120)
    return results


def test_through_areals_workflow_executor_a_failed_sample_stops_training_or_is_rejected_when_asked(
    tok: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    """AReaL's executor only logs what an episode raises and counts it rejected: by default the workflow also stops
    the rollouts, so the trainer's next call raises naming the sample; with mask_errors it is a rejected episode."""
    engine = CannedEngine(tok, {"q": "four"})
    rows = [row("q: a", extra_info=json.dumps({"delay": 0})), row("q: b", extra_info='{"delay": "oops", "index": 9}')]
    named = r"rewardmesh pipeline 'sleepy' could not score sample 9 \(prompt 'q: b'\): INTERNAL.*mask_errors=True"
    with server_thread({"sleepy": fn_pipeline("sleepy")}) as server:
        executor = executor_for(engine, 2)
        try:
            with pytest.raises(RuntimeError, match="Background thread failed: " + named):
                rollouts(executor, workflow(tok, server.address, "sleepy"), rows)
        finally:
            executor.destroy()  # ends the rollout loop: the workflow's reward client closes first, with it
        assert "Workflow execution failed" in capfd.readouterr().err  # AReaL's own log (stderr, not propagated)
        executor = executor_for(engine, 2)
        try:
            executor.submit(rows[0], masked := workflow(tok, server.address, "sleepy", mask_errors=True))
            executor.submit(rows[1], masked)
            results = executor.wait(2, timeout=120)
        finally:
            executor.destroy()
    rewards = [None if r is None else r["rewards"].tolist() for r in results]
    assert sorted(rewards, key=str) == [None, [4.0]]  # the failed sample rejected (AReaL shuffles a batch)


def test_through_areals_workflow_executor_a_server_down_stops_training_at_once(tok: Any) -> None:
    """Every episode would be rejected and the trainer would wait for a batch forever; a masked one too."""
    engine = CannedEngine(tok, {"2 + 2": "#### 4"})
    with refusing_port() as port:
        executor = executor_for(engine, 1)
        start = time.monotonic()
        try:
            wf = workflow(tok, f"127.0.0.1:{port}", "gsm8k", timeout_s=20, mask_errors=True)
            with pytest.raises(
                RuntimeError, match=r"Background thread failed: rewardmesh pipeline 'gsm8k'.*UNAVAILABLE"
            ):
                rollouts(executor, wf, [row("What is 2 + 2?", "4")])
        finally:
            executor.destroy()
    assert time.monotonic() - start < 60


def test_a_slow_sample_is_scored_or_fails_never_zero(tok: Any) -> None:
    """AsyncRewardWrapper returns 0 after its timeout; here a slow sample waits for its score, and one past the
    pipeline's deadline (the sleepy function's 2 s) raises DEADLINE_EXCEEDED."""
    engine = CannedEngine(tok, {"q": "four"})
    with server_thread({"sleepy": fn_pipeline("sleepy")}) as server:
        wf = workflow(tok, server.address, "sleepy")
        slow = episode(wf, engine, row("q: slow", extra_info=json.dumps({"delay": 0.5})))
        assert slow["rewards"].tolist() == [4.0]
        with pytest.raises(RewardMeshError, match="DEADLINE_EXCEEDED"):
            episode(wf, engine, row("q: slower", extra_info=json.dumps({"delay": 30})))


def test_reward_server_down_fails_every_episode_at_once(tok: Any) -> None:
    engine = CannedEngine(tok, {"2 + 2": "#### 4"})
    took = []
    with refusing_port() as port:
        wf = workflow(tok, f"127.0.0.1:{port}", "gsm8k", timeout_s=20, mask_errors=True)
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(RewardMeshError, match="UNAVAILABLE"):
                episode(wf, engine, row("What is 2 + 2?", "4"))  # masking never covers a service error
            took.append(time.monotonic() - start)
    assert max(took) < 30 and max(took[1:]) < took[0] + 10  # no call waits longer than the first did
