"""An LLM judge behind an OpenAI-compatible chat-completions endpoint (vLLM, SGLang, OpenAI, ...).

Everything is async on aiohttp (a session per tenant): a judge call is pure network wait, so hundreds can be
in flight on the event loop without threads; max_concurrency and requests_per_minute protect the
judge server, not us, and are the source's capacity: the pipeline hands over a sample only when a request
may start (common.rate_limit, common.circuit_breaker: the limiter and breaker any HTTP client can use).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import string
from typing import Any

import aiohttp

from rewardmesh.common.circuit_breaker import acquire_breaker, release_breaker
from rewardmesh.common.errors import (
    DeadlineExceeded,
    DependencyFailed,
    InvalidInput,
    RewardError,
    SourceFailed,
    Unavailable,
    describe_exception,
)
from rewardmesh.common.rate_limit import RateLimiter
from rewardmesh.reward_engine.isolation import Call, IsolatedPool
from rewardmesh.reward_engine.sources import options
from rewardmesh.reward_engine.types import (
    BatchResult,
    Capacity,
    Outcome,
    RewardInput,
    RewardOutput,
    RewardSource,
    SourceKind,
)

DEFAULT_PROMPT_TEMPLATE = """\
You are a strict grader. Rate how well the response below answers the prompt, on a scale from 0 \
(wrong, off-topic or no answer) to 10 (fully correct, complete and clear). If a reference answer is \
given, a response whose final answer disagrees with it cannot score above 2.

[Prompt]
{prompt}

[Reference answer (may be empty)]
{ground_truth}

[Response]
{response}

