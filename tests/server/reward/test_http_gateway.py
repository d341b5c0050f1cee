"""The reward server's HTTP gateway over real sockets: OpenRLHF's /get_reward and slime's /score/{pipeline}."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import signal
import ssl
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from rewardmesh.demo.server_process import ServerProcess
from rewardmesh.server.config import resolve
from rewardmesh.server.limits import Limits
from rewardmesh.server.reward.http_gateway import _HTTP, load_token, server_ssl_context, strip_prompt
from rewardmesh.server.reward.server import RewardServerConfig
from tests.support.pki import make_pki
from tests.support.ports import free_port, refusing_port
from tests.support.servers import FNS, fn_pipeline, http_gateway, reward_server
from tests.support.waiting import wait_until

PROMPT = "Q: What is 2 + 2?\nA:"


async def post(url: str, body: Any, headers: dict[str, str] | None = None, **kw: Any) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(headers or {})}
        async with session.post(url, data=data, headers=headers, **kw) as resp:
            return resp.status, await resp.json(), resp.headers


async def test_openrlhf_batch_strips_the_prompt_and_reads_labels_as_ground_truth_or_json() -> None:
    async with reward_server() as server, http_gateway(server, default_pipeline="gsm8k") as gw:
        labels = ["4", json.dumps({"ground_truth": "5", "data_source": "openai/gsm8k"}), "4"]
        body = {
            "query": [PROMPT + " #### 4", PROMPT + " #### 4", "<s>" + PROMPT + " The answer is 4 #### 4"],
            "prompts": [PROMPT, PROMPT, PROMPT],
            "labels": labels,
        }
        status, reply, _ = await post(f"{gw.url}/get_reward", body)
    assert status == 200
    assert reply["rewards"] == [1.0, 0.0, 1.0] and reply["scores"] == reply["rewards"]
    assert reply["errors"] == [None, None, None]
    assert reply["extra_logs"]["acc"] == [1.0, 0.0, 1.0]  # the pipeline's extras, one value per query


async def test_openrlhf_a_failed_sample_fails_its_request_saying_why_never_a_null_reward() -> None:
    """OpenRLHF's client turns a null reward into a crash in its own code: a failed sample fails the request
    (4xx at once, the cause in the reason phrase it logs), the others' results still in the body."""
    pipelines = {"explode": {"sources": [{"type": "function", "function": f"{FNS}:explode", "executor": "thread"}]}}
    async with reward_server(pipelines) as server, http_gateway(server, default_pipeline="gsm8k") as gw:
        bad_label = {"query": [PROMPT + " #### 4", PROMPT + " #### 4"], "prompts": [PROMPT, 7], "labels": ["4", "4"]}
        status, reply, headers = await post(f"{gw.url}/get_reward", bad_label)
        assert status == 400 and "Retry-After" not in headers
        assert reply["error"]["code"] == "INVALID_ARGUMENT" and "prompts[1]" in reply["error"]["message"]
        assert reply["rewards"] == [1.0, None] and reply["errors"][0] is None
        assert reply["errors"][1]["code"] == "INVALID_ARGUMENT" and "prompts[1]" in reply["errors"][1]["message"]

        status, reply, _ = await post(f"{gw.url}/get_reward?pipeline=explode", {"query": ["x"], "labels": ["4"]})
        assert status == 422 and reply["error"]["code"] == "INTERNAL" and "checker bug" in reply["error"]["message"]

        # Opt-in: a failed sample scores error_score, flagged, and every request carries the same extra keys.
        status, reply, _ = await post(f"{gw.url}/get_reward?error_score=-1", bad_label)
        assert status == 200 and reply["rewards"] == [1.0, -1.0] and reply["scores"] == [1.0, -1.0]
        assert reply["extra_logs"]["rewardmesh_error"] == [0.0, 1.0]
        assert reply["extra_logs"]["acc"][0] == 1.0 and math.isnan(reply["extra_logs"]["acc"][1])
        status, reply, _ = await post(f"{gw.url}/get_reward?error_score=nan", bad_label)
        assert status == 400 and "error_score" in reply["error"]["message"]

        status, reply, _ = await post(f"{gw.url}/get_reward?pipeline=nope", {"query": ["x"]})
        assert status == 404 and reply["error"]["code"] == "NOT_FOUND" and "gsm8k" in reply["error"]["message"]
        status, reply, _ = await post(f"{gw.url}/get_reward", {"query": ["a", "b"], "labels": ["1"]})
        assert status == 400 and "labels: expected a list of 2 items, got 1" in reply["error"]["message"]
        status, reply, _ = await post(f"{gw.url}/get_reward", b"{not json")
        assert status == 400 and reply["error"]["code"] == "INVALID_ARGUMENT"


