"""The one target pool every client uses: dns:/// expansion, least-outstanding pick, backoff, membership.

A target list is comma-separated HOST:PORT, or dns:///name:port expanded to every address it resolves
to. A headless Service resolves to every pod; expanding it here, rather than leaving it to gRPC's
round_robin, lets the clients balance by outstanding work per pod, keep one long-lived Score stream
per pod, and broadcast weights to every rollout pod.

Names are resolved with `loop.getaddrinfo` (a thread), never a blocking lookup on the event loop, in
the background: on a client's first pick, every `interval_s`, and after a failure (the pod may have
been replaced). The reward client and the trainer client each keep one `TargetPool` of their own
per-address `Member`s (a Score stream, a Generate stub) and ask it which member gets the next piece of
work. Other code hooks into membership with `on_change` (added and removed members), `on_join` (an
async step, such as bringing a new rollout server to the current weights, that must finish before a
member that joined, or came back after failing, gets any work) and `on_up` (a member that was down is
reachable again).

Failing fast, recovering at once: a member that fails is kept from new work for a backoff that grows with its
consecutive failures, so a live fleet does not send work to a dead pod. But a caller whose every target is down
does not wait for that growing backoff: it tries again on its own schedule (`retry_in(attempt)`: at once, then
backoff_s, 2 x backoff_s ... for its own attempts), so a call on a fleet that has been down for an hour fails as
fast as the first call did. And a down member whose channel connects again (gRPC reconnects in the background)
is usable at once: the callers waiting for it (`wait_up`, `on_up`) go without waiting out any backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import random
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Generic, TypeVar

import grpc
from grpc import aio

log = logging.getLogger(__name__)

# Answers no retry can change (the caller's credentials): never retried, never taken for a target that is down.
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def refusal_message(address: str, exc: grpc.RpcError) -> str:
    """What an UNAUTHENTICATED or PERMISSION_DENIED answer means, and what to do about it."""
    code = exc.code()
    hint = (
        "set REWARDMESH_AUTH_TOKEN (or REWARDMESH_AUTH_TOKEN_FILE) to the server's token"
        if code == grpc.StatusCode.UNAUTHENTICATED
        else "this caller's token is not allowed to make this call"
    )
    return f"{code.name} from {address}: {exc.details()}; {hint}"


def split_targets(targets: Sequence[str] | str) -> list[str]:
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    return [t.strip() for t in items if t.strip()]


def _dns_name(target: str) -> tuple[str, int]:
    name = target.split("dns:", 1)[1].lstrip("/")
    host, _, port = name.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"target {target!r}: expected dns:///HOST:PORT")
    return host, int(port)


async def expand_targets(targets: Sequence[str] | str) -> list[str]:
    """Resolve each dns:///host:port to host addresses (deduplicated, order kept); others pass through."""
    loop = asyncio.get_running_loop()
    out: list[str] = []
    for target in split_targets(targets):
        if not target.startswith("dns:"):
            out.append(target)
            continue
        host, port = _dns_name(target)
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ValueError(f"target {target!r}: cannot resolve {host}: {exc}") from None
        for info in infos:
            ip = str(info[4][0])
            out.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return list(dict.fromkeys(out))


class Member:
    """What the pool knows of one address; clients subclass it with their channel and work."""

    # The member's gRPC channel, if it has one: while the member is down, the pool watches it connect again.
    channel: aio.Channel | None = None

    def __init__(self, address: str, server_name: str = "") -> None:
        self.address = address
        self.server_name = server_name  # the name a TLS certificate is checked against (the dns:/// name)
        self.failures = 0  # consecutive; sets the backoff
        self.down_until = 0.0  # monotonic time before which no work goes here
        self.down = False  # failed and not yet answered again (logged once per change)
        self.joining = False  # on_join hooks are running: no work yet
        self.watched = False  # the pool watches its channel for a reconnect (while down)

    @property
    def load(self) -> int:
        """Outstanding work, the least-loaded member is picked."""
        return 0

    async def close(self) -> None:
        """Release the member's connection; called once it has left the pool."""


M = TypeVar("M", bound=Member)
Resolve = Callable[[list[str]], "Awaitable[list[str]] | list[str]"]


