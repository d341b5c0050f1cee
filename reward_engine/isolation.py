"""Running untrusted parsing (rules, user functions, a judge's reply parser) in warm worker processes.

A policy in training writes anything, and checkers parse and evaluate what it wrote: one answer such as
``\\boxed{9^{9^{9}}}`` keeps math-verify (sympy) busy for hours. A thread cannot be interrupted, so each
call runs in a worker process under a time budget (over it: the worker is killed and replaced, and the
call is DeadlineExceeded) and a memory budget (an address-space limit; over it: ResourceExhausted and
the worker is replaced). The event loop never waits on a call, and neither does any other call running
in another worker.

Cheap calls stay cheap: workers are spawned once and kept warm, and each lane sends several queued calls
per round trip. Each lane is a thread that owns one worker process: the thread blocks on the pipe (without
the GIL) and watches the clock, so the event loop is woken once per finished group of calls, not per call.
A call never waits behind a budget being burned: a lane whose call has run longer than
``straggler_after_s`` while other calls wait, or while every lane is busy (the pipeline's fair queue holds the
work that waits), becomes a straggler. It hands the calls it has not started back to the front of the queue, a
fresh lane takes its place, and it ends once its slow call does (finished, or killed at its budget). So
``workers`` lanes keep serving however many hostile calls run; at most ``max_stragglers`` slow calls run beside
them, each holding one worker, its own. The pool's capacity (``slots``) is its serving lanes plus the stragglers:
it grows when a slow call steps aside, and ``on_capacity`` listeners hear of it. A worker runs in a process group of
its own, killed whole with it: processes a user's function starts do not outlive the worker or the server.

Calls are named by a ``module:attr`` or ``/path/file.py:attr`` spec that the worker imports itself (spawn,
never fork: the server runs gRPC threads, and a forked child may inherit their locks held); arguments and
results are pickled over a local pipe between processes of the same server, never to or from the wire.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import inspect
import itertools
import logging
import multiprocessing
import os
import pickle
import resource
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from rewardmesh.common.errors import (
    DeadlineExceeded,
    InvalidInput,
    QueueFull,
    ResourceExhausted,
    RewardError,
    SourceFailed,
    Unavailable,
    UnknownReward,
    describe_exception,
)
from rewardmesh.reward_engine.loading import load_function, parse_spec

log = logging.getLogger(__name__)

# Spawning a worker and importing its preloads is not charged to any call, but may not take forever.
STARTUP_TIMEOUT_S = 120.0
# Most calls sent to one worker in one round trip.
MAX_CALLS_PER_TRIP = 32
# A worker sends finished results before starting a call once the oldest unsent one is this old, so a
# slow call does not hold back its round-trip neighbours' results for long (and cheap ones go in groups).
_FLUSH_AFTER_S = 0.001
# How often a lane looks at which call its worker is running (the granularity of timeouts).
_TICK_S = 0.05
# Workers run this much nicer than the server: CPU-bound reward code never starves the event loop that feeds it
# work and answers every tenant's samples (it still gets every cycle the server leaves).
WORKER_NICENESS = 5

_KNOWN_ERRORS: tuple[type[RewardError], ...] = (
    DeadlineExceeded,
    InvalidInput,
    QueueFull,
    ResourceExhausted,
    SourceFailed,
    Unavailable,
    UnknownReward,
)


def plain_error(exc: RewardError) -> RewardError:
    """The engine's own class for a RewardError: a user's subclass defined in a file module could not be
    unpickled in the parent process."""
    for cls in _KNOWN_ERRORS:
        if isinstance(exc, cls):
            return exc if type(exc) is cls else cls(str(exc))
    return exc if type(exc) is RewardError else RewardError(str(exc))


def spec_of(fn: Callable[..., Any]) -> str | None:
    """The ``module:qualname`` a worker can import ``fn`` by, or None when it cannot (a closure, __main__)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname:
        return None
    try:
        obj: Any = __import__(module, fromlist=["_"])
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:
        return None
    return f"{module}:{qualname}" if obj is fn else None


# ------------------------------------------------------------------------------------- worker side


@dataclass(frozen=True)
class Call:
    """One call for a worker: ``target`` (a spec) called with ``kwargs``; ``what`` names it in errors.
    ``verl``: the return value is a verl-style score, converted to a RewardOutput in the worker."""

    target: str
    kwargs: dict[str, Any]
    what: str
    verl: bool = False
    args: tuple[Any, ...] = ()


_worker_fns: dict[str, Callable[..., Any]] = {}