async def test_nested_or_malformed_json_is_400_and_one_bad_label_fails_only_its_sample() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    deep_label = '{"extra_info": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + ', "ground_truth": "4"}'
    async with reward_server() as server, http_gateway(server, default_pipeline="gsm8k") as gw:
        for url in (f"{gw.url}/get_reward", f"{gw.url}/score/gsm8k"):
            status, reply, _ = await post(url, deep.encode())
            assert status == 400 and "nested too deeply" in reply["error"]["message"], reply
        body = {"query": ["#### 4", "#### 4", "#### 4"], "labels": ["4", deep_label, {"extra_info": [1]}]}
        status, reply, _ = await post(f"{gw.url}/get_reward?error_score=0", body)
        assert status == 200 and reply["rewards"] == [1.0, 0.0, 0.0]
        assert [e and e["code"] for e in reply["errors"]] == [None, "INVALID_ARGUMENT", "INVALID_ARGUMENT"]
        assert "labels[1]" in reply["errors"][1]["message"] and "labels[2]" in reply["errors"][2]["message"]
        items = [{"response": "#### 4", "label": "4"}, {"response": "#### 4", "label": deep_label}]
        status, reply, _ = await post(f"{gw.url}/score/gsm8k", items)
        assert status == 200 and [r["score"] for r in reply] == [1.0, None]


async def test_overload_is_503_with_retry_after_and_draining_refuses_new_requests() -> None:
    pipelines = {"sleepy": fn_pipeline("sleepy", max_queue_size=1, max_concurrent_batches=1)}
    async with reward_server(pipelines) as server, http_gateway(server) as gw:
        slow = {"prompt": "p", "response": "r", "label": "", "extra_info": {"delay": 0.5}}
        results = await asyncio.gather(*(post(f"{gw.url}/score/sleepy", slow) for _ in range(6)))
        statuses = sorted(s for s, _, _ in results)
        assert statuses[0] == 200 and statuses[-1] == 503
        busy = next(r for r in results if r[0] == 503)
        assert busy[1]["error"]["code"] == "RESOURCE_EXHAUSTED" and busy[2]["Retry-After"] == "1"
        gw.begin_drain()
        status, reply, headers = await post(f"{gw.url}/score/sleepy", slow)
        assert status == 503 and reply["error"]["code"] == "UNAVAILABLE" and headers["Retry-After"] == "1"


