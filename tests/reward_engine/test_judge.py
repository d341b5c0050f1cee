"""JudgeSource against a local fake OpenAI-compatible server: parsing, limits, timeouts, retries."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import pytest

from rewardmesh.common.errors import DeadlineExceeded, DependencyFailed, InvalidInput, SourceFailed, Unavailable
from rewardmesh.reward_engine.sources.judge import JudgeSource, chat_completions_url
from rewardmesh.reward_engine.types import RewardOutput
from tests.support.fake_openai import DroppingServer, FakeOpenAI, Reply
from tests.support.ports import refusing_port
from tests.support.samples import reward_input
from tests.support.waiting import eventually

# What the judge is asked about unless a test says otherwise.
sample = functools.partial(reward_input, prompt="What is 6 x 7?", ground_truth="42")


def judged(score: float, raw: float) -> RewardOutput:
    """The output expected for a judge reply of ``raw``, with the score rounded as the division does."""
    return RewardOutput(score=pytest.approx(score), extras={"judge_raw": raw})  # type: ignore[arg-type]


def judge(url: str, **config: Any) -> JudgeSource:
    return JudgeSource(name=config.pop("name", "judge"), url=url, model=config.pop("model", "judge-model"), **config)


async def test_score_is_parsed_and_scaled() -> None:
    replies = {
        "a": "The response is right.\nScore: 7",
        "b": "**Score:** 9",
        "c": "A score: 3 would be harsh. Final verdict:\nScore = 6.5/10",
    }
    async with FakeOpenAI(reply=lambda body: replies[body["messages"][-1]["content"][-1]]) as server:
        source = judge(server.url, prompt_template="{response}")
        try:
            results = await source.score_batch([sample("a"), sample("b"), sample("c")])
        finally:
            await source.close()
    assert results == [
        judged(0.7, 7.0),
        judged(0.9, 9.0),
        judged(0.65, 6.5),  # the last match counts
    ]
    assert {r.path for r in server.requests} == {"/v1/chat/completions"}


async def test_template_fields_and_request_body(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_TEST_KEY", "sekret")
    template = "Q={prompt}|A={response}|REF={ground_truth}|SRC={data_source}|TOPIC={extra_info[topic]}|{{literal}}"
    async with FakeOpenAI(reply="Score: 10") as server:
        source = judge(
            server.url + "/v1",
            model="qwen-judge",
            prompt_template=template,
            score_regex=r"Score: (\d+)",
            score_scale=1.0,
            system_prompt="Be fair.",
            temperature=0.3,
            max_tokens=64,
            api_key_env="JUDGE_TEST_KEY",
        )
        try:
            (result,) = await source.score_batch(
                [sample("It is 42 {not a field}", prompt="6x7?", data_source="arith", topic="times")]
            )
        finally:
            await source.close()
    assert result == RewardOutput(10.0, {"judge_raw": 10.0})
    (request,) = server.requests
    assert request.body == {
        "model": "qwen-judge",
        "messages": [
            {"role": "system", "content": "Be fair."},
            {"role": "user", "content": "Q=6x7?|A=It is 42 {not a field}|REF=42|SRC=arith|TOPIC=times|{literal}"},
        ],
        "temperature": 0.3,
        "max_tokens": 64,
    }
    assert request.headers["Authorization"] == "Bearer sekret"


async def test_default_template_shows_everything() -> None:
    async with FakeOpenAI(reply="Fine.\nScore: 8") as server:
        source = judge(server.url, api_key_env="JUDGE_TEST_UNSET_VARIABLE")
        try:
            (result,) = await source.score_batch([sample("The product is 42.", prompt="What is 6 x 7?")])
        finally:
            await source.close()
    assert result == judged(0.8, 8.0)
    text = server.requests[0].user_message
    assert "What is 6 x 7?" in text and "The product is 42." in text and "\n42\n" in text
    assert "Authorization" not in server.requests[0].headers
    assert [m["role"] for m in server.requests[0].body["messages"]] == ["user"]


async def test_max_concurrency_is_respected() -> None:
    """Each request is answered only once three are in flight together (or all twelve have arrived): the limit
    is reached by construction, whatever the machine's timing, and a fourth would show in the peak."""

    async def when_three_in_flight(body: dict[str, Any]) -> Reply:
        await eventually(lambda: server.in_flight >= 3 or len(server.requests) == 12, "three requests in flight")
        return Reply(content="Score: 5")

    async with FakeOpenAI(reply=when_three_in_flight) as server:
        source = judge(server.url, max_concurrency=3)
        try:
            results = await source.score_batch([sample(str(i)) for i in range(12)])
        finally:
            await source.close()
    assert all(isinstance(r, RewardOutput) for r in results)
    assert len(server.requests) == 12
    assert server.peak_in_flight == 3  # never more, and the limit is actually used


