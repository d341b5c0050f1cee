"""Tools the agent loop can run, registered by name, and Hermes-style `<tool_call>{json}</tool_call>` parsing."""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

ToolFn = Callable[[dict[str, Any]], Awaitable[str]]

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class Tool:
    name: str
    description: str
    fn: ToolFn
    timeout_s: float = 10.0


TOOLS: dict[str, Tool] = {}


def register_tool(name: str, description: str, *, timeout_s: float = 10.0) -> Callable[[ToolFn], ToolFn]:
    def deco(fn: ToolFn) -> ToolFn:
        TOOLS[name] = Tool(name, description, fn, timeout_s)
        return fn

    return deco


@dataclass
class ToolCall:
    """A parsed call, or the reason it could not be parsed (which goes back to the model as the result)."""

    name: str
    arguments: dict[str, Any]
    error: str = ""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>` block; malformed JSON becomes a ToolCall with `error`, never an exception."""
    calls = []
    for raw in TOOL_CALL.findall(text):
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ValueError('expected {"name": ..., "arguments": {...}}')
            args = obj.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
            calls.append(ToolCall(obj["name"], args))
        except (json.JSONDecodeError, ValueError) as exc:
            calls.append(ToolCall("", {}, f"malformed tool call: {exc}"))
    return calls


async def run_tool_call(call: ToolCall, allowed: list[str]) -> str:
    """The text the model sees: the tool's output, or what went wrong (unknown tool, bad arguments, timeout)."""
    if call.error:
        return f"error: {call.error}"
    if call.name not in allowed or call.name not in TOOLS:
        return f"error: unknown tool '{call.name}' (available: {', '.join(allowed)})"
    tool = TOOLS[call.name]
    try:
        return await asyncio.wait_for(tool.fn(call.arguments), tool.timeout_s)
    except TimeoutError:
        return f"error: tool '{call.name}' timed out after {tool.timeout_s}s"
    except Exception as exc:
        return f"error: tool '{call.name}' failed: {type(exc).__name__}: {exc}"


_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return float(_OPS[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return float(_OPS[type(node.op)](_eval(node.operand)))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


@register_tool("calculator", 'Evaluate an arithmetic expression. Arguments: {"expression": "(2 + 3) * 4"}')
async def calculator(arguments: dict[str, Any]) -> str:
    expr = arguments.get("expression")
    if not isinstance(expr, str) or not expr.strip():
        return 'error: calculator needs {"expression": "<arithmetic>"}'
    if len(expr) > 200:
        return "error: expression longer than 200 characters"
    try:
        value = _eval(ast.parse(expr, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: cannot evaluate {expr!r}: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