Explain your judgement in a few sentences, then give the rating on the last line, exactly in the \
form "Score: N" with N an integer from 0 to 10."""

# "Score: 7", "score = 7.5", "**Score:** 7", "Score: 7/10"; the last match in the reply counts.
DEFAULT_SCORE_REGEX = r"(?i)score\s*\**\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"

TEMPLATE_FIELDS = ("prompt", "response", "ground_truth", "data_source", "extra_info")

_SNIPPET_CHARS = 200


class _AnyKey(dict[str, Any]):
    """extra_info stand-in for checking a template: any {extra_info[key]} is acceptable there."""

    def __missing__(self, key: str) -> str:
        return ""


def chat_completions_url(url: str) -> str:
    """Accept a server root, an OpenAI-style base URL ending in /v1, or the full endpoint."""
    base = url.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if base.endswith("/v1"):
        return base + "/chat/completions"
    return base + "/v1/chat/completions"


class _HTTPFailure(Exception):
    """A reply we will not retry (HTTP error status, unusable body)."""

    def __init__(self, message: str, *, server_error: bool = False) -> None:
        super().__init__(message)
        self.server_error = server_error  # a 5xx: counts against the endpoint's circuit breaker


# The score sits at the end of a reply; a regex never sees more than this many of its last characters.
_PARSE_CLIP_CHARS = 8192


_PARSER = "rewardmesh.reward_engine.sources.judge:parse_reply"


def parse_reply(reply: str, pattern: str, scale: float) -> RewardOutput:
    """The judge's number from its reply (the last match of ``pattern``), times ``scale``.

    Runs in an isolated worker: the pattern is the user's and the reply is the judge's answer to what
    a policy wrote, so a pathological pair could backtrack for hours.
    """
    score_re = re.compile(pattern)
    matches = list(score_re.finditer(reply[-_PARSE_CLIP_CHARS:]))
    if not matches:
        raise SourceFailed(f"judge reply has no score matching {pattern!r}: {_snippet(reply)}")
    last = matches[-1]
    text = last.group(1) if score_re.groups else last.group(0)
    try:
        raw = float(text)
    except (TypeError, ValueError):
        raise SourceFailed(f"judge score {text!r} is not a number; reply: {_snippet(reply)}") from None
    if not math.isfinite(raw):
        raise SourceFailed(f"judge score {text!r} is not finite; reply: {_snippet(reply)}")
    return RewardOutput(score=raw * scale, extras={"judge_raw": raw})


def _snippet(text: str) -> str:
    return repr(text[:_SNIPPET_CHARS] + ("..." if len(text) > _SNIPPET_CHARS else ""))


class JudgeSource(RewardSource):
    """Scores each sample by asking an LLM judge and parsing a number out of its reply.

    Config keys:
      url: judge server (e.g. http://vllm:8000, .../v1 or the full .../v1/chat/completions).
      model: model name sent in the request.
      prompt_template: str.format template with {prompt}, {response}, {ground_truth},
        {data_source} and {extra_info[key]}; write literal braces as {{ }}.
      score_regex: the last match's group 1 (or whole match if no group) is the judge's number;
        score = number * score_scale (default 0.1 maps 0-10 to 0-1). Extra ``judge_raw`` = number.
      max_concurrency: requests in flight to the judge at once, from this source (its capacity: a sample
        holds one until answered, its retries included).
      requests_per_minute: request starts per minute, retries included (0 = unlimited); samples are then
        handed over one at a time, as the limit allows.
      timeout_s: per HTTP attempt -> DeadlineExceeded (not retried: the judge is slow, not away).
      max_retries, retry_backoff_s: connection errors only (refused, reset, DNS) are retried, with
        backoff retry_backoff_s * 2**n, then DependencyFailed (FAILED_PRECONDITION: another reward
        server would fail the same way, so clients do not re-route it). HTTP errors are never retried:
        a 4xx will not improve and a 5xx judge under load should not get extra traffic from us.
      breaker_failures, breaker_open_s: the endpoint's circuit breaker (common.circuit_breaker): after this
        many consecutive failures, samples fail at once with DependencyFailed for breaker_open_s.
      parse_timeout_s: time budget for parsing one reply in the isolated parser worker.
      temperature, max_tokens, system_prompt: sent as is.
      api_key_env: environment variable holding a bearer token, read when the session opens
        (unset or empty = no Authorization header).
    """

    kind = SourceKind.JUDGE
    extra_keys = ("judge_raw",)

    def __init__(
        self,
        name: str,
        url: str,
        model: str,
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
        score_regex: str = DEFAULT_SCORE_REGEX,
        score_scale: float = 0.1,
        max_concurrency: int = 8,
        requests_per_minute: float = 0,
        timeout_s: float = 60,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        temperature: float = 0.0,
        max_tokens: int = 256,
        api_key_env: str = "OPENAI_API_KEY",
        system_prompt: str = "",
        breaker_failures: int = 5,
        breaker_open_s: float = 10.0,
        parse_timeout_s: float = 2.0,
    ) -> None:
        where = options.source_where("judge source", name)
        self._score_re = self._check_request(where, url, model, prompt_template, score_regex, score_scale)
        self._check_pacing(where, max_concurrency, requests_per_minute, timeout_s, max_retries, retry_backoff_s)
        options.non_negative(where, "temperature", temperature)
        options.integer(where, "max_tokens", max_tokens, minimum=1)
        options.text(where, "api_key_env", api_key_env, empty=True)
        options.text(where, "system_prompt", system_prompt, empty=True)
        options.integer(where, "breaker_failures", breaker_failures, minimum=1)
        options.positive(where, "breaker_open_s", breaker_open_s)
        options.positive(where, "parse_timeout_s", parse_timeout_s)

        self.name = name
        self.target = url
        self.endpoint = chat_completions_url(url)
        self.model = model
        self.prompt_template = prompt_template
        self.score_scale = float(score_scale)
        self.max_concurrency = max_concurrency
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self.retry_backoff_s = float(retry_backoff_s)
        self.temperature = float(temperature)
        self.max_tokens = max_tokens
        self.api_key_env = api_key_env
        self.system_prompt = system_prompt
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._limiter = RateLimiter(float(requests_per_minute))
        self._sessions: dict[str, aiohttp.ClientSession] = {}  # by tenant
        self._closed = False
        self.breaker = acquire_breaker(self.endpoint, breaker_failures, float(breaker_open_s))
        self._score_pattern = score_regex
        self._parser = self._reply_parser(name, score_regex, float(parse_timeout_s))

    @staticmethod
    def _check_request(
        where: str, url: Any, model: Any, prompt_template: Any, score_regex: Any, score_scale: Any
    ) -> re.Pattern[str]:
        """Reject, at config time, a judge that cannot be asked or whose replies cannot be read; the compiled
        ``score_regex`` is what comes back."""
        if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+", url):
            raise ValueError(f"{where}: 'url' must be an http:// or https:// URL, got {url!r}")
        options.text(where, "model", model)
        JudgeSource._check_template(where, prompt_template)
        try:
            score_re = re.compile(score_regex)
        except (re.error, TypeError) as exc:
            raise ValueError(f"{where}: 'score_regex' {score_regex!r} does not compile: {exc}") from exc
        options.number(where, "score_scale", score_scale)
        return score_re

    @staticmethod
    def _check_pacing(
        where: str, max_concurrency: Any, requests_per_minute: Any, timeout_s: Any, max_retries: Any, backoff_s: Any
    ) -> None:
        """Reject, at config time, limits on how many requests go out, how fast, how long each may take and how
        often one is retried."""
        options.integer(where, "max_concurrency", max_concurrency, minimum=1)
        options.non_negative(where, "requests_per_minute", requests_per_minute, note=" (0 = unlimited)")
        options.positive(where, "timeout_s", timeout_s)
        options.integer(where, "max_retries", max_retries, minimum=0)
        options.non_negative(where, "retry_backoff_s", backoff_s)

    @staticmethod
    def _reply_parser(name: str, score_regex: str, parse_timeout_s: float) -> IsolatedPool | None:
        """Where replies are parsed: the default regex is linear-time on a clipped reply, so inline (None). A user's
        regex may backtrack for hours on some reply, so it is parsed in an isolated worker under parse_timeout_s."""
        if score_regex == DEFAULT_SCORE_REGEX:
            return None
        return IsolatedPool(f"judge-{name}", workers=1, timeout_s=parse_timeout_s, memory_mb=256, preload=(_PARSER,))

    @staticmethod
    def _check_template(where: str, template: Any) -> None:
        """Reject a template that would fail on every sample, at config time."""
        if not isinstance(template, str) or not template:
            raise ValueError(f"{where}: 'prompt_template' must be a non-empty string")
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
            probe = dict.fromkeys(TEMPLATE_FIELDS[:-1], "")
            template.format_map({**probe, "extra_info": _AnyKey()})
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            raise ValueError(
                f"{where}: 'prompt_template' is not a valid template ({describe_exception(exc)}); "
                f"fields: {', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)}; literal braces are {{{{ }}}}"
            ) from exc
        if not any(re.match(r"response\b", f) for f in fields):
            raise ValueError(f"{where}: 'prompt_template' never shows the judge the {{response}}")

    def _session_for(self, tenant: str) -> aiohttp.ClientSession:
        """The tenant's own connections. Stopping a request for another tenant's closes its connection (HTTP/1.1
        cannot abandon a response and keep it); the tenant whose request takes the slot then reuses a warm
        connection of its own instead of opening one on a busy loop (3-5 ms here), and the stopped tenant opens
        one when its request is sent again. The requests in flight stay bounded by the semaphore, whoever sends."""
        session = self._sessions.get(tenant)
        if session is None:
            headers = {"Content-Type": "application/json"}
            key = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
            if key:
                headers["Authorization"] = f"Bearer {key}"
            session = self._sessions[tenant] = aiohttp.ClientSession(
                headers=headers,
                # Our own asyncio.timeout bounds each attempt; aiohttp's default 5-minute total must not.
                timeout=aiohttp.ClientTimeout(total=None),
                connector=aiohttp.TCPConnector(limit=self.max_concurrency),
            )
        return session

    def _messages(self, sample: RewardInput) -> list[dict[str, str]]:
        try:
            content = self.prompt_template.format(
                prompt=sample.prompt_text,
                response=sample.response_text,
                ground_truth=sample.ground_truth,
                data_source=sample.data_source,
                extra_info=sample.extra_info,
            )
        except (KeyError, IndexError, AttributeError, ValueError) as exc:
            raise InvalidInput(
                f"judge {self.name!r}: prompt_template cannot be filled for sample "
                f"{sample.sample_id!r}: {describe_exception(exc)}"
            ) from exc
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": content})
        return messages

    async def _post(self, body: dict[str, Any], tenant: str) -> str:
        async with self._session_for(tenant).post(self.endpoint, json=body) as response:
            raw = await response.text(errors="replace")
            if not 200 <= response.status < 300:
                raise _HTTPFailure(
                    f"judge {self.endpoint} answered HTTP {response.status}: {_snippet(raw)}",
                    server_error=response.status >= 500,
                )
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise _HTTPFailure(f"judge {self.endpoint} sent no chat completion: {_snippet(raw)}") from exc
        if not isinstance(content, str):
            raise _HTTPFailure(f"judge {self.endpoint} sent a completion without text content: {_snippet(raw)}")
        return content

    async def _parse(self, reply: str) -> RewardOutput | RewardError:
        args = (reply, self._score_pattern, self.score_scale)
        if self._parser is None:
            try:
                return parse_reply(*args)
            except RewardError as exc:
                return exc
        what = f"judge {self.name!r} reply parser"
        call = Call(_PARSER, {}, what, args=args)
        (result,) = await self._parser.run([call])
        out: RewardOutput | RewardError = result
        return out

    async def _score_one(self, sample: RewardInput) -> RewardOutput | BaseException:
        try:
            body = {
                "model": self.model,
                "messages": self._messages(sample),
                "temperature": self.temperature,
                "max_tokens": self.max_tokens,
            }
            attempts = self.max_retries + 1
            last_error: BaseException | None = None
            for attempt in range(attempts):
                if self._closed:
                    return Unavailable(f"judge source {self.name!r} is closed")
                async with self._semaphore:
                    await self._limiter.acquire()
                    if not self.breaker.allow():  # checked last: the breaker may have opened while we queued
                        return DependencyFailed(f"judge {self.breaker.describe(self.endpoint)}")
                    try:
                        async with asyncio.timeout(self.timeout_s):
                            reply = await self._post(body, sample.tenant)
                        self.breaker.success()
                    except TimeoutError:  # before ClientConnectionError: aiohttp's timeouts subclass both
                        self.breaker.failure(f"no answer within {self.timeout_s:g}s")
                        return DeadlineExceeded(f"judge {self.endpoint} did not answer within {self.timeout_s:g}s")
                    except aiohttp.ClientConnectionError as exc:
                        self.breaker.failure(describe_exception(exc))
                        last_error = exc
                    except _HTTPFailure as exc:
                        if exc.server_error:
                            self.breaker.failure(str(exc))
                        else:
                            self.breaker.success()
                        raise
                    else:
                        return await self._parse(reply)
                # Back off outside the semaphore: a sample waiting to retry holds no concurrency slot.
                if attempt + 1 < attempts:
                    await asyncio.sleep(self.retry_backoff_s * 2**attempt)
            return DependencyFailed(
                f"judge {self.endpoint} unreachable after {attempts} attempt(s): "
                f"{describe_exception(last_error) if last_error else 'no attempt made'}"
            )
        except RewardError as exc:
            return exc
        except _HTTPFailure as exc:
            return SourceFailed(str(exc))
        except Exception as exc:  # other aiohttp errors: bad redirect, payload error, ...
            return SourceFailed(f"judge {self.endpoint} request failed: {describe_exception(exc)}")

    @property
    def capacity(self) -> Capacity:
        # A judge's request is idempotent, and a judge server drops a request its client hangs up on: preemptible,
        # unless a rate limit makes every start count.
        paced = self._limiter.interval > 0
        return Capacity(self.max_concurrency, "requests in flight", "sample", paced=paced, preemptible=not paced)

    def start_delay(self) -> float:
        return self._limiter.delay()

    async def score_batch(self, batch: list[RewardInput]) -> BatchResult:
        return list(await asyncio.gather(*self.start_each(batch)))

    def start_each(self, batch: list[RewardInput]) -> list[asyncio.Future[Outcome]]:
        """Each sample's request started now (answered when its reply is parsed)."""
        if self._parser is not None:
            self._parser.start()  # spawns the parser's worker while the first requests are in flight
        return [asyncio.ensure_future(self._score_one(sample)) for sample in batch]

    async def warmup(self) -> None:
        if self._parser is not None:
            await self._parser.warmup()

    async def close(self) -> None:
        if not self._closed:
            release_breaker(self.endpoint, self.breaker)
        self._closed = True
        if self._parser is not None:
            await self._parser.close()
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()
