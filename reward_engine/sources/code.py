"""Code-execution rewards: the response's program run against the sample's tests in a sandbox.

The tests of one sample go to one sandbox start (in chunks of ``tests_per_sandbox``, one after another), each test
still a fresh process under its own limits; samples run at once up to the sandbox pool's size (the source's
capacity: a sample holds one sandbox slot), so a step's code samples are scored as they stream in. The score follows
``data_source`` as verl's default_compute_score does: the pass fraction for the sources verl scores continuously
(codecontests, apps, codeforces, taco), all tests passed (1/0) for the others. Extras: ``acc`` (all passed),
``pass_rate``, ``tests``, ``passed``, a count per failure kind, and per test (the first ``MAX_TEST_EXTRAS``)
``outcome/<i>`` (codes in sandbox.grading.OUTCOMES) and ``time_s/<i>``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from rewardmesh.common.errors import InvalidInput, RewardError, SourceFailed, Unavailable
from rewardmesh.reward_engine.sandbox.executor import Limits, Sandbox, TestRun
from rewardmesh.reward_engine.sandbox.grading import OUTCOMES, Plan, job_of, outcome, plan
from rewardmesh.reward_engine.sources.verl_compat import describe_exception
from rewardmesh.reward_engine.types import BatchResult, Capacity, Outcome, RewardInput, RewardOutput, RewardSource

log = logging.getLogger(__name__)

# verl's default_compute_score scores these data sources with prime_code(continuous=True): the pass fraction.
VERL_CONTINUOUS = ("codecontests", "apps", "codeforces", "taco")
SCORES = ("auto", "pass_rate", "all_passed")
MAX_TEST_EXTRAS = 64


def score_kind(data_source: str, score: str = "auto") -> str:
    """ "pass_rate" or "all_passed" for a sample, routed by data_source under "auto"."""
    if score != "auto":
        return score
    return "pass_rate" if data_source.strip().lower() in VERL_CONTINUOUS else "all_passed"


@dataclass
class TestOutcome:
    outcome: str  # a key of OUTCOMES
    reason: str
    time_s: float


@dataclass
class Grade:
    """A sample's verdict with every test's outcome, for callers that want more than the extras."""

    score: float
    tests: list[TestOutcome] = field(default_factory=list)

    @property
    def passed(self) -> int:
        return sum(t.outcome == "passed" for t in self.tests)

    def extras(self) -> dict[str, float]:
        n = len(self.tests)
        out: dict[str, float] = {
            "acc": 1.0 if n and self.passed == n else 0.0,
            "pass_rate": self.passed / n if n else 0.0,
            "tests": float(n),
            "passed": float(self.passed),
            "time_max_s": max((t.time_s for t in self.tests), default=0.0),
        }
        for kind in OUTCOMES:
            if kind != "passed":
                out[kind] = float(sum(t.outcome == kind for t in self.tests))
        for i, t in enumerate(self.tests[:MAX_TEST_EXTRAS]):
            out[f"outcome/{i}"] = float(OUTCOMES[t.outcome])
            out[f"time_s/{i}"] = t.time_s
        return out


class CodeSource(RewardSource):
    """Runs each sample's program against its tests in the sandbox (rewardmesh.reward_engine.sandbox).

    Config keys:
      isolation: "bwrap" (bubblewrap, the default) or "unshare" (util-linux, the fallback level).
      allow_weaker_isolation: run with a lower level than ``isolation`` when it is missing (off: refuse).
      workers: sandboxes running at once (0: one per CPU); the source's capacity, one slot per sample.
      timeout_s: wall and CPU seconds per test; memory_mb: address space per test; max_processes,
        max_open_files, max_output_bytes (stdout per test), tmp_mb (the sandbox's tmpfs).
      tests_per_sandbox: tests of one sample run in one sandbox start (a fresh process each).
      score: "auto" (by data_source, as verl), "pass_rate" or "all_passed".
      prestart: prove the sandbox when the server starts (else on the first sample).
    """

    kind = "code"
    sandbox: Sandbox

    def __init__(
        self,
        name: str,
        isolation: str = "bwrap",
        allow_weaker_isolation: bool = False,
        workers: int = 0,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        max_processes: int = 32,
        max_open_files: int = 64,
        max_output_bytes: int = 1 << 20,
        tmp_mb: int = 64,
        tests_per_sandbox: int = 32,
        score: str = "auto",
        prestart: bool = True,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("code source: 'name' must be a non-empty string")
        where = f"code source {name!r}"
        if score not in SCORES:
            raise ValueError(f"{where}: 'score' must be one of {', '.join(SCORES)}, got {score!r}")
        if isinstance(tests_per_sandbox, bool) or not isinstance(tests_per_sandbox, int) or tests_per_sandbox < 1:
            raise ValueError(f"{where}: 'tests_per_sandbox' must be an integer >= 1, got {tests_per_sandbox!r}")
        limits = Limits(
            cpu_s=timeout_s,
            wall_s=timeout_s,
            memory_mb=memory_mb,
            procs=max_processes,
            files=max_open_files,
            output_bytes=max_output_bytes,
            tmp_mb=tmp_mb,
        )
        limits.check(where)
        self.name = name
        self.target = isolation
        self.score = score
        self.prestart = bool(prestart)
        self.tests_per_sandbox = tests_per_sandbox
        self.sandbox = Sandbox(
            isolation=isolation, allow_weaker_isolation=allow_weaker_isolation, workers=workers, limits=limits
        )

    @property
    def capacity(self) -> Capacity:
        return Capacity(self.sandbox.workers, "sandbox slots", "sample")

    async def warmup(self) -> None:
        """Prove the sandbox now (prestart), or at least say which isolation tools it will try."""
        if self.prestart:
            await self.sandbox.start()
        else:
            log.info("code source %r: %s; proven on first use", self.name, self.sandbox.outlook())

    async def _runs(self, p: Plan, stop_on_error: bool) -> list[TestRun]:
        job = job_of(p, self.sandbox.python)
        job.stop_on_error = stop_on_error
        size = self.tests_per_sandbox
        chunks = [job.stdins[i : i + size] for i in range(0, len(job.stdins), size)]
        results = [await self.sandbox.run(replace(job, stdins=c)) for c in chunks]  # one slot per sample
        runs = [run for result in results for run in result.runs]
        if all(r.status == "sandbox_error" for r in runs):
            notes = "; ".join(n for result in results for n in result.notes)
            raise SourceFailed(f"code sandbox failed before running any test: {notes or 'no output'}")
        return runs

    async def grade(
        self, response: str, ground_truth: str, data_source: str = "", extra_info: dict[str, Any] | None = None
    ) -> Grade:
        """Score one response; InvalidInput for malformed tests, SourceFailed/Unavailable if the sandbox is."""
        p = plan(response, ground_truth, extra_info)
        kind = score_kind(data_source, self.score)
        runs = await self._runs(p, stop_on_error=kind == "all_passed")
        tests = []
        for i, run in enumerate(runs):
            what, reason = outcome(p, i, run)
            tests.append(TestOutcome(what, reason, run.time_s))
        passed = sum(t.outcome == "passed" for t in tests)
        if kind == "pass_rate":
            value = passed / len(tests)
        else:
            value = 1.0 if passed == len(tests) else 0.0
        return Grade(value, tests)

    async def _one(self, sample: RewardInput) -> RewardOutput | BaseException:
        try:
            g = await self.grade(sample.response_text, sample.ground_truth, sample.data_source, sample.extra_info)
        except (InvalidInput, SourceFailed, Unavailable):
            raise
        except RewardError:
            raise
        except Exception as exc:
            return SourceFailed(f"code source {self.name!r} raised {describe_exception(exc)}")
        return RewardOutput(g.score, g.extras())

    async def _guarded(self, sample: RewardInput) -> RewardOutput | BaseException:
        try:
            return await self._one(sample)
        except RewardError as exc:
            return exc

    async def score_batch(self, batch: list[RewardInput]) -> BatchResult:
        return list(await asyncio.gather(*self.start_each(batch)))

    def start_each(self, batch: list[RewardInput]) -> list[asyncio.Future[Outcome]]:
        """Each sample's run started now (answered when its own tests are done)."""
        return [asyncio.ensure_future(self._guarded(s)) for s in batch]

    async def close(self) -> None:
        """Sandboxes in flight end within their budgets (and die with the server: --die-with-parent)."""
        self.sandbox.close()
