"""Code-execution rewards: the response's program run against the sample's tests in a sandbox.

A sample holds one sandbox of the pool for all its tests, each test still a fresh process under its own limits;
samples run at once up to the pool's size (``sandbox.workers``, the source's capacity, less the slots the server's
``/run_code`` holds: a sample leaves the fair queue only when a sandbox is free for it, and claims its slot as it
is handed over), so a step's code samples are scored as they stream in. The pool's sandboxes are
started ahead and serve many samples, reset between them. The score follows
``data_source`` as verl's default_compute_score does: the pass fraction for the sources verl scores continuously
(codecontests, apps, codeforces, taco), all tests passed (1/0) for the others. Extras: ``acc`` (all passed),
``pass_rate``, ``tests``, ``passed``, a count per failure kind, and per test (the first ``MAX_TEST_EXTRAS``)
``outcome/<i>`` (codes in sandbox.grading.OUTCOMES) and ``time_s/<i>``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rewardmesh.common.errors import InvalidInput, RewardError, SourceFailed, Unavailable, describe_exception
from rewardmesh.reward_engine.sandbox.executor import Claim, Limits, Sandbox, TestRun
from rewardmesh.reward_engine.sandbox.grading import OUTCOMES, Plan, job_of, outcome, plan
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
      samples_per_sandbox: samples one sandbox serves (reset between them) before a fresh one replaces it;
        1: a sandbox is started for every sample.
      score: "auto" (by data_source, as verl), "pass_rate" or "all_passed".
      prestart: prove the sandbox and start the pool's sandboxes when the server starts (else on first use).
    """

    kind = SourceKind.CODE
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
        samples_per_sandbox: int = 100,
        score: str = "auto",
        prestart: bool = True,
    ) -> None:
        where = options.source_where("code source", name)
        options.one_of(where, "score", score, SCORES)
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
        # The pool: its size (sandbox.workers) is how many samples run at once.
        self.sandbox = Sandbox(
            isolation=isolation,
            allow_weaker_isolation=allow_weaker_isolation,
            workers=workers,
            limits=limits,
            samples_per_sandbox=samples_per_sandbox,
        )

    @property
    def capacity(self) -> Capacity:
        """The pool's slots, less those held by jobs from outside the pipeline (the server's /run_code). Preemptible:
        a program can be run again from the start, at the cost of the time it ran and of its sandbox's reset (the
        runner kills it and resets the sandbox, which then serves the slot's next job). A program past the
        straggler time while every slot is taken steps aside (runs on in its own sandbox, beside the slots): the
        slots grow by one while it runs, and it is never stopped for another tenant."""
        box = self.sandbox
        return Capacity(box.slots, "sandbox slots", "sample", held_elsewhere=box.held_outside, preemptible=True,
                        stop_cost_s=box.stop_s, aside=box.stragglers)  # fmt: skip

    def on_capacity(self, wake: Callable[[], None]) -> None:
        self.sandbox.on_capacity(wake)

    async def warmup(self) -> None:
        """Prove the sandbox and start the pool now (prestart), or at least say which isolation tools it will try."""
        if self.prestart:
            await self.sandbox.prestart()
        else:
            log.info("code source %r: %s; proven on first use", self.name, self.sandbox.outlook())

    async def _runs(self, p: Plan, stop_on_error: bool, claim: Claim | None) -> list[TestRun]:
        job = job_of(p, self.sandbox.python)
        job.stop_on_error = stop_on_error
        result = await self.sandbox.run(job, claim)
        if all(r.status == "sandbox_error" for r in result.runs):
            notes = "; ".join(result.notes)
            raise SourceFailed(f"code sandbox failed before running any test: {notes or 'no output'}")
        return result.runs

    async def grade(
        self,
        response: str,
        ground_truth: str,
        data_source: str = "",
        extra_info: dict[str, Any] | None = None,
        claim: Claim | None = None,
    ) -> Grade:
        """Score one response; InvalidInput for malformed tests, SourceFailed/Unavailable if the sandbox is.
        ``claim``: the slot the pipeline claimed for it (without one, it counts as a job from outside)."""
        p = plan(response, ground_truth, extra_info)
        kind = score_kind(data_source, self.score)
        runs = await self._runs(p, kind == "all_passed", claim)
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

    async def _one(self, sample: RewardInput, claim: Claim) -> RewardOutput | BaseException:
        try:
            g = await self.grade(
                sample.response_text, sample.ground_truth, sample.data_source, sample.extra_info, claim
            )
        except (InvalidInput, SourceFailed, Unavailable):
            raise
        except RewardError:
            raise
        except Exception as exc:
            return SourceFailed(f"code source {self.name!r} raised {describe_exception(exc)}")
        return RewardOutput(g.score, g.extras())

    async def _guarded(self, sample: RewardInput, claim: Claim) -> RewardOutput | BaseException:
        try:
            return await self._one(sample, claim)
        except RewardError as exc:
            return exc

    async def score_batch(self, batch: list[RewardInput]) -> BatchResult:
        return list(await asyncio.gather(*self.start_each(batch)))

    def start_each(self, batch: list[RewardInput]) -> list[asyncio.Future[Outcome]]:
        """Each sample's run started now, its slot claimed now, as the batcher hands it over (answered when its
        own tests are done)."""
        started: list[asyncio.Future[Outcome]] = []
        for s in batch:
            claim = self.sandbox.claim()
            task = asyncio.ensure_future(self._guarded(s, claim))
            # Its slot back if the sample ends before its job took it (a bad test spec, a cancel): else nothing.
            task.add_done_callback(lambda _, claim=claim: self.sandbox.drop(claim))  # type: ignore[misc]
            started.append(task)
        return started

    async def close(self) -> None:
        """Warm sandboxes end now; those running a sample end within their budgets (and die with the server)."""
        self.sandbox.close()
