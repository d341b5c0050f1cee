"""A pool of warm sandboxes sized to the machine, for the code pipeline and the server's ``/run_code``: a job (one
sample's program and all its tests) holds one slot, and so one sandbox, for its time budget. ``Sandbox`` is the
pool's face: it proves the isolation level, runs jobs, stops them and closes. Its parts keep one concern each:

- proof.py: the isolation level the sandboxes run under, proven by a probe program before any job;
- slots.py: the slots, claimed in arrival order, and the jobs in them;
- warm.py: the sandboxes started ahead (one per slot, one spare), when they serve on or retire, and their uids;
- stragglers.py: slow jobs stepping aside to run on beside the slots;
- exchange.py: one sandbox's exchange with its runner, and why the sandbox retires after it.

A pipeline's job whose caller is cancelled (the batcher stops it for another tenant's sample, or shuts down) is
stopped at once: the runner kills its program and resets the sandbox as after any job. While the spare is warm, the
slot takes it and serves the next job at once, and the stopped sandbox, once reset and clean, is the next spare;
else the slot, with its sandbox, serves the next job once reset. A stop thus costs the slot nothing or a reset
(``stop_s``, timed), not a sandbox start; a sandbox whose runner does not reset in time (``process.STOP_S``), or is
not clean after it, is retired as usual. A job from outside the pipeline runs on within its budget when its caller
goes away.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rewardmesh.reward_engine.sandbox.exchange import RunnerExchange
from rewardmesh.reward_engine.sandbox.jobs import Job, JobResult, Limits, TestRun
from rewardmesh.reward_engine.sandbox.levels import LEVELS, Level, default_python
from rewardmesh.reward_engine.sandbox.process import Reply, SandboxProcess
from rewardmesh.reward_engine.sandbox.proof import IsolationProof, SandboxUnavailable
from rewardmesh.reward_engine.sandbox.slots import Claim, Running, SlotQueue
from rewardmesh.reward_engine.sandbox.stragglers import Stragglers
from rewardmesh.reward_engine.sandbox.warm import WarmPool

__all__ = ["Claim", "Job", "JobResult", "Limits", "Sandbox", "SandboxUnavailable", "TestRun"]

log = logging.getLogger(__name__)

# What stopping a job is taken to cost until one has been timed: its runner's kill and reset.
STOP_GUESS_S = 0.01


class Sandbox:
    """Runs jobs in warm sandboxes, at most ``workers`` at once (one per slot), each sandbox serving up to
    ``samples_per_sandbox`` jobs (1: a sandbox is started for every job, and nothing ahead).

    ``isolation`` is the level the operator asks for ("bwrap" or "unshare"). ``start()`` proves it works by
    running a program; if it does not, a lower level is used only with ``allow_weaker_isolation=True``, and
    otherwise every job fails with SandboxUnavailable. There is no level without namespaces. ``prestart()``
    also starts a sandbox for every slot. ``straggler_after_s``: a pipeline's job running this long while every slot
    is taken steps aside (default: a tenth of the time limit per test, at most 1 s); ``max_stragglers``: how many
    such jobs may run beside the slots (default ``2 x workers``). ``stats`` counts sandboxes started, jobs run, jobs
    from outside the pipeline, jobs that waited for a slot or stepped aside, and why sandboxes retired.
    """

    def __init__(
        self,
        *,
        isolation: str = "bwrap",
        allow_weaker_isolation: bool = False,
        workers: int = 0,
        limits: Limits | None = None,
        python: str = "",
        uid_base: int = 61000,
        samples_per_sandbox: int = 100,
        straggler_after_s: float | None = None,
        max_stragglers: int | None = None,
    ) -> None:
        _check(isolation, workers, samples_per_sandbox)
        reuse = samples_per_sandbox
        self.workers = workers or max(1, len(os.sched_getaffinity(0)))
        self.samples_per_sandbox = reuse
        self.limits = limits or Limits()
        self.limits.check("sandbox")
        self.straggler_after_s = min(1.0, self.limits.wall_s / 10) if straggler_after_s is None else straggler_after_s
        self.max_stragglers = most = 2 * self.workers if max_stragglers is None else max_stragglers
        if not self.straggler_after_s > 0 or most < 0:
            raise ValueError("sandbox: 'straggler_after_s' must be > 0 and 'max_stragglers' >= 0")
        self.python = python or default_python()
        self.uid_base = uid_base
        self.stats: Counter[str] = Counter()
        self._proof = IsolationProof(isolation, bool(allow_weaker_isolation), self.python, self._run_alone)
        # Threads block on the sandboxes' pipes: one per slot serving a job, one per straggler, one per slot starting
        # its next sandbox, one starting the spare, one for the start probe. They live as long as the pool: a sandbox
        # dies with the thread that started it (bubblewrap's --die-with-parent).
        self._threads = ThreadPoolExecutor(2 * self.workers + most + 2, thread_name_prefix="sandbox")
        self._slots = SlotQueue(self.workers, self.stats)
        self._lock = threading.Lock()  # guards the warm pool, the jobs running, the stragglers and the counters
        self.warm = WarmPool(
            self.workers, most, self.limits, self.python, uid_base, self._lock, self._threads, self.stats
        )
        self._running: set[Running] = set()  # the jobs whose sandbox runs them now
        self._aside = Stragglers(self, reuse > 1, self._running, self._slots, self.warm)
        self.stop_s = STOP_GUESS_S  # what stopping a job costs until its slot serves again (moving average)
        self._busy = 0

    @property
    def level(self) -> Level | None:
        """The isolation level in use, once proven."""
        return self._proof.level

    @property
    def description(self) -> str:
        if self.level is None:
            failure = self._proof.failure
            return f"unavailable ({failure})" if failure else "not started"
        reuse = self.samples_per_sandbox
        kept = f"each serving up to {reuse} samples, one spare" if reuse > 1 else "a fresh one per sample"
        seccomp = self._proof.filter  # the filter the runner installs ("seccomp", or why none)
        filtered = "system-call filter on" if seccomp == "seccomp" else f"system-call filter: {seccomp}"
        return f"{self.level.name} ({self.level.tool}), {filtered}, {self.workers} workers, {kept}"

    def outlook(self) -> str:
        """Which isolation this sandbox asks for and which tools are installed, without starting anything."""
        return self._proof.outlook()

    async def start(self) -> Level:
        """Find and prove the isolation level (once it works); raises SandboxUnavailable when none is acceptable."""
        level, proven = await self._proof.prove()
        if proven:
            log.info("code sandbox: isolation level %s", self.description)
            if os.geteuid() == 0 and not self.warm.setpriv:
                log.warning("code sandbox: running as root without setpriv: sandboxes keep uid 0 outside")
        return level

    async def prestart(self) -> Level:
        """Prove the level, then start a sandbox for every slot that has none, and wait until they are ready."""
        level = await self.start()
        if self.samples_per_sandbox > 1:
            warm = self.warm
            starting = [warm.start_ahead(level, slot) for slot in range(self.workers)] + [warm.start_spare(level)]
            await asyncio.gather(*(asyncio.wrap_future(f) for f in starting if f is not None))
            log.info("code sandbox: %d sandboxes started ahead (one spare)", len(warm.idle) + len(warm.starting))
        return level

    async def _run_alone(self, level: Level, job: Job) -> tuple[JobResult, dict[str, Any]]:
        """The start probe's job, in a sandbox of its own started in one of the pool's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._run_once, level, job, 0)

    @property
    def slots(self) -> int:
        """Jobs that can run at once now: the slots, plus one for each job that stepped aside."""
        return self.workers + self._aside.count

    @property
    def stragglers(self) -> int:
        """Jobs that stepped aside and run now beside the slots, each in its own sandbox."""
        return self._aside.count

    @property
    def held_outside(self) -> int:
        """Jobs from outside the pipeline (the server's /run_code) asking for a slot or holding one."""
        return self._slots.held_outside

    def on_capacity(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (on the event loop) whenever a job from outside the pipeline ends or a job steps
        aside: the slots free for the pipeline grew."""
        self._slots.listeners.append(callback)

    def claim(self, *, outside: bool = False) -> Claim:
        """A slot, claimed now: at once when one is free and no claim waits before it, else when one frees, in
        arrival order. A claim not used by ``run`` must be dropped (``drop``)."""
        return self._slots.claim(outside)

    def drop(self, claim: Claim) -> None:
        """Give back a claim whose job will not run (nothing, once its job took the slot)."""
        self._slots.drop(claim)

    async def run(self, job: Job, claim: Claim | None = None) -> JobResult:
        """Run a job in the sandbox of a slot: ``claim``'s, claimed by the pipeline's batcher as it handed the job
        over; without one, a job from outside the pipeline: it claims a slot now (waiting for one when all are
        busy) and is counted in ``held_outside`` until it ends."""
        outside = claim is None
        if claim is None:
            self._slots.held_outside += 1
            claim = self.claim(outside=True)
        try:
            level = await self.start()
            slot = await claim.slot
        except BaseException:
            self.drop(claim)
            if outside:
                self._slots.outside_ended()
            raise
        claim.settled = True
        with self._lock:
            self._busy += 1
        loop = asyncio.get_running_loop()
        if outside:
            self.stats["outside jobs"] += 1
        run = Running(slot, None if outside else claim.seq)
        try:
            future = loop.run_in_executor(self._threads, self._serve, level, job, run)
        except BaseException:  # the pool was closed
            self._release(run, outside)
            raise
        future.add_done_callback(lambda _: self._release(run, outside))
        try:
            if not outside:
                await self._aside.watch(future, run, level)
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The pipeline takes its sample back (for another tenant's, or shutting down): its program ends now and
            # the slot frees as soon as its sandbox is gone. A caller from outside going away leaves its job running
            # within its budget.
            if not outside:
                self._stop(run)
            raise
        finally:
            # An aside job leaves the stragglers with its caller (its pipeline sample ends in the same step), not
            # before: while it counts in ``slots`` as aside, the sample is running or done, never neither.
            self._aside.let_go(run)

    def _stop(self, run: Running) -> None:
        run.stop.set()
        with self._lock:  # held, the exchange cannot end and its sandbox (and its wake pipe) cannot close meanwhile
            if run not in self._running or run.box is None:
                return
            run.box.wake()
            handed = self.warm.hand_spare(run)
        if handed:
            self._slots.give(run.slot)

    def _release(self, run: Running, outside: bool) -> None:
        self._aside.let_go(run)
        if not run.aside and run.handed is None:  # else its slot was given on when it stepped aside or was stopped
            self._slots.give(run.slot)
        with self._lock:
            self._busy -= 1
            last = self.warm.closed and self._busy == 0
        if last:
            self._threads.shutdown(wait=False, cancel_futures=True)
        if outside:
            self._slots.outside_ended()

    def close(self) -> None:
        """No new sandboxes; the warm ones end now, those running a job end within their budgets."""
        with self._lock:  # closed as the jobs running are counted: the last to end, or this, ends the threads
            self.warm.closed = True
            quiet = self._busy == 0
        self.warm.close()
        if quiet:
            self._threads.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ blocking, in the pool's threads

    def _run_once(self, level: Level, job: Job, slot: int) -> tuple[JobResult, dict[str, Any]]:
        """A job in a sandbox started for it alone (the start probe), with the runner's ready record."""
        box = self.warm.spawn(level, self.warm.uid_of[slot], (job.limits or self.limits).tmp_mb)
        try:
            result, reply = RunnerExchange(job, self.limits, self.samples_per_sandbox).run(box, fresh=True)
        finally:
            box.kill()
        ready = next((r for r in reply.records if "ready" in r), {})
        return result, ready

    def _serve(self, level: Level, job: Job, run: Running) -> JobResult:
        """One job in the slot's warm sandbox (or one started for it), then keep, or retire and replace it. ``run.stop``
        set: its caller took the job back, and its program is stopped (``_stop``) or never starts. A job that stepped
        aside meanwhile retires its sandbox, and gives its uid back once the sandbox is gone."""
        exchange = RunnerExchange(job, self.limits, self.samples_per_sandbox)
        lim, warm = exchange.limits, self.warm
        reuse = self.samples_per_sandbox > 1 and lim.tmp_mb == self.limits.tmp_mb
        slot, stop = run.slot, run.stop
        run.reuse = reuse
        box = warm.take(slot) if reuse else None
        if reuse:
            warm.start_spare(level)  # the spare taken (or never up) is replaced now, not when a job ends
        fresh = box is None
        if box is None:
            box = warm.spawn(level, warm.uid_of[slot], lim.tmp_mb)
        try:
            result, reply = self._exchange_in(run, box, exchange, fresh)
            if not fresh and reply.final is None and not reply.records and not reply.timed_out and not stop.is_set():
                # A warm sandbox that died while it waited (killed from outside) ran nothing: start one for the job.
                box.kill()
                with self._lock:
                    self.stats["retired: died while warm"] += 1
                    uid = warm.uid_of[slot] if run.uid is None else run.uid  # its own, if it stepped aside
                box, fresh = warm.spawn(level, uid, lim.tmp_mb), True
                result, reply = self._exchange_in(run, box, exchange, fresh)
        except BaseException:
            box.kill()
            warm.uid_back(run)
            raise
        why = exchange.retire_reason(box, result, reply, stop.is_set(), reuse)
        self._ended(level, run, box, why, fresh, reply)
        return result

    def _ended(
        self, level: Level, run: Running, box: SandboxProcess, why: str | None, fresh: bool, reply: Reply
    ) -> None:
        """The job has ended: it is counted, its sandbox serves on or retires (``why``), a stop's cost is learned."""
        with self._lock:
            run.ended = True
            self.stats["jobs"] += 1
            self.stats["jobs in a warm sandbox"] += not fresh
            keep = self.warm.keep(run, box, why)
            if reply.stop_s is not None:
                self.stats["jobs stopped"] += 1
                # A slot that took the spare served on at once, but the next stop may find none warm: the reset
                # is what a stop is taken to cost.
                cost = reply.stop_s + (0.0 if keep or run.aside or run.handed is not None else self.warm.start_s)
                self.stop_s += 0.2 * (cost - self.stop_s)
        self.warm.after(level, run, box, keep, run.reuse)

    def _exchange_in(
        self, run: Running, box: SandboxProcess, exchange: RunnerExchange, fresh: bool
    ) -> tuple[JobResult, Reply]:
        """The job's exchange in its sandbox, which ``_stop`` stops meanwhile if the job is taken back; a job taken
        back before it started runs nothing (a warm sandbox stays warm)."""
        with self._lock:
            stopped = run.stop.is_set()
            if not stopped:
                run.box = box
                if run.uid is None:  # the slot's uid is its sandbox's until the job steps aside
                    run.uid = self.warm.uid_of[run.slot]
                self._running.add(run)
        if stopped:
            gone = JobResult([TestRun("sandbox_error", stderr="taken back before it started")])
            return gone, Reply(final=None if fresh else {"clean": True})
        try:
            return exchange.run(box, fresh, run.stop)
        finally:
            with self._lock:
                self._running.discard(run)


def _check(isolation: str, workers: int, samples_per_sandbox: int) -> None:
    """Refuse a pool that cannot be, naming the field, before anything starts."""
    if isolation not in LEVELS:
        raise ValueError(f"sandbox: 'isolation' must be one of {', '.join(LEVELS)}, got {isolation!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"sandbox: 'workers' must be an integer >= 0 (0: one per CPU), got {workers!r}")
    reuse = samples_per_sandbox
    if isinstance(reuse, bool) or not isinstance(reuse, int) or reuse < 1:
        raise ValueError(f"sandbox: 'samples_per_sandbox' must be an integer >= 1, got {reuse!r}")
