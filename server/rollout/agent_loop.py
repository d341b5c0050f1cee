"""One sample's agent loop: generate, parse tool calls, run tools, generate again, until done.

Tool output tokens enter the response with mask 0 (the policy did not produce them). Times are
summed over turns like verl's AgentLoopMetrics: `generate_sequences` and `tool_calls`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from rewardmesh.server.rollout.backends.base import Backend, GenerationOutput, GenerationRequest
from rewardmesh.server.rollout.tools import parse_tool_calls, run_tool_call


@dataclass
class AgentSettings:
    max_turns: int = 1
    max_response_tokens: int = 0  # 0: limited only by the context
    tools: list[str] = field(default_factory=list)


@dataclass
class Rollout:
    """What the loop produced for one sample."""

    response_ids: list[int]
    response_mask: list[int]
    finish_reason: str  # stop | length | abort | max_turns
    generate_s: float = 0.0
    tool_s: float = 0.0
    num_turns: int = 0
    num_tool_calls: int = 0
    num_preempted: int = -1
    policy_version: int = 0
    # Per response token: the sampled token's log-prob (tool tokens 0), when the request asked for them.
    response_logprobs: list[float] | None = None
    # Per response token: the weights version that produced it (a tool token: that of the turn before it);
    # None when the backend could not tell for some turn.
    response_versions: list[int] | None = None


def tool_turn_ids(tokenizer: Any, outputs: list[str], last_token: int | None) -> list[int]:
    """Tool results as a Hermes/ChatML user turn, closing the assistant turn first if the model did not."""
    end = "<|im_end|>"
    body = "".join(f"<tool_response>\n{json.dumps(out)}\n</tool_response>\n" for out in outputs)
    text = f"\n<|im_start|>user\n{body.rstrip()}{end}\n<|im_start|>assistant\n"
    end_id = tokenizer.convert_tokens_to_ids(end)
    if last_token != end_id:
        text = end + text
    return list(tokenizer.encode(text, add_special_tokens=False))


async def run_agent_loop(
    backend: Backend,
    prompt_ids: list[int],
    sampling: GenerationRequest,
    settings: AgentSettings,
    on_turn: Callable[[str, str, int, int], None] | None = None,
) -> Rollout:
    """Run turns until the model stops without calling a tool, a budget runs out, or max_turns is reached.

    `sampling` is the per-turn template (its prompt_ids are ignored). `on_turn(kind, name, start_ns,
    end_ns)` is an optional hook for tracing each generate and tool call.
    """
    ids = list(prompt_ids)
    out = new_rollout(sampling)
    versions: list[int] = []
    max_turns = max(1, settings.max_turns)
    for turn in range(max_turns):
        max_tokens = turn_max_tokens(backend, len(ids), len(out.response_ids), sampling, settings)
        if max_tokens <= 0:
            out.finish_reason = "length"
            break
        started = time.time_ns()
        gen = await backend.generate(replace(sampling, prompt_ids=ids, max_tokens=max_tokens))
        ended = time.time_ns()
        if on_turn is not None:
            on_turn("generate", f"turn {turn}", started, ended)
        add_turn(out, gen, (ended - started) / 1e9)
        versions.append(gen.policy_version)
        ids += gen.token_ids
        if not settings.tools or gen.finish_reason != "stop":
            break
        calls = parse_tool_calls(backend.tokenizer.decode(gen.token_ids, skip_special_tokens=False))
        if not calls:
            break
        if turn == max_turns - 1:
            out.finish_reason = "max_turns"
            break
        results = []
        for call in calls:
            started = time.time_ns()
            results.append(await run_tool_call(call, settings.tools))
            ended = time.time_ns()
            out.tool_s += (ended - started) / 1e9
            out.num_tool_calls += 1
            if on_turn is not None:
                on_turn("tool_call", call.name or "malformed", started, ended)
        observation = tool_turn_ids(backend.tokenizer, results, gen.token_ids[-1] if gen.token_ids else None)
        if settings.max_response_tokens:
            observation = observation[: max(0, settings.max_response_tokens - len(out.response_ids))]
        add_observation(out, observation, gen.policy_version)
        ids += observation
    # The oldest policy that contributed tokens: what bounded staleness must check.
    out.policy_version = min(versions) if versions else backend.policy_version
    return out


def new_rollout(sampling: GenerationRequest) -> Rollout:
    """A rollout before its first turn (log-probs collected when the request asks for them)."""
    return Rollout([], [], "stop", response_logprobs=[] if sampling.logprobs else None, response_versions=[])


def turn_max_tokens(
    backend: Backend, context_tokens: int, response_tokens: int, sampling: GenerationRequest, settings: AgentSettings
) -> int:
    """What the next turn may generate: max_tokens, within the context left and the response budget (<= 0: none)."""
    budget = backend.max_model_len - context_tokens
    if settings.max_response_tokens:
        budget = min(budget, settings.max_response_tokens - response_tokens)
    return min(sampling.max_tokens, budget)


def add_turn(out: Rollout, gen: GenerationOutput, generate_s: float) -> None:
    """Append one generated turn: its tokens (mask 1), log-probs, versions, preemptions and finish reason."""
    out.generate_s += generate_s
    out.num_turns += 1
    if gen.num_preempted >= 0:
        out.num_preempted = max(out.num_preempted, 0) + gen.num_preempted
    out.response_ids += gen.token_ids
    out.response_mask += [1] * len(gen.token_ids)
    _extend(out, gen)
    out.finish_reason = gen.finish_reason


def add_observation(out: Rollout, observation: list[int], policy_version: int) -> None:
    """Append tool output tokens: mask 0, log-prob 0.0, and the version of the turn before them (``policy_version``,
    the turn's, if no token came before)."""
    out.response_ids += observation
    out.response_mask += [0] * len(observation)
    if out.response_logprobs is not None:
        out.response_logprobs += [0.0] * len(observation)
    if out.response_versions is not None:
        out.response_versions += [out.response_versions[-1] if out.response_versions else policy_version] * len(
            observation
        )


def one_turn(backend: Backend, sampling: GenerationRequest, gen: GenerationOutput | None, generate_s: float) -> Rollout:
    """The rollout of a sample whose loop ends after one turn (no tools), from that turn's output (None: no
    turn, the budget was spent before it): the same as `run_agent_loop` gives for it."""
    out = new_rollout(sampling)
    if gen is None:
        out.finish_reason = "length"
        out.policy_version = backend.policy_version
        return out
    add_turn(out, gen, generate_s)
    out.policy_version = gen.policy_version
    return out


def _extend(out: Rollout, gen: GenerationOutput) -> None:
    """Append one turn's per-token log-probs and versions; a turn without them leaves that list unknown."""
    n = len(gen.token_ids)
    if out.response_logprobs is not None:
        if gen.logprobs is not None and len(gen.logprobs) == n:
            out.response_logprobs += gen.logprobs
        else:
            out.response_logprobs = None
    if out.response_versions is not None:
        if gen.token_versions is not None and len(gen.token_versions) == n:
            out.response_versions += gen.token_versions
        else:
            out.response_versions = None
