"""The engine's own sample and score types, so no source ever sees a protobuf."""

from __future__ import annotations

import asyncio
import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from rewardmesh.reward_engine.sandbox.executor import Sandbox


@dataclass
class RewardInput:
    """One sample as a reward source sees it."""

    sample_id: str
    prompt_ids: np.ndarray  # int32 [prompt_length]
    response_ids: np.ndarray  # int32 [response_length]
    prompt_text: str = ""
    response_text: str = ""
    data_source: str = ""
    ground_truth: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    response_mask: np.ndarray | None = None  # int32, 0 on tool-output tokens
    tenant: str = ""  # whom it is scored for, set as it is queued (a judge keeps each tenant's connections apart)

    @property
    def num_tokens(self) -> int:
        """Tokens the sample occupies in a padded batch (what max_batch_tokens counts)."""
        return int(self.prompt_ids.shape[0] + self.response_ids.shape[0])


_I4 = np.dtype("<i4")


def _ids_field(name: str) -> Any:
    """A property over the instance dict: validated little-endian int32 bytes become an array on first read."""

    def get(self: RewardInput) -> np.ndarray:
        d = self.__dict__
        value = d[name]
        if value.__class__ is bytes:
            value = d[name] = np.frombuffer(value, _I4)
        return value

    def put(self: RewardInput, value: np.ndarray) -> None:
        self.__dict__[name] = value

    return property(get, put)