class TargetPool(Generic[M]):
    """Members for a target list: picks the least-loaded usable one, backs off failed ones, follows DNS."""

    def __init__(
        self,
        targets: Sequence[str] | str,
        connect: Callable[[str, str], M],
        *,
        kind: str = "target",
        interval_s: float = 30.0,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        resolve: Resolve | None = None,
    ) -> None:
        self.specs = split_targets(targets)
        if not self.specs:
            raise ValueError(f"need at least one {kind} HOST:PORT")
        for spec in self.specs:
            if spec.startswith("dns:"):
                _dns_name(spec)  # a malformed name fails here, not later in the background
        self.kind = kind
        self.dynamic = any(t.startswith("dns:") for t in self.specs)
        self.interval_s = interval_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._connect = connect  # (address, server_name) -> member
        self._resolve: Resolve = resolve or expand_targets
        # The name a TLS certificate is checked against when we dial pod addresses.
        dns = [_dns_name(t)[0] for t in self.specs if t.startswith("dns:")]
        self.server_name = dns[0] if dns else ""
        self.members: list[M] = []
        self.retired: list[M] = []  # left the pool; closed with it (calls in flight there finish or fail)
        self._on_change: list[Callable[[list[M], list[M]], None]] = []
        self._on_join: list[Callable[[M], Awaitable[None]]] = []
        self._on_up: list[Callable[[M], None]] = []
        self._up_waiters: list[asyncio.Future[None]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._resolving: asyncio.Task[None] | None = None
        self._last_resolve = -math.inf
        self._resolve_error = ""
        self._closed = False
        if not self.dynamic:
            self.members = [connect(a, self.server_name) for a in dict.fromkeys(self.specs)]

    # -- hooks --------------------------------------------------------------------------------

    def on_change(self, callback: Callable[[list[M], list[M]], None]) -> None:
        """Call `callback(added, removed)` whenever re-resolution changes the members."""
        self._on_change.append(callback)

    def on_join(self, hook: Callable[[M], Awaitable[None]]) -> None:
        """Run `await hook(member)` before a member that joined, or came back after failing, gets work.

        A hook that raises keeps the member out of `pick` and is retried after the member's backoff.
        """
        self._on_join.append(hook)

    def on_up(self, callback: Callable[[M], None]) -> None:
        """Call `callback(member)` when a member that was down is usable again (its channel connected again, or
        it answered), so work waiting for a target goes at once instead of at its next retry."""
        self._on_up.append(callback)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A background task the pool keeps a reference to (so it is never collected mid-run) and cancels on close."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- picking ------------------------------------------------------------------------------

    def usable(self, member: M, now: float | None = None) -> bool:
        return not member.joining and (now if now is not None else time.monotonic()) >= member.down_until

    def pick(self, avoid: M | None = None, *, probe: bool = False) -> M | None:
        """The usable member with the least outstanding work (not `avoid` unless it is the only one); None: wait.

        `probe`: when every member is backing off, the one whose backoff ends first (the caller's own retry
        schedule has come: it tries it now rather than wait out a backoff others' failures grew); where members
        join through hooks, their joining is the probe, and None is returned meanwhile."""
        self.maybe_refresh()
        members = self.members
        if len(members) == 1:  # the common case, without building lists
            only = members[0]
            if self.usable(only) and not (only.down and self._on_join):
                return only
        now = time.monotonic()
        usable = []
        for m in members:
            if not self.usable(m, now):
                continue
            if m.down and self._on_join:  # back from a failure: rejoin (hooks) before it gets work
                self._start_join(m)
                continue
            usable.append(m)
        preferred = [m for m in usable if m is not avoid] or usable
        if preferred:
            return min(preferred, key=lambda m: m.load)
        if not probe:
            return None
        waiting = [m for m in members if not m.joining]
        if not waiting:
            return None
        if self._on_join:
            for m in waiting:
                if m.down:
                    self._start_join(m)
            return None
        return min(waiting, key=lambda m: (m is avoid, m.down_until))

    def retry_in(self, attempt: int | None = None) -> float:
        """Seconds until a pick may succeed (the earliest backoff to end; a resolution is awaited too). With
        `attempt` (the caller's failed attempts so far), no longer than the caller's own backoff for it: a call
        never waits on a backoff that earlier calls' failures grew (see the module's docstring)."""
        now = time.monotonic()
        waits = [m.down_until - now for m in self.members if not m.joining]
        if not waits:  # nothing to try yet: names resolving, or every member joining
            return self.backoff_s
        wait = max(0.01, min(waits))
        if attempt is not None:
            wait = min(wait, self.own_backoff(attempt))
        return wait

    def own_backoff(self, attempt: int) -> float:
        """A caller's wait before its next try after `attempt` failed tries: none before the first, then a
        jittered backoff_s x 2^(attempt - 1), at most max_backoff_s."""
        if attempt <= 0:
            return 0.0
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    async def wait_up(self, timeout_s: float) -> None:
        """Wait until a member that was down is usable again, or `timeout_s` has passed."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._up_waiters.append(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, max(0.0, timeout_s))
        finally:
            with contextlib.suppress(ValueError):
                self._up_waiters.remove(waiter)

    async def wait_for_members(self) -> list[M]:
        """Every current member, resolving the names first if that has not happened yet."""
        if not self.members and self.dynamic:
            await self.refresh_now()
        if not self.members:
            raise ValueError(f"{self.kind}s {self.specs} resolve to no address: {self._resolve_error or 'empty'}")
        return list(self.members)

    # -- health -------------------------------------------------------------------------------

    def mark_failed(self, member: M, reason: str) -> None:
        """Keep work off `member` for a jittered, growing backoff; log the change once, not once per retry."""
        member.failures += 1
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (member.failures - 1))
        member.down_until = time.monotonic() + delay * random.uniform(0.5, 1.0)
        if not member.down:
            member.down = True
            log.warning("%s %s is down (%s); retrying it with backoff", self.kind, member.address, reason)
        else:
            log.debug("%s %s still down (%s); next try in %.2fs", self.kind, member.address, reason, delay)
        if member.channel is not None and not member.watched and not self._closed:
            member.watched = True
            self.spawn(self._watch(member))
        if self.dynamic and member in self.members:
            self.refresh()  # the pod may have been replaced

    def mark_ok(self, member: M) -> None:
        """`member` answered: forget its failures."""
        was_down = member.down
        if member.down and not self._on_join:
            log.info("%s %s is back", self.kind, member.address)
        if not self._on_join:
            member.down = False
        member.failures = 0
        member.down_until = 0.0
        if was_down and not self._on_join:
            self._notify_up(member)

    async def _watch(self, member: M) -> None:
        """While `member` is down, watch its channel: once it connects again after having lost its connection,
        the member is usable at once (gRPC reconnects in the background on its own short schedule). A failure on
        a channel that stayed connected (the server ended a stream) is left to the backoff."""
        channel = member.channel
        assert channel is not None
        try:
            state = channel.get_state(try_to_connect=True)
            lost = state != grpc.ChannelConnectivity.READY
            while member.down and member in self.members:
                if state == grpc.ChannelConnectivity.READY and lost:
                    if member.down_until > time.monotonic():
                        log.info("%s %s is reachable again", self.kind, member.address)
                        member.down_until = 0.0
                        self._notify_up(member)
                    return
                await channel.wait_for_state_change(state)
                state = channel.get_state(try_to_connect=True)
                lost = lost or state != grpc.ChannelConnectivity.READY
        finally:
            member.watched = False

    def _notify_up(self, member: M) -> None:
        for waiter in self._up_waiters:
            if not waiter.done():
                waiter.set_result(None)
        for callback in self._on_up:
            try:
                callback(member)
            except Exception:  # a listener's bug must not cost the pool its other listeners
                log.exception("%s pool: on_up listener failed", self.kind)

    def _start_join(self, member: M) -> None:
        member.joining = True
        self.spawn(self._join(member))

    async def _join(self, member: M) -> None:
        try:
            for hook in self._on_join:
                await hook(member)
        except Exception as exc:  # the member stays out until a later try succeeds
            member.joining = False
            self.mark_failed(member, f"joining failed: {type(exc).__name__}: {exc}")
            return
        was_down = member.down
        if member.down:
            log.info("%s %s is back", self.kind, member.address)
        member.joining = member.down = False
        member.failures = 0
        member.down_until = 0.0
        if was_down:
            self._notify_up(member)

    # -- membership ---------------------------------------------------------------------------

    def maybe_refresh(self) -> None:
        """Re-resolve in the background when due (every `interval_s`, or at once while there are no members)."""
        if not self.dynamic or self._resolving is not None:
            return
        since = time.monotonic() - self._last_resolve
        if since >= self.interval_s or (not self.members and since >= self.backoff_s):
            self.refresh()

    def refresh(self) -> None:
        """Re-resolve in the background now (unless a resolution is already running)."""
        if self.dynamic and self._resolving is None and not self._closed:
            self._resolving = self.spawn(self._refresh())

    async def refresh_now(self) -> None:
        """Re-resolve and reconcile before returning."""
        self.refresh()
        if self._resolving is not None:
            await asyncio.shield(self._resolving)

    async def _refresh(self) -> None:
        self._last_resolve = time.monotonic()
        try:
            answer = self._resolve(self.specs)
            addresses = await answer if inspect.isawaitable(answer) else answer
        except ValueError as exc:
            if str(exc) != self._resolve_error:
                log.warning("keeping %d known %s addresses: %s", len(self.members), self.kind, exc)
            self._resolve_error = str(exc)
            return
        finally:
            self._resolving = None
        self._resolve_error = ""
        if addresses and addresses != [m.address for m in self.members]:
            self.reconcile(addresses)

    def reconcile(self, addresses: list[str]) -> None:
        """Make the members exactly `addresses`: connect new ones, retire vanished ones, tell the listeners."""
        addresses = list(dict.fromkeys(addresses))
        known = {m.address: m for m in self.members}
        if known:
            log.info("%ss %s now resolve to %s (were %s)", self.kind, self.specs, addresses, list(known))
        added = [self._connect(a, self.server_name) for a in addresses if a not in known]
        new = {m.address: m for m in added}
        self.members = [known.get(a) or new[a] for a in addresses]
        removed = [m for a, m in known.items() if a not in addresses]
        self.retired += removed
        for m in added:
            if self._on_join:
                self._start_join(m)
        for callback in self._on_change:
            callback(added, removed)

    async def close(self) -> None:
        """Stop background work and close every member, current and retired."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for m in [*self.members, *self.retired]:
            await m.close()
