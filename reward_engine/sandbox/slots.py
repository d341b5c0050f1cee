"""The pool's slots and the jobs in them. A job (one sample's program and all its tests) holds one slot, and so one
sandbox, for its time budget.

Slots are claimed in arrival order and handed from a finished job straight to the next claim. A code pipeline's
batcher claims its samples' slots as it hands them over (``claim``), within the slots free for it; any other job
(the server's ``/run_code``) is counted in ``held_outside`` from when it asks until it ends, and the pipeline
hands over that much less (``on_capacity`` wakes it when such a job ends, or a job steps aside), so a pipeline's
sample never waits here: it waits in the pipeline's fair queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future

from rewardmesh.reward_engine.sandbox.process import SandboxProcess

log = logging.getLogger(__name__)


class Running:
    """A job in a slot: its claim's place in arrival order (``seq``; None: a job from outside the pipeline), its stop,
    its sandbox and that sandbox's uid once it runs (under the pool's lock), whether it stepped aside (its slot given
    on, its sandbox retired when it ends) or was stopped with its slot given the spare, and whether it has ended."""

    __slots__ = ("aside", "box", "ended", "handed", "holders", "reuse", "seq", "slot", "stop", "uid")

    def __init__(self, slot: int, seq: int | None) -> None:
        self.slot = slot
        self.seq = seq
        self.holders = 2  # its thread and its caller: an aside job leaves the stragglers when both are done
        self.stop = threading.Event()
        self.box: SandboxProcess | None = None
        self.uid: int | None = None
        self.aside = False
        # Stopped, its slot given the spare: it stands for the next spare until its sandbox's reset ends.
        self.handed: Future[SandboxProcess | None] | None = None
        self.reuse = False  # its sandbox may serve another job after it
        self.ended = False


class Claim:
    """A slot claimed in arrival order (``seq``): ``slot`` gives its number once one is free for it."""

    __slots__ = ("seq", "settled", "slot")

    def __init__(self, slot: asyncio.Future[int], seq: int) -> None:
        self.slot = slot
        self.seq = seq
        self.settled = False  # its job took the slot, or the claim was dropped


class SlotQueue:
    """``workers`` slots handed out in arrival order, on the event loop; ``stats`` counts the claims that waited."""

    def __init__(self, workers: int, stats: Counter[str]) -> None:
        self.stats = stats
        self.free = list(range(workers))[::-1]  # slots no job holds (taken from the end)
        self.claims: deque[asyncio.Future[int]] = deque()  # claims waiting for a slot, in arrival order
        self.claimed = itertools.count()
        # Jobs not claimed by the pipeline's batcher (the server's /run_code), asking for a slot or holding one.
        self.held_outside = 0
        self.listeners: list[Callable[[], None]] = []

    def claim(self, outside: bool) -> Claim:
        """A slot, claimed now: at once when one is free and no claim waits before it, else when one frees."""
        slot: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if self.free and not self.claims:
            slot.set_result(self.free.pop())
        else:
            self.claims.append(slot)
            self.stats["outside jobs that waited for a slot" if outside else "jobs that waited for a slot"] += 1
        return Claim(slot, next(self.claimed))

    def drop(self, claim: Claim) -> None:
        """Give back a claim whose job will not run (nothing, once its job took the slot)."""
        if claim.settled:
            return
        claim.settled = True
        if claim.slot.done() and not claim.slot.cancelled():
            self.give(claim.slot.result())
        else:
            claim.slot.cancel()  # skipped when a slot frees

    def give(self, slot: int) -> None:
        """A freed slot goes to the oldest claim still waiting, else back to the free ones."""
        while self.claims:
            waiting = self.claims.popleft()
            if not waiting.done():
                waiting.set_result(slot)
                return
        self.free.append(slot)

    def outside_ended(self) -> None:
        self.held_outside -= 1
        self.grew()

    def grew(self) -> None:
        """The slots free for the pipeline grew: its listeners hear of it."""
        for callback in self.listeners:
            try:
                callback()
            except Exception:  # a listener's bug must not cost the pool its slots
                log.exception("code sandbox: a capacity listener failed")