def _resolve(target: str) -> Callable[..., Any]:
    fn = _worker_fns.get(target)
    if fn is None:
        digest = hashlib.sha1(target.encode()).hexdigest()[:10]
        fn = load_function(parse_spec(target), module_name=f"_rewardmesh_fn_{digest}_worker")
        _worker_fns[target] = fn
    return fn


async def _await(awaitable: Any) -> Any:
    return await awaitable


def run_call(fn: Callable[..., Any], call: Call) -> Any:
    """Run one call; failures come back as values, never as raises, so that only engine types cross
    the process boundary and one sample's failure is its own."""
    try:
        value = fn(*call.args, **call.kwargs)
        if inspect.isawaitable(value):  # an async function forced into a thread or process
            value = asyncio.run(_await(value))
        if call.verl:
            from rewardmesh.reward_engine.sources.verl_compat import to_output

            value = to_output(value, call.what)
        return value
    except RewardError as exc:
        return plain_error(exc)
    except MemoryError:
        return ResourceExhausted(f"{call.what} ran out of memory")
    except RecursionError:
        return SourceFailed(f"{call.what} raised RecursionError (input nested too deeply)")
    except Exception as exc:
        return SourceFailed(f"{call.what} raised {describe_exception(exc)}")


def _address_space() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * resource.getpagesize()


def _limit_memory(budget_bytes: int) -> None:
    """Let the address space grow by at most ``budget_bytes`` from here (Linux; a no-op elsewhere)."""
    if budget_bytes <= 0:
        return
    with contextlib.suppress(OSError, ValueError):
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        soft = _address_space() + budget_bytes
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _run_one(call: Call) -> Any:
    try:
        try:
            fn = _resolve(call.target)
        except ValueError as exc:
            return SourceFailed(str(exc))
        return run_call(fn, call)
    except MemoryError:  # raised outside the call's own handler (e.g. while building the error)
        return ResourceExhausted(f"{call.what} ran out of memory")


def _die_with_group(signum: int, frame: Any) -> None:
    """SIGTERM (also what the kernel sends when the lane that started us dies): take our process group along."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _own_group() -> None:
    """Lead a process group of our own (killed whole by the parent), and die with the thread that started us."""
    with contextlib.suppress(OSError):
        os.setsid()
    signal.signal(signal.SIGTERM, _die_with_group)
    with contextlib.suppress(Exception):  # Linux: PR_SET_PDEATHSIG, so a parent killed -9 leaves no worker
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
        if os.getppid() == 1:  # the parent died before prctl
            _die_with_group(signal.SIGTERM, None)


def worker_main(conn: Connection, progress: Any, preload: tuple[str, ...], memory_bytes: int, stop: Any = None) -> None:
    """A worker process: import the preloads, say ready, then run round trips of calls until EOF.

    Before each call the worker writes the call's sequence number into ``progress`` (shared memory, no
    syscall), so the parent knows which call is running and for how long without a message per call.
    Results go back in groups: everything finished is sent before a call starts once the oldest unsent
    result is over _FLUSH_AFTER_S old, and at the end of the trip. A call that ran out of memory ends
    the worker after its result is sent, since its heap may be left in any state. ``stop`` (shared
    memory): the first sequence number not to start; the parent lowers it when it hands calls back.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle; it then kills us
    _own_group()
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICENESS)
    for target in preload:  # "spec" is imported; "spec()" is also called (a warm-up hook)
        with contextlib.suppress(Exception):  # reported by the first call that uses it
            fn = _resolve(target.removesuffix("()"))
            if target.endswith("()"):
                fn()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            trip: tuple[int, list[Call]] | None = conn.recv()
        except (EOFError, OSError):
            return
        if trip is None:
            return
        base, calls = trip
        _limit_memory(memory_bytes)  # once per round trip: reading the current size costs a syscall
        out: list[Any] = []
        first_unsent = 0.0
        for offset, call in enumerate(calls):
            if out and time.monotonic() - first_unsent > _FLUSH_AFTER_S:
                _send(conn, out, calls)
                out = []
            if stop is not None and base + offset >= stop.value:
                break  # handed back to another lane
            progress.value = base + offset
            result = _run_one(call)
            if not out:
                first_unsent = time.monotonic()
            out.append(result)
            if isinstance(result, ResourceExhausted):
                break
        _send(conn, out, calls)
        if out and isinstance(out[-1], ResourceExhausted):
            return


def _send(conn: Connection, results: list[Any], calls: list[Call]) -> None:
    try:
        conn.send(results)
    except (OSError, ValueError):
        raise
    except Exception:  # an unpicklable return value: only that call fails
        safe: list[Any] = []
        for result in results:
            try:
                pickle.dumps(result)
                safe.append(result)
            except Exception as exc:
                safe.append(SourceFailed(f"a call returned a value that cannot be sent back: {exc}"))
        conn.send(safe)


