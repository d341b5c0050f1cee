"""The reward server's data plane, under its thin servicer: samples from Score streams and ScoreBatch calls
queued on the engine's pipelines, each answered exactly once; a stream's results built in place in its next
message; flow control (a stream is not read past its bound of unanswered samples); sample ids scoped to their
stream or call; drain.

A sample in flight is one object, its batcher ticket (`_Flight`, a Ticket, made once the sample is decoded): the
batcher hands the outcome back to `Scoring._settle` itself, with no future per sample."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from rewardmesh.common.errors import Cancelled, InvalidInput, Unavailable
from rewardmesh.common.tensors import duration_seconds
from rewardmesh.reward_engine.engine import RewardEngine
from rewardmesh.reward_engine.fair_queue import DEFAULT_TENANT, Tenant
from rewardmesh.reward_engine.ticket import Scored, Sink, Ticket
from rewardmesh.reward_engine.types import RewardInput
from rewardmesh.server.limits import DEFAULT_LIMITS, LimitExceeded, Limits, check
from rewardmesh.server.reward.reward_input import to_reward_input
from rewardmesh.server.reward.sample_split import ParsedBatch, ParsedScore, Refusals
from rewardmesh.server.reward.telemetry import RewardTelemetry
from rewardmesh.server.status import SAMPLE_ERRORS, status_proto
from rewardmesh.v1 import common_pb2, reward_pb2

DEFAULT_MAX_STREAM_UNANSWERED = 2048
# The loop time one message's samples are queued in before the reader lets the loop turn: the loop reads every
# tenant's messages, and a flooder's message of hundreds of samples must not hold it while a small step's message
# waits to be read.
READ_TURN_S = 0.00025

_RESULT = reward_pb2.RewardResult
_END = object()  # the client half-closed the stream
_DRAIN = object()  # the server is draining: finish what is in flight, then end the stream


class _Owner:
    """A ScoreBatch call: the scope of its samples' ids."""

    __slots__ = ("flights",)

    def __init__(self) -> None:
        self.flights: dict[str, _Flight] = {}  # its samples between arrival and result, by id


class _Outbox:
    """One stream's results, gathered in place in the next ScoreResponse (a result is built where it is sent:
    no copy into the message), and its sentinels; one waiter: the stream's writer. Also the scope of the
    stream's sample ids (`flights`): an id names a sample only on its own stream, so no other client can
    cancel, supersede or collide with it."""

    __slots__ = ("add", "flights", "items", "response", "waiter")

    def __init__(self) -> None:
        self.flights: dict[str, _Flight] = {}
        self.items: collections.deque[Any] = collections.deque()  # END, DRAIN or the reader's exception
        self.response = reward_pb2.ScoreResponse()
        self.add: Callable[..., reward_pb2.RewardResult] = self._add
        self.waiter: asyncio.Future[None] | None = None

    def _add(self, **fields: Any) -> reward_pb2.RewardResult:
        """A new result in the response being gathered; fill it in place."""
        self.wake()
        return self.response.results.add(**fields)

    def take(self) -> reward_pb2.ScoreResponse | None:
        """The gathered results (None if there are none); the next ones gather in a new message."""
        response = self.response
        if not response.results:
            return None
        self.response = reward_pb2.ScoreResponse()
        return response

    def put(self, item: Any) -> None:
        self.items.append(item)
        self.wake()

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self) -> None:
        while not self.items and not self.response.results:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None


class _Stream:
    """One Score stream's state, shared by its reader and its writer: its outbox, how many of its samples are
    read and not yet answered (bounded by `limit`: flow control), the client's max_results_per_message, and
    what has ended it."""

    __slots__ = ("box", "draining", "limit", "per_message", "reader_done", "room", "tenant", "unanswered")

    def __init__(self, tenant: Tenant, limit: int) -> None:
        self.box = _Outbox()
        self.tenant = tenant
        self.limit = limit
        self.unanswered = 0  # samples read and not yet written back
        self.per_message = 1  # the client's max_results_per_message
        self.room: asyncio.Future[None] | None = None  # the reader waits here while the stream is at its bound
        self.reader_done = False  # the client half-closed the stream (END)
        self.draining = False  # the server is draining (DRAIN)


