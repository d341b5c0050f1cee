"""verl 0.9.1's own RewardLoopWorker, built from verl's real Hydra config (no Ray, no GPU), scoring a
hand-built DataProto through the `rewardmesh` reward manager (found through the verl.plugins entry point)
and through verl's naive manager with our async compute_score."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl")

from hydra import compose, initialize_config_dir  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.experimental.reward_loop.reward_loop import RewardLoopWorker  # noqa: E402
from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls  # noqa: E402

from rewardmesh.client.integrations.scoring import RewardMeshError  # noqa: E402
from rewardmesh.client.integrations.verl import FIXED_KEYS, RewardMeshRewardManager  # noqa: E402
from rewardmesh.demo.tiny_models import TinyModelPaths  # noqa: E402
from tests.integrations.support import server_thread  # noqa: E402
from tests.support.ports import refusing_port  # noqa: E402
from tests.support.servers import fn_pipeline  # noqa: E402

PIPELINES = {"sleepy": fn_pipeline("sleepy"), "declared": {**fn_pipeline("sleepy"), "extra_keys": ["delay"]}}


@pytest.fixture(autouse=True)
def _close_worker_loops(monkeypatch: pytest.MonkeyPatch) -> Any:
    """verl's RewardLoopWorker takes the thread's event loop (making one when there is none) and never closes it:
    the loops the test's workers took are closed after it, so no unclosed loop or socket outlives the test. (Its
    loop lookup is wrapped, not the class: Ray ships the class to its actors.)"""
    from verl.experimental.reward_loop import reward_loop as verl_reward_loop

    loops: list[asyncio.AbstractEventLoop] = []
    lookup = verl_reward_loop.get_event_loop

    def recording_lookup() -> asyncio.AbstractEventLoop:
        loop = lookup()
        loops.append(loop)
        return loop

    monkeypatch.setattr(verl_reward_loop, "get_event_loop", recording_lookup)
    yield
    for loop in loops:
        if not loop.is_closed() and not loop.is_running():
            loop.close()
    asyncio.set_event_loop(None)  # a closed loop is nobody's next one


def verl_config(policy: Path, *overrides: str) -> Any:
    """verl's ppo_trainer config, composed by Hydra from the installed package's YAML."""
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(
            config_name="ppo_trainer",
            overrides=[f"actor_rollout_ref.model.path={policy}", "reward.num_workers=1", *overrides],
        )


def rewardmesh_config(policy: Path, target: str, pipeline: str, *extra: str) -> Any:
    return verl_config(
        policy,
        "reward.reward_manager.name=rewardmesh",
        f"+reward.rewardmesh.target={target}",
        f"+reward.rewardmesh.pipeline={pipeline}",
        "+reward.rewardmesh.timeout_s=20",
        *extra,
    )


def batch(tokenizer: Any, rows: list[tuple[str, str, str]], extra_info: list[dict[str, Any]] | None = None) -> Any:
    """A DataProto as verl's trainer hands it over: prompts left-padded, responses right-padded."""
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p, _, _ in rows]
    responses = [tokenizer.encode(r, add_special_tokens=False) for _, r, _ in rows]
    plen, rlen = max(map(len, prompts)) + 2, max(map(len, responses)) + 3
    n = len(rows)
    prompt_t = torch.zeros(n, plen, dtype=torch.long)
    response_t = torch.zeros(n, rlen, dtype=torch.long)
    mask = torch.zeros(n, plen + rlen, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_t[i, plen - len(p) :] = torch.tensor(p)
        response_t[i, : len(r)] = torch.tensor(r)
        mask[i, plen - len(p) : plen + len(r)] = 1
    return DataProto.from_dict(
        tensors={
            "prompts": prompt_t,
            "responses": response_t,
            "attention_mask": mask,
            "input_ids": torch.cat([prompt_t, response_t], dim=1),
            "position_ids": (mask.cumsum(dim=1) - 1).clamp(min=0),
        },
        non_tensors={
            "data_source": np.array(["openai/gsm8k"] * n, dtype=object),
            "reward_model": np.array([{"ground_truth": t, "style": "rule"} for _, _, t in rows], dtype=object),
            "extra_info": np.array(extra_info or [{"index": i} for i in range(n)], dtype=object),
        },
    )


def test_the_plugin_registers_the_manager_under_its_name() -> None:
    assert get_reward_manager_cls("rewardmesh") is RewardMeshRewardManager


def test_reward_loop_worker_scores_with_fixed_extra_keys(tiny_models: TinyModelPaths) -> None:
    rows = [("What is 2 + 2?", "#### 4", "4"), ("What is 3 + 4?", "I think #### 8", "7"), ("1+1=", "#### 2", "2")]
    with server_thread(PIPELINES) as server:
        worker = RewardLoopWorker(rewardmesh_config(tiny_models.policy, server.address, "gsm8k"))
        assert isinstance(worker.reward_manager, RewardMeshRewardManager)
        data = batch(worker.input_tokenizer, rows)
        # Two separate event loops, as a worker's lifetime may see: the client is made inside each.
        outputs = asyncio.run(worker.compute_score_batch(data))
        again = asyncio.run(worker.compute_score_batch(data[:1]))
    assert [o["reward_score"] for o in outputs] == [1.0, 0.0, 1.0]
    assert again[0]["reward_score"] == 1.0
    keys = [list(o["reward_extra_info"]) for o in outputs]
    assert all(k == keys[0] for k in keys) and set(FIXED_KEYS) <= set(keys[0]) and "acc" in keys[0]
    first = outputs[0]["reward_extra_info"]
    assert first["rewardmesh/error"] == 0.0 and first["rewardmesh/batch_size"] >= 1
    # verl's own assembly puts each score on the last valid response token.
    rm = RewardMeshRewardManager.assemble_rm_scores(data, [o["reward_score"] for o in outputs])
    assert rm.sum(dim=1).tolist() == [1.0, 0.0, 1.0]
    last = data.batch["attention_mask"][:, data.batch["prompts"].shape[1] :].sum(dim=1) - 1
    assert rm[torch.arange(3), last].tolist() == [1.0, 0.0, 1.0]


def test_a_failed_sample_fails_the_step_naming_it_or_scores_error_score_with_the_code(
    tiny_models: TinyModelPaths,
) -> None:
    rows = [("p", "four", ""), ("q", "four", "")]
    extra: list[dict[str, Any]] = [{"index": 0, "delay": 0}, {"index": 1, "delay": "oops"}]  # the second raises
    with server_thread(PIPELINES) as server:
        strict = RewardLoopWorker(rewardmesh_config(tiny_models.policy, server.address, "sleepy"))
        data = batch(strict.input_tokenizer, rows, extra)
        with pytest.raises(RewardMeshError, match=r"sample 1 \(prompt 'q'\): INTERNAL.*oops.*error_score"):
            asyncio.run(asyncio.wait_for(strict.compute_score_batch(data), 30))
        lenient = RewardLoopWorker(
            rewardmesh_config(tiny_models.policy, server.address, "sleepy", "+reward.rewardmesh.error_score=-1")
        )
        outputs = asyncio.run(asyncio.wait_for(lenient.compute_score_batch(data), 30))
        declared = RewardLoopWorker(
            rewardmesh_config(tiny_models.policy, server.address, "declared", "+reward.rewardmesh.error_score=-1")
        )
        with_extras = asyncio.run(asyncio.wait_for(declared.compute_score_batch(data), 30))
    assert [o["reward_score"] for o in outputs] == [4.0, -1.0]
    # The same keys from every sample, whichever finished first: the function announces no extras.
    assert list(outputs[0]["reward_extra_info"]) == list(outputs[1]["reward_extra_info"]) == list(FIXED_KEYS)
    assert outputs[1]["reward_extra_info"]["rewardmesh/error"] == 13.0  # INTERNAL
    # A pipeline that declares its extras (extra_keys in the server's config) reports them, NaN where missing.
    assert [list(o["reward_extra_info"]) for o in with_extras] == [[*FIXED_KEYS, "delay"]] * 2
    assert with_extras[0]["reward_extra_info"]["delay"] == 0.0
    assert math.isnan(with_extras[1]["reward_extra_info"]["delay"])


def test_reward_server_down_is_a_clear_error_not_a_hang(tiny_models: TinyModelPaths) -> None:
    with refusing_port() as port:
        worker = RewardLoopWorker(rewardmesh_config(tiny_models.policy, f"127.0.0.1:{port}", "gsm8k"))
        data = batch(worker.input_tokenizer, [("What is 2 + 2?", "#### 4", "4")])

        async def run() -> Any:
            return await asyncio.wait_for(worker.compute_score_batch(data), 30)

        start = time.monotonic()
        with pytest.raises(RewardMeshError, match="UNAVAILABLE"):
            asyncio.run(run())
    assert time.monotonic() - start < 30


def test_async_compute_score_through_verls_naive_manager(tiny_models: TinyModelPaths) -> None:
    with server_thread(PIPELINES) as server:
        config = verl_config(
            tiny_models.policy,
            "reward.custom_reward_function.path=pkg://rewardmesh.client.integrations.verl",
            "reward.custom_reward_function.name=compute_score",
            f"+reward.custom_reward_function.reward_kwargs.target={server.address}",
            "+reward.custom_reward_function.reward_kwargs.pipeline=gsm8k",
        )
        worker = RewardLoopWorker(config)
        data = batch(worker.input_tokenizer, [("What is 2 + 2?", "#### 4", "4"), ("2+3=", "#### 6", "5")])
        # verl's naive manager runs the tokenizer on the loop it saw when built: the worker's (a Ray actor's) loop.
        outputs = worker.loop.run_until_complete(worker.compute_score_batch(data))
    assert [o["reward_score"] for o in outputs] == [1.0, 0.0]
    assert outputs[0]["reward_extra_info"]["rewardmesh/error"] == 0.0


def test_a_wrong_token_fails_the_step_at_once_with_unauthenticated(
    tiny_models: TinyModelPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "token").write_text("right\n")
    with server_thread(PIPELINES, grpc_token_file=str(tmp_path / "token")) as server:
        monkeypatch.setenv("REWARDMESH_AUTH_TOKEN", "wrong")
        worker = RewardLoopWorker(
            rewardmesh_config(tiny_models.policy, server.address, "gsm8k", "+reward.rewardmesh.error_score=0")
        )
        data = batch(worker.input_tokenizer, [("What is 2 + 2?", "#### 4", "4")])
        start = time.monotonic()
        with pytest.raises(RewardMeshError, match=r"UNAUTHENTICATED.*REWARDMESH_AUTH_TOKEN"):
            asyncio.run(asyncio.wait_for(worker.compute_score_batch(data), 30))
    assert time.monotonic() - start < 10  # one refused attempt, no retries


# Ray's reward loop: verl's RewardLoopManager splits a batch over its workers (Ray actors, 8 by default) and builds
# each extra-info column from the first sample's keys. `auto` picks gsm8k (acc, format) or math (acc, parsed) per
# data_source, so a worker that saw only one kind would report other keys than the next.
MIXED = [
    ("openai/gsm8k", "What is 2 + 2?", "#### 4", "4"),
    ("openai/gsm8k", "What is 3 + 4?", "#### 8", "7"),
    ("lighteval/MATH", "Compute 1/2 + 1/2.", "\\boxed{1}", "1"),
    ("lighteval/MATH", "Compute 2 * 3.", "\\boxed{5}", "6"),
]


# A hang's bound, not a speed check: Ray's actors each import verl and torch as they start, and on a machine whose
# cores are busy many times over (the flake hunt's load) one reward-loop call has taken three minutes.
RAY_TEST_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def ray_local() -> Any:
    """A local Ray instance on 127.0.0.1 (tests/integrations/conftest.py). Ray gives its raylet a fixed 30 s to
    register and a start that misses it leaves its processes running: a missed start is cleaned up and tried
    once more, and a second miss fails with the raylet's own last words."""
    import ray

    assert ray.util.get_node_ip_address() == "127.0.0.1"
    for attempt in (1, 2):
        try:
            ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 * 1024 * 1024, log_to_driver=False)
            break
        except Exception as exc:
            logs = ray_log_tail()
            ray.shutdown()
            stop_ray_children()
            if attempt == 2:
                raise AssertionError(f"Ray did not start twice: {exc}\n{logs}") from exc
    yield ray
    ray.shutdown()


