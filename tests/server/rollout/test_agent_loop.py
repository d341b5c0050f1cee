"""Agent loop and tools with a scripted backend: tool turns, masks, budgets, malformed calls."""

from __future__ import annotations

from typing import Any

from rewardmesh.server.rollout.agent_loop import AgentSettings, run_agent_loop
from rewardmesh.server.rollout.backends.base import GenerationRequest
from rewardmesh.server.rollout.tools import calculator, parse_tool_calls, run_tool_call
from tests.support.scripted_backend import ScriptedBackend


def calc_then_answer(text: str, turn: int) -> tuple[str, float]:
    if turn == 0:
        return '<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 3"}}</tool_call>', 0.0
    return "The answer is #### 51", 0.0


async def test_tool_call_round_trip_masks_tool_tokens(tok: Any) -> None:
    backend = ScriptedBackend(tok, calc_then_answer)
    prompt = tok.encode("What is 17 * 3?")
    out = await run_agent_loop(
        backend, prompt, GenerationRequest([], 256), AgentSettings(max_turns=3, tools=["calculator"])
    )
    assert out.num_turns == 2 and out.num_tool_calls == 1 and out.finish_reason == "stop"
    text = tok.decode(out.response_ids, skip_special_tokens=False)
    assert "<tool_response>" in text and '"51"' in text and text.rstrip().endswith("#### 51<|im_end|>")
    # Model tokens are 1, tool output tokens 0; the observation sits between the two assistant turns.
    masked = [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m == 0]
    assert "<tool_response>" in tok.decode(masked) and "51" in tok.decode(masked)
    assert "#### 51" in tok.decode([t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m == 1])
    assert len(out.response_mask) == len(out.response_ids)
    # The second turn saw the tool result in its prompt.
    assert "<tool_response>" in tok.decode(backend.requests[1].prompt_ids)
    assert out.generate_s >= 0 and out.tool_s > 0


async def test_max_turns_stops_a_model_that_keeps_calling_tools(tok: Any) -> None:
    def always_call(text: str, turn: int) -> tuple[str, float]:
        return '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>', 0.0

    out = await run_agent_loop(
        ScriptedBackend(tok, always_call), tok.encode("hi"), GenerationRequest([], 256),
        AgentSettings(max_turns=3, tools=["calculator"]),
    )  # fmt: skip
    assert out.num_turns == 3 and out.num_tool_calls == 2 and out.finish_reason == "max_turns"


async def test_malformed_json_and_unknown_tool_become_messages_to_the_model(tok: Any) -> None:
    def bad_calls(text: str, turn: int) -> tuple[str, float]:
        if turn == 0:
            return (
                '<tool_call>{"name": "calculator", "arguments": </tool_call><tool_call>{"name": "web"}</tool_call>',
                0,
            )
        return "ok", 0.0

    backend = ScriptedBackend(tok, bad_calls)
    out = await run_agent_loop(backend, tok.encode("x"), GenerationRequest([], 256),
                               AgentSettings(max_turns=2, tools=["calculator"]))  # fmt: skip
    seen = tok.decode(backend.requests[1].prompt_ids)
    assert "malformed tool call" in seen and "unknown tool 'web'" in seen
    assert out.finish_reason == "stop" and out.num_turns == 2


async def test_max_response_tokens_caps_all_turns_together(tok: Any) -> None:
    def chatty(text: str, turn: int) -> tuple[str, float]:
        body = "blah " * 20
        return (body + '<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}</tool_call>', 0.0)

    out = await run_agent_loop(ScriptedBackend(tok, chatty), tok.encode("x"), GenerationRequest([], 200),
                               AgentSettings(max_turns=5, max_response_tokens=60, tools=["calculator"]))  # fmt: skip
    assert len(out.response_ids) <= 60 and out.finish_reason == "length"


async def test_single_turn_ignores_tool_calls_when_no_tools_enabled(tok: Any) -> None:
    out = await run_agent_loop(ScriptedBackend(tok, calc_then_answer), tok.encode("x"), GenerationRequest([], 256),
                               AgentSettings())  # fmt: skip
    assert out.num_turns == 1 and out.num_tool_calls == 0 and all(m == 1 for m in out.response_mask)


def test_parse_tool_calls() -> None:
    calls = parse_tool_calls(
        'a <tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+2\\"}"}</tool_call>'
    )
    assert calls[0].name == "calculator" and calls[0].arguments == {"expression": "1+2"}
    assert parse_tool_calls("<tool_call>[1, 2]</tool_call>")[0].error
    assert parse_tool_calls("no calls here") == []


async def test_calculator_is_safe_and_exact() -> None:
    assert await calculator({"expression": "(2 + 3) * 4 - 10 / 4"}) == "17.5"
    assert await calculator({"expression": "2 ** 10"}) == "1024"
    for bad in ("__import__('os')", "2 ** 1000", "1/0", "x + 1"):
        assert (await calculator({"expression": bad})).startswith("error"), bad
    assert (await run_tool_call(parse_tool_calls('<tool_call>{"name": "calculator"}</tool_call>')[0], ["calculator"])
            ).startswith("error")  # fmt: skip


async def test_logprobs_and_versions_concatenate_turns_with_tool_tokens_zero(tok: Any) -> None:
    backend = ScriptedBackend(tok, calc_then_answer)
    backend.policy_version = 3
    settings = AgentSettings(max_turns=3, tools=["calculator"])
    out = await run_agent_loop(
        backend, tok.encode("What is 17 * 3?"), GenerationRequest([], 256, logprobs=True), settings
    )
    assert out.response_logprobs is not None and out.response_versions is not None
    assert len(out.response_logprobs) == len(out.response_versions) == len(out.response_ids)
    expected = [
        0.0 if m == 0 else (-0.1 if i < out.response_mask.index(0) else -0.2) for i, m in enumerate(out.response_mask)
    ]
    assert out.response_logprobs == expected
    assert set(out.response_versions) == {3}
    # not asked: no log-probs, versions still known
    plain = await run_agent_loop(backend, tok.encode("What is 17 * 3?"), GenerationRequest([], 256), settings)
    assert plain.response_logprobs is None and plain.response_versions == [3] * len(plain.response_ids)
