"""The `rewardmesh` command as a user runs it: a real process, real sockets, SIGTERM drain."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import grpc
import pytest

from rewardmesh.demo.server_process import ServerProcess
from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.v1 import reward_pb2, reward_pb2_grpc
from tests.support.paths import CLI
from tests.support.ports import free_port
from tests.support.servers import FNS, sample
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


def test_help_lists_commands() -> None:
    out = subprocess.run([*CLI, "--help"], capture_output=True, text=True, check=True).stdout
    for word in ("serve", "tiny-models", "demo"):
        assert word in out
    for service in ("reward", "rollout"):
        serve = subprocess.run([*CLI, "serve", service, "--help"], capture_output=True, text=True, check=True).stdout
        assert "--port" in serve and "--config" in serve and "--grace-s" in serve and "--port-file" in serve


def test_bad_config_says_what_to_fix(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("pipelines:\n  broken:\n    sources:\n      - type: rule\n        rul: gsm8k\n")
    proc = subprocess.run([*CLI, "serve", "reward", "--port", "0", "--config", str(cfg)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "pipelines.broken.sources[0]" in proc.stderr and "rul" in proc.stderr


@pytest.mark.timeout(90)
def test_serve_reward_process_scores_and_drains_on_sigterm(tmp_path: Path) -> None:
    cfg = tmp_path / "reward.yaml"
    cfg.write_text(
        "server:\n  grace_s: 10\n"
        f"pipelines:\n  sleepy:\n    sources:\n      - type: function\n        function: {FNS}:sleepy\n"
    )
    server = ServerProcess("reward", [*CLI, "serve", "reward", "--port", "0", "--host", "127.0.0.1", "--config",
                                      str(cfg)], tmp_path)  # fmt: skip
    try:
        port = server.start(timeout_s=60)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            started = tmp_path / "scoring"
            slow = sample("slow", "abc", delay=2.0, started_file=str(started))
            pending = stub.ScoreBatch.future(reward_pb2.ScoreBatchRequest(reward="sleepy", samples=[slow]))
            wait_until(started.exists, "the server is scoring the sample")
            server.signal(signal.SIGTERM)  # the in-flight sample must still be answered
            (result,) = pending.result(timeout=30).results
        assert not result.HasField("error") and result.score == 3.0
        assert server.stop(timeout_s=30) == 0
        log = server.log_text()
        assert "draining" in log and "stopped" in log
    finally:
        server.kill()


@pytest.mark.timeout(90)
def test_prometheus_endpoint_serves_reward_metrics(tmp_path: Path) -> None:
    import urllib.request

    prom_port = free_port()
    server = ServerProcess("reward", [*CLI, "serve", "reward", "--port", "0", "--host", "127.0.0.1",
                                      "--prometheus-port", str(prom_port)], tmp_path)  # fmt: skip
    try:
        port = server.start(timeout_s=60)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            stub.ScoreBatch(reward_pb2.ScoreBatchRequest(reward="gsm8k", samples=[sample("a"), sample("b")]))
        body = urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/metrics", timeout=10).read().decode()
        scored = [line for line in body.splitlines() if line.startswith("rewardmesh_reward_scored")]
        assert scored and float(scored[0].split()[-1]) == 2.0, body[:2000]
        assert "rewardmesh_reward_latency" in body and 'pipeline="gsm8k"' in body
    finally:
        server.stop(timeout_s=30)


def test_demo_without_the_demo_extra_says_which_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from rewardmesh.server import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tqdm" else real(name, *a))
    assert cli.main(["reward-demo"]) == 2
    err = capsys.readouterr().err
    assert "rewardmesh[demo]" in err and "tqdm" in err and "matplotlib" not in err


def test_demo_writes_every_span_of_its_kept_trees_as_otlp_json_lines(
    tmp_path: Path, tiny_models: TinyModelPaths
) -> None:
    """`rewardmesh demo --trace-out` as a user runs it: the configured exporter gets the SDK's spans (steps, RPCs)
    through a batch processor and the kept sample trees straight from the flight recorder, both in one file; every
    kept span's parent is in it, and each kept sample's tree is whole (generate and reward under the sample, the
    reward server's reward.queue and reward.compute under its reward span)."""
    import json

    out = tmp_path / "spans.jsonl"
    proc = subprocess.run([*CLI, "demo", "--steps", "2", "--models", str(tiny_models.root), "--trace-out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "slowest sample of step" in proc.stdout
    spans = [s for line in out.read_text().splitlines() for rs in json.loads(line)["resourceSpans"]
             for ss in rs["scopeSpans"] for s in ss["spans"]]  # fmt: skip
    by_id = {s["spanId"]: s for s in spans}
    assert len(by_id) == len(spans)  # nothing written twice
    assert [s["name"] for s in spans].count("trainer.step") == 2
    samples = [s for s in spans if s["name"] == "rollout.sample"]
    assert len(samples) >= 4  # the 4 slowest of each step at least
    kept = ("rollout.sample", "generate", "reward", "reward.queue", "reward.compute")
    assert all(s["parentSpanId"] in by_id for s in spans if s["name"] in kept)
    for sample_span in samples:
        children = {s["name"]: s for s in spans if s.get("parentSpanId") == sample_span["spanId"]}
        assert {"generate", "reward"} <= set(children)
        under_reward = {s["name"] for s in spans if s.get("parentSpanId") == children["reward"]["spanId"]}
        assert under_reward == {"reward.queue", "reward.compute"}
