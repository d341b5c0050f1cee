"""User reward functions with verl's signature, loaded from a module or a .py file and run under a timeout.

Sync functions run in isolated worker processes by default (rewardmesh.reward_engine.isolation): reward code is
usually CPU-bound Python, which would hold the GIL (and stall the gRPC event loop) in a thread pool,
and a thread cannot be stopped when a call hangs.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rewardmesh.common.errors import DeadlineExceeded, RewardError, SourceFailed, Unavailable, describe_exception
from rewardmesh.reward_engine.isolation import Call, IsolatedPool, run_call
from rewardmesh.reward_engine.loading import load_function, parse_spec
from rewardmesh.reward_engine.sources import options
from rewardmesh.reward_engine.sources.verl_compat import to_output, verl_kwargs
from rewardmesh.reward_engine.types import (
    BatchResult,
    Capacity,
    Outcome,
    RewardInput,
    RewardOutput,
    RewardSource,
    SourceKind,
)

EXECUTORS = ("auto", "process", "thread", "inline")


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


# ---------------------------------------------------------------------------------- running a call


def _done(outcome: Outcome) -> asyncio.Future[Outcome]:
    future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
    future.set_result(outcome)
    return future


async def _run_on_loop(fn: Callable[..., Any], what: str, kwargs: dict[str, Any]) -> RewardOutput | RewardError:
    try:
        value = fn(**kwargs)
        if inspect.isawaitable(value):
            value = await value
        return to_output(value, what)
    except RewardError as exc:
        return exc
    except Exception as exc:
        return SourceFailed(f"{what} raised {describe_exception(exc)}")


class FunctionSource(RewardSource):
    """A user's verl-style reward function (sync or async) run with a per-call time budget.

    Config keys:
      function: "pkg.module:fn" (importable) or "path/to/file.py:fn" (relative to cwd or absolute).
      timeout_s: limit per call (execution only: waiting for a free worker and starting one are not
        counted) -> DeadlineExceeded for that sample.
      memory_mb: how much one call may grow its worker process's memory -> ResourceExhausted (0: no limit;
        process executor only).
      executor: "auto" (async functions on the event loop, sync ones in worker processes),
        "process", "thread" or "inline" (on the event loop: a sync function then blocks the loop
        and its timeout cannot interrupt it; use it only for trivial functions).
      max_workers: worker processes or threads (the source's capacity: samples beyond it wait in the
        pipeline's fair queue until one is free).
      max_concurrency: calls of an async function in flight at once on the event loop (its capacity there).

    "process" is the isolation every untrusted parser in the engine shares (rewardmesh.reward_engine.isolation):
    warm spawned workers that import the function by its spec (so the server's main module must be
    import-safe, as with any spawn pool), several calls per round trip, a call over its budget kills
    and replaces its worker and fails alone, a worker that dies fails only the call it was running.
    Threads cannot be killed: with executor="thread" a timed-out call's pool is abandoned and a thread
    stuck forever leaks, so prefer "process" for code that may hang.
    """

    kind = SourceKind.FUNCTION

    def __init__(
        self,
        name: str,
        function: str,
        timeout_s: float = 30.0,
        executor: str = "auto",
        max_workers: int = 2,
        memory_mb: int = 2048,
        max_concurrency: int = 16,
    ) -> None:
        where = options.source_where("function source", name)
        options.positive(where, "timeout_s", timeout_s)
        options.one_of(where, "executor", executor, EXECUTORS)
        options.integer(where, "max_workers", max_workers, minimum=1)
        options.integer(where, "memory_mb", memory_mb, minimum=0, note=" (0: no limit)")
        options.integer(where, "max_concurrency", max_concurrency, minimum=1)
        self._spec = parse_spec(function)
        self._fn = load_function(self._spec)  # fail at config time, in the parent, with a clear error
        self.name = name
        self.target = function
        self.timeout_s = float(timeout_s)
        self.max_workers = max_workers
        self.executor = executor
        if executor == "auto":
            self._mode = "loop" if _is_async(self._fn) else "process"
        else:
            self._mode = {"inline": "loop", "process": "process", "thread": "thread"}[executor]
        self._what = f"function {function!r}"
        self.pool: IsolatedPool | None = None
        if self._mode == "process":
            self.pool = IsolatedPool(
                f"fn-{name}",
                workers=max_workers,
                timeout_s=self.timeout_s,
                memory_mb=memory_mb,
                preload=(self._spec.resolved,),
            )
        self._threads: ThreadPoolExecutor | None = None
        self._slots = asyncio.Semaphore(max_workers)
        self.max_concurrency = max_concurrency
        self._loop_slots = asyncio.Semaphore(max_concurrency)
        self._closed = False

    @property
    def mode(self) -> str:
        """Where calls run: "loop", "thread" or "process" (what executor="auto" chose)."""
        return self._mode

    @property
    def capacity(self) -> Capacity:
        """Per sample: the worker processes (plus a spare for each slow call that stepped aside), the threads, or
        the calls in flight on the event loop."""
        if self.pool is not None:
            return Capacity(self.pool.slots, "worker processes", "sample", aside=self.pool.stragglers)
        if self._mode == "thread":
            return Capacity(self.max_workers, "threads", "sample")
        return Capacity(self.max_concurrency, "calls in flight on the event loop", "sample")

    def on_capacity(self, wake: Callable[[], None]) -> None:
        if self.pool is not None:
            self.pool.on_capacity(wake)

    async def warmup(self) -> None:
        """Start the worker processes now (spawning them and importing the function in each), so the
        first batch does not wait for it. A no-op for the other executors."""
        if self.pool is not None:
            await self.pool.warmup()

    async def _in_thread(self, kwargs: dict[str, Any]) -> RewardOutput | RewardError:
        call = Call(self._spec.resolved, kwargs, self._what, verl=True)
        async with self._slots:  # a call's timeout counts from when it runs, not from when it queued
            if self._threads is None:
                self._threads = ThreadPoolExecutor(self.max_workers, thread_name_prefix=f"reward-fn-{self.name}")
            threads = self._threads
            future = asyncio.get_running_loop().run_in_executor(threads, run_call, self._fn, call)
            try:
                result: RewardOutput | RewardError = await asyncio.wait_for(future, self.timeout_s)
                return result
            except TimeoutError:
                pass
        # The stuck thread keeps its pool's slot for ever: later calls go to a fresh pool.
        if self._threads is threads:
            self._threads = None
            threads.shutdown(wait=False, cancel_futures=True)
        return DeadlineExceeded(f"{self._what} timed out after {self.timeout_s:g}s")

    async def score_batch(self, batch: list[RewardInput]) -> BatchResult:
        return list(await asyncio.gather(*self.start_each(batch)))

    def start_each(self, batch: list[RewardInput]) -> list[asyncio.Future[Outcome]]:
        """Each sample's call started now (queued for a worker process, a thread or the event loop)."""
        if self._closed:
            return [_done(Unavailable(f"function source {self.name!r} is closed")) for _ in batch]
        if self.pool is not None:
            calls = [Call(self._spec.resolved, verl_kwargs(s), self._what, verl=True) for s in batch]
            return self.pool.submit(calls)
        if self._mode == "thread":
            return [asyncio.ensure_future(self._in_thread(verl_kwargs(s))) for s in batch]
        return [asyncio.ensure_future(self._on_loop(verl_kwargs(s))) for s in batch]

    async def _on_loop(self, kwargs: dict[str, Any]) -> RewardOutput | RewardError:
        async with self._loop_slots:
            try:
                return await asyncio.wait_for(_run_on_loop(self._fn, self._what, kwargs), self.timeout_s)
            except TimeoutError:
                return DeadlineExceeded(f"{self._what} timed out after {self.timeout_s:g}s")

    async def close(self) -> None:
        """Stop every worker now, stuck ones included; calls still in flight fail."""
        self._closed = True
        if self.pool is not None:
            await self.pool.close()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
