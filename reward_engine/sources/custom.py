"""User reward functions with verl's signature, loaded from a module or a .py file and run under a timeout.

Sync functions run in a process pool by default: reward code is usually CPU-bound Python, which
would hold the GIL (and stall the gRPC event loop) in a thread pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import itertools
import multiprocessing
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

from reward_engine.errors import (
    DeadlineExceeded,
    InvalidInput,
    QueueFull,
    RewardError,
    SourceFailed,
    Unavailable,
    UnknownReward,
)
from reward_engine.sources.verl_compat import describe_exception, to_output, verl_kwargs
from reward_engine.types import BatchResult, RewardInput, RewardOutput

EXECUTORS = ("auto", "process", "thread", "inline")

# Starting a pool (spawning workers, importing the user's module there) is not charged to any call's
# timeout_s, but it may not take forever either.
_STARTUP_TIMEOUT_S = 120.0
# How long a retired worker gets to exit after SIGTERM before SIGKILL.
_TERMINATE_GRACE_S = 5.0

_file_counter = itertools.count()

# ------------------------------------------------------------------------------------------ loading


@dataclass(frozen=True)
class FunctionSpec:
    """A parsed 'module:function' or 'path/to/file.py:function' (path made absolute)."""

    spec: str  # as configured, for messages
    target: str  # module name, or absolute file path
    attr: str  # attribute path inside the module, may be dotted (Class.method)
    is_file: bool

    @property
    def resolved(self) -> str:
        """The spec a worker process re-loads: independent of the worker's working directory."""
        return f"{self.target}:{self.attr}"


def parse_spec(spec: str) -> FunctionSpec:
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"function: expected 'module:function' or 'path/to/file.py:function', got {spec!r}")
    target, _, attr = spec.rpartition(":")
    target, attr = target.strip(), attr.strip()
    if not target or not attr:
        raise ValueError(f"function: {spec!r} needs both parts of 'module:function' or 'path/to/file.py:function'")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    if is_file:
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise ValueError(f"function {spec!r}: file {path} does not exist")
        target = path
    return FunctionSpec(spec=spec, target=target, attr=attr, is_file=is_file)


