"""A pool of warm sandboxes sized to the machine: each slot keeps a sandbox started ahead of need, and a job (one
sample's program and all its tests) holds one slot, and so one sandbox, for its time budget.

A sandbox serves up to ``samples_per_sandbox`` jobs. Between two jobs its runner resets it as between two tests
(every process but the runner killed, /tmp wiped, IPC objects and keys removed, limits fresh per test) and checks
that nothing is left; the pool retires it at once on any anomaly: something left after the reset, a runner that
misbehaves (garbage, silence past the budget, an exit), or a test that hit a limit other than its time (a test
that runs out of time is killed with the rest, as a stopped job is). A retired or used-up sandbox
is replaced in the background, so the next job of its slot finds one warm; a job that comes before its slot's
replacement is up takes the pool's one spare warm sandbox instead, and the replacement becomes the spare.

A pipeline's job whose caller is cancelled (the batcher stops it for another tenant's sample, or shuts down) is
stopped at once: the runner kills its program and resets the sandbox as after any job. While the spare is warm, the
slot takes it and serves the next job at once, and the stopped sandbox, once reset and clean, is the next spare;
else the slot, with its sandbox, serves the next job once reset. A stop thus costs the slot nothing or a reset
(``stop_s``, timed), not a sandbox start; a sandbox whose runner does not reset in time (``process.STOP_S``), or is
not clean after it, is retired as usual. A job from outside the pipeline runs on within its budget when its caller
goes away.

A pipeline's job that has run past the straggler time (a tenth of its time limit per test, at most 1 s) while
every slot is taken steps aside: it runs on in its sandbox, under its uid, to its end or its budget, and gives its
slot to the next claim with the warm spare as the slot's sandbox (a job steps aside only once the spare is up, so
the next job never waits for a sandbox to start; the next spare starts at once). Jobs step aside in the order
their slots were claimed. So at most ``max_stragglers`` slow programs run beside the ``workers`` slots that keep
serving, each holding one sandbox, its own, and the pool's capacity (``slots``) grows by one while each runs
(``on_capacity`` listeners hear of it). A sandbox whose job stepped aside, reset and clean when the job ends, is
kept for the next spare (at most one per slot, each under its uid), so a steady stream of stragglers costs resets,
not sandbox starts.

The host never trusts what comes back beyond its size: the runner's lines are parsed, capped, and a sandbox that
dies, hangs or prints garbage fails its job's remaining tests as sandbox errors, never as passes. When the server
runs as root, each sandbox runs as an unprivileged uid of its own (``uid_base + n``, with n below
``workers + 1 + max_stragglers``, set with util-linux ``setpriv``), so a program cannot signal or read anything of
the server's or of another sandbox's even outside the namespaces. A uid belongs to a sandbox, not to a slot: when
a slot takes the spare, the two swap uids, and a job that steps aside keeps its sandbox's uid while the next spare
takes one of the ``max_stragglers`` more, so no two live sandboxes ever share one.

Slots are claimed in arrival order and handed from a finished job straight to the next claim. A code pipeline's
batcher claims its samples' slots as it hands them over (``claim``), within the slots free for it; any other job
(the server's ``/run_code``) is counted in ``held_outside`` from when it asks until it ends, and the pipeline
hands over that much less (``on_capacity`` wakes it when such a job ends, or a job steps aside), so a pipeline's
sample never waits here: it waits in the pipeline's fair queue.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rewardmesh.common.errors import Unavailable
from rewardmesh.reward_engine.isolation import WORKER_NICENESS
from rewardmesh.reward_engine.sandbox.exchange import STARTUP_S, RunnerExchange
from rewardmesh.reward_engine.sandbox.jobs import Job, JobResult, Limits, TestRun
from rewardmesh.reward_engine.sandbox.levels import LEVELS, PATH, RANK, Level, default_python
from rewardmesh.reward_engine.sandbox.process import Reply, SandboxProcess
from rewardmesh.reward_engine.sandbox.slots import Claim, Running, SlotQueue

log = logging.getLogger(__name__)

# What starting a sandbox is taken to cost until one has been timed.
STARTUP_GUESS_S = 0.05
# A job past its straggler time that may not step aside yet (a slot free, the spare not up) looks again this often.
RECHECK_S = 0.05
# What stopping a job is taken to cost until one has been timed: its runner's kill and reset.
STOP_GUESS_S = 0.01
# A level that failed its probe (missing tool, a probe slowed past its budget) is tried again this much later.
RETRY_START_S = 30.0


class SandboxUnavailable(Unavailable):
    """The configured isolation cannot be provided on this machine; no code runs."""


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
        if isolation not in LEVELS:
            raise ValueError(f"sandbox: 'isolation' must be one of {', '.join(LEVELS)}, got {isolation!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"sandbox: 'workers' must be an integer >= 0 (0: one per CPU), got {workers!r}")
        reuse = samples_per_sandbox
        if isinstance(reuse, bool) or not isinstance(reuse, int) or reuse < 1:
            raise ValueError(f"sandbox: 'samples_per_sandbox' must be an integer >= 1, got {reuse!r}")
        self.requested = isolation
        self.allow_weaker = bool(allow_weaker_isolation)
        self.workers = workers or max(1, len(os.sched_getaffinity(0)))
        self.samples_per_sandbox = reuse
        self.limits = limits or Limits()
        self.limits.check("sandbox")
        self.straggler_after_s = min(1.0, self.limits.wall_s / 10) if straggler_after_s is None else straggler_after_s
        self.max_stragglers = 2 * self.workers if max_stragglers is None else max_stragglers
        if not self.straggler_after_s > 0 or self.max_stragglers < 0:
            raise ValueError("sandbox: 'straggler_after_s' must be > 0 and 'max_stragglers' >= 0")
        self.stragglers = 0  # jobs running beside the slots, each in its own sandbox
        self.python = python or default_python()
        self.uid_base = uid_base
        self.level: Level | None = None
        self.filter = "?"  # the system-call filter the runner installs ("seccomp", or why none), once proven
        self.stats: Counter[str] = Counter()
        self._setpriv = shutil.which("setpriv", path=PATH + ":/usr/sbin:/sbin")
        self._nice = shutil.which("nice", path=PATH)
        self._failure: str | None = None
        self._retry_at = 0.0
        self._start_lock = asyncio.Lock()
        # Threads block on the sandboxes' pipes: one per slot serving a job, one per straggler, one per slot starting
        # its next sandbox, one starting the spare, one for the start probe. They live as long as the pool: a sandbox
        # dies with the thread that started it (bubblewrap's --die-with-parent).
        self._threads = ThreadPoolExecutor(2 * self.workers + self.max_stragglers + 2, thread_name_prefix="sandbox")
        self._slots = SlotQueue(self.workers, self.stats)
        self._lock = threading.Lock()  # guards the dicts below and the counters
        self._idle: dict[int, SandboxProcess] = {}  # a warm sandbox per slot, waiting for its next job
        self._starting: dict[int, Future[SandboxProcess | None]] = {}  # the next sandbox of a slot, starting
        self._spare: SandboxProcess | None = None  # warm, for a slot whose next sandbox is not up yet
        self._spare_starting: Future[SandboxProcess | None] | None = None
        # Sandboxes whose job stepped aside, reset and clean, each with its uid: the next spares.
        self._kept: list[tuple[SandboxProcess, int]] = []
        # Each slot's sandbox runs as uid_base + _uid_of[slot], the spare as uid_base + _spare_uid. When a job steps
        # aside, the next spare (with a sandbox per job, the slot) takes one of _free_uids; the job's sandbox keeps its
        # own, given back once that sandbox is gone.
        self._uid_of = list(range(self.workers))
        self._spare_uid = self.workers
        self._free_uids = list(range(self.workers + 1, self.workers + 1 + self.max_stragglers))
        self._running: set[Running] = set()  # the jobs whose sandbox runs them now
        self.start_s = STARTUP_GUESS_S  # how long starting a sandbox takes (moving average of those started ahead)
        self.stop_s = STOP_GUESS_S  # what stopping a job costs until its slot serves again (moving average)
        self._busy = 0
        self._closed = False

    @property
    def description(self) -> str:
        if self.level is None:
            return f"unavailable ({self._failure})" if self._failure else "not started"
        reuse = self.samples_per_sandbox
        kept = f"each serving up to {reuse} samples, one spare" if reuse > 1 else "a fresh one per sample"
        filtered = "system-call filter on" if self.filter == "seccomp" else f"system-call filter: {self.filter}"
        return f"{self.level.name} ({self.level.tool}), {filtered}, {self.workers} workers, {kept}"

    def outlook(self) -> str:
        """Which isolation this sandbox asks for and which tools are installed, without starting anything."""
        found = [name for name in LEVELS if Level.find(name) is not None]
        weaker = " (weaker levels allowed)" if self.allow_weaker else ""
        return f"isolation '{self.requested}'{weaker}, tools found: {', '.join(found) or 'none'}"

    async def start(self) -> Level:
        """Find and prove the isolation level (once it works); raises SandboxUnavailable when none is acceptable."""
        async with self._start_lock:
            if self.level is not None:
                return self.level
            if self._failure is not None and time.monotonic() < self._retry_at:
                raise SandboxUnavailable(self._failure)
            tried: list[str] = []
            candidates = [n for n in LEVELS if RANK[n] <= RANK[self.requested]]
            for name in candidates:
                weaker = RANK[name] < RANK[self.requested]
                if weaker and not self.allow_weaker:
                    break
                level = Level.find(name)
                if level is None:
                    tried.append(f"{name}: not installed")
                    continue
                problem = await self._probe(level)
                if problem:
                    tried.append(f"{name}: {problem}")
                    continue
                self.level = level
                if weaker:
                    log.warning(
                        "code sandbox: %s unavailable (%s); running with the weaker level %s as allowed by "
                        "allow_weaker_isolation",
                        self.requested,
                        "; ".join(tried),
                        name,
                    )
                log.info("code sandbox: isolation level %s", self.description)
                if os.geteuid() == 0 and not self._setpriv:
                    log.warning("code sandbox: running as root without setpriv: sandboxes keep uid 0 outside")
                return level
            hint = "" if self.allow_weaker else " (set allow_weaker_isolation to accept a lower level)"
            self._failure = (
                f"isolation level '{self.requested}' is not available: {'; '.join(tried) or 'nothing tried'}{hint};"
                " no code is executed"
            )
            self._retry_at = time.monotonic() + RETRY_START_S
            log.error("code sandbox: %s (tried again in %gs when asked)", self._failure, RETRY_START_S)
            raise SandboxUnavailable(self._failure)

    async def prestart(self) -> Level:
        """Prove the level, then start a sandbox for every slot that has none, and wait until they are ready."""
        level = await self.start()
        if self.samples_per_sandbox > 1:
            starting = [self._start_ahead(level, slot) for slot in range(self.workers)] + [self._start_spare(level)]
            await asyncio.gather(*(asyncio.wrap_future(f) for f in starting if f is not None))
            log.info("code sandbox: %d sandboxes started ahead (one spare)", len(self._idle) + len(self._starting))
        return level

    async def _probe(self, level: Level) -> str | None:
        """None if a program runs in the level's sandbox with its network, tmp, root and filter as promised."""
        probe = (
            "import os, socket\n"
            "s = socket.socket()\n"
            "try:\n    s.connect(('127.0.0.1', 1)); print('net')\n"
            "except OSError:\n    pass\n"
            "seccomp = [line.split()[1] for line in open('/proc/self/status') if line.startswith('Seccomp:')]\n"
            "print(len(socket.if_nameindex()) <= 1, os.access('/usr', os.W_OK), os.getpid() < 100, *seccomp)\n"
        )
        job = Job({"probe.py": probe}, [self.python, "-I", "-S", "probe.py"], [""])
        loop = asyncio.get_running_loop()
        try:
            result, ready = await loop.run_in_executor(self._threads, self._run_once, level, job, 0)
        except OSError as exc:
            return str(exc)
        run = result.runs[0]
        if run.status != "exited" or run.exit_code != 0:
            return f"a probe program did not run ({run.status}: {(run.stderr or '').strip()[-300:]})"
        self.filter = str(ready.get("filter", "?"))
        filtered = "2" if self.filter == "seccomp" else "0"
        if run.stdout.split() != ["True", "False", "True", filtered]:
            return f"the probe saw a leaky sandbox: {run.stdout.strip()!r}"
        return None

    @property
    def slots(self) -> int:
        """Jobs that can run at once now: the slots, plus one for each job that stepped aside."""
        return self.workers + self.stragglers

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
                await self._watch(future, run, level)
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
            self._let_go(run)

    async def _watch(self, future: asyncio.Future[JobResult], run: Running, level: Level) -> None:
        """Until the job ends or steps aside: once it has run past the straggler time, it steps aside as soon as
        it may (every slot taken, the spare up, the jobs claimed before it aside), looking again every 50 ms."""
        wait = self.straggler_after_s
        while wait < float("inf"):
            await asyncio.wait((future,), timeout=wait)
            if future.done() or self._step_aside(run, level):
                return
            wait = min(wait, RECHECK_S)
        await asyncio.wait((future,))

    def _step_aside(self, run: Running, level: Level) -> bool:
        """``run``'s job runs on beside the slots, its slot given to the next claim with the warm spare as its
        sandbox (False: a slot is free, no more stragglers may run, the job is not running, no spare is up yet, or
        one of the pipeline's claimed before it still serves in a slot: jobs step aside in their claims' order, so
        those aside are the pipeline's oldest started, which is how its batcher knows them)."""
        if self._slots.free or self._closed or self.stragglers >= self.max_stragglers:
            return False
        reuse = self.samples_per_sandbox > 1
        with self._lock:
            if run.uid is None or run.ended or run.stop.is_set() or not (self._free_uids or self._kept):
                return False
            if any(other.seq is not None and run.seq is not None and other.seq < run.seq and not other.aside
                   and not other.ended and not other.stop.is_set() for other in self._running):  # fmt: skip
                return False
            spare = self._warm_spare() if reuse else None
            wait = reuse and spare is None  # the slot's next sample would wait for a sandbox to start: not yet
            if not wait:
                run.aside = True
                self.stragglers += 1
                self.stats["jobs that stepped aside"] += 1
                if spare is None:  # a sandbox per job: the slot's next starts under a free uid
                    self._uid_of[run.slot] = self._free_uids.pop()
                else:  # the spare becomes the slot's, with its uid; the next spare is a kept sandbox, or starts
                    self._idle[run.slot], self._spare = spare, None  # under a free uid
                    self._uid_of[run.slot] = self._spare_uid
                    if self._free_uids:
                        self._spare_uid = self._free_uids.pop()
                    else:
                        self._spare, self._spare_uid = self._kept.pop()
        if reuse:
            self._start_spare(level)  # the next spare; or, where none is up (it died, say), one to step aside to
        if wait:
            return False
        self._slots.give(run.slot)
        self._slots.grew()
        return True

    def _stop(self, run: Running) -> None:
        run.stop.set()
        with self._lock:  # held, the exchange cannot end and its sandbox (and its wake pipe) cannot close meanwhile
            if run not in self._running or run.box is None:
                return
            run.box.wake()
            handed = self._hand_spare(run)
        if handed:
            self._slots.give(run.slot)

    def _hand_spare(self, run: Running) -> bool:
        """A stopped job's slot serves the next claim at once with the warm spare (under the lock), instead of after
        its sandbox's reset; that sandbox, once reset and clean, is the next spare. The two swap uids."""
        if self._closed or run.aside or not run.reuse or run.uid is None or (spare := self._warm_spare()) is None:
            return False
        run.handed = Future()
        self._idle[run.slot], self._spare, self._spare_starting = spare, None, run.handed
        self._uid_of[run.slot], self._spare_uid = self._spare_uid, run.uid
        self.stats["stops that gave the slot the spare"] += 1
        return True

    def _let_go(self, run: Running) -> None:
        """The job's thread or its caller is done; once both are, an aside job no longer runs beside the slots."""
        with self._lock:
            run.holders -= 1
            if run.aside and not run.holders:
                self.stragglers -= 1

    def _release(self, run: Running, outside: bool) -> None:
        self._let_go(run)
        if not run.aside and run.handed is None:  # else its slot was given on when it stepped aside or was stopped
            self._slots.give(run.slot)
        with self._lock:
            self._busy -= 1
            last = self._closed and self._busy == 0
        if last:
            self._threads.shutdown(wait=False, cancel_futures=True)
        if outside:
            self._slots.outside_ended()

    def close(self) -> None:
        """No new sandboxes; the warm ones end now, those running a job end within their budgets."""
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle.values()), {}
            starting, self._starting = list(self._starting.values()), {}
            quiet = self._busy == 0
        for box in idle:
            box.kill()
        for future in starting:
            future.add_done_callback(_kill_result)
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.kill()
        with self._lock:
            kept, self._kept = self._kept, []
        for box, _ in kept:
            box.kill()
        if self._spare_starting is not None:
            self._spare_starting.add_done_callback(_kill_result)
        if quiet:
            self._threads.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ blocking, in the pool's threads

    def _spawn(self, level: Level, uid_of: int, tmp_mb: int) -> SandboxProcess:
        argv = level.command(self.python, tmp_mb << 20)
        if os.geteuid() == 0 and self._setpriv:
            # Through setpriv, not Popen(user=...): that makes CPython fork instead of vfork, and a fork of a
            # process running gRPC's threads runs gRPC's fork handlers in the child, which can crash it.
            uid = str(self.uid_base + uid_of)
            argv = [self._setpriv, "--reuid", uid, "--regid", uid, "--clear-groups", "--", *argv]
        if self._nice:
            # The whole sandbox (its start, its resets, its programs) runs nicer than the server, as the reward
            # worker processes do: busy programs never starve the event loop that answers every tenant, and a
            # sandbox starting in the background never outranks the programs of those already started.
            argv = [self._nice, "-n", str(WORKER_NICENESS), *argv]
        with self._lock:
            self.stats["started"] += 1
        return SandboxProcess(argv)

    def _start_ahead(self, level: Level, slot: int) -> Future[SandboxProcess | None] | None:
        """Start the next sandbox of a slot in the background (None: it has one, or the pool is closed)."""
        with self._lock:
            if self._closed or slot in self._idle or slot in self._starting:
                return None
            future = self._threads.submit(self._start_ready, level, self._uid_of[slot])
            self._starting[slot] = future
            return future

    def _start_spare(self, level: Level) -> Future[SandboxProcess | None] | None:
        """Start the pool's spare in the background, unless a kept sandbox can be the spare (None: it has one, or the
        pool is closed)."""
        with self._lock:
            if self._closed or self._warm_spare() is not None or self._spare_starting is not None:
                return None  # a spare that died, or whose start failed, is replaced
            while self._kept:  # the spare's uid, held by no sandbox now, is free; the kept one's is the spare's
                box, uid = self._kept.pop()
                self._free_uids.append(self._spare_uid)
                self._spare, self._spare_uid = box, uid
                if self._warm_spare() is not None:
                    self.stats["spares that were kept"] += 1
                    return None
            self._spare_starting = self._threads.submit(self._start_ready, level, self._spare_uid)
            return self._spare_starting

    def _start_ready(self, level: Level, uid_of: int) -> SandboxProcess | None:
        began = time.monotonic()
        try:
            box = self._spawn(level, uid_of, self.limits.tmp_mb)
        except OSError as exc:
            log.warning("code sandbox: starting a sandbox ahead failed: %s", exc)
            return None
        reply = box.exchange(b"", "ready", STARTUP_S, 1 << 16)
        if reply.final is None or self._closed:
            if reply.final is None:
                why = box.stderr.decode(errors="replace").strip()[-300:] or "no ready line"
                log.warning("code sandbox: a sandbox started ahead did not come up: %s", why)
            box.kill()
            return None
        self.start_s += 0.2 * (time.monotonic() - began - self.start_s)
        return box

    def _take(self, slot: int) -> SandboxProcess | None:
        """The slot's warm sandbox; while the slot has none up (its last retired), the spare if it is warm, the slot's
        next becoming the spare; else the one starting, waited for; None when there is none that lives."""
        with self._lock:
            box = self._idle.pop(slot, None)
            starting = self._starting.pop(slot, None) if box is None else None  # else it stays the slot's next
            if box is None and (starting is None or not starting.done()) and (spare := self._warm_spare()):
                box, self._spare, self._spare_starting = spare, None, starting
                self._uid_of[slot], self._spare_uid = self._spare_uid, self._uid_of[slot]
                starting = None
                self.stats["jobs in the spare sandbox"] += 1
        if box is None and starting is not None:
            try:
                box = starting.result()
            except Exception as exc:  # its start failed: the job starts one of its own
                log.warning("code sandbox: starting a sandbox ahead failed: %s", exc)
        if box is not None and not box.alive():
            box.kill()
            return None
        return box

    def _warm_spare(self) -> SandboxProcess | None:
        """The spare, if it is up and alive (under the lock)."""
        starting = self._spare_starting
        if self._spare is None and starting is not None and starting.done():
            self._spare_starting = None
            self._spare = None if starting.cancelled() or starting.exception() else starting.result()
        if self._spare is not None and not self._spare.alive():
            self._spare.kill()
            self._spare = None
        return self._spare

    def _run_once(self, level: Level, job: Job, slot: int) -> tuple[JobResult, dict[str, Any]]:
        """A job in a sandbox started for it alone (the start probe), with the runner's ready record."""
        box = self._spawn(level, self._uid_of[slot], (job.limits or self.limits).tmp_mb)
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
        lim = exchange.limits
        reuse = self.samples_per_sandbox > 1 and lim.tmp_mb == self.limits.tmp_mb
        slot, stop = run.slot, run.stop
        run.reuse = reuse
        box = self._take(slot) if reuse else None
        if reuse:
            self._start_spare(level)  # the spare taken (or never up) is replaced now, not when a job ends
        fresh = box is None
        if box is None:
            box = self._spawn(level, self._uid_of[slot], lim.tmp_mb)
        try:
            result, reply = self._exchange_in(run, box, exchange, fresh)
            if not fresh and reply.final is None and not reply.records and not reply.timed_out and not stop.is_set():
                # A warm sandbox that died while it waited (killed from outside) ran nothing: start one for the job.
                box.kill()
                with self._lock:
                    self.stats["retired: died while warm"] += 1
                    uid = self._uid_of[slot] if run.uid is None else run.uid  # its own, if it stepped aside
                box, fresh = self._spawn(level, uid, lim.tmp_mb), True
                result, reply = self._exchange_in(run, box, exchange, fresh)
        except BaseException:
            box.kill()
            self._uid_back(run)
            raise
        why = exchange.retire_reason(box, result, reply, stop.is_set(), reuse)
        with self._lock:
            run.ended = True
            self.stats["jobs"] += 1
            self.stats["jobs in a warm sandbox"] += not fresh
            keep = why is None and not self._closed and not run.aside
            if run.handed is not None:
                # Its slot took the spare: kept, this sandbox is the spare now; retired, the next spare starts below,
                # under its uid. It stands for the spare until now (nothing else replaces that while it resets).
                mine = self._spare_starting is run.handed
                keep = keep and mine
                if mine:
                    self._spare, self._spare_starting = box if keep else None, None
            elif keep:
                self._idle[slot] = box
            elif (
                run.aside
                and why is None
                and not self._closed
                and run.uid is not None
                and len(self._kept) < self.workers
            ):
                keep = True  # kept, with its uid, for the next spare
                self._kept.append((box, run.uid))
                run.uid = None
                self.stats["sandboxes kept when their job that stepped aside ended"] += 1
            if not keep:
                self.stats[f"retired: {why or ('stepped aside' if run.aside else 'pool closed')}"] += 1
            if reply.stop_s is not None:
                self.stats["jobs stopped"] += 1
                # A slot that took the spare served on at once, but the next stop may find none warm: the reset
                # is what a stop is taken to cost.
                cost = reply.stop_s + (0.0 if keep or run.aside or run.handed is not None else self.start_s)
                self.stop_s += 0.2 * (cost - self.stop_s)
        if run.handed is not None:
            run.handed.set_result(None)
        if not keep:
            box.kill()
            if run.aside:
                self._uid_back(run)
            elif reuse and run.handed is None:
                self._start_ahead(level, slot)
        if reuse:
            self._start_spare(level)
        return result

    def _uid_back(self, run: Running) -> None:
        """A job that stepped aside, its sandbox gone: its uid may serve another sandbox."""
        with self._lock:
            if run.aside and run.uid is not None:
                self._free_uids.append(run.uid)
                run.uid = None

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
                    run.uid = self._uid_of[run.slot]
                self._running.add(run)
        if stopped:
            gone = JobResult([TestRun("sandbox_error", stderr="taken back before it started")])
            return gone, Reply(final=None if fresh else {"clean": True})
        try:
            return exchange.run(box, fresh, run.stop)
        finally:
            with self._lock:
                self._running.discard(run)


def _kill_result(future: Future[SandboxProcess | None]) -> None:
    if not future.cancelled() and future.exception() is None and (box := future.result()) is not None:
        box.kill()