def ray_log_tail(lines: int = 20) -> str:
    """The last lines of the newest Ray session's raylet and GCS logs, where a failed start says why."""
    from ray._common.utils import get_default_ray_temp_dir

    logs = Path(get_default_ray_temp_dir()) / "session_latest" / "logs"
    out = []
    for name in ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err"):
        path = logs / name
        if path.is_file():
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path}\n" + "\n".join(tail))
    return "\n".join(out) or f"(no Ray logs under {logs})"


def stop_ray_children() -> None:
    """Kill the Ray processes (GCS, raylet, agents, workers) this test process started."""
    import psutil

    procs = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any("/ray/" in part for part in proc.cmdline()):
                proc.kill()
                procs.append(proc)
    psutil.wait_procs(procs, timeout=30)


def mixed_batch(tokenizer: Any) -> Any:
    data = batch(tokenizer, [(p, r, t) for _, p, r, t in MIXED])
    data.non_tensor_batch["data_source"] = np.array([d for d, *_ in MIXED], dtype=object)
    return data


@pytest.mark.timeout(RAY_TEST_TIMEOUT_S)
def test_rays_reward_loop_on_two_workers_assembles_columns_from_announced_keys(
    tiny_models: TinyModelPaths, ray_local: Any
) -> None:
    from verl.experimental.reward_loop.reward_loop import RewardLoopManager

    with server_thread() as server:
        for route in (
            ["reward.reward_manager.name=rewardmesh", f"+reward.rewardmesh.target={server.address}",
             "+reward.rewardmesh.pipeline=auto"],
            ["reward.custom_reward_function.path=pkg://rewardmesh.client.integrations.verl",
             "reward.custom_reward_function.name=compute_score",
             f"+reward.custom_reward_function.reward_kwargs.target={server.address}",
             "+reward.custom_reward_function.reward_kwargs.pipeline=auto"],
        ):  # fmt: skip
            config = verl_config(tiny_models.policy, *route)
            config.reward.num_workers = 2
            manager = RewardLoopManager(config)
            data = mixed_batch(RewardLoopWorker(config).input_tokenizer)
            out = manager.compute_rm_score(data)
            for worker in manager.reward_loop_workers:
                ray_local.kill(worker)
            assert out.batch["rm_scores"].sum(dim=1).tolist() == [1.0, 0.0, 1.0, 0.0], route
            keys = out.meta_info["reward_extra_keys"]
            assert {"acc", "format", "parsed", "rewardmesh/error"} <= set(keys), keys
            assert out.non_tensor_batch["acc"].tolist() == [1.0, 0.0, 1.0, 0.0]
            fmt, parsed = out.non_tensor_batch["format"], out.non_tensor_batch["parsed"]
            assert fmt[:2].tolist() == [1.0, 1.0] and np.isnan(fmt[2:].astype(float)).all()
            assert np.isnan(parsed[:2].astype(float)).all() and parsed[2:].tolist() == [1.0, 1.0]


@pytest.mark.timeout(RAY_TEST_TIMEOUT_S)
def test_rays_reward_loop_fails_the_step_naming_the_sample(tiny_models: TinyModelPaths, ray_local: Any) -> None:
    from verl.experimental.reward_loop.reward_loop import RewardLoopManager

    with server_thread() as server:
        config = rewardmesh_config(tiny_models.policy, server.address, "auto")
        config.reward.num_workers = 2
        manager = RewardLoopManager(config)
        data = mixed_batch(RewardLoopWorker(config).input_tokenizer)
        data.non_tensor_batch["data_source"][3] = "unknown/source"  # auto has no rule for it
        data.non_tensor_batch["extra_info"] = np.array([{"index": i} for i in range(4)], dtype=object)
        with pytest.raises(Exception, match=r"sample 3 \(prompt 'Compute 2 \* 3.'\): NOT_FOUND.*unknown/source"):
            manager.compute_rm_score(data)
        for worker in manager.reward_loop_workers:
            ray_local.kill(worker)
