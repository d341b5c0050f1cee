"""A sample on its way through a pipeline: its ticket, made whole as the sample arrives (what it carries: tenant,
deadline, step deadline, trace context, where its outcome goes), queued through `DynamicBatcher.add`, the batcher's
one way in, and answered exactly once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rewardmesh.reward_engine.fair_queue import DEFAULT_TENANT, Tenant
from rewardmesh.reward_engine.types import RewardInput, RewardOutput

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Scored:
    """A sample's result plus where its time went on this server."""

    output: RewardOutput
    queue_s: float
    compute_s: float
    batch_size: int


# Where a queued sample's outcome goes without a future: sink(token, Scored or the sample's exception),
# called once, at once (no loop round trip per sample), unless the ticket was cancelled first.
Sink = Callable[[Any, "Scored | BaseException"], None]


class Ticket:
    """One queued sample (slots: thousands are made per second). Its outcome goes to `sink(token, outcome)` when
    it has a sink (no future, no loop hop per sample: the cheapest way for a server), else to its own `future`;
    `cancel()` drops it if it has not been answered yet. A caller may subclass it to carry its own per-sample
    fields (the reward servicer's flight record is its sample's ticket): one object per sample, not two."""

    __slots__ = ("_future", "context", "deadline", "done", "due", "enqueued", "inp", "preempted", "sink", "started",
                 "tenant", "token", "tokens")  # fmt: skip

    def __init__(
        self,
        inp: RewardInput,
        *,
        tenant: Tenant = DEFAULT_TENANT,
        deadline: float | None = None,  # start computing by (time.monotonic()), or DEADLINE_EXCEEDED
        due: float | None = None,  # step deadline (time.monotonic()): scored by then, or DEADLINE_EXCEEDED early
        context: object = None,  # opaque per-sample context (a trace context), handed back in BatchInfo
        sink: Sink | None = None,
        token: Any = None,
        arrived: float | None = None,  # time.monotonic() of its arrival, when the caller read it for a whole message
    ) -> None:
        self.inp = inp
        self.sink = sink
        self.token = token
        self._future: asyncio.Future[Scored] | None = (
            None if sink is not None else asyncio.get_running_loop().create_future()
        )
        self.done = False  # answered or cancelled (sink tickets; a future keeps its own state)
        self.enqueued = time.monotonic() if arrived is None else arrived
        self.deadline = deadline
        self.due = due
        self.tenant = tenant
        self.context = context
        self.tokens = inp.num_tokens  # (a WireInput counts its ids without making arrays)
        self.started = False  # handed to the source (set by the batcher, which also resets it in `add`)
        self.preempted = False  # its work was stopped for another tenant's (again only while an older one runs)

    @property
    def future(self) -> asyncio.Future[Scored]:
        """The sample's outcome, for a ticket without a sink (cancelling it drops the sample)."""
        if self._future is None:
            raise TypeError(f"sample {self.inp.sample_id}: its ticket answers through a sink, not a future")
        return self._future

    @property
    def finished(self) -> bool:
        return self.done or (self._future is not None and self._future.done())

    def cancel(self) -> bool:
        """Drop the sample unless already answered; True if this call dropped it (nothing will be delivered)."""
        if self._future is not None:
            return self._future.cancel()
        if self.done:
            return False
        self.done = True
        self.token = None  # a token may be the ticket itself (a servicer's flight): no cycle left to collect
        return True

    def resolve(self, value: Scored | BaseException) -> None:
        """Deliver the outcome once (a cancelled or answered ticket ignores it)."""
        future = self._future
        if future is not None:
            if not future.done():
                if isinstance(value, BaseException):
                    future.set_exception(value)
                else:
                    future.set_result(value)
            return
        if self.done:
            return
        self.done = True
        assert self.sink is not None
        token, self.token = self.token, None  # as in cancel: refcounting frees an answered ticket, not the GC
        try:
            self.sink(token, value)
        except Exception:  # a sink's bug must not strand the rest of the batch
            log.exception("result sink failed for sample %s", self.inp.sample_id)