def _import_file(path: str, module_name: str) -> Any:
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    # Registered so that dataclasses, pickling and the like inside the user's module work.
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def load_function(spec: FunctionSpec, module_name: str | None = None) -> Callable[..., Any]:
    """Import the module or file and return the callable, raising ValueError that says what is wrong.

    A file is executed under a fresh module name each time (``module_name`` or a counter), so a
    source built after the file was edited sees the new code; modules are imported normally.
    """
    where = f"function {spec.spec!r}"
    if spec.is_file:
        if module_name is None:
            digest = hashlib.sha1(spec.target.encode()).hexdigest()[:10]
            module_name = f"_rewardmesh_fn_{digest}_{next(_file_counter)}"
        try:
            module = _import_file(spec.target, module_name)
        except Exception as exc:
            raise ValueError(f"{where}: loading {spec.target} raised {describe_exception(exc)}") from exc
    else:
        try:
            module = importlib.import_module(spec.target)
        except ModuleNotFoundError as exc:
            if exc.name and (spec.target == exc.name or spec.target.startswith(exc.name + ".")):
                raise ValueError(f"{where}: no module named {spec.target!r} (is it on sys.path?)") from exc
            raise ValueError(f"{where}: importing {spec.target!r} raised {describe_exception(exc)}") from exc
        except Exception as exc:
            raise ValueError(f"{where}: importing {spec.target!r} raised {describe_exception(exc)}") from exc
    obj: Any = module
    for part in spec.attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{where}: {spec.target!r} has no attribute {spec.attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{where}: {spec.attr!r} is a {type(obj).__name__}, not a callable")
    fn: Callable[..., Any] = obj
    return fn


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


# ---------------------------------------------------------------------------------- running a call

_KNOWN_ERRORS: tuple[type[RewardError], ...] = (
    DeadlineExceeded,
    InvalidInput,
    QueueFull,
    SourceFailed,
    Unavailable,
    UnknownReward,
)


def _plain_error(exc: RewardError) -> RewardError:
    """The engine's own class for a RewardError: a user's subclass defined in a file module could
    not be unpickled in the parent process."""
    for cls in _KNOWN_ERRORS:
        if isinstance(exc, cls):
            return exc if type(exc) is cls else cls(str(exc))
    return exc if type(exc) is RewardError else RewardError(str(exc))


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def _run_sync(fn: Callable[..., Any], what: str, kwargs: dict[str, Any]) -> RewardOutput | RewardError:
    """One call in a worker thread or process; failures come back as values, never as raises,
    so only picklable engine types cross the process boundary."""
    try:
        value = fn(**kwargs)
        if inspect.isawaitable(value):  # an async function forced into a thread or process
            value = asyncio.run(_await(value))
        return to_output(value, what)
    except RewardError as exc:
        return _plain_error(exc)
    except Exception as exc:
        return SourceFailed(f"{what} raised {describe_exception(exc)}")


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


# Worker-process side: functions are re-loaded there by spec (a function from a file cannot be
# pickled by reference) and cached per process.
_worker_fns: dict[str, Callable[..., Any]] = {}
_worker_lock = threading.Lock()


def _worker_function(resolved: str) -> Callable[..., Any]:
    with _worker_lock:
        fn = _worker_fns.get(resolved)
        if fn is None:
            spec = parse_spec(resolved)
            digest = hashlib.sha1(resolved.encode()).hexdigest()[:10]
            fn = load_function(spec, module_name=f"_rewardmesh_fn_{digest}_worker")
            _worker_fns[resolved] = fn
        return fn


def _worker_init(resolved: str) -> None:
    """Load the function as the worker starts, so its import cost is not charged to a call's timeout.
    An error is swallowed here (it would break the whole pool) and reported by the first call."""
    try:
        _worker_function(resolved)
    except Exception:
        pass


def _worker_ping(resolved: str) -> int:
    _worker_init(resolved)
    threading.Event().wait(0.01)  # long enough that one fast worker cannot answer every ping
    return os.getpid()


def _worker_call(resolved: str, what: str, kwargs: dict[str, Any]) -> RewardOutput | RewardError:
    try:
        fn = _worker_function(resolved)
    except ValueError as exc:
        return SourceFailed(str(exc))
    return _run_sync(fn, what, kwargs)


# -------------------------------------------------------------------------------------------- pools


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


@dataclass(eq=False)
class _Pool:
    executor: Executor
    processes: bool
    inflight: int = 0
    poisoned: bool = False
    retired: bool = False
    ready: asyncio.Future[None] | None = None
    pids: set[int] = field(default_factory=set)


def _reap(processes: list[BaseProcess]) -> None:
    """SIGTERM, then SIGKILL whatever has not exited after the grace period (runs in a thread)."""
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(_TERMINATE_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)


class FunctionSource:
    """A user's verl-style reward function (sync or async) run with a per-call timeout.

    Config keys:
      function: "pkg.module:fn" (importable) or "path/to/file.py:fn" (relative to cwd or absolute).
      timeout_s: limit per call (execution only: waiting for a free worker and starting the pool
        are not counted) -> DeadlineExceeded for that sample.
      executor: "auto" (async functions on the event loop, sync ones in a process pool),
        "process", "thread" or "inline" (on the event loop: a sync function then blocks the loop
        and its timeout cannot interrupt it; use it only for trivial functions).
      max_workers: pool size for "process"/"thread"; calls beyond it wait for a free worker.
        Async functions on the event loop are not limited by it: all samples of a batch run at once.

    Process pools use the "spawn" start method, never fork: the server runs gRPC threads, and a
    forked child can inherit their locks held. Workers re-import the function by its spec, so the
    server's main module must be import-safe (``if __name__ == "__main__"`` guard), as with any
    spawn pool. The pool starts on first use; call ``warmup()`` to pay that cost up front.

    Stuck calls: a timed-out call keeps running in its worker and would hold that slot forever.
    So a timeout retires the pool: new calls go to a fresh pool at once, and when the retired
    pool's other in-flight calls have finished (or timed out) its processes are terminated, the
    stuck one included. Threads cannot be killed: with executor="thread" the retired pool is only
    abandoned, and a thread stuck forever leaks (and delays interpreter exit), so prefer "process"
    for code that may hang. A call whose caller is cancelled (e.g. the request's deadline passed)
    keeps its worker slot until the call really ends or reaches timeout_s, which then recycles
    the pool as above: otherwise the next call would queue behind it in the pool.

    A worker process that dies (segfault, os._exit) breaks its whole pool: the calls in flight on
    it are retried once on a fresh pool, then fail with SourceFailed. The retry cannot tell the
    culprit from its victims, so with max_workers > 1 a sample that kills its worker every time
    may also fail a batch-mate that was unlucky twice.
    """

    kind = "function"

    def __init__(
        self,
        name: str,
        function: str,
        timeout_s: float = 30.0,
        executor: str = "auto",
        max_workers: int = 2,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("function source: 'name' must be a non-empty string")
        where = f"function source {name!r}"
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"{where}: 'timeout_s' must be a positive number, got {timeout_s!r}")
        if executor not in EXECUTORS:
            raise ValueError(f"{where}: 'executor' must be one of {', '.join(EXECUTORS)}; got {executor!r}")
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"{where}: 'max_workers' must be an integer >= 1, got {max_workers!r}")
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
        self._slots = asyncio.Semaphore(max_workers)
        self._pool: _Pool | None = None
        self._pools: set[_Pool] = set()
        self._retiring: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def mode(self) -> str:
        """Where calls run: "loop", "thread" or "process" (what executor="auto" chose)."""
        return self._mode

    # ---------------------------------------------------------------------------------- pools

    def _new_pool(self) -> _Pool:
        executor: Executor
        if self._mode == "process":
            executor = ProcessPoolExecutor(
                max_workers=self.max_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
                initargs=(self._spec.resolved,),
            )
        else:
            executor = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix=f"reward-fn-{self.name}")
        pool = _Pool(executor=executor, processes=self._mode == "process")
        self._pools.add(pool)
        return pool

    async def _start(self, pool: _Pool) -> None:
        """Ping until every worker has answered: each has then started and imported the function."""
        if not pool.processes:
            return
        loop = asyncio.get_running_loop()
        resolved = self._spec.resolved
        while len(pool.pids) < self.max_workers:
            pings = [loop.run_in_executor(pool.executor, _worker_ping, resolved) for _ in range(self.max_workers)]
            pool.pids.update(await asyncio.gather(*pings))

    async def _ready_pool(self) -> _Pool:
        while True:
            if self._closed:
                raise Unavailable(f"function source {self.name!r} is closed")
            pool = self._pool
            if pool is None:
                pool = self._pool = self._new_pool()
                pool.ready = asyncio.ensure_future(asyncio.wait_for(self._start(pool), _STARTUP_TIMEOUT_S))
            assert pool.ready is not None
            try:
                await asyncio.shield(pool.ready)
            except Exception as exc:
                self._poison(pool)
                self._maybe_retire(pool)
                if isinstance(exc, TimeoutError):
                    reason = f"did not start within {_STARTUP_TIMEOUT_S:g}s"
                else:
                    reason = f"failed to start: {describe_exception(exc)}"
                raise Unavailable(f"{self._what}: worker pool {reason}") from exc
            if not pool.poisoned:
                return pool

    def _poison(self, pool: _Pool) -> None:
        pool.poisoned = True
        if self._pool is pool:
            self._pool = None

    def _maybe_retire(self, pool: _Pool) -> None:
        if pool.poisoned and pool.inflight == 0 and not pool.retired:
            self._retire(pool)

    def _retire(self, pool: _Pool) -> None:
        pool.retired = True
        self._pools.discard(pool)
        processes: list[BaseProcess] = []
        if isinstance(pool.executor, ProcessPoolExecutor):
            processes = list((getattr(pool.executor, "_processes", None) or {}).values())
        pool.executor.shutdown(wait=False, cancel_futures=True)
        if processes:
            task = asyncio.ensure_future(asyncio.to_thread(_reap, processes))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def warmup(self) -> None:
        """Start the worker pool now (spawning processes and importing the function in each),
        so the first batch does not wait for it. A no-op for functions run on the event loop."""
        if self._mode != "loop":
            await self._ready_pool()

    # ---------------------------------------------------------------------------------- calls

    def _submit(self, pool: _Pool, kwargs: dict[str, Any]) -> asyncio.Future[RewardOutput | RewardError]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RewardOutput | RewardError]
        if pool.processes:
            future = loop.run_in_executor(pool.executor, _worker_call, self._spec.resolved, self._what, kwargs)
        else:
            future = loop.run_in_executor(pool.executor, _run_sync, self._fn, self._what, kwargs)
        future.add_done_callback(_consume)  # an abandoned call's late error must not be logged as lost
        return future

    def _drain_later(self, pool: _Pool, future: asyncio.Future[Any], started: float) -> None:
        """Our caller was cancelled, but the worker still runs the call: keep its slot (and the
        pool's in-flight count) taken until the call ends or its timeout_s runs out (then the
        pool is recycled as for any timeout), so the next call does not queue behind it."""

        async def drain() -> None:
            try:
                remaining = self.timeout_s - (asyncio.get_running_loop().time() - started)
                await asyncio.wait_for(asyncio.shield(future), max(remaining, 0.0))
            except TimeoutError:
                self._poison(pool)
            except BaseException:
                pass  # the call failed or the source closed: nothing left to wait for
            finally:
                pool.inflight -= 1
                self._maybe_retire(pool)
                self._slots.release()

        task = asyncio.ensure_future(drain())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _call_pooled(self, kwargs: dict[str, Any]) -> RewardOutput | RewardError:
        loop = asyncio.get_running_loop()
        await self._slots.acquire()
        slot_owned = True  # until a drain task takes the slot over
        try:
            for attempt in (1, 2):
                pool = await self._ready_pool()
                pool.inflight += 1
                pool_owned = True
                started = loop.time()
                future: asyncio.Future[RewardOutput | RewardError] | None = None
                try:
                    future = self._submit(pool, kwargs)
                    # shield: a timeout or cancellation here must not drop the call from our books
                    # while a worker still runs it (see _drain_later); the pool is dealt with below.
                    return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
                except TimeoutError:
                    self._poison(pool)
                    return DeadlineExceeded(f"{self._what} timed out after {self.timeout_s:g}s")
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is None or not task.cancelling():
                        # Not us: close() cancelled the pool's pending calls.
                        return Unavailable(f"function source {self.name!r} was closed during the call")
                    if future is not None and not future.done():
                        self._drain_later(pool, future, started)
                        pool_owned = slot_owned = False
                    raise
                except BrokenProcessPool as exc:
                    self._poison(pool)
                    if attempt == 2 or self._closed:
                        return SourceFailed(f"{self._what}: its worker process died ({exc})")
                finally:
                    if pool_owned:
                        pool.inflight -= 1
                        self._maybe_retire(pool)
        finally:
            if slot_owned:
                self._slots.release()
        raise AssertionError("unreachable")

    async def _score_one(self, sample: RewardInput) -> RewardOutput | BaseException:
        kwargs = verl_kwargs(sample)
        try:
            if self._mode == "loop":
                try:
                    return await asyncio.wait_for(_run_on_loop(self._fn, self._what, kwargs), self.timeout_s)
                except TimeoutError:
                    return DeadlineExceeded(f"{self._what} timed out after {self.timeout_s:g}s")
            return await self._call_pooled(kwargs)
        except RewardError as exc:
            return exc
        except Exception as exc:  # e.g. arguments that cannot be pickled for a worker process
            return SourceFailed(f"{self._what} could not be called: {describe_exception(exc)}")

    async def score_batch(self, batch: list[RewardInput]) -> BatchResult:
        return list(await asyncio.gather(*(self._score_one(sample) for sample in batch)))

    async def close(self) -> None:
        """Stop every worker now, stuck ones included; calls still in flight fail."""
        self._closed = True
        self._pool = None
        background = list(self._background)
        for task in background:
            task.cancel()
        if background:
            await asyncio.gather(*background, return_exceptions=True)
        for pool in list(self._pools):
            pool.poisoned = True
            if not pool.retired:
                self._retire(pool)
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)
