"""From a response and a sample's tests to sandbox jobs, and from the runs back to per-test outcomes.

Two test forms, as the datasets ship them:
- stdin/stdout (APPS, CodeContests, TACO, LiveCodeBench; verl's ground truth JSON ``{"inputs": [...],
  "outputs": [...]}``), call-based when it names a ``fn_name`` (each input then holds the call's arguments);
- assert-style (HumanEval ``{"test": ..., "entry_point": ...}``, MBPP ``{"test_list": [...],
  "test_setup_code": ..., "test_imports": [...]}``), each assert its own test where they come as a list.
Expected outputs never enter the sandbox: the host compares.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from rewardmesh.common.errors import InvalidInput
from rewardmesh.reward_engine.sandbox.jobs import Job, TestRun

LANGUAGES = ("python", "cpp")
_LANG_ALIASES = {"python": "python", "python3": "python", "py": "python", "cpp": "cpp", "c++": "cpp", "cc": "cpp"}
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.S)
# Outcome codes as extras, verl's sandbox conventions extended: 1 passed, 0 wrong answer, negatives are errors.
OUTCOMES = {
    "passed": 1,
    "wrong_answer": 0,
    "sandbox_error": -1,
    "runtime_error": -2,
    "timeout": -3,
    "compile_error": -4,
    "memory": -5,
    "output_limit": -6,
    "skipped": -7,
}
_MARK = "\x1e__rewardmesh_result__"  # the harness's result line starts with it
_CALL_HARNESS = """import io, json, sys, contextlib
sys.setrecursionlimit(100000)
_src = open('solution.py').read()
_raw = sys.stdin.read()
_g = {'__name__': '__solution__'}
exec(compile(_src, 'solution.py', 'exec'), _g)
_args = json.loads(_raw)
_fn = _g.get(%(fn)r)
if _fn is None and 'Solution' in _g:
    _fn = getattr(_g['Solution'](), %(fn)r)
if _fn is None:
    raise NameError('no function named %(fn)s')
with contextlib.redirect_stdout(io.StringIO()):
    _out = _fn(*_args)
sys.stdout.write('\\n' + %(mark)r + json.dumps(_out, default=repr) + '\\n')
"""
_ASSERT_HARNESS = """import sys
_src = open('solution.py').read()
_test = sys.stdin.read()
_g = {'__name__': '__solution__'}
exec(compile(_src, 'solution.py', 'exec'), _g)
try:
    exec(compile(_test, 'test.py', 'exec'), _g)
except AssertionError:
    sys.stderr.write('AssertionError\\n')
    sys.exit(2)
sys.stdout.write('\\n' + %(mark)r + 'null\\n')
"""


def extract_program(response: str, language: str = "python") -> str:
    """The program in a response, as verl's code scorers read it: the last fenced block tagged with the
    language, else the first fenced block, else the whole response."""
    blocks = _FENCE.findall(response)
    if not blocks:
        return response
    tagged = [code for tag, code in blocks if _LANG_ALIASES.get(tag.strip().lower()) == language]
    return tagged[-1] if tagged else blocks[0][1]


@dataclass
class Plan:
    """One sample's program and tests."""

    language: str
    form: str  # "stdio" | "call" | "assert"
    program: str
    stdins: list[str]
    expected: list[Any] = field(default_factory=list)
    fn_name: str = ""