class _Flight(Ticket):
    """A sample between arrival and result, once decoded: its batcher ticket (one object per sample, not a record
    plus a ticket), with who asked: its stream's outbox, where its result is built, or an `owner` with a
    `deliver` callback. Its outcome comes back through `sink(self, outcome)`, with no future."""

    __slots__ = ("arrival_ns", "deliver", "owner", "reward", "sid")

    def __init__(
        self,
        inp: RewardInput,
        sink: Sink,
        *,
        sid: str,
        reward: str,
        deliver: Callable[[reward_pb2.RewardResult], None] | None,
        owner: _Outbox | _Owner,
        arrived: tuple[float, int],
        tenant: Tenant,
        deadline: float | None,
        due: float | None,
        parent: str | None,
    ) -> None:
        super().__init__(inp, tenant=tenant, deadline=deadline, due=due, context=parent, sink=sink, token=self,
                         arrived=arrived[0])  # fmt: skip
        self.sid = sid
        self.reward = reward
        self.deliver = deliver
        self.owner = owner  # the stream (or ScoreBatch call) it came on
        self.arrival_ns = arrived[1]


class _Refused:
    """A sample answered before its ticket was made (refused, or not decodable): who asked, as a `_Flight` has
    it, so that a sample refused early costs no ticket."""

    __slots__ = ("arrival_ns", "context", "deliver", "enqueued", "owner", "reward", "sid")

    def __init__(
        self,
        sid: str,
        reward: str,
        deliver: Callable[[reward_pb2.RewardResult], None] | None,
        owner: _Outbox | _Owner,
        context: str | None,
        arrived: tuple[float, int],
    ) -> None:
        self.sid = sid
        self.reward = reward
        self.deliver = deliver
        self.owner = owner
        self.context = context  # its traceparent when tracing
        self.enqueued, self.arrival_ns = arrived