async def test_bearer_token_is_required_when_configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    assert load_token(str(secret)) == "s3cret"
    monkeypatch.setenv("REWARDMESH_HTTP_TOKEN", "from-env")
    assert load_token("") == "from-env"
    with pytest.raises(ValueError, match="cannot read"):
        load_token(str(tmp_path / "missing"))
    one = {"prompt": PROMPT, "response": "#### 4", "label": "4"}
    async with reward_server() as server, http_gateway(server, token="s3cret") as gw:
        status, reply, _ = await post(f"{gw.url}/score/gsm8k", one)
        assert status == 401 and reply["error"]["code"] == "UNAUTHENTICATED"
        status, _, _ = await post(f"{gw.url}/score/gsm8k", one, headers={"Authorization": "Bearer wrong"})
        assert status == 401
        status, reply, _ = await post(f"{gw.url}/score/gsm8k", one, headers={"Authorization": "Bearer s3cret"})
        assert status == 200 and reply["score"] == 1.0
        # Clients that can send only a URL (OpenRLHF, slime) put the token in the path.
        status, reply, _ = await post(f"{gw.url}/t/s3cret/score/gsm8k", one)
        assert status == 200 and reply["score"] == 1.0
        status, reply, _ = await post(f"{gw.url}/t/s3cret/get_reward", {"query": ["#### 4"], "labels": ["4"]})
        assert status == 404  # no default pipeline here: past auth, to the route
        status, reply, _ = await post(f"{gw.url}/t/wrong/score/gsm8k", one)
        assert status == 401 and reply["error"]["message"] == "invalid token"
        async with aiohttp.ClientSession() as session, session.get(f"{gw.url}/health") as resp:
            assert resp.status == 200 and await resp.json() == {"status": "SERVING"}  # probes need no token


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_tls_gateway_serves_https_with_the_servers_certificate(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    ctx = server_ssl_context(str(pki / "server.crt"), str(pki / "server.key"))
    client_ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    one = {"prompt": PROMPT, "response": "#### 4", "label": "4"}
    async with reward_server() as server, http_gateway(server, ssl_context=ctx) as gw:
        assert gw.url.startswith("https://")
        status, reply, _ = await post(f"{gw.url}/score/gsm8k", one, ssl=client_ctx)
        assert status == 200 and reply["score"] == 1.0
        with pytest.raises(aiohttp.ClientError):
            await post(f"{gw.url.replace('https', 'http')}/score/gsm8k", one)
    with pytest.raises(ValueError, match="both tls_cert and tls_key"):
        server_ssl_context(str(pki / "server.crt"), "")


def test_gateway_options_come_from_flags_env_and_yaml(monkeypatch: pytest.MonkeyPatch) -> None:
    from rewardmesh.server.cli import build_parser

    args = build_parser().parse_args(["serve", "reward", "--http-port", "8000"])
    monkeypatch.setenv("REWARDMESH_HTTP_PIPELINE", "gsm8k")
    cfg = resolve(RewardServerConfig, args, {"http_token_file": "/etc/rm/token"})
    assert (cfg.http_port, cfg.http_pipeline, cfg.http_token_file) == (8000, "gsm8k", "/etc/rm/token")


def test_strip_prompt_recovers_the_response() -> None:
    assert strip_prompt("PROMPT answer", "PROMPT") == " answer"
    assert strip_prompt("<bos>PROMPT answer", "PROMPT") == " answer"
    assert strip_prompt("unrelated", "PROMPT") == "unrelated"


def test_every_grpc_code_has_an_http_status() -> None:
    assert set(_HTTP) == set(grpc.StatusCode)
    assert _HTTP[grpc.StatusCode.OK] == 200
    assert all(400 <= status < 600 for code, status in _HTTP.items() if code != grpc.StatusCode.OK)
    # Only "busy or going away" is 503 (retried by OpenRLHF and slime); a judge outage is the upstream's failure.
    busy = [c for c, s in _HTTP.items() if s == 503]
    assert busy == [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE]
    assert _HTTP[grpc.StatusCode.FAILED_PRECONDITION] == 502


async def test_a_judge_outage_is_502_failed_precondition_per_sample_never_a_retry_of_the_batch() -> None:
    """A failed dependency (item 5) is not "busy": no Retry-After, no 503, the batch's other answers stand."""
    one = {"prompt": PROMPT, "response": "#### 4", "label": "4"}
    with refusing_port() as port:
        judge = {"type": "judge", "url": f"http://127.0.0.1:{port}", "model": "m", "max_retries": 0}
        async with reward_server({"judged": {"sources": [judge]}}) as server, http_gateway(server) as gw:
            status, reply, headers = await post(f"{gw.url}/score/judged", one)
            assert status == 502 and reply["error"]["code"] == "FAILED_PRECONDITION", reply
            assert "Retry-After" not in headers
            status, reply, _ = await post(f"{gw.url}/score/judged", [one, {"prompt": "p", "response": 3}])
            assert status == 200
            assert [r["error"]["code"] for r in reply] == ["FAILED_PRECONDITION", "INVALID_ARGUMENT"]
            body = {"query": [PROMPT + " #### 4"], "prompts": [PROMPT], "labels": ["4"]}
            status, reply, headers = await post(f"{gw.url}/get_reward?pipeline=judged", body)
            assert status == 502 and reply["rewards"] == [None] and "Retry-After" not in headers
            assert reply["errors"][0]["code"] == "FAILED_PRECONDITION" and "judge" in reply["errors"][0]["message"]


async def test_the_servers_size_limits_hold_on_the_gateway_too() -> None:
    """The limits hold on the second front door: counts and sizes over the limits are refused naming the option."""
    limits = Limits(max_samples_per_request=3, max_text_chars=100, max_extra_info_depth=2)
    async with reward_server() as server, http_gateway(server, default_pipeline="gsm8k", limits=limits) as gw:
        status, reply, _ = await post(f"{gw.url}/get_reward", {"query": ["#### 4"] * 4, "labels": ["4"] * 4})
        assert status == 400 and "max_samples_per_request" in reply["error"]["message"], reply
        status, reply, _ = await post(f"{gw.url}/score/gsm8k", [{"response": "#### 4"}] * 4)
        assert status == 400 and "number of items is 4" in reply["error"]["message"], reply
        body = {"query": ["#### 4", "x" * 101], "labels": ["4", "4"]}
        status, reply, _ = await post(f"{gw.url}/get_reward", body)
        assert status == 400 and reply["rewards"] == [1.0, None]  # the other sample is scored
        assert "query[1] length is 101" in reply["errors"][1]["message"], reply
        assert "max_text_chars" in reply["errors"][1]["message"]
        deep = {"response": "#### 4", "label": "4", "extra_info": {"a": {"b": {"c": 1}}}}
        status, reply, _ = await post(f"{gw.url}/score/gsm8k", deep)
        assert status == 400 and "max_extra_info_depth" in reply["error"]["message"], reply


def http_call(url: str, body: Any = None, token: str = "") -> tuple[int, Any, dict[str, str]]:
    """One blocking request (a GET without a body); the status, JSON reply and headers, errors included."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def serve_reward(tmp_path: Path, http_port: int, *flags: str, pipelines: str = "") -> ServerProcess:
    """`rewardmesh serve reward --http-port N ...` as a real process (not started)."""
    argv = [sys.executable, "-m", "rewardmesh.server.cli", "serve", "reward", "--port", "0", "--host", "127.0.0.1",
            "--http-port", str(http_port), "--http-pipeline", "gsm8k", *flags]  # fmt: skip
    if pipelines:
        (tmp_path / "config.yaml").write_text(pipelines)
        argv += ["--config", str(tmp_path / "config.yaml")]
    return ServerProcess("reward", argv, tmp_path)


ONE = {"query": [PROMPT + " #### 4"], "prompts": [PROMPT], "labels": ["4"]}


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_serve_reward_http_port_serves_the_gateway_with_its_token(tmp_path: Path) -> None:
    """`rewardmesh serve reward --http-port N --http-token-file F`: listening once the port file is there."""
    http_port = free_port()
    (tmp_path / "token").write_text("t0ken\n")
    server = serve_reward(tmp_path, http_port, "--http-token-file", str(tmp_path / "token"))
    url = f"http://127.0.0.1:{http_port}"
    try:
        server.start(timeout_s=90)
        status, reply, _ = http_call(f"{url}/get_reward", ONE, token="t0ken")  # no retry: it listens already
        assert status == 200 and reply["rewards"] == [1.0]
        assert http_call(f"{url}/get_reward", ONE, token="wrong")[0] == 401
        assert http_call(f"{url}/t/t0ken/get_reward", ONE)[1]["rewards"] == [1.0]
        assert server.stop(timeout_s=60) == 0
    finally:
        server.kill()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_grpc_token_without_an_http_token_closes_the_gateway_too(tmp_path: Path) -> None:
    """The gateway shares the gRPC auth policy: a server closed on gRPC is never open on HTTP."""
    http_port = free_port()
    (tmp_path / "grpc-token").write_text("g-secret\n")
    server = serve_reward(tmp_path, http_port, "--auth-token-file", str(tmp_path / "grpc-token"))
    url = f"http://127.0.0.1:{http_port}"
    try:
        server.start(timeout_s=90)
        status, reply, _ = http_call(f"{url}/get_reward", ONE)
        assert status == 401 and reply["error"]["code"] == "UNAUTHENTICATED"
        assert http_call(f"{url}/get_reward", ONE, token="g-secret")[0] == 200
        assert http_call(f"{url}/health")[0] == 200  # probes stay open, as gRPC health
        assert server.stop(timeout_s=60) == 0
        assert "it requires the gRPC auth token" in server.log_path.read_text()
    finally:
        server.kill()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_after_sigterm_the_gateway_drains_with_grpc_health(tmp_path: Path) -> None:
    """SIGTERM: /health 503 and new work 503 + Retry-After at once (as gRPC goes NOT_SERVING), the request
    in flight still answered, then a clean exit."""
    http_port = free_port()
    pipelines = f"pipelines:\n  sleepy:\n    sources:\n      - {{type: function, function: '{FNS}:sleepy'}}\n"
    server = serve_reward(tmp_path, http_port, "--grace-s", "30", pipelines=pipelines)
    url = f"http://127.0.0.1:{http_port}"
    started = tmp_path / "started"
    slow = {"prompt": "p", "response": "four", "extra_info": {"delay": 3, "started_file": str(started)}}
    try:
        server.start(timeout_s=90)
        assert http_call(f"{url}/health")[0] == 200
        in_flight: list[Any] = []
        caller = threading.Thread(target=lambda: in_flight.append(http_call(f"{url}/score/sleepy", slow)))
        caller.start()
        wait_until(started.exists, "the slow sample is being scored")
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: http_call(f"{url}/health")[0] == 503, "/health answers 503 while draining", 20)
        status, reply, _ = http_call(f"{url}/health")
        assert reply["status"] == "NOT_SERVING"
        assert asyncio.run(grpc_health(server.address)) == "NOT_SERVING"
        status, reply, headers = http_call(f"{url}/score/sleepy", {"prompt": "p", "response": "x"})
        assert status == 503 and reply["error"]["code"] == "UNAVAILABLE" and headers["Retry-After"] == "1"
        caller.join(30)
        assert in_flight and in_flight[0][0] == 200 and in_flight[0][1]["score"] == 4.0
        assert server.proc.wait(60) == 0
    finally:
        server.kill()


async def grpc_health(address: str) -> str:
    from grpc import aio
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