async def test_requests_per_minute_is_respected() -> None:
    async with FakeOpenAI(reply="Score: 5") as server:
        source = judge(server.url, requests_per_minute=600, max_concurrency=10)  # one per 0.1 s
        try:
            started = time.monotonic()
            results = await source.score_batch([sample(str(i)) for i in range(10)])
            elapsed = time.monotonic() - started
        finally:
            await source.close()
    assert all(isinstance(r, RewardOutput) for r in results)
    # The tenth request's slot is 0.9 s after the first: a lower bound, safe on a loaded machine (the gap
    # between arrivals is not: a late first arrival shrinks it). The upper bound only catches a stall.
    assert len(server.requests) == 10
    assert elapsed >= 0.88
    assert elapsed < 20.0


async def test_timeout_is_deadline_exceeded_for_that_sample_only() -> None:
    def reply(body: dict[str, Any]) -> Reply:
        slow = "slow" in body["messages"][-1]["content"]
        return Reply(content="Score: 4", delay_s=30 if slow else 0)

    async with FakeOpenAI(reply=reply) as server:
        source = judge(server.url, prompt_template="{response}", timeout_s=0.3, max_retries=3)
        try:
            started = time.monotonic()
            results = await source.score_batch([sample("slow"), sample("fast")])
            elapsed = time.monotonic() - started
        finally:
            await source.close()
    assert isinstance(results[0], DeadlineExceeded) and "0.3s" in str(results[0])
    assert results[1] == judged(0.4, 4.0)
    assert len(server.requests) == 2  # a timeout is not retried
    assert elapsed < 20.0  # the slow reply (30 s) was not waited for


async def test_http_error_is_source_failed_and_not_retried() -> None:
    async with FakeOpenAI(reply=Reply(status=500, raw_body="upstream model crashed: CUDA OOM")) as server:
        source = judge(server.url, max_retries=3, retry_backoff_s=0.01)
        try:
            (result,) = await source.score_batch([sample("x")])
        finally:
            await source.close()
    assert isinstance(result, SourceFailed)
    assert "HTTP 500" in str(result) and "CUDA OOM" in str(result)
    assert len(server.requests) == 1


async def test_client_error_status_is_source_failed() -> None:
    async with FakeOpenAI(reply=Reply(status=404, raw_body='{"error": "model not found"}')) as server:
        source = judge(server.url, max_retries=2)
        try:
            (result,) = await source.score_batch([sample("x")])
        finally:
            await source.close()
    assert isinstance(result, SourceFailed) and "HTTP 404" in str(result) and "model not found" in str(result)
    assert len(server.requests) == 1


async def test_connection_refused_is_retried_then_dependency_failed() -> None:
    with refusing_port() as port:
        source = judge(f"http://127.0.0.1:{port}", max_retries=3, retry_backoff_s=0.05)
        try:
            started = time.monotonic()
            (result,) = await source.score_batch([sample("x")])
            elapsed = time.monotonic() - started
        finally:
            await source.close()
    assert isinstance(result, DependencyFailed)  # not UNAVAILABLE: another reward server fails the same way
    assert "after 4 attempt(s)" in str(result)
    assert elapsed >= 0.05 + 0.1 + 0.2 - 0.02  # the three backoffs between the four attempts


async def test_dropped_connections_are_retried_exactly_max_retries_times() -> None:
    async with DroppingServer() as server:
        source = judge(server.url, max_retries=2, retry_backoff_s=0.01)
        try:
            (result,) = await source.score_batch([sample("x")])
        finally:
            await source.close()
    assert isinstance(result, DependencyFailed) and "after 3 attempt(s)" in str(result)
    assert server.connections == 3


async def test_unparseable_reply_is_source_failed_quoting_it() -> None:
    async with FakeOpenAI(reply="I refuse to grade this response because it is rude.") as server:
        source = judge(server.url, max_retries=3)
        try:
            (result,) = await source.score_batch([sample("x")])
        finally:
            await source.close()
    assert isinstance(result, SourceFailed)
    assert "I refuse to grade" in str(result) and "no score" in str(result)
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    "body",
    ["<html>502 Bad Gateway</html>", '{"choices": []}', '{"choices": [{"message": {"content": null}}]}'],
)
async def test_garbage_body_is_source_failed(body: str) -> None:
    async with FakeOpenAI(reply=Reply(status=200, raw_body=body)) as server:
        source = judge(server.url)
        try:
            (result,) = await source.score_batch([sample("x")])
        finally:
            await source.close()
    assert isinstance(result, SourceFailed) and body[:10] in str(result)


async def test_missing_template_field_fails_only_that_sample() -> None:
    async with FakeOpenAI(reply="Score: 3") as server:
        source = judge(server.url, prompt_template="{response} on {extra_info[topic]}")
        try:
            results = await source.score_batch([sample("a", topic="sums"), sample("b", sid="no-topic")])
        finally:
            await source.close()
    assert results[0] == judged(0.3, 3.0)
    assert isinstance(results[1], InvalidInput) and "no-topic" in str(results[1]) and "topic" in str(results[1])
    assert len(server.requests) == 1


async def test_closed_source_is_unavailable() -> None:
    async with FakeOpenAI(reply="Score: 3") as server:
        source = judge(server.url)
        await source.close()
        (result,) = await source.score_batch([sample("a")])
    assert isinstance(result, Unavailable) and server.requests == []


