"""Tenants on a real reward server: who a caller is (its token), fair share under a flood, step deadlines carried
from the trainer through the rollout server, and a fleet that scales down without losing a sample."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from rewardmesh.client.reward_client import RewardClient
from rewardmesh.client.trainer import PromptSpec, TrainerClient
from rewardmesh.demo.paced_reward import PIPELINE, paced_engine
from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.server.reward.server import RewardServer, build_engine, load_tokenizer
from rewardmesh.server.reward.tenants import TenantTable
from rewardmesh.server.serving import ServerOptions
from rewardmesh.v1 import reward_pb2
from tests.support.scripted_backend import ScriptedBackend
from tests.support.servers import reward_stub, rollout_server, sample
from tests.support.waiting import eventually

DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def write_tokens(tmp_path: Path, **tokens: str) -> dict[str, dict[str, Any]]:
    config: dict[str, dict[str, Any]] = {}
    for name, token in tokens.items():
        path = tmp_path / f"{name}.token"
        path.write_text(token + "\n")
        config[name] = {"token_file": str(path)}
    return config


@asynccontextmanager
async def paced_server(
    table: TenantTable, batch_s: float = 0.05, max_batch_size: int = 8, **batching: Any
) -> AsyncIterator[RewardServer]:
    engine = paced_engine(batch_s, max_batch_size, **batching)
    server = RewardServer(engine, ServerOptions(host="127.0.0.1", port=0, grace_s=10.0), tenants=table)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=1.0)


# ------------------------------------------------------------------------------------------ the tenant table


def test_the_tenant_table_reads_tokens_weights_and_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOB_B_TOKEN", "b-secret")
    config: dict[str, Any] = write_tokens(tmp_path, a="a-secret")
    config["a"].update(weight=3, max_in_flight=100, max_queue_share=0.5)
    config["b"] = {"token_env": "JOB_B_TOKEN"}
    config["default"] = {"weight": 0.5}
    table = TenantTable.from_config(config)
    a, b = (
        table.of_metadata([("authorization", "Bearer a-secret")]),
        table.of_metadata([("authorization", "Bearer b-secret")]),
    )
    assert (a.name, a.weight, a.max_in_flight, a.max_queue_share) == ("a", 3, 100, 0.5)
    assert (b.name, b.weight) == ("b", 1.0)
    assert table.of_metadata([("authorization", "Bearer nobody")]) is table.default
    assert table.of_metadata([]) is table.default and table.default.weight == 0.5
    assert sorted(table.tokens) == ["a-secret", "b-secret"]
    assert TenantTable.from_config(None).tokens == []


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"a": {"weight": 1}}, r"tenants\.a: needs token_file or token_env"),
        ({"a": {"token_env": "NO_SUCH_VAR_SET", "weight": 1}}, r"tenants\.a: token_env NO_SUCH_VAR_SET is not set"),
        ({"a": {"token_env": "T1", "wieght": 2}}, r"tenants\.a: unknown option\(s\) \['wieght'\]"),
        ({"a": {"token_env": "T1", "weight": 0}}, r"tenants\.a: tenant 'a': weight must be > 0"),
        ({"a": {"token_env": "T1", "max_queue_share": 2}}, r"max_queue_share must be in \(0, 1\]"),
        ({"a": {"token_env": "T1"}, "b": {"token_env": "T1"}}, r"tenants\.b: has the same token as tenants\.a"),
        ({"default": {"token_env": "T1"}}, r"tenants\.default: the default tenant has no token"),
        (["a"], r"tenants: must be a mapping"),
    ],
)
def test_a_bad_tenant_table_names_the_field(config: Any, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("T1", "t1-secret")
    with pytest.raises(ValueError, match=message):
        TenantTable.from_config(config)


async def test_each_caller_is_its_tokens_tenant_and_with_auth_on_an_unknown_token_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = TenantTable.from_config(write_tokens(tmp_path, a="a-secret", b="b-secret"))
    async with paced_server(table, batch_s=0.01) as server:  # auth off: a token only names the tenant
        async with RewardClient([server.address], token="nobody") as client:
            assert not (await client.submit(sample("x"), PIPELINE)).HasField("error")
        assert table.default.in_flight == 0 and server.servicer.telemetry.queues()[0][0] == (PIPELINE, "default")
    monkeypatch.setenv("REWARDMESH_AUTH_TOKEN", "shared-secret")  # auth on: the shared token or a tenant's
    async with paced_server(table, batch_s=0.01) as server:
        async with (
            RewardClient([server.address], token="a-secret") as ca,
            RewardClient([server.address], token="b-secret") as cb,
        ):
            results = await asyncio.gather(
                *(ca.submit(sample(f"a{i}"), PIPELINE) for i in range(5)),
                *(cb.submit(sample(f"b{i}"), PIPELINE) for i in range(3)),
            )
            assert all(not r.HasField("error") and r.score == 1.0 for r in results)
            # Every tenant that queued shows up in the gauges an autoscaler reads.
            seen = {tenant for (pipeline, tenant), _, _ in server.servicer.telemetry.queues() if pipeline == PIPELINE}
            assert seen == {"a", "b", "default"}  # the default tenant's zeros are always there
        async with reward_stub(server.address) as stub:
            with pytest.raises(aio.AioRpcError) as refused:
                await stub.ListRewards(reward_pb2.ListRewardsRequest(), metadata=[("authorization", "Bearer nope")])
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_tenants_in_flight_limit_answers_its_excess_resource_exhausted(tmp_path: Path) -> None:
    config = write_tokens(tmp_path, a="a-secret")
    config["a"]["max_in_flight"] = 4
    async with paced_server(TenantTable.from_config(config), batch_s=0.2, max_batch_size=2) as server:
        async with RewardClient([server.address], token="a-secret") as client:
            results = await asyncio.gather(*(client.submit(sample(f"a{i}"), PIPELINE) for i in range(10)))
    refused = [r for r in results if r.HasField("error")]
    assert refused and all(r.error.code == EXHAUSTED and "max_in_flight" in r.error.message for r in refused)
    assert sum(not r.HasField("error") for r in results) >= 4


# ------------------------------------------------------------------------------------------ step deadlines


async def test_a_sample_that_cannot_make_its_step_deadline_is_answered_at_once() -> None:
    async with paced_server(TenantTable(), batch_s=0.3, max_batch_size=4) as server:
        async with RewardClient([server.address]) as client:
            first = await client.submit(sample("teach"), PIPELINE)  # the server learns a batch takes ~0.3 s
            assert not first.HasField("error")
            hopeless = await client.submit(sample("hopeless"), PIPELINE, step_deadline=time.monotonic() + 0.1)
            assert hopeless.error.code == DEADLINE_EXCEEDED
            assert "step deadline cannot be met" in hopeless.error.message
            fine = await client.submit(sample("fine"), PIPELINE, step_deadline=time.monotonic() + 30)
            assert not fine.HasField("error")
        source = server.engine.pipelines[PIPELINE].sources[0].source
        assert source.samples == 2  # type: ignore[attr-defined]  # the hopeless one never reached the model


async def test_the_trainers_step_deadline_reaches_the_reward_server_through_the_rollout_server(
    tiny_models: TinyModelPaths,
) -> None:
    tok = load_tokenizer(str(tiny_models.policy))
    backend = ScriptedBackend(tok, lambda text, turn: ("#### 4", 0.0))
    async with paced_server(TenantTable(), batch_s=0.3, max_batch_size=4) as reward:
        async with RewardClient([reward.address]) as client:
            await client.submit(sample("teach"), PIPELINE)  # a batch takes ~0.3 s
        async with rollout_server(backend, [reward.address]) as rollout:
            prompts = [PromptSpec(token_ids=tok.encode("What is 2 + 2?"), ground_truth="4")]
            async with TrainerClient([rollout.address], reward=PIPELINE, step_deadline_s=0.1) as trainer:
                tight = await trainer.generate_batch(prompts, n=2)
            async with TrainerClient([rollout.address], reward=PIPELINE, step_deadline_s=60) as trainer:
                loose = await trainer.generate_batch(prompts, n=2)
    assert [s.error_code for s in tight.samples] == [DEADLINE_EXCEEDED] * 2
    assert all("step deadline" in s.error for s in tight.samples)
    assert all(not s.error and s.score == 1.0 for s in loose.samples)


# ------------------------------------------------------------------------------------------ under load


def _starts_in_workers(log: Path) -> list[str]:
    return log.read_text().split()


def _a_before_each_b(started: list[str]) -> list[int]:
    counts, a = [], 0
    for sid in started:
        if sid.startswith("a"):
            a += 1
        else:
            counts.append(a)
    return counts


@pytest.mark.parametrize("tenants", [("a", "b"), ()], ids=["shared", "one-tenant"])
async def test_a_server_shared_by_tenants_says_which_pipelines_score_on_its_event_loop(
    tmp_path: Path, tenants: tuple[str, ...], caplog: pytest.LogCaptureFixture
) -> None:
    """An inline rule's batches take turns of the loop that reads every tenant's messages, so fair share cannot
    hold its latency under a flood as worker processes do: where tenants share the server, one log line names those
    pipelines and what to run instead; a pipeline in worker processes is not named, and a server of one tenant
    says nothing of it."""
    pipelines = {
        "inline": {"sources": [{"type": "rule", "rule": "gsm8k", "isolation": "inline"}]},
        "workers": {"sources": [{"type": "rule", "rule": "gsm8k", "isolation": "process", "workers": 1}]},
    }
    table = TenantTable.from_config(write_tokens(tmp_path, **{name: f"{name}-secret" for name in tenants}))
    server = RewardServer(build_engine(pipelines), ServerOptions(host="127.0.0.1", port=0), tenants=table)
    with caplog.at_level("INFO", logger="rewardmesh.server.reward.server"):
        await server.start()
    await server.stop(grace=1.0)
    hints = [r.getMessage() for r in caplog.records if "scoring on the event loop" in r.getMessage()]
    if tenants:
        assert len(hints) == 1 and "isolation: process" in hints[0]
        named = hints[0].split(": ", 1)[1].split(". ", 1)[0].split(", ")
        assert "inline" in named and "gsm8k" in named  # a built-in rule's pipeline runs inline too
        assert "workers" not in named
    else:
        assert hints == []


@pytest.mark.parametrize("batching", [{}, {"max_batch_size": 16, "max_queue_delay_ms": 2}], ids=["default", "user"])
async def test_a_flooding_tenant_never_puts_its_backlog_before_its_neighbours_step(
    tmp_path: Path, batching: dict[str, Any]
) -> None:
    """A real function pipeline on two worker processes, over gRPC. A floods it far past its queue while every
    worker is held on A's samples; B's step of 8 arrives meanwhile; then the workers are let go. B's first sample
    is the next to start, then B gets its weighted half; what was handed to the workers is what they ran (never
    more at once than there were worker processes: no queue behind the fair queue); only A's excess is refused (B,
    under its share, takes the places of A's newest); every sample is answered once."""
    log, gate = tmp_path / "starts.log", tmp_path / "gate"
    log.touch()
    function = {"type": "function", "function": "tests/support/reward_fns.py:logged_start", "max_workers": 2}
    pipelines = {"fn": {"sources": [function], "batching": {**batching, "max_queue_size": 64}}}
    table = TenantTable.from_config(write_tokens(tmp_path, a="a-secret", b="b-secret"))
    server = RewardServer(build_engine(pipelines), ServerOptions(host="127.0.0.1", port=0), tenants=table)
    await server.start()
    pipeline = server.engine.pipelines["fn"]
    batcher = pipeline.batcher
    pool = pipeline.sources[0].source.pool  # type: ignore[attr-defined]
    pool.straggler_after_s = math.inf  # A's gated calls hold their workers until the gate opens, on any load
    handed: list[str] = []
    over: list[tuple[int, int]] = []  # (samples started, worker processes) whenever the first exceeds the second

    def on_start(batch: list[Any]) -> None:
        handed.extend(t.inp.sample_id for t in batch)
        if batcher.in_flight_samples > len(pool.pids):
            over.append((batcher.in_flight_samples, len(pool.pids)))

    batcher.on_start = on_start
    try:
        async with (
            RewardClient([server.address], token="a-secret", result_timeout_s=120) as ca,
            RewardClient([server.address], token="b-secret", result_timeout_s=120) as cb,
        ):
            flood = [ca.submit(sample(f"a{i}", truth=f"a{i}", log=str(log), gate=str(gate)), "fn") for i in range(200)]
            await eventually(lambda: sum(f.done() for f in flood) >= 100, "A fills the queue, its excess refused")
            step = [cb.submit(sample(f"b{i}", truth=f"b{i}", log=str(log)), "fn") for i in range(8)]
            b_queued = lambda: {t.name: n for t, n, _ in batcher.tenant_queues()}.get("b") == 8  # noqa: E731
            await eventually(b_queued, "B's step waits in the queue")
            before = len(handed)
            gate.touch()
            b_results = await asyncio.gather(*step)
            a_results = await asyncio.gather(*flood)
    finally:
        await server.stop(grace=1.0)
    assert all(not r.HasField("error") and r.score == 1.0 for r in b_results)
    refused = [r for r in a_results if r.HasField("error")]
    assert refused and all(r.error.code == EXHAUSTED for r in refused)
    scored_a = sorted(r.sample_id for r in a_results if not r.HasField("error"))
    # Each sample handed over started in a worker process, once; none refused ever did.
    assert sorted(_starts_in_workers(log)) == sorted(handed) == sorted([*scored_a, *(f"b{i}" for i in range(8))])
    assert over == []
    counts = _a_before_each_b(handed[before:])
    assert counts[0] == 0 and all(c <= k + 1 for k, c in enumerate(counts)), (counts, handed[before:])