def _loads(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidInput(f"{where}: not valid JSON ({exc})") from None


def _spec_of(ground_truth: str, extra_info: dict[str, Any]) -> dict[str, Any]:
    """The tests: ground_truth as JSON, else extra_info's test fields (verl datasets keep them in either)."""
    text = ground_truth.strip()
    if text:
        spec = _loads(text, "ground_truth")
        if not isinstance(spec, dict):
            raise InvalidInput(f"ground_truth: expected a JSON object with tests, got {type(spec).__name__}")
        return spec
    for key in ("tests", "test_cases", "input_output"):
        value = extra_info.get(key)
        if isinstance(value, str):
            value = _loads(value, f"extra_info.{key}")
        if isinstance(value, dict):
            return value
    keys = {"test", "entry_point", "test_list", "inputs"}
    if keys & set(extra_info):
        return dict(extra_info)
    raise InvalidInput("ground_truth: empty, and extra_info holds no tests (tests, input_output, test, test_list)")


def _language(spec: dict[str, Any], extra_info: dict[str, Any], response: str) -> str:
    named = spec.get("language") or extra_info.get("language")
    if named:
        lang = _LANG_ALIASES.get(str(named).lower())
        if lang is None:
            raise InvalidInput(f"language: {named!r} is not supported (supported: {', '.join(LANGUAGES)})")
        return lang
    tags = [_LANG_ALIASES.get(tag.strip().lower()) for tag, _ in _FENCE.findall(response)]
    return "cpp" if tags and tags[-1] == "cpp" else "python"


def _as_stdin(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(v if isinstance(v, str) else json.dumps(v) for v in value)
    return json.dumps(value)


def _call_args(value: Any) -> list[Any]:
    """A call-based input: the argument list, or verl's one JSON value per line."""
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        lines = [line for line in value.split("\n") if line.strip()]
        try:
            return [json.loads(line) for line in lines]
        except ValueError:
            return [value]
    return [value]


def plan(response: str, ground_truth: str, extra_info: dict[str, Any] | None = None) -> Plan:
    """Parse the tests and extract the program; InvalidInput names what is malformed."""
    extra = extra_info or {}
    spec = _spec_of(ground_truth, extra)
    lang = _language(spec, extra, response)
    program = extract_program(response, lang)
    if "inputs" in spec or "outputs" in spec:
        inputs, outputs = spec.get("inputs"), spec.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise InvalidInput("ground_truth: 'inputs' and 'outputs' must be lists of the same length")
        if not inputs:
            raise InvalidInput("ground_truth: no test cases ('inputs' is empty)")
        fn_name = spec.get("fn_name") or ""
        if fn_name:
            if lang != "python":
                raise InvalidInput("ground_truth: call-based tests (fn_name) are supported for python only")
            stdins = [json.dumps(_call_args(v)) for v in inputs]
            return Plan(lang, "call", program, stdins, list(outputs), str(fn_name))
        return Plan(lang, "stdio", program, [_as_stdin(v) for v in inputs], [_as_stdin(v) for v in outputs])
    if lang != "python":
        raise InvalidInput("ground_truth: assert-style tests are supported for python only")
    setup = "\n".join(str(x) for x in spec.get("test_imports") or []) + "\n" + str(spec.get("test_setup_code") or "")
    asserts = spec.get("test_list") or spec.get("assert_tests")
    if isinstance(asserts, list) and asserts:
        return Plan(lang, "assert", program, [f"{setup}\n{a}\n" for a in asserts])
    test = spec.get("test")
    if isinstance(test, str) and test.strip():
        entry = spec.get("entry_point") or ""
        call = f"\ncheck({entry})\n" if entry and "def check(" in test else "\n"
        return Plan(lang, "assert", program, [f"{setup}\n{test}{call}"])
    raise InvalidInput("ground_truth: no tests found (expected inputs/outputs, test_list, or test + entry_point)")


def job_of(p: Plan, python: str) -> Job:
    if p.language == "cpp":
        build = [*_GPP, "-o", "prog", "main.cpp"]
        return Job({"main.cpp": p.program}, ["./prog"], p.stdins, compile=build, binary="prog")
    if p.form == "stdio":
        return Job({"main.py": p.program}, [python, "-I", "main.py"], p.stdins)
    if p.form == "call":
        harness = _CALL_HARNESS % {"fn": p.fn_name, "mark": _MARK}
    else:
        harness = _ASSERT_HARNESS % {"mark": _MARK}
    return Job({"main.py": harness, "solution.py": p.program}, [python, "-I", "main.py"], p.stdins)


_GPP = ["/usr/bin/g++", "-O2", "-std=c++17", "-pipe"]


def _tokens_equal(got: str, want: str) -> bool:
    """Whitespace-insensitive, numbers within 1e-6 (relative or absolute), as contest checkers allow."""
    a, b = got.split(), want.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not (math.isfinite(fx) and math.isfinite(fy) and math.isclose(fx, fy, rel_tol=1e-6, abs_tol=1e-6)):
            return False
    return True


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def stdout_matches(got: str, want: str) -> bool:
    return _lines(got) == _lines(want) or _tokens_equal(got, want)


def _result_of(stdout: str) -> tuple[bool, Any]:
    at = stdout.rfind(_MARK)
    if at < 0:
        return False, None
    try:
        return True, json.loads(stdout[at + len(_MARK) :].strip() or "null")
    except ValueError:
        return False, None


def _call_matches(value: Any, want: Any) -> bool:
    if isinstance(want, str):
        try:
            want_value = json.loads(want)
        except ValueError:
            want_value = want
        if value == want_value or value == want:
            return True
        want = want_value
    if value == want:
        return True
    return isinstance(want, list) and len(want) == 1 and value == want[0]


def outcome(p: Plan, index: int, run: TestRun) -> tuple[str, str]:
    """(outcome, reason) of one test."""
    if run.status in ("timeout", "output_limit", "compile_error", "sandbox_error", "skipped"):
        return run.status, run.stderr[-300:]
    if run.status == "error":
        return "sandbox_error", run.stderr[-300:]
    err = run.stderr
    if run.exit_code == 0 and run.signal is None:
        if p.form == "stdio":
            ok = stdout_matches(run.stdout, p.expected[index])
            return ("passed", "") if ok else ("wrong_answer", "stdout differs from the expected output")
        found, value = _result_of(run.stdout)
        if not found:
            return "runtime_error", "the program exited before its tests finished"
        if p.form == "call" and not _call_matches(value, p.expected[index]):
            return "wrong_answer", f"returned {json.dumps(value, default=repr)[:200]}"
        return "passed", ""
    if "MemoryError" in err or "bad_alloc" in err or "Cannot allocate memory" in err:
        return "memory", err.strip().splitlines()[-1][:300] if err.strip() else "out of memory"
    if run.signal == 24:  # SIGXCPU: over the CPU-time limit
        return "timeout", "CPU time limit"
    if p.form == "assert" and run.exit_code == 2 and err.strip().endswith("AssertionError"):
        return "wrong_answer", "an assertion failed"
    last = err.strip().splitlines()[-1][:300] if err.strip() else ""
    how = f"killed by signal {run.signal}" if run.signal else f"exit code {run.exit_code}"
    return "runtime_error", f"{how}: {last}" if last else how