class WireInput(RewardInput):
    """A RewardInput as it came off the wire: its token ids stay bytes (checked: int32, 1-D, >= 0) until a
    source reads them. Rules and judges never do, and an array per id tensor was a tenth of the reward
    server's CPU per rule-scored sample. Pickles as a plain RewardInput."""

    prompt_ids = _ids_field("prompt_ids")
    response_ids = _ids_field("response_ids")

    @classmethod
    def of(
        cls,
        sample_id: str,
        prompt_ids: bytes | np.ndarray,
        response_ids: bytes | np.ndarray,
        prompt_text: str,
        response_text: str,
        data_source: str,
        ground_truth: str,
        extra_info: dict[str, Any],
        response_mask: np.ndarray | None,
    ) -> WireInput:
        """Ids as little-endian int32 bytes (already validated) or arrays; no __init__ (one dict, no setters)."""
        self = cls.__new__(cls)
        self.__dict__ = {
            "sample_id": sample_id,
            "prompt_ids": prompt_ids,
            "response_ids": response_ids,
            "prompt_text": prompt_text,
            "response_text": response_text,
            "data_source": data_source,
            "ground_truth": ground_truth,
            "extra_info": extra_info,
            "response_mask": response_mask,
        }
        return self

    @property
    def num_tokens(self) -> int:
        """As RewardInput's, without making the arrays."""
        d = self.__dict__
        p, r = d["prompt_ids"], d["response_ids"]
        return (len(p) >> 2 if p.__class__ is bytes else int(p.shape[0])) + (
            len(r) >> 2 if r.__class__ is bytes else int(r.shape[0])
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (RewardInput, tuple(getattr(self, f.name) for f in fields(RewardInput)))


@dataclass
class RewardOutput:
    """A source's verdict on one sample."""

    score: float
    extras: dict[str, float] = field(default_factory=dict)


# A source returns, per input and in input order, either an output or the exception that sample raised: one bad
# sample must not fail its batch-mates.
Outcome = RewardOutput | BaseException
BatchResult = list[Outcome]
# A batch's outcomes as a pipeline hands them to its batcher: a future in the place of a sample not done yet.
ApartResult = Sequence["Outcome | asyncio.Future[Outcome]"]


@dataclass(frozen=True)
class Capacity:
    """How much of a source's work can have started at once, and in what unit. The batcher hands a source only
    what it can start; everything else waits in the pipeline's fair queue (tenant share, then step deadline),
    so no queue of the source's own sits between the fair queue and the workers.

    ``per="sample"``: each sample handed over holds one of ``slots`` until its result is in (worker processes,
    sandbox slots, judge requests in flight). ``per="batch"``: each batch holds one (a reward model's batches in
    flight). ``slots=0``: the source works on the event loop itself (a rule inline): its capacity is the loop,
    which every tenant's messages also need, so the batcher hands it one batch at a time, each bounded in loop
    time. ``held_elsewhere``: slots taken by work the batcher did not hand over (the server's own calls on the
    same sandbox), not free for the pipeline until they end. ``paced``: the source also spaces its starts out in
    time (a rate limit): samples are handed over one at a time, when its ``start_delay()`` says the next may start.
    ``preemptible``: a started sample's work may be cancelled and started again later with nothing lost but the
    time it ran (an idempotent request to a server that drops what its client hangs up on): a tenant under its
    share of the slots then takes slots from a tenant over its own at once (and more, while its credit in the fair
    queue lasts), instead of waiting for that tenant's started work to end. ``stop_cost_s``: what stopping a
    started sample costs besides the time it ran (its sandbox's reset): one is stopped only when it can be
    expected to run longer than that still. ``aside``: of the ``slots``, how many are held by slow samples that
    stepped aside (a straggler runs on beside the slots that keep serving, each of which grew the capacity by one):
    the oldest started samples still running and not being stopped, as many (samples step aside in the order they
    started); a stop never takes one of them, since its slot would not go to another. ``overtakes`` (``per="batch"``):
    one batch handed over beyond the slots (``score_batch_first``) runs ahead of those in flight, which pause for it
    at their next step (a model's next layer) and go on after it, nothing lost or computed twice: a tenant back from
    idle waits for a step of the batch in flight, not for the whole batch.
    """

    slots: int = 0
    unit: str = "inline on the event loop"
    per: Literal["sample", "batch"] = "batch"
    paced: bool = False
    held_elsewhere: int = 0
    preemptible: bool = False
    stop_cost_s: float = 0.0
    aside: int = 0
    overtakes: bool = False

    def __post_init__(self) -> None:
        if self.slots < 0:
            raise ValueError(f"capacity: slots must be >= 0 (0: inline on the event loop), got {self.slots}")
        if self.per not in ("sample", "batch"):
            raise ValueError(f"capacity: per must be 'sample' or 'batch', got {self.per!r}")
        if self.held_elsewhere < 0:
            raise ValueError(f"capacity: held_elsewhere must be >= 0, got {self.held_elsewhere}")
        if not 0 <= self.aside <= self.slots:
            raise ValueError(f"capacity: aside must be between 0 and slots ({self.slots}), got {self.aside}")
        if not self.stop_cost_s >= 0:
            raise ValueError(f"capacity: stop_cost_s must be >= 0 seconds, got {self.stop_cost_s}")
        if self.overtakes and (self.per != "batch" or not self.slots):
            raise ValueError("capacity: overtakes needs per='batch' and slots >= 1 (a batch runs ahead of batches)")

    @property
    def inline(self) -> bool:
        """The source's work runs on the event loop itself."""
        return not self.slots

    @property
    def free_for_pipeline(self) -> int:
        """Slots the pipeline's own work may hold now (its slots less those held elsewhere)."""
        return max(0, self.slots - self.held_elsewhere)

    def describe(self) -> str:
        if not self.slots:
            return f"the event loop ({self.unit}): one batch at a time, each bounded in loop time"
        elsewhere = f" ({self.held_elsewhere} held outside the pipeline now)" if self.held_elsewhere else ""
        preempt = ", preemptible" if self.preemptible else ""
        ahead = ", overtaken by a batch sent first" if self.overtakes else ""
        return f"{self.slots} {self.unit}" + (", paced" if self.paced else "") + preempt + ahead + elsewhere


class SourceKind(enum.StrEnum):
    """What a source computes with: the batcher's defaults for its pipeline and the kind ListRewards reports
    follow it. A str ("rule" == SourceKind.RULE), so logs and configs read as before."""

    RULE = "rule"
    FUNCTION = "function"
    MODEL = "model"
    JUDGE = "judge"
    CODE = "code"


class RewardSource(ABC):
    """A reward source as the pipeline, the batcher and the server see it: a rule, a user function, a code
    sandbox, a judge, a reward model. Every source subclasses this; what it does not override keeps the default
    here (no extras, no warm-up, nothing to close, no limit on the work it can start, answers with its batch)."""

    name: str
    kind: SourceKind
    target: str  # rule name, function spec, model path, judge URL or isolation level
    # The extras this source reports (ListRewards announces them, so every caller builds the same columns).
    extra_keys: tuple[str, ...] = ()
    # The code sandbox this source runs programs in, if any (the server's /run_code endpoint lends it).
    sandbox: Sandbox | None = None

    @abstractmethod
    async def score_batch(self, batch: list[RewardInput]) -> BatchResult:
        """Each sample's result (or the exception it raised), in input order."""

    async def score_batch_first(self, batch: list[RewardInput]) -> tuple[BatchResult, float]:
        """As ``score_batch``, ahead of the batches in flight, where the capacity ``overtakes``: they pause at their
        next step until this batch is done. Also how long it waited for them to get there (seconds): its time, but
        not its work, so its tenant is not charged for it. The default scores it as any other batch."""
        return await self.score_batch(batch), 0.0

    def start_each(self, batch: list[RewardInput]) -> list[asyncio.Future[Outcome]] | None:
        """Start every sample's work now and return, at once, a future of each one's outcome, so each sample is
        answered, and frees its slot, when its own work is done, not with its batch's slowest (the pipeline
        scores this way when it can). A source that takes work per sample overrides it; None (the default):
        this source scores whole batches, with ``score_batch``."""
        return None

    @property
    def capacity(self) -> Capacity:
        """How much work can have started at once (read whenever the batcher hands work over: it may change
        while running, as when a worker pool lends a spare worker to a slow sample)."""
        return Capacity()

    def on_capacity(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` on the event loop whenever ``capacity`` grows while work runs (a source whose capacity
        is fixed never calls it: the batcher already knows when its own work ends)."""
        return None

    def start_delay(self) -> float:
        """Seconds before the source may start another sample (a paced source's rate limit); 0: now."""
        return 0.0

    async def warmup(self) -> None:
        """Get ready to score (start workers, load a model, prove a sandbox), so the first batch does not pay."""
        return None

    async def close(self) -> None:
        """Release what the source holds; samples still running fail."""
        return None