def test_endpoint_url_forms() -> None:
    assert chat_completions_url("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h:8000/") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h:8000/v1") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("https://h/api/v1/chat/completions") == "https://h/api/v1/chat/completions"
    source = judge("http://h:8000/v1")
    assert (source.kind, source.target, source.endpoint) == (
        "judge",
        "http://h:8000/v1",
        "http://h:8000/v1/chat/completions",
    )


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"url": "h:8000"}, "'url'"),
        ({"model": ""}, "'model'"),
        ({"prompt_template": "Rate {answer}"}, "'prompt_template'"),
        ({"prompt_template": "Rate {prompt} {"}, "'prompt_template'"),
        ({"prompt_template": "Rate {prompt}"}, "never shows the judge the {response}"),
        ({"score_regex": "Score: ("}, "'score_regex'"),
        ({"max_concurrency": 0}, "'max_concurrency'"),
        ({"requests_per_minute": -1}, "'requests_per_minute'"),
        ({"timeout_s": 0}, "'timeout_s'"),
        ({"max_retries": -1}, "'max_retries'"),
        ({"max_tokens": 0}, "'max_tokens'"),
    ],
)
def test_bad_config_names_the_key(config: dict[str, Any], key: str) -> None:
    url = config.pop("url", "http://127.0.0.1:1")
    with pytest.raises(ValueError, match=key.replace("{", r"\{").replace("}", r"\}")):
        judge(url, **config)


async def test_circuit_breaker_fails_samples_fast_during_an_outage_and_recovers() -> None:
    async with DroppingServer() as server:
        source = judge(
            server.url, max_retries=1, retry_backoff_s=0.01, breaker_failures=3, breaker_open_s=30, max_concurrency=2
        )
        try:
            results = await source.score_batch([sample(str(i), sid=str(i)) for i in range(20)])
            assert all(isinstance(r, DependencyFailed) for r in results)
            # The breaker opened after 3 failed attempts: the other samples never reached the endpoint.
            assert server.connections <= 3 + 2  # attempts already in flight when it opened may finish
            assert any("circuit open" in str(r) for r in results)
        finally:
            await source.close()


async def test_circuit_breaker_half_open_probe_closes_it_when_the_judge_is_back() -> None:
    async with FakeOpenAI(reply=Reply(status=503, raw_body="overloaded")) as server:
        source = judge(server.url, breaker_failures=2, breaker_open_s=1.0, max_concurrency=1)
        try:
            first = await source.score_batch([sample("a"), sample("b"), sample("c")])
            assert [type(r) for r in first] == [SourceFailed, SourceFailed, DependencyFailed]
            assert len(server.requests) == 2
            server.reply = "Score: 8"
            await asyncio.sleep(1.05)  # a lower bound: the breaker is half-open after at least this long
            assert await source.score_batch([sample("d")]) == [judged(0.8, 8.0)]  # the probe
            assert await source.score_batch([sample("e")]) == [judged(0.8, 8.0)]  # closed again
        finally:
            await source.close()


async def test_a_breaker_is_shared_while_open_and_forgotten_with_its_last_source() -> None:
    """Sources of one endpoint and settings share a breaker; one left open by closed sources does not
    greet the next server at that address (an ephemeral port is reused), nor a source with other settings."""
    async with FakeOpenAI(reply=Reply(status=503, raw_body="down")) as server:
        first = judge(server.url, breaker_failures=2, breaker_open_s=30, max_concurrency=1)
        twin = judge(server.url, breaker_failures=2, breaker_open_s=30, max_concurrency=1)
        other = judge(server.url, breaker_failures=5, breaker_open_s=30, max_concurrency=1)
        try:
            await first.score_batch([sample("a"), sample("b")])
            assert len(server.requests) == 2
            assert isinstance((await twin.score_batch([sample("c")]))[0], DependencyFailed)  # shared, open
            assert isinstance((await other.score_batch([sample("d")]))[0], SourceFailed)  # its own breaker
            assert len(server.requests) == 3
        finally:
            await first.close()
            await other.close()
        try:
            assert isinstance((await twin.score_batch([sample("e")]))[0], DependencyFailed)  # still a user
        finally:
            await twin.close()
        server.reply = "Score: 8"
        fresh = judge(server.url, breaker_failures=2, breaker_open_s=30, max_concurrency=1)
        try:
            assert await fresh.score_batch([sample("f")]) == [judged(0.8, 8.0)]
        finally:
            await fresh.close()


async def test_hostile_reply_for_the_score_regex_is_that_sample_s_deadline() -> None:
    """A catastrophically backtracking score_regex on a judge reply is stopped by the parser's budget."""
    reply = "a" * 40 + "!"

    async with FakeOpenAI(reply=lambda body: reply if "evil" in body["messages"][-1]["content"] else "aaaa1") as server:
        source = judge(server.url, prompt_template="{response}", score_regex=r"(?:a+)+(\d)", parse_timeout_s=0.5)
        try:
            results = await source.score_batch([sample("evil"), sample("fine")])
        finally:
            await source.close()
    assert isinstance(results[0], DeadlineExceeded) and "parser timed out" in str(results[0])
    assert results[1] == judged(0.1, 1.0)
