"""The pool's warm sandboxes: each slot keeps a sandbox started ahead of need, and the pool keeps one spare warm.

A sandbox serves up to ``samples_per_sandbox`` jobs. Between two jobs its runner resets it as between two tests
(every process but the runner killed, /tmp wiped, IPC objects and keys removed, limits fresh per test) and checks
that nothing is left; the pool retires it at once on any anomaly: something left after the reset, a runner that
misbehaves (garbage, silence past the budget, an exit), or a test that hit a limit other than its time (a test
that runs out of time is killed with the rest, as a stopped job is). A retired or used-up sandbox
is replaced in the background, so the next job of its slot finds one warm; a job that comes before its slot's
replacement is up takes the pool's one spare warm sandbox instead, and the replacement becomes the spare.

When the server runs as root, each sandbox runs as an unprivileged uid of its own (``uid_base + n``, with n below
``workers + 1 + max_stragglers``, set with util-linux ``setpriv``), so a program cannot signal or read anything of
the server's or of another sandbox's even outside the namespaces. A uid belongs to a sandbox, not to a slot: when
a slot takes the spare, the two swap uids, and a job that steps aside keeps its sandbox's uid while the next spare
takes one of the ``max_stragglers`` more, so no two live sandboxes ever share one.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from rewardmesh.reward_engine.isolation import WORKER_NICENESS
from rewardmesh.reward_engine.sandbox.exchange import STARTUP_S
from rewardmesh.reward_engine.sandbox.jobs import Limits
from rewardmesh.reward_engine.sandbox.levels import PATH, Level
from rewardmesh.reward_engine.sandbox.process import SandboxProcess
from rewardmesh.reward_engine.sandbox.slots import Running

log = logging.getLogger(__name__)

# What starting a sandbox is taken to cost until one has been timed.
STARTUP_GUESS_S = 0.05


@dataclass(eq=False)
class WarmPool:
    """The slots' next sandboxes, the spare, the sandboxes kept for the next spares, and which uid each runs as.
    ``lock`` (the pool's) guards all of it and ``stats``; sandboxes start in ``threads``, in the background."""

    workers: int
    max_stragglers: int
    limits: Limits  # the pool's: a sandbox started ahead gets its tmpfs size
    python: str
    uid_base: int
    lock: threading.Lock
    threads: ThreadPoolExecutor
    stats: Counter[str]

    def __post_init__(self) -> None:
        workers, max_stragglers = self.workers, self.max_stragglers
        self.setpriv = shutil.which("setpriv", path=PATH + ":/usr/sbin:/sbin")
        self.nice = shutil.which("nice", path=PATH)
        self.idle: dict[int, SandboxProcess] = {}  # a warm sandbox per slot, waiting for its next job
        self.starting: dict[int, Future[SandboxProcess | None]] = {}  # the next sandbox of a slot, starting
        self.spare: SandboxProcess | None = None  # warm, for a slot whose next sandbox is not up yet
        self.spare_starting: Future[SandboxProcess | None] | None = None
        # Sandboxes whose job stepped aside, reset and clean, each with its uid: the next spares.
        self.kept: list[tuple[SandboxProcess, int]] = []
        # Each slot's sandbox runs as uid_base + uid_of[slot], the spare as uid_base + spare_uid. When a job steps
        # aside, the next spare (with a sandbox per job, the slot) takes one of free_uids; the job's sandbox keeps its
        # own, given back once that sandbox is gone.
        self.uid_of = list(range(workers))
        self.spare_uid = workers
        self.free_uids = list(range(workers + 1, workers + 1 + max_stragglers))
        self.start_s = STARTUP_GUESS_S  # how long starting a sandbox takes (moving average of those started ahead)
        self.closed = False

    def spawn(self, level: Level, uid_of: int, tmp_mb: int) -> SandboxProcess:
        argv = level.command(self.python, tmp_mb << 20)
        if os.geteuid() == 0 and self.setpriv:
            # Through setpriv, not Popen(user=...): that makes CPython fork instead of vfork, and a fork of a
            # process running gRPC's threads runs gRPC's fork handlers in the child, which can crash it.
            uid = str(self.uid_base + uid_of)
            argv = [self.setpriv, "--reuid", uid, "--regid", uid, "--clear-groups", "--", *argv]
        if self.nice:
            # The whole sandbox (its start, its resets, its programs) runs nicer than the server, as the reward
            # worker processes do: busy programs never starve the event loop that answers every tenant, and a
            # sandbox starting in the background never outranks the programs of those already started.
            argv = [self.nice, "-n", str(WORKER_NICENESS), *argv]
        with self.lock:
            self.stats["started"] += 1
        return SandboxProcess(argv)

    def start_ahead(self, level: Level, slot: int) -> Future[SandboxProcess | None] | None:
        """Start the next sandbox of a slot in the background (None: it has one, or the pool is closed)."""
        with self.lock:
            if self.closed or slot in self.idle or slot in self.starting:
                return None
            future = self.threads.submit(self._start_ready, level, self.uid_of[slot])
            self.starting[slot] = future
            return future

    def start_spare(self, level: Level) -> Future[SandboxProcess | None] | None:
        """Start the pool's spare in the background, unless a kept sandbox can be the spare (None: it has one, or the
        pool is closed)."""
        with self.lock:
            if self.closed or self.warm_spare() is not None or self.spare_starting is not None:
                return None  # a spare that died, or whose start failed, is replaced
            while self.kept:  # the spare's uid, held by no sandbox now, is free; the kept one's is the spare's
                box, uid = self.kept.pop()
                self.free_uids.append(self.spare_uid)
                self.spare, self.spare_uid = box, uid
                if self.warm_spare() is not None:
                    self.stats["spares that were kept"] += 1
                    return None
            self.spare_starting = self.threads.submit(self._start_ready, level, self.spare_uid)
            return self.spare_starting

    def _start_ready(self, level: Level, uid_of: int) -> SandboxProcess | None:
        began = time.monotonic()
        try:
            box = self.spawn(level, uid_of, self.limits.tmp_mb)
        except OSError as exc:
            log.warning("code sandbox: starting a sandbox ahead failed: %s", exc)
            return None
        reply = box.exchange(b"", "ready", STARTUP_S, 1 << 16)
        if reply.final is None or self.closed:
            if reply.final is None:
                why = box.stderr.decode(errors="replace").strip()[-300:] or "no ready line"
                log.warning("code sandbox: a sandbox started ahead did not come up: %s", why)
            box.kill()
            return None
        self.start_s += 0.2 * (time.monotonic() - began - self.start_s)
        return box

    def take(self, slot: int) -> SandboxProcess | None:
        """The slot's warm sandbox; while the slot has none up (its last retired), the spare if it is warm, the slot's
        next becoming the spare; else the one starting, waited for; None when there is none that lives."""
        with self.lock:
            box = self.idle.pop(slot, None)
            starting = self.starting.pop(slot, None) if box is None else None  # else it stays the slot's next
            if box is None and (starting is None or not starting.done()) and (spare := self.warm_spare()):
                box, self.spare, self.spare_starting = spare, None, starting
                self.uid_of[slot], self.spare_uid = self.spare_uid, self.uid_of[slot]
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

    def warm_spare(self) -> SandboxProcess | None:
        """The spare, if it is up and alive (under the lock)."""
        starting = self.spare_starting
        if self.spare is None and starting is not None and starting.done():
            self.spare_starting = None
            self.spare = None if starting.cancelled() or starting.exception() else starting.result()
        if self.spare is not None and not self.spare.alive():
            self.spare.kill()
            self.spare = None
        return self.spare

    def step_aside(self, slot: int, spare: SandboxProcess | None) -> None:
        """The slot of a job that steps aside serves on without it (under the lock): with a sandbox per job, its next
        starts under a free uid; else the warm spare becomes the slot's, with its uid, and the next spare is a kept
        sandbox, or starts under a free uid."""
        if spare is None:
            self.uid_of[slot] = self.free_uids.pop()
            return
        self.idle[slot], self.spare = spare, None
        self.uid_of[slot] = self.spare_uid
        if self.free_uids:
            self.spare_uid = self.free_uids.pop()
        else:
            self.spare, self.spare_uid = self.kept.pop()

    def hand_spare(self, run: Running) -> bool:
        """A stopped job's slot serves the next claim at once with the warm spare (under the lock), instead of after
        its sandbox's reset; that sandbox, once reset and clean, is the next spare. The two swap uids."""
        if self.closed or run.aside or not run.reuse or run.uid is None or (spare := self.warm_spare()) is None:
            return False
        run.handed = Future()
        self.idle[run.slot], self.spare, self.spare_starting = spare, None, run.handed
        self.uid_of[run.slot], self.spare_uid = self.spare_uid, run.uid
        self.stats["stops that gave the slot the spare"] += 1
        return True

    def keep(self, run: Running, box: SandboxProcess, why: str | None) -> bool:
        """Whether the sandbox of a job that ended serves on (under the lock; ``why``: the reason it must retire):
        as its slot's next, as the spare, or kept for a later spare when its job had stepped aside."""
        keep = why is None and not self.closed and not run.aside
        if run.handed is not None:
            # Its slot took the spare: kept, this sandbox is the spare now; retired, the next spare starts after it,
            # under its uid. It stands for the spare until now (nothing else replaces that while it resets).
            mine = self.spare_starting is run.handed
            keep = keep and mine
            if mine:
                self.spare, self.spare_starting = box if keep else None, None
        elif keep:
            self.idle[run.slot] = box
        elif run.aside and why is None and not self.closed and run.uid is not None and len(self.kept) < self.workers:
            keep = True  # kept, with its uid, for the next spare
            self.kept.append((box, run.uid))
            run.uid = None
            self.stats["sandboxes kept when their job that stepped aside ended"] += 1
        if not keep:
            self.stats[f"retired: {why or ('stepped aside' if run.aside else 'pool closed')}"] += 1
        return keep

    def after(self, level: Level, run: Running, box: SandboxProcess, keep: bool, reuse: bool) -> None:
        """After a job: a sandbox not kept ends, and its slot's next (or the next spare) starts ahead."""
        if run.handed is not None:
            run.handed.set_result(None)
        if not keep:
            box.kill()
            if run.aside:
                self.uid_back(run)
            elif reuse and run.handed is None:
                self.start_ahead(level, run.slot)
        if reuse:
            self.start_spare(level)

    def uid_back(self, run: Running) -> None:
        """A job that stepped aside, its sandbox gone: its uid may serve another sandbox."""
        with self.lock:
            if run.aside and run.uid is not None:
                self.free_uids.append(run.uid)
                run.uid = None

    def close(self) -> None:
        """No new sandboxes; the warm ones end now (those starting as soon as they are up)."""
        with self.lock:
            self.closed = True
            idle, self.idle = list(self.idle.values()), {}
            starting, self.starting = list(self.starting.values()), {}
        for box in idle:
            box.kill()
        for future in starting:
            future.add_done_callback(_kill_result)
        spare, self.spare = self.spare, None
        if spare is not None:
            spare.kill()
        with self.lock:
            kept, self.kept = self.kept, []
        for box, _ in kept:
            box.kill()
        if self.spare_starting is not None:
            self.spare_starting.add_done_callback(_kill_result)


def _kill_result(future: Future[SandboxProcess | None]) -> None:
    if not future.cancelled() and future.exception() is None and (box := future.result()) is not None:
        box.kill()