class Scoring:
    """Samples from Score streams and ScoreBatch calls, queued on the engine's pipelines and each answered exactly
    once, with the counters the server reports; one bad sample is that sample's error, never the stream's."""

    def __init__(
        self,
        engine: RewardEngine,
        telemetry: RewardTelemetry,
        tokenizer: Any = None,
        *,
        max_stream_unanswered: int = DEFAULT_MAX_STREAM_UNANSWERED,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        if max_stream_unanswered < 1:
            raise ValueError(f"max_stream_unanswered must be >= 1, got {max_stream_unanswered}")
        self.engine = engine
        self.telemetry = telemetry
        self.tokenizer = tokenizer
        self.limits = limits
        self._sink: Sink = self._settle  # bound once: a bound method per sample is an allocation per sample
        # Backpressure: a Score stream with this many samples read but not yet answered is not read further,
        # so gRPC flow control pushes back on a client that writes and never reads.
        self.max_stream_unanswered = max_stream_unanswered
        self._in_flight = 0  # samples queued and not yet answered, over every stream and call
        self._outboxes: set[_Outbox] = set()
        self._draining = asyncio.Event()
        self.results_sent = 0
        self.messages_in = self.messages_out = 0  # Score messages read and written: samples per message
        self.held = 0  # samples read on Score streams and not yet answered, over all streams

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def drain(self) -> None:
        """Refuse new samples (UNAVAILABLE, so clients resend elsewhere) and wait for those in flight."""
        self._draining.set()
        for box in self._outboxes:
            box.put(_DRAIN)
        while self._in_flight:
            await asyncio.sleep(0.01)

    # -- one sample ---------------------------------------------------------------------------

    def begin(
        self,
        sample: common_pb2.Sample,
        reward: str,
        owner: _Outbox | _Owner,
        *,
        tenant: Tenant = DEFAULT_TENANT,
        timeout_s: float | None = None,
        step_left_s: float | None = None,
        parent: str | None = None,
        deliver: Callable[[reward_pb2.RewardResult], None] | None = None,
        refused: BaseException | None = None,
        arrived: tuple[float, int] | None = None,
    ) -> None:
        """Validate, decode and queue one sample; its result is made exactly once, whatever happens: in its
        stream's next message when `owner` is a stream's outbox, else handed to `deliver`. Its id is scoped to
        `owner`: the same id on another stream or call is another sample.
        ``tenant``: whose it is (the call's token); ``timeout_s``: start computing within;
        ``step_left_s``: time left until its step must be scored (ScoreRequest.step_time_left);
        ``parent``: its traceparent when tracing (`RewardTelemetry.begin`), carried through its batch;
        ``refused``: answer the sample with this error without looking at it (its message was over a limit);
        ``arrived``: (time.monotonic(), time.time_ns()) of its message, read once for all of the message's items."""
        sid = sample.sample_id
        if arrived is None:
            arrived = (time.monotonic(), time.time_ns())
        f: _Flight | None = None
        try:
            if refused is not None:
                raise refused
            if not sid:
                raise InvalidInput("sample.sample_id is empty; give every sample a unique id")
            if self._draining.is_set():
                raise Unavailable("reward server is draining; send the sample to another reward target")
            flights = owner.flights
            if sid in flights:
                where = "stream" if owner.__class__ is _Outbox else "call"
                raise InvalidInput(f"sample.sample_id '{sid}' is already in flight on this {where}; ids must be unique")
            pipeline = self.engine.get(reward)
            inp = to_reward_input(sample, self.tokenizer, self.limits)
            mono = arrived[0]
            # No future per sample: the batcher calls _settle(f, outcome) itself when the batch is done.
            f = _Flight(
                inp,
                self._sink,
                sid=sid,
                reward=reward,
                deliver=deliver,
                owner=owner,
                arrived=arrived,
                tenant=tenant,
                deadline=mono + timeout_s if timeout_s is not None else None,
                due=mono + step_left_s if step_left_s is not None else None,
                parent=parent,
            )
            pipeline.add(f)
        except SAMPLE_ERRORS as exc:
            self._finish(f if f is not None else _Refused(sid, reward, deliver, owner, parent, arrived), error=exc)
            return
        flights[sid] = f
        self._in_flight += 1

    def _forget(self, f: _Flight) -> None:
        flights = f.owner.flights
        if flights.get(f.sid) is f:
            del flights[f.sid]
            self._in_flight -= 1

    def _settle(self, f: _Flight, outcome: Scored | BaseException) -> None:
        self._forget(f)
        if isinstance(outcome, BaseException):
            self._finish(f, error=outcome)
        else:
            self._finish(f, scored=outcome)

    def _cancel(self, f: _Flight, why: str) -> None:
        self._forget(f)
        if f.cancel():  # every flight in an owner's flights is queued (armed)
            self._finish(f, error=Cancelled(why))

    def _finish(
        self, f: _Flight | _Refused, *, scored: Scored | None = None, error: BaseException | None = None
    ) -> None:
        owner = f.owner
        new = owner.add if owner.__class__ is _Outbox else _RESULT
        result = None
        if scored is not None:
            try:  # fields by keyword, the timing submessage touched once: the cheapest way to build it
                out = scored.output
                result = new(sample_id=f.sid, reward=f.reward, score=out.score, batch_size=scored.batch_size)
                if out.extras:
                    result.extras.update(out.extras)
                timing = result.timing
                timing.queue = scored.queue_s
                timing.compute = scored.compute_s
                timing.total = time.monotonic() - f.enqueued
            except SAMPLE_ERRORS as exc:  # e.g. a source's extras that are not numbers
                error = exc
        if error is not None or result is None:
            failure = status_proto(error or Cancelled("no result"))
            if result is None:
                result = new(sample_id=f.sid, reward=f.reward, error=failure)
            else:  # already in its message: made over into the error
                result.Clear()
                result.sample_id, result.reward = f.sid, f.reward
                result.error.CopyFrom(failure)
            result.timing.total = time.monotonic() - f.enqueued
            self.telemetry.on_failure(result, f.context, f.arrival_ns)  # a scored sample's telemetry: its batch's
        if f.deliver is not None:
            f.deliver(result)

    def _cancel_ids(self, box: _Outbox, ids: Any) -> None:
        """Cancel this stream's samples by id (another stream's ids are not this stream's to cancel)."""
        # Over the limit, the stream fails INVALID_ARGUMENT before one id is looked at (a client's own stream).
        check(len(ids), self.limits.max_ids_per_message, "ScoreRequest.cancel_sample_ids count", "max_ids_per_message")
        flights = box.flights
        for sid in ids:
            f = flights.get(sid)
            if f is not None:
                self._cancel(f, f"sample '{sid}' was cancelled by the client")

    def _keep_on_stream(self, keep: Any) -> None:
        """A keep decision riding on the stream, as KeepTraces without a call."""
        check(len(keep), self.limits.max_ids_per_message, "ScoreRequest.keep_traces count", "max_ids_per_message")
        self.telemetry.keep(dict(keep))

    def _over_limit(self, count: int, what: str) -> LimitExceeded | None:
        try:
            check(count, self.limits.max_samples_per_request, what, "max_samples_per_request")
        except LimitExceeded as exc:
            return exc
        return None

    @staticmethod
    def _timeout(msg: reward_pb2.ScoreRequest | reward_pb2.ScoreBatchRequest) -> float | None:
        return duration_seconds(msg.timeout) if msg.HasField("timeout") else None

    @staticmethod
    def _step_left(msg: reward_pb2.ScoreRequest | reward_pb2.ScoreBatchRequest) -> float | None:
        return duration_seconds(msg.step_time_left) if msg.HasField("step_time_left") else None

    # -- streams and calls ---------------------------------------------------------------------

    async def stream(
        self, requests: AsyncIterator[ParsedScore], tenant: Tenant
    ) -> AsyncIterator[reward_pb2.ScoreResponse]:
        """One Score stream: one reader task (`_read`) feeds its outbox (results, END, DRAIN or the reader's
        exception); this loop writes. The reader stops reading at `max_stream_unanswered` unanswered samples
        (flow control)."""
        st = _Stream(tenant, self.max_stream_unanswered)
        self._outboxes.add(st.box)
        if self._draining.is_set():
            st.box.put(_DRAIN)
        reader = asyncio.create_task(self._read(requests, st))
        try:
            # half-closed and answered, or draining: end with OK; the client resends elsewhere
            while st.unanswered or not (st.reader_done or st.draining):
                response = await self._gathered(st)
                if response is None:
                    continue
                for message in self._messages(response, st.per_message):
                    yield message
                    self._written(st, len(message.results) or 1)
        finally:
            self.held -= st.unanswered
            self._outboxes.discard(st.box)
            reader.cancel()
            for f in list(st.box.flights.values()):
                self._cancel(f, "the stream ended")

    async def _read(self, requests: AsyncIterator[ParsedScore], st: _Stream) -> None:
        """The stream's reader: each message's samples queued, its cancellations and keep decisions applied; not
        read further while the stream is at its bound of unanswered samples. Ends the outbox with END, or with
        the exception that broke the stream."""
        try:
            async for parsed in requests:
                self.messages_in += 1
                await self._read_message(parsed, st)
                while st.unanswered >= st.limit:  # stop reading: flow control pushes back on the writer
                    st.room = asyncio.get_running_loop().create_future()
                    await st.room
            st.box.put(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the stream broke: the writer re-raises it
            st.box.put(exc)

    async def _read_message(self, parsed: ParsedScore, st: _Stream) -> None:
        """One ScoreRequest: its items (or its one sample) queued, then its cancellations and keep decisions."""
        unparsed = None  # samples of the message that did not parse (server/reward/sample_split.py)
        if isinstance(parsed, tuple):
            req, unparsed = parsed
        else:
            req = parsed
        if req.max_results_per_message > 0:
            st.per_message = req.max_results_per_message
        if req.items:
            await self._begin_items(req, unparsed, st)
        elif req.HasField("sample"):
            st.unanswered += 1
            self.held += 1
            self.begin(
                req.sample,
                req.reward,
                st.box,
                tenant=st.tenant,
                timeout_s=self._timeout(req),
                step_left_s=self._step_left(req),
                parent=self.telemetry.begin(req.trace_context),
                refused=unparsed.get(-1) if unparsed else None,
            )
        if req.cancel_sample_ids:  # after the items: a message may cancel its own
            self._cancel_ids(st.box, req.cancel_sample_ids)
        if req.keep_traces:  # a keep decision, as KeepTraces without a call
            self._keep_on_stream(req.keep_traces)

    async def _begin_items(self, req: reward_pb2.ScoreRequest, unparsed: Refusals | None, st: _Stream) -> None:
        """A message's items queued, READ_TURN_S of loop time at a time (a big message is not one long turn of
        the loop: every other stream's messages are read on it too)."""
        items = req.items
        n = len(items)
        refused = self._over_limit(n, "ScoreRequest.items count")
        arrived = (time.monotonic(), time.time_ns())  # one clock read for the whole message
        st.unanswered += n
        self.held += n
        begin, timeout, step_left, telemetry, box, tenant = (
            self.begin, self._timeout, self._step_left, self.telemetry, st.box, st.tenant
        )  # fmt: skip
        # once per message: each item's trace context is read only if one may carry it
        traced = telemetry.tracing and not req.items_untraced
        turn = arrived[0] + READ_TURN_S
        for k, item in enumerate(items):
            if k and time.monotonic() > turn:
                await asyncio.sleep(0)
                turn = time.monotonic() + READ_TURN_S
            begin(
                item.sample,
                item.reward,
                box,
                tenant=tenant,
                timeout_s=timeout(item),
                step_left_s=step_left(item),
                parent=telemetry.begin(item.trace_context) if traced else None,
                refused=refused or (unparsed.get(k) if unparsed else None),
                arrived=arrived,
            )

    @staticmethod
    async def _gathered(st: _Stream) -> reward_pb2.ScoreResponse | None:
        """The results gathered since the last write (None: only sentinels came: END or DRAIN noted on `st`);
        re-raises the reader's exception."""
        box = st.box
        if not box.items and not box.response.results:
            await box.wait()
        items = box.items
        while items:
            item = items.popleft()
            if item is _END:
                st.reader_done = True
            elif item is _DRAIN:
                st.draining = True
            else:
                raise item
        return box.take()

    @staticmethod
    def _messages(response: reward_pb2.ScoreResponse, per_message: int) -> Iterable[reward_pb2.ScoreResponse]:
        """The gathered results in messages of at most the client's `max_results_per_message`."""
        results = response.results
        n = len(results)
        if per_message > 1 and n <= per_message:
            return (response,)  # as gathered: no copy
        if per_message > 1:
            return (reward_pb2.ScoreResponse(results=results[lo : lo + per_message]) for lo in range(0, n, per_message))
        return (reward_pb2.ScoreResponse(result=r) for r in results)  # a client that takes one result per message

    def _written(self, st: _Stream, sent: int) -> None:
        """`sent` results written: counted, and the reader let go on once the stream is under its bound."""
        st.unanswered -= sent
        self.held -= sent
        self.results_sent += sent
        self.messages_out += 1
        room = st.room
        if room is not None and not room.done() and st.unanswered < st.limit:
            room.set_result(None)

    async def batch(self, parsed: ParsedBatch, tenant: Tenant) -> reward_pb2.ScoreBatchResponse:
        """One ScoreBatch call: every sample queued at once, the response once each has its result."""
        unparsed: Refusals = {}  # samples that did not parse (server/reward/sample_split.py)
        if isinstance(parsed, tuple):
            request, unparsed = parsed
        else:
            request = parsed
        error = self._over_limit(len(request.samples), "ScoreBatchRequest.samples count")
        if error is not None:
            raise error
        timeout = self._timeout(request)
        step_left = self._step_left(request)
        slots: list[reward_pb2.RewardResult | None] = [None] * len(request.samples)
        left = len(request.samples)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        owner = _Owner()

        def deliver_to(i: int) -> Callable[[reward_pb2.RewardResult], None]:
            def deliver(result: reward_pb2.RewardResult) -> None:
                nonlocal left
                slots[i] = result
                left -= 1
                if not left and not done.done():
                    done.set_result(None)

            return deliver

        for i, s in enumerate(request.samples):
            refused = unparsed.get(i)
            self.begin(s, request.reward, owner, tenant=tenant, timeout_s=timeout, step_left_s=step_left,
                       deliver=deliver_to(i), refused=refused)  # fmt: skip
        try:
            if left:
                await done
        finally:
            for f in list(owner.flights.values()):
                self._cancel(f, "the call ended")
        self.results_sent += len(slots)
        return reward_pb2.ScoreBatchResponse(results=[r for r in slots if r is not None])
