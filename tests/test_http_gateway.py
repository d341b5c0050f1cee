"""The reward server's HTTP gateway over real sockets: OpenRLHF's /get_reward and slime's /score/{pipeline}."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from rewardmesh.server.config import resolve
from rewardmesh.server.http_gateway import _HTTP, load_token, server_ssl_context, strip_prompt
from rewardmesh.server.limits import Limits
from rewardmesh.server.reward_server import RewardServerConfig
from tests.support.fake_openai import closed_port
from tests.support.pki import make_pki
from tests.support.servers import FNS, fn_pipeline, http_gateway, reward_server

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


async def test_openrlhf_per_sample_errors_match_grpc_and_the_rest_are_scored() -> None:
    pipelines = {"explode": {"sources": [{"type": "function", "function": f"{FNS}:explode", "executor": "thread"}]}}
    async with reward_server(pipelines) as server, http_gateway(server, default_pipeline="gsm8k") as gw:
        bad_label = {"query": [PROMPT + " #### 4", PROMPT + " #### 4"], "prompts": [PROMPT, 7], "labels": ["4", "4"]}
        status, reply, _ = await post(f"{gw.url}/get_reward", bad_label)
        assert status == 200
        assert reply["rewards"] == [1.0, None]
        assert reply["errors"][0] is None
        assert reply["errors"][1]["code"] == "INVALID_ARGUMENT" and "prompts[1]" in reply["errors"][1]["message"]

        status, reply, _ = await post(f"{gw.url}/get_reward?pipeline=explode", {"query": ["x"], "labels": ["4"]})
        assert status == 200 and reply["rewards"] == [None]
        assert reply["errors"][0]["code"] == "INTERNAL" and "checker bug" in reply["errors"][0]["message"]

        status, reply, _ = await post(f"{gw.url}/get_reward?pipeline=nope", {"query": ["x"]})
        assert status == 404 and reply["error"]["code"] == "NOT_FOUND" and "gsm8k" in reply["error"]["message"]
        status, reply, _ = await post(f"{gw.url}/get_reward", {"query": ["a", "b"], "labels": ["1"]})
        assert status == 400 and "labels: expected a list of 2 items, got 1" in reply["error"]["message"]
        status, reply, _ = await post(f"{gw.url}/get_reward", b"{not json")
        assert status == 400 and reply["error"]["code"] == "INVALID_ARGUMENT"


async def test_slime_single_and_list_forms_and_errors_as_http_status() -> None:
    pipelines = {"explode": {"sources": [{"type": "function", "function": f"{FNS}:explode", "executor": "thread"}]}}
    async with reward_server(pipelines) as server, http_gateway(server) as gw:
        one = {"prompt": PROMPT, "response": "#### 4", "label": "4"}
        status, reply, _ = await post(f"{gw.url}/score/gsm8k", one)
        assert status == 200 and reply["score"] == 1.0 and reply["acc"] == 1.0
        chat = {"prompt": [{"role": "user", "content": "2+2?"}], "response": "#### 5", "label": "4"}
        status, reply, _ = await post(f"{gw.url}/score/gsm8k", [one, chat, {"prompt": "p", "response": 3}])
        assert status == 200
        assert [r["score"] for r in reply] == [1.0, 0.0, None]
        assert reply[2]["error"]["code"] == "INVALID_ARGUMENT" and "[2].response" in reply[2]["error"]["message"]
        status, reply, _ = await post(f"{gw.url}/score/explode", one)
        assert status == 500 and reply["error"]["code"] == "INTERNAL"
        status, reply, _ = await post(f"{gw.url}/score/gsm8k", {"prompt": PROMPT})
        assert status == 400 and "response" in reply["error"]["message"]


async def test_overload_is_503_with_retry_after_and_draining_refuses_new_requests() -> None:
    pipelines = {"sleepy": fn_pipeline("sleepy", max_queue_size=1, max_concurrent_batches=1)}
    async with reward_server(pipelines) as server, http_gateway(server) as gw:
        slow = {"prompt": "p", "response": "r", "label": "", "extra_info": {"delay": 0.5}}
        results = await asyncio.gather(*(post(f"{gw.url}/score/sleepy", slow) for _ in range(6)))
        statuses = sorted(s for s, _, _ in results)
        assert statuses[0] == 200 and statuses[-1] == 503
        busy = next(r for r in results if r[0] == 503)
        assert busy[1]["error"]["code"] == "RESOURCE_EXHAUSTED" and busy[2]["Retry-After"] == "1"
        gw._draining = True
        status, reply, _ = await post(f"{gw.url}/score/sleepy", slow)
        assert status == 503 and reply["error"]["code"] == "UNAVAILABLE"


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
    judge = {"type": "judge", "url": f"http://127.0.0.1:{closed_port()}", "model": "m", "max_retries": 0}
    pipelines = {"judged": {"sources": [judge]}}
    one = {"prompt": PROMPT, "response": "#### 4", "label": "4"}
    async with reward_server(pipelines) as server, http_gateway(server) as gw:
        status, reply, headers = await post(f"{gw.url}/score/judged", one)
        assert status == 502 and reply["error"]["code"] == "FAILED_PRECONDITION", reply
        assert "Retry-After" not in headers
        status, reply, _ = await post(f"{gw.url}/score/judged", [one, {"prompt": "p", "response": 3}])
        assert status == 200
        assert [r["error"]["code"] for r in reply] == ["FAILED_PRECONDITION", "INVALID_ARGUMENT"]
        body = {"query": [PROMPT + " #### 4"], "prompts": [PROMPT], "labels": ["4"]}
        status, reply, _ = await post(f"{gw.url}/get_reward?pipeline=judged", body)
        assert status == 200 and reply["rewards"] == [None]
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
        assert status == 200 and reply["rewards"] == [1.0, None]  # the other sample is scored
        assert "query[1] length is 101" in reply["errors"][1]["message"], reply
        assert "max_text_chars" in reply["errors"][1]["message"]
        deep = {"response": "#### 4", "label": "4", "extra_info": {"a": {"b": {"c": 1}}}}
        status, reply, _ = await post(f"{gw.url}/score/gsm8k", deep)
        assert status == 400 and "max_extra_info_depth" in reply["error"]["message"], reply


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_serve_reward_http_port_serves_the_gateway_with_its_token(tmp_path: Path) -> None:
    """`rewardmesh serve reward --http-port N --http-token-file F` as a real process."""
    import socket
    import sys
    import time
    import urllib.error
    import urllib.request

    from rewardmesh.demo.server_process import ServerProcess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    (tmp_path / "token").write_text("t0ken\n")
    argv = [sys.executable, "-m", "rewardmesh.server.cli", "serve", "reward", "--port", "0", "--host", "127.0.0.1",
            "--http-port", str(http_port), "--http-pipeline", "gsm8k",
            "--http-token-file", str(tmp_path / "token")]  # fmt: skip
    server = ServerProcess("reward", argv, tmp_path)
    body = json.dumps({"query": [PROMPT + " #### 4"], "prompts": [PROMPT], "labels": ["4"]}).encode()

    def post_sync(token: str) -> tuple[int, Any]:
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/get_reward", data=body, method="POST")
        req.add_header("Content-Type", "application/json")
        req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    try:
        server.start(timeout_s=90)
        deadline = time.monotonic() + 60
        while True:  # the gateway opens right after the gRPC port
            try:
                status, reply = post_sync("t0ken")
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert status == 200 and reply["rewards"] == [1.0]
        assert post_sync("wrong")[0] == 401
        assert server.stop(timeout_s=60) == 0
    finally:
        server.kill()