# ------------------------------------------------------------------------------------- parent side


@dataclass(eq=False)
class _Pending:
    call: Call
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


def _settle(items: list[tuple[_Pending, Any]]) -> None:
    for pending, result in items:
        if not pending.future.done():
            pending.future.set_result(result)


class _Lane(threading.Thread):
    """One worker process and the thread that feeds it round trips from the pool's queue."""

    def __init__(self, pool: IsolatedPool, index: int) -> None:
        super().__init__(name=f"isolation-{pool.name}-{index}", daemon=True)
        self.pool = pool
        self.process: BaseProcess | None = None
        self.conn: Connection | None = None
        self.pid = 0
        self.progress: Any = None
        self.sequence = 0  # numbers the calls sent to this lane's workers, so progress names one
        self.stop_at: Any = None  # shared with the worker: the first sequence number it must not start
        self.straggler = False  # its slow call runs on; a fresh lane serves the queue meanwhile
        self.ready = threading.Event()
        self._lock = threading.Lock()

    # ---- the worker process

    def _spawn(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        progress = ctx.RawValue("q", -1)
        stop = ctx.RawValue("q", 1 << 62)
        process = ctx.Process(
            target=worker_main,
            args=(child, progress, self.pool.preload, self.pool.memory_bytes, stop),
            name=f"rewardmesh-{self.pool.name}",
            daemon=True,
        )
        process.start()
        child.close()
        self.process, self.conn, self.progress, self.stop_at = process, parent, progress, stop
        if not parent.poll(STARTUP_TIMEOUT_S):
            self._kill()
            raise RuntimeError(f"did not start within {STARTUP_TIMEOUT_S:g}s")
        try:
            _, pid = parent.recv()
        except (EOFError, OSError) as exc:
            self._kill()
            raise RuntimeError(f"died while starting (exit code {process.exitcode})") from exc
        self.pid = int(pid)
        self.pool.spawned += 1

    def _kill(self) -> None:
        with self._lock:
            process, conn = self.process, self.conn
            self.process = self.conn = None
            self.pid = 0
        if conn is not None:
            conn.close()
        if process is not None:
            if process.pid:  # the worker's group: whatever the user's code started dies with it
                with contextlib.suppress(OSError):
                    os.killpg(process.pid, signal.SIGKILL)
            if process.is_alive():
                process.kill()
            process.join(5.0)
            with contextlib.suppress(ValueError):
                process.close()

    def stop(self) -> None:
        self._kill()

    # ---- the loop

    def run(self) -> None:
        pool = self.pool
        try:
            self._spawn()  # warm before the first call; a failure is retried (and reported) by a call
        except Exception as exc:
            log.warning("isolation worker for %s did not start (%s); retrying on the next call", pool.name, exc)
        finally:
            self.ready.set()
        while True:
            batch = pool.take()
            if batch is None:
                self._kill()
                return
            try:
                self._run_trip(batch)
            except Exception as exc:  # never lose a call: whatever is left fails alone
                log.exception("isolation lane %s failed", self.name)
                self._kill()
                self._deliver([(p, SourceFailed(f"{p.call.what}: worker lane failed: {exc}")) for p in batch])
            if self.straggler:  # its place is taken: end with the slow call
                self._kill()
                pool.retire(self)
                return

    def _deliver(self, done: list[tuple[_Pending, Any]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Pending, Any]]] = {}
        for pending, result in done:
            by_loop.setdefault(pending.loop, []).append((pending, result))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, items)

    def _run_trip(self, batch: list[_Pending]) -> None:
        """Run ``batch`` on this lane's worker (replacing it as often as needed) until every call has
        its result; each result is handed to the event loop in groups as they come."""
        pool = self.pool
        todo = list(batch)
        while todo:
            if pool.closed:
                self._deliver([(p, Unavailable(f"{p.call.what}: the source was closed")) for p in todo])
                return
            if self.straggler:  # what is left goes back to the lanes that serve the queue
                pool.give_back(todo)
                return
            if self.conn is None:
                try:
                    self._spawn()
                except Exception as exc:
                    self._deliver([(p, Unavailable(f"{p.call.what}: worker process {exc}")) for p in todo])
                    return
            todo = self._one_trip(todo)

    def _one_trip(self, sent: list[_Pending]) -> list[_Pending]:
        """One round trip; returns the calls still to run (on a fresh worker) when this one was replaced."""
        pool, conn = self.pool, self.conn
        assert conn is not None
        base = self.sequence
        self.sequence += len(sent)
        try:
            conn.send((base, [p.call for p in sent]))
        except (OSError, ValueError):
            self._kill()
            return sent
        except Exception as exc:  # arguments that cannot be pickled
            reason = describe_exception(exc)
            self._deliver([(p, SourceFailed(f"{p.call.what} could not be called: {reason}")) for p in sent])
            return []
        received = 0
        current, since = 0, time.monotonic()
        while received < len(sent):
            try:
                if conn.poll(min(_TICK_S, max(0.0, since + pool.timeout_s - time.monotonic()))):
                    results: list[Any] = conn.recv()
                    self._deliver(list(zip(sent[received:], results, strict=False)))
                    received += len(results)
                    if results and isinstance(results[-1], ResourceExhausted):
                        self._kill()  # the worker exits after an out-of-memory call
                        return sent[received:]
                    continue
            except (EOFError, OSError):
                running = max(received, self.progress.value - base)
                if running >= len(sent):  # it died running a call handed back to another lane
                    self._kill()
                    return sent[received:]
                code = self.process.exitcode if self.process is not None else None
                self._kill()
                pending = sent[running]
                died: RewardError = SourceFailed(f"{pending.call.what}: its worker process died (exit code {code})")
                if pool.closed:
                    died = Unavailable(f"{pending.call.what}: the source was closed during the call")
                self._deliver([(pending, died)])
                # Calls before it finished but their results died with the worker: run them again.
                return sent[received:running] + sent[running + 1 :]
            running = max(received, self.progress.value - base)
            if running >= len(sent):  # the worker raced past a hand-back: it runs a call another lane has
                self._kill()
                return sent[received:]
            now = time.monotonic()
            if running != current:
                current, since = running, now
            elif not self.straggler and now - since >= pool.straggler_after_s and pool.stalls(self, sent, running):
                sent = self._hand_back(sent, base, running)
            elif now - since >= pool.timeout_s:
                self._kill()
                pool.timeouts += 1
                pending = sent[running]
                self._deliver([(pending, DeadlineExceeded(f"{pending.call.what} timed out after {pool.timeout_s:g}s"))])
                return sent[received:running] + sent[running + 1 :]
        return []

    def _hand_back(self, sent: list[_Pending], base: int, running: int) -> list[_Pending]:
        """Become a straggler: the calls not started go back to the queue, a fresh lane takes our place; the
        calls this trip still waits for (those up to the slow one)."""
        self.straggler = True
        assert self.stop_at is not None
        self.stop_at.value = base + running + 1  # the worker starts none of the rest (best effort: see above)
        self.pool.give_back(sent[running + 1 :])
        self.pool.replace(self)
        return sent[: running + 1]


