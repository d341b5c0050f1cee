"""Stragglers stepping aside, so one slow program does not hold a slot that the next samples need.

A pipeline's job that has run past the straggler time (a tenth of its time limit per test, at most 1 s) while
every slot is taken steps aside: it runs on in its sandbox, under its uid, to its end or its budget, and gives its
slot to the next claim with the warm spare as the slot's sandbox (a job steps aside only once the spare is up, so
the next job never waits for a sandbox to start; the next spare starts at once). Jobs step aside in the order
their slots were claimed. So at most ``max_stragglers`` slow programs run beside the ``workers`` slots that keep
serving, each holding one sandbox, its own, and the pool's capacity (``slots``) grows by one while each runs
(``on_capacity`` listeners hear of it). A sandbox whose job stepped aside, reset and clean when the job ends, is
kept for the next spare (at most one per slot, each under its uid), so a steady stream of stragglers costs resets,
not sandbox starts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from rewardmesh.reward_engine.sandbox.jobs import JobResult
from rewardmesh.reward_engine.sandbox.levels import Level
from rewardmesh.reward_engine.sandbox.slots import Running, SlotQueue
from rewardmesh.reward_engine.sandbox.warm import WarmPool

# A job past its straggler time that may not step aside yet (a slot free, the spare not up) looks again this often.
RECHECK_S = 0.05


class StragglerSettings(Protocol):
    """The pool's settings for stragglers, read at each look so that a change takes effect on the jobs running."""

    straggler_after_s: float  # how long a job runs while every slot is taken before it steps aside
    max_stragglers: int  # how many jobs may run aside at once


@dataclass(eq=False)
class Stragglers:
    """The pipeline's jobs that step aside, as ``settings`` allow; ``count`` run now. ``reuse``: sandboxes serve more
    than one job (a spare is kept warm). ``running`` (the jobs whose sandbox runs them now), the slots and the warm
    pool are the pool's; ``lock`` and ``stats`` are the warm pool's."""

    settings: StragglerSettings
    reuse: bool
    running: set[Running]
    slots: SlotQueue
    warm: WarmPool
    count: int = 0  # jobs running beside the slots, each in its own sandbox

    async def watch(self, future: asyncio.Future[JobResult], run: Running, level: Level) -> None:
        """Until the job ends or steps aside: once it has run past the straggler time, it steps aside as soon as
        it may (every slot taken, the spare up, the jobs claimed before it aside), looking again every 50 ms."""
        wait = self.settings.straggler_after_s
        while wait < float("inf"):
            await asyncio.wait((future,), timeout=wait)
            if future.done() or self.step_aside(run, level):
                return
            wait = min(wait, RECHECK_S)
        await asyncio.wait((future,))

    def step_aside(self, run: Running, level: Level) -> bool:
        """``run``'s job runs on beside the slots, its slot given to the next claim with the warm spare as its
        sandbox (False: a slot is free, no more stragglers may run, the job is not running, no spare is up yet, or
        one of the pipeline's claimed before it still serves in a slot: jobs step aside in their claims' order, so
        those aside are the pipeline's oldest started, which is how its batcher knows them)."""
        if self.slots.free or self.warm.closed or self.count >= self.settings.max_stragglers:
            return False
        with self.warm.lock:
            if run.uid is None or run.ended or run.stop.is_set() or not (self.warm.free_uids or self.warm.kept):
                return False
            if any(other.seq is not None and run.seq is not None and other.seq < run.seq and not other.aside
                   and not other.ended and not other.stop.is_set() for other in self.running):  # fmt: skip
                return False
            spare = self.warm.warm_spare() if self.reuse else None
            wait = self.reuse and spare is None  # the slot's next sample would wait for a sandbox to start: not yet
            if not wait:
                run.aside = True
                self.count += 1
                self.warm.stats["jobs that stepped aside"] += 1
                self.warm.step_aside(run.slot, spare)
        if self.reuse:
            self.warm.start_spare(level)  # the next spare; or, where none is up (it died, say), one to step aside to
        if wait:
            return False
        self.slots.give(run.slot)
        self.slots.grew()
        return True

    def let_go(self, run: Running) -> None:
        """The job's thread or its caller is done; once both are, an aside job no longer runs beside the slots."""
        with self.warm.lock:
            run.holders -= 1
            if run.aside and not run.holders:
                self.count -= 1