async def test_under_saturation_earliest_deadline_first_finishes_more_steps_in_time_than_fifo() -> None:
    # 12 steps of 8 samples, all queued at once on a server that scores 8 per 100 ms (1.2 s of work): the first six
    # have loose deadlines (5 s), the last six tight ones (0.9 s). In arrival order (FIFO: no step deadlines sent)
    # the tight steps wait behind the loose ones and most miss; earliest deadline first serves them first.
    async with paced_server(TenantTable(), batch_s=0.1, max_batch_size=8) as server:
        async with RewardClient([server.address], result_timeout_s=60) as client:
            made = {}
            for mode in ("fifo", "edf"):
                started = time.monotonic()
                deadlines = [started + (5.0 if step < 6 else 0.9) for step in range(12)]

                async def step_done(step: int, mode: str = mode, deadlines: list[float] = deadlines) -> bool:
                    due = deadlines[step]
                    futures = [
                        client.submit(
                            sample(f"{mode}-{step}-{k}"), PIPELINE, step_deadline=due if mode == "edf" else None
                        )
                        for k in range(8)
                    ]
                    results = await asyncio.gather(*futures)
                    return all(not r.HasField("error") for r in results) and time.monotonic() <= due

                made[mode] = await asyncio.gather(*(step_done(s) for s in range(12)))
    assert sum(made["edf"]) > sum(made["fifo"]), made
    assert all(made["edf"][6:]), made  # every tight step made it
    assert sum(made["fifo"][6:]) <= 3, made  # in arrival order they end at 0.7, 0.8, ... 1.2 s


