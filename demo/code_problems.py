"""A small code test set the project ships: problems in both test forms (stdin/stdout, call-based, and
assert-style as HumanEval and MBPP write them), each with a canonical solution that passes and a wrong one that
fails, written as a policy would answer (fenced blocks). Used by the tests, the benchmark and smoke checks."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    name: str
    data_source: str
    ground_truth: str  # verl's JSON, as it comes in a sample
    canonical: str  # a response whose program passes every test
    wrong: str  # a response whose program fails at least one test
    form: str  # "stdio" | "call" | "assert"
    language: str = "python"


def _fence(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n\n```{tag}\n{code.strip()}\n```\n"


def _io(inputs: list[object], outputs: list[object], **more: object) -> str:
    return json.dumps({"inputs": inputs, "outputs": outputs, **more})


_CPP = "#include <iostream>\nint main() { long long a, b; std::cin >> a >> b; std::cout << %s << '\\n'; }"

PROBLEMS: tuple[Problem, ...] = (
    Problem(
        "sum_two",
        "codecontests",
        _io(["1 2\n", "-5 5\n", "1000000000 1000000000\n"], ["3\n", "0\n", "2000000000\n"]),
        _fence("a, b = map(int, input().split())\nprint(a + b)"),
        _fence("a, b = map(int, input().split())\nprint(a - b)"),
        "stdio",
    ),
    Problem(
        "sum_lines",
        "apps",
        _io(["3\n1\n2\n3\n", "1\n-7\n", "0\n"], ["6\n", "-7\n", "0\n"]),
        _fence("import sys\nn, *xs = map(int, sys.stdin.read().split())\nprint(sum(xs[:n]))"),
        _fence("import sys\nn, *xs = map(int, sys.stdin.read().split())\nprint(sum(xs[:n]) + (n > 2))"),
        "stdio",
    ),
    Problem(
        "mean",
        "taco",
        _io(["2\n1 2\n", "3\n1 1 2\n"], ["1.5\n", "1.3333333333\n"]),
        _fence("n = int(input())\nxs = list(map(int, input().split()))\nprint(f'{sum(xs) / n:.9f}')"),
        _fence("n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(xs) // n)"),
        "stdio",
    ),
    Problem(
        "sum_two_cpp",
        "codeforces",
        _io(["1 2\n", "40 2\n"], ["3\n", "42\n"], language="cpp"),
        _fence(
            "#include <iostream>\nint main() { long long a, b; std::cin >> a >> b; std::cout << a + b << '\\n'; }",
            "cpp",
        ),
        _fence(
            "#include <iostream>\nint main() { long long a, b; std::cin >> a >> b; std::cout << a * b << '\\n'; }",
            "cpp",
        ),
        "stdio",
        "cpp",
    ),
    Problem(
        "add_call",
        "apps",
        _io([[1, 2], [10, -3]], [[3], [7]], fn_name="add"),
        _fence("def add(a, b):\n    return a + b"),
        _fence("def add(a, b):\n    return a * b"),
        "call",
    ),
    Problem(
        "max_subarray",
        "livecodebench",
        _io(["[-2, 1, -3, 4, -1, 2, 1, -5, 4]", "[1]", "[-3, -1]"], ["6", "1", "-1"], fn_name="maxSubArray"),
        _fence(
            "class Solution:\n    def maxSubArray(self, nums):\n        best = cur = nums[0]\n"
            "        for x in nums[1:]:\n            cur = max(x, cur + x)\n            best = max(best, cur)\n"
            "        return best"
        ),
        _fence("class Solution:\n    def maxSubArray(self, nums):\n        return max(nums)"),
        "call",
    ),
    Problem(
        "is_palindrome",
        "openai_humaneval",
        json.dumps(
            {
                "test": "def check(candidate):\n    assert candidate('abba')\n    assert not candidate('abc')\n"
                "    assert candidate('')\n",
                "entry_point": "is_palindrome",
            }
        ),
        _fence("def is_palindrome(s: str) -> bool:\n    return s == s[::-1]"),
        _fence("def is_palindrome(s: str) -> bool:\n    return len(s) > 0 and s == s[::-1]"),
        "assert",
    ),
    Problem(
        "square",
        "mbpp",
        json.dumps(
            {
                "test_list": ["assert square(2) == 4", "assert square(-3) == 9", "assert square(0) == 0"],
                "test_setup_code": "",
            }
        ),
        _fence("def square(x):\n    return x * x"),
        _fence("def square(x):\n    return x * 2"),
        "assert",
    ),
)
