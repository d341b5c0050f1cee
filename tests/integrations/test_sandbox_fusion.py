"""verl 0.9.1's own SandboxFusion client (`reward.sandbox_fusion.url`) scoring code through the reward server's
/run_code: verl's default_compute_score routing, its call-based wrapper, and its reading of failures."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest

pytest.importorskip("verl")

from verl.utils.reward_score import default_compute_score, sandbox_fusion

from rewardmesh.demo.code_problems import PROBLEMS, Problem
from tests.integrations.support import RunningServer, server_thread
from tests.support.sandbox import needs_bwrap

pytestmark = needs_bwrap
# The data sources verl sends to SandboxFusion, with the stdin/stdout problems of the shipped set whose outputs
# verl's exact comparison accepts.
VERL_CODE = [p for p in PROBLEMS if p.data_source in ("codecontests", "apps") and p.form == "stdio"]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with server_thread() as running:
        yield running


@pytest.mark.parametrize("problem", VERL_CODE, ids=[p.name for p in VERL_CODE])
def test_default_compute_score_through_run_code(problem: Problem, server: RunningServer) -> None:
    url = f"{server.url}/run_code"
    semaphore = threading.Semaphore(4)
    p = problem
    good = default_compute_score(
        p.data_source, p.canonical, p.ground_truth, sandbox_fusion_url=url, concurrent_semaphore=semaphore
    )
    bad = default_compute_score(
        p.data_source, p.wrong, p.ground_truth, sandbox_fusion_url=url, concurrent_semaphore=semaphore
    )
    assert good == 1.0
    assert bad < 1.0


def test_call_based_and_failures_as_verl_reads_them(server: RunningServer) -> None:
    url = f"{server.url}/run_code"
    calls = json.dumps({"fn_name": "add", "inputs": ["1\n2", "10\n-3"], "outputs": ["3", "7"]})
    score, meta = sandbox_fusion.compute_score(
        url, None, 512, "```python\ndef add(a, b):\n    return a + b\n```", calls
    )
    assert score == 1.0 and [m["status"] for m in meta] == ["success", "success"]
    cases = json.dumps({"inputs": ["1\n", "2\n", "3\n"], "outputs": ["1\n", "4\n", "9\n"]})
    program = (
        "n = int(input())\nif n == 2:\n    raise SystemExit(1)\nif n == 3:\n    while True:\n        pass\nprint(n)"
    )
    score, meta = sandbox_fusion.compute_score(url, None, 512, f"```python\n{program}\n```", cases, timeout=2)
    assert [m["status"] for m in meta] == ["success", "runtime_error", "timeout"]
    assert score == pytest.approx(1 / 3)


def test_a_token_in_the_url(server: RunningServer) -> None:
    """verl's client sends no headers: a gateway with a token takes it in the path."""
    cases = json.dumps({"inputs": ["2\n"], "outputs": ["4\n"]})
    response = "```python\nprint(int(input()) * 2)\n```"
    with server_thread(token="s3cret") as guarded:
        assert sandbox_fusion.compute_score(f"{guarded.url}/t/s3cret/run_code", None, 512, response, cases)[0] == 1.0
        score, meta = sandbox_fusion.compute_score(f"{guarded.url}/run_code", None, 512, response, cases)
        assert score == 0.0 and meta[0]["status"] == "api_error" and "401" in str(meta[0]["api_request_error"])
