"""verifiers 0.4.0's own `Task.score` on canned traces, both ways round, against real reward servers: the
`rewardmesh_judge` plugin (a task's judge scores on a rewardmesh pipeline) and the server's `verifiers` source (a
pipeline runs an installed environment's Task.score on each sample). Right answers 1.0 and wrong 0.0; a failing
reward, a sample past its deadline and a server that is down are errors naming the sample, never zeros."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

vf = pytest.importorskip("verifiers.v1")

from verifiers.v1.graph import MessageNode  # noqa: E402
from verifiers.v1.trace import AgentInfo, Trace, TraceTask  # noqa: E402
from verifiers.v1.types import AssistantMessage, UserMessage  # noqa: E402

from rewardmesh.client.integrations import verifiers_judge  # noqa: E402
from rewardmesh.client.integrations.scoring import MeshScorer, make_sample  # noqa: E402
from rewardmesh.reward_engine.engine import build_source  # noqa: E402
from rewardmesh.v1 import reward_pb2  # noqa: E402
from tests.integrations.support import server_thread  # noqa: E402
from tests.support.ports import refusing_port  # noqa: E402
from tests.support.servers import fn_pipeline  # noqa: E402

ENVS = Path(__file__).with_name("vf_envs")


@pytest.fixture(scope="module")
def env() -> Iterator[Any]:
    """The test environment, importable by its id as when pip-installed (`vf_math_env`)."""
    sys.path.insert(0, str(ENVS))
    try:
        import vf_math_env

        yield vf_math_env
    finally:
        sys.path.remove(str(ENVS))


def trace_of(task: Any, reply: str) -> Any:
    """A finished single-turn rollout: the task's prompt, then the model's reply."""
    nodes = [
        MessageNode(message=UserMessage(content=task.data.prompt_text)),
        MessageNode(parent=0, message=AssistantMessage(content=reply), sampled=True),
    ]
    return Trace(
        task=TraceTask(type=type(task).__name__, data=task.data), agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes
    )


def run(coro: Any) -> Any:
    """On a fresh loop, bounded at 60 s; the judge's reward clients are closed with it."""

    async def main() -> Any:
        try:
            return await asyncio.wait_for(coro, 60)
        finally:
            await verifiers_judge.close()

    return asyncio.run(main())


def judged(env: Any, target: str, pipeline: str, reply: str, **data: Any) -> Any:
    """verifiers' Task.score on a task whose only reward is the plugged rewardmesh judge; the scored trace."""
    config = vf.TaskConfig(judges=[{"id": "rewardmesh_judge", "target": target, "pipeline": pipeline, "name": "mesh"}])
    task = env.JudgedTask(env.MathData(**{"prompt": "What is 2 + 2?", "answer": "4", **data}), config)
    trace = trace_of(task, reply)
    run(task.score(trace))
    return trace


# --- the judge plugin: a verifiers task scored by a rewardmesh pipeline ---


def test_judge_plugin_scores_right_and_wrong_with_extras_as_metrics(env: Any) -> None:
    with server_thread() as server:
        right = judged(env, server.address, "gsm8k", "#### 4")
        wrong = judged(env, server.address, "gsm8k", "#### 5")
    assert right.rewards["mesh"].score == 1.0 and right.reward == 1.0
    assert wrong.rewards["mesh"].score == 0.0 and wrong.reward == 0.0
    # the pipeline's extras are metrics: a reward returning a dict would count `acc` into the total (2.0 here)
    assert right.metrics["mesh/acc"] == 1.0 and set(right.rewards) == {"mesh"}


def test_judge_plugin_failure_is_a_task_error_naming_the_sample(env: Any) -> None:
    with server_thread({"sleepy": fn_pipeline("sleepy")}) as server:
        ok = judged(env, server.address, "sleepy", "four", delay=0)
        assert ok.reward == 4.0  # the sleepy checker scores the response's length
        with pytest.raises(vf.TaskError, match=r"sample q7 \(prompt 'What is 2 \+ 2\?'\): INTERNAL.*oops"):
            judged(env, server.address, "sleepy", "four", delay="oops", id="q7")
        # slow past the function's 2 s deadline: an error, never AReaL-style 0
        with pytest.raises(vf.TaskError, match="DEADLINE_EXCEEDED"):
            judged(env, server.address, "sleepy", "four", delay=30)


