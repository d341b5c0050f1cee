"""slime 0.3.1's own reward code (slime.rollout.rm_hub from its source, tests/integrations/slime_src) against a
real reward server: `--custom-rm-path rewardmesh.client.integrations.slime.custom_rm` through slime's async_rm and
batched_async_rm (a failed sample stops the rollout naming it, or is masked when asked; a server that is down or a
wrong token stops it at once), and `--rm-type remote_rm` against the HTTP gateway (a failed sample is a 4xx with
its cause in what slime raises, `?error_score=` opts in to a score, the token rides in the URL)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest

rm_hub = pytest.importorskip("slime.rollout.rm_hub")

from slime.utils.types import Sample  # noqa: E402

from rewardmesh.client.integrations import slime as mesh_slime  # noqa: E402
from rewardmesh.client.integrations.scoring import RewardMeshError  # noqa: E402
from tests.integrations.support import server_thread  # noqa: E402
from tests.support.ports import refusing_port  # noqa: E402
from tests.support.servers import FNS, fn_pipeline  # noqa: E402

CUSTOM_RM = "rewardmesh.client.integrations.slime.custom_rm"
T = TypeVar("T")


def slime_args(**kw: Any) -> Any:
    """The fields of slime's parsed arguments that its reward hub reads."""
    base = {"custom_rm_path": None, "rm_type": None, "rm_url": None, "reward_key": None}
    return SimpleNamespace(**{**base, **kw})


def bounded(call: Awaitable[T]) -> T:
    """Run slime's coroutine on a fresh loop, failing the test past 30 s (slime's shared HTTP session is bound to
    the loop it was made on: forget it between runs; the adapter's reward clients are closed with the loop)."""

    async def run() -> T:
        try:
            return await asyncio.wait_for(call, 30)
        finally:
            await mesh_slime.close()
            if rm_hub._shared_session is not None:
                await rm_hub._shared_session.close()
            rm_hub._shared_session = None

    return asyncio.run(run())


def test_custom_rm_through_slimes_async_rm_and_batched_async_rm(monkeypatch: pytest.MonkeyPatch) -> None:
    with server_thread({"sleepy": fn_pipeline("sleepy")}) as server:
        monkeypatch.setenv("REWARDMESH_REWARD_TARGET", server.address)
        monkeypatch.setenv("REWARDMESH_PIPELINE", "gsm8k")
        args = slime_args(custom_rm_path=CUSTOM_RM)
        right = Sample(prompt="2+2?", response="#### 4", label="4", index=0)
        wrong = Sample(prompt="3+4?", response="#### 8", label="7", index=1)
        assert bounded(rm_hub.async_rm(args, right)) == 1.0
        assert bounded(rm_hub.batched_async_rm(args, [right, wrong])) == [1.0, 0.0]
        keyed = bounded(rm_hub.async_rm(slime_args(custom_rm_path=CUSTOM_RM, reward_key="score"), right))
        assert keyed["score"] == 1.0 and keyed["acc"] == 1.0

        monkeypatch.setenv("REWARDMESH_PIPELINE", "sleepy")
        good = Sample(prompt="p", response="four", index=2, metadata={"delay": 0})
        bad = Sample(prompt="q", response="four", index=3, metadata={"delay": "oops"})
        with pytest.raises(RewardMeshError, match=r"sample 3 \(prompt 'q'\): INTERNAL.*oops.*REWARDMESH_ERROR_SCORE"):
            bounded(rm_hub.batched_async_rm(args, [good, bad]))
        monkeypatch.setenv("REWARDMESH_ERROR_SCORE", "0")
        assert bounded(rm_hub.batched_async_rm(args, [good, bad])) == [4.0, 0.0]
    assert bad.remove_sample and not good.remove_sample  # slime zeroes a removed sample's loss mask


def test_custom_rm_server_down_or_wrong_token_stops_at_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    args = slime_args(custom_rm_path=CUSTOM_RM)
    monkeypatch.setenv("REWARDMESH_PIPELINE", "gsm8k")
    monkeypatch.setenv("REWARDMESH_ERROR_SCORE", "0")  # masking never covers a service error
    with refusing_port() as port:
        monkeypatch.setenv("REWARDMESH_REWARD_TARGET", f"127.0.0.1:{port}")
        start = time.monotonic()
        with pytest.raises(RewardMeshError, match="UNAVAILABLE"):
            bounded(rm_hub.async_rm(args, Sample(prompt="2+2?", response="#### 4", label="4")))
    assert time.monotonic() - start < 30
    (tmp_path / "token").write_text("right\n")
    with server_thread(grpc_token_file=str(tmp_path / "token")) as server:
        monkeypatch.setenv("REWARDMESH_REWARD_TARGET", server.address)
        monkeypatch.setenv("REWARDMESH_AUTH_TOKEN", "wrong")
        with pytest.raises(RewardMeshError, match=r"UNAUTHENTICATED.*REWARDMESH_AUTH_TOKEN"):
            bounded(rm_hub.async_rm(args, Sample(prompt="2+2?", response="#### 4", label="4")))


def test_remote_rm_against_the_gateway(tmp_path: Path) -> None:
    """slime's own remote_rm: scores; a failed sample is a 4xx (slime's policy retries it; its own max_retries
    parameter keeps this test short), the cause in the error slime raises; `?error_score=`; the token in the URL."""
    pipelines = {"explode": {"sources": [{"type": "function", "function": f"{FNS}:explode", "executor": "thread"}]}}
    (tmp_path / "token").write_text("s3cret\n")
    with server_thread(pipelines, grpc_token_file=str(tmp_path / "token")) as server:
        right = Sample(prompt="2+2?", response="#### 4", label="4")
        url = f"{server.url}/t/s3cret/score"
        reply = bounded(rm_hub.async_rm(slime_args(rm_type="remote_rm", rm_url=f"{url}/gsm8k"), right))
        assert reply["score"] == 1.0 and reply["acc"] == 1.0
        explode = slime_args(rm_type="remote_rm", rm_url=f"{url}/explode")
        with pytest.raises(Exception, match=r"422.*INTERNAL.*checker bug"):
            bounded(rm_hub.remote_rm(explode, right, max_retries=1))
        lenient = slime_args(rm_type="remote_rm", rm_url=f"{url}/explode?error_score=0")
        reply = bounded(rm_hub.async_rm(lenient, right))
        assert reply["score"] == 0.0 and reply["rewardmesh_error"] == 1.0
        wrong = slime_args(rm_type="remote_rm", rm_url=f"{server.url}/t/wrong/score/gsm8k")
        with pytest.raises(Exception, match=r"401.*UNAUTHENTICATED"):
            bounded(rm_hub.remote_rm(wrong, right, max_retries=1))