_pool_ids = itertools.count()


class IsolatedPool:
    """Warm worker processes that run calls under a per-call time and memory budget.

    ``workers``: lanes (processes), spawned on first use (or by ``warmup``). ``timeout_s``: each call's
    running time; waiting in the queue and starting a worker are not counted. ``memory_mb``: how much a
    call may grow its worker's address space (0: unlimited). ``preload``: specs each worker imports as
    it starts, so that cost is not charged to a call (a spec ending in ``()`` is also called, with no
    arguments: a warm-up hook). ``straggler_after_s``: a call running this long while others wait has its
    lane replaced (default: a tenth of ``timeout_s``, at most 1 s); ``max_stragglers``: how many such slow
    calls may run beside the ``workers`` lanes (default: ``2 * workers``).
    """

    def __init__(
        self,
        name: str,
        *,
        workers: int = 2,
        timeout_s: float = 10.0,
        memory_mb: int = 1024,
        preload: tuple[str, ...] = (),
        straggler_after_s: float | None = None,
        max_stragglers: int | None = None,
    ) -> None:
        self.name = name
        self.timeout_s = float(timeout_s)
        self.straggler_after_s = min(1.0, self.timeout_s / 10) if straggler_after_s is None else straggler_after_s
        self.max_stragglers = 2 * workers if max_stragglers is None else max_stragglers
        self.workers = workers
        self.stragglers = 0  # lanes running a slow call beside the `workers` that serve the queue
        self._idle = 0  # lanes waiting for work
        self.memory_bytes = int(memory_mb) * 1024 * 1024
        self.preload = preload
        self.closed = False
        self.spawned = 0  # worker processes started, replacements included
        self.timeouts = 0
        self._queue: collections.deque[_Pending] = collections.deque()
        self._cond = threading.Condition()
        self._lanes = [_Lane(self, i) for i in range(workers)]
        self._lane_ids = itertools.count(workers)
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None  # where calls come from (capacity listeners run there)
        self._capacity_listeners: list[Callable[[], None]] = []

    @property
    def pids(self) -> set[int]:
        return {lane.pid for lane in self._lanes if lane.pid}

    @property
    def slots(self) -> int:
        """Calls that can run at once now: the serving lanes, plus a spare for each slow call that stepped aside."""
        return self.workers + self.stragglers

    def on_capacity(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the calls' event loop whenever ``slots`` grows (a slow call stepped aside)."""
        self._capacity_listeners.append(callback)

    def start(self) -> None:
        """Start the lanes (each spawns its worker in the background); idempotent."""
        if not self._started:
            self._started = True
            for lane in self._lanes:
                lane.start()

    def take(self) -> list[_Pending] | None:
        """A lane's next round trip: a fair share of what is queued, at most MAX_CALLS_PER_TRIP."""
        with self._cond:
            self._idle += 1
            while not self._queue and not self.closed:
                self._cond.wait()
            self._idle -= 1
            if self.closed:
                return None
            share = -(-len(self._queue) // self.workers)
            count = max(1, min(MAX_CALLS_PER_TRIP, share))
            return [self._queue.popleft() for _ in range(min(count, len(self._queue)))]

    def stalls(self, lane: _Lane, sent: list[_Pending], running: int) -> bool:
        """Whether ``lane``'s slow call may hold up others (calls behind it in its trip or in the queue, or every
        lane busy while work waits where the pool cannot see it) and another straggler may run."""
        with self._cond:
            waiting = running + 1 < len(sent) or bool(self._queue) or not self._idle
            return waiting and not self.closed and self.stragglers < self.max_stragglers

    def give_back(self, calls: list[_Pending]) -> None:
        """Calls a lane will not run: to the front of the queue, in their order."""
        if not calls:
            return
        with self._cond:
            self._queue.extendleft(reversed(calls))
            self._cond.notify(len(calls))

    def replace(self, lane: _Lane) -> None:
        """``lane`` became a straggler: a fresh lane serves the queue in its place."""
        with self._cond:
            if self.closed:
                return
            self.stragglers += 1
            fresh = _Lane(self, next(self._lane_ids))
            self._lanes.append(fresh)
        fresh.start()
        loop = self._loop
        if loop is not None:
            for callback in self._capacity_listeners:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                    loop.call_soon_threadsafe(callback)

    def retire(self, lane: _Lane) -> None:
        with self._cond:
            self.stragglers -= 1
            with contextlib.suppress(ValueError):
                self._lanes.remove(lane)

    def submit(self, calls: list[Call]) -> list[asyncio.Future[Any]]:
        """Queue the calls now; each future resolves with its call's return value, or the RewardError it ended
        with (never an exception: one call's failure is its own)."""
        loop = asyncio.get_running_loop()
        if self.closed:
            closed: list[asyncio.Future[Any]] = []
            for c in calls:
                fut = loop.create_future()
                fut.set_result(Unavailable(f"{c.what}: the source is closed"))
                closed.append(fut)
            return closed
        pending = [_Pending(c, loop.create_future(), loop) for c in calls]
        self._put(pending)
        return [p.future for p in pending]

    async def run(self, calls: list[Call]) -> list[Any]:
        """Each call's return value, or the RewardError it ended with; in order."""
        return list(await asyncio.gather(*self.submit(calls)))

    def _put(self, pending: list[_Pending]) -> None:
        self._loop = pending[0].loop if pending else self._loop
        self.start()
        with self._cond:
            self._queue.extend(pending)
            self._cond.notify(len(pending))

    async def warmup(self) -> None:
        """Start every worker now, so the first calls do not wait for spawning and imports."""
        self.start()
        await asyncio.to_thread(self._wait_ready)

    def _wait_ready(self) -> None:
        for lane in self._lanes[: self.workers]:
            lane.ready.wait(STARTUP_TIMEOUT_S + 5)

    async def close(self) -> None:
        """Stop every worker now, a stuck one included; calls not yet finished get Unavailable."""
        self.closed = True
        with self._cond:
            left = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        _settle([(p, Unavailable(f"{p.call.what}: the source was closed")) for p in left])
        with self._cond:
            lanes = list(self._lanes)
        for lane in lanes:
            lane.stop()  # kills the worker: a lane blocked on it sees EOF and ends
        await asyncio.to_thread(self._join)

    def _join(self) -> None:
        with self._cond:
            lanes = list(self._lanes)
        for lane in lanes:
            if lane.is_alive():
                lane.join(5.0)