async def test_a_scale_down_drains_without_losing_a_sample(tmp_path: Path) -> None:
    """Two reward servers share a tenant's load; one is stopped mid-load (the path SIGTERM takes when the autoscaler
    removes a pod): what it holds finishes, what comes later goes to the other; each sample answered once, scored."""
    table = TenantTable.from_config(write_tokens(tmp_path, a="a-secret"))
    async with paced_server(table, batch_s=0.05) as keep, paced_server(table, batch_s=0.05) as leaving:
        async with RewardClient([keep.address, leaving.address], token="a-secret") as client:
            futures = []
            for i in range(300):
                futures.append(client.submit(sample(f"s{i}"), PIPELINE))
                if i == 100:
                    await eventually(lambda: leaving.servicer.in_flight > 0, "the leaving server holds samples")
                    stopping = asyncio.create_task(leaving.stop())
                await asyncio.sleep(0.002)
            results = await asyncio.gather(*futures)
            await stopping
    assert sorted(r.sample_id for r in results) == sorted(f"s{i}" for i in range(300))
    assert all(not r.HasField("error") and r.score == 1.0 for r in results)
    assert leaving.servicer.results_sent > 0  # it scored some before leaving


@pytest.mark.timeout(120)
def test_serve_reward_reads_its_tenants_and_names_a_mistake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`rewardmesh serve reward --config` as an operator runs it: the tenants: section's tokens pass auth beside the
    shared one; a mistake in the section stops the server with the field named."""
    import subprocess

    from rewardmesh.demo.server_process import ServerProcess
    from rewardmesh.v1 import reward_pb2_grpc
    from tests.support.paths import CLI

    token = tmp_path / "job-a.token"
    token.write_text("a-secret\n")
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(f"tenants:\n  job-a:\n    token_file: {token}\n    weight: 2\n")
    bad.write_text(f"tenants:\n  job-a:\n    token_file: {token}\n    wieght: 2\n")
    monkeypatch.setenv("REWARDMESH_AUTH_TOKEN", "shared-secret")
    serve = [*CLI, "serve", "reward", "--port", "0", "--host", "127.0.0.1", "--config"]
    failed = subprocess.run([*serve, str(bad)], capture_output=True, text=True, timeout=60)
    assert failed.returncode == 2 and "tenants.job-a: unknown option(s) ['wieght']" in failed.stderr, failed.stderr
    server = ServerProcess("reward", [*serve, str(good)], tmp_path)
    try:
        port = server.start(timeout_s=60)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            for sent, passes in (("a-secret", True), ("shared-secret", True), ("other", False)):
                try:
                    stub.ListRewards(reward_pb2.ListRewardsRequest(), metadata=(("authorization", f"Bearer {sent}"),))
                    assert passes, sent
                except grpc.RpcError as exc:
                    assert not passes and exc.code() == grpc.StatusCode.UNAUTHENTICATED, sent
    finally:
        server.stop(timeout_s=30)