def test_judge_plugin_server_down_fails_every_score_at_once(env: Any) -> None:
    took = []
    with refusing_port() as port:
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(vf.TaskError, match="UNAVAILABLE"):
                judged(env, f"127.0.0.1:{port}", "gsm8k", "#### 4")
            took.append(time.monotonic() - start)
    assert max(took) < 30 and max(took[1:]) < took[0] + 10  # no call waits longer than the first did


# --- the server's verifiers source: a pipeline runs the environment's own Task.score ---


def score(address: str, pipeline: str, samples: list[Any]) -> list[reward_pb2.RewardResult]:
    async def main() -> list[reward_pb2.RewardResult]:
        scorer = MeshScorer(address, pipeline, timeout_s=30)
        try:
            return await asyncio.wait_for(scorer.score(samples), 60)
        finally:
            await scorer.close()

    return asyncio.run(main())


def vf_pipeline(**options: Any) -> dict[str, Any]:
    return {"sources": [{"type": "verifiers", "taskset": "vf_math_env", **options}]}


def test_source_scores_the_environments_task_on_each_sample(env: Any) -> None:
    task = env.MathTask(env.MathData(prompt="What is 3 + 4?", answer="7"))
    full_trace = trace_of(task, "#### 7").model_dump(mode="json")
    samples = [
        make_sample("right", prompt_text="What is 2 + 2?", response_text="#### 4", ground_truth="4"),
        make_sample("wrong", prompt_text="What is 2 + 2?", response_text="#### 5", ground_truth="4"),
        # the task and the trace sent with the sample, as a verifiers rollout recorded them
        make_sample("traced", extra_info={"task": task.data.model_dump(mode="json"), "trace": full_trace}),
    ]
    with server_thread({"vf-math": vf_pipeline(concurrency=2)}) as server:
        right, wrong, traced = score(server.address, "vf-math", samples)
    for result in (right, wrong, traced):
        assert not result.HasField("error"), result.error
    assert (right.score, wrong.score, traced.score) == (1.0, 0.0, 1.0)
    assert right.extras["correct"] == 1.0 and right.extras["reply_chars"] == 6.0  # rewards and metrics as extras


def test_source_failures_name_the_sample_never_a_zero(env: Any) -> None:
    samples = [
        make_sample("ok", prompt_text="2+2?", response_text="4", ground_truth="4"),
        make_sample("boom", prompt_text="2+2?", response_text="boom", ground_truth="4"),
        make_sample("slow", prompt_text="2+2?", response_text="slow", ground_truth="4"),
        make_sample("bad", response_text="4", extra_info={"task": {"answer": ["not", "a", "string"]}}),
    ]
    with server_thread({"vf-math": vf_pipeline(timeout_s=1.0)}) as server:
        ok, boom, slow, bad = score(server.address, "vf-math", samples)
    assert ok.score == 1.0 and not ok.HasField("error")
    assert (
        boom.error.code == grpc.StatusCode.INTERNAL.value[0] and "checker crashed" in boom.error.message
    )  # verifiers' TaskError
    assert slow.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and "1s" in slow.error.message
    assert (
        bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "extra_info.task" in bad.error.message
    )  # naming the field


def test_source_config_errors_are_loud(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"taskset 'no_such_env'.*not found"):
        build_source("pipelines.x.sources[0]", {"type": "verifiers", "taskset": "no_such_env"})
    with pytest.raises(ValueError, match="set one of 'taskset'"):
        build_source("pipelines.x.sources[0]", {"type": "verifiers"})
    source, _ = build_source("s", {"type": "verifiers", "task": "vf_math_env:MathTask", "name": "m"})
    assert source.kind == "function" and source.capacity.slots == 32
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # as on a server without verifiers
    with pytest.raises(ValueError, match=r"needs the verifiers package.*pip install verifiers==0\.4\.0"):
        build_source("s", {"type": "verifiers", "taskset": "vf_math_env"})
