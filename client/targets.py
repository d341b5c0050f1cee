"""Target lists: comma-separated HOST:PORT, or dns:///name:port expanded to every address it resolves to.

A headless Service resolves to every pod. Expanding it here, rather than leaving it to gRPC's
round_robin, lets the clients balance by outstanding work per pod, keep one long-lived Score
stream per pod, and broadcast weights to every rollout pod.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)


def split_targets(targets: Sequence[str] | str) -> list[str]:
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    return [t.strip() for t in items if t.strip()]


def expand_targets(targets: Sequence[str] | str) -> list[str]:
    """Resolve each dns:///host:port to host addresses (deduplicated, order kept); others pass through."""
    out: list[str] = []
    for target in split_targets(targets):
        if not target.startswith("dns:"):
            out.append(target)
            continue
        name = target.split("dns:", 1)[1].lstrip("/")
        host, _, port = name.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"target {target!r}: expected dns:///HOST:PORT")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ValueError(f"target {target!r}: cannot resolve {host}: {exc}") from None
        for info in infos:
            ip = str(info[4][0])
            out.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return list(dict.fromkeys(out))


class Resolver:
    """Re-resolves a target list when asked and at most every `interval_s` on its own.

    Pods behind a headless Service come and go (autoscaling, rolling updates): clients call
    `refresh()` after a failure and `maybe_refresh()` on their hot path, then reconcile their
    per-address connections with the list it returns.
    """

    def __init__(
        self,
        targets: Sequence[str] | str,
        *,
        interval_s: float = 30.0,
        resolve: Callable[[list[str]], list[str]] | None = None,
    ) -> None:
        self.specs = split_targets(targets)
        self.dynamic = any(t.startswith("dns:") for t in self.specs)
        self.interval_s = interval_s
        self._resolve = resolve or expand_targets
        self._last = time.monotonic()
        self.addresses = self._resolve(self.specs)
        # The name a TLS certificate is checked against when we dial pod addresses.
        dns = [t.split("dns:", 1)[1].lstrip("/").rpartition(":")[0] for t in self.specs if t.startswith("dns:")]
        self.server_name = dns[0] if dns else ""

    def refresh(self) -> list[str] | None:
        """The new address list, or None when nothing changed or the name cannot be resolved right now."""
        if not self.dynamic:
            return None
        self._last = time.monotonic()
        try:
            addresses = self._resolve(self.specs)
        except ValueError as exc:
            log.warning("keeping %d known addresses: %s", len(self.addresses), exc)
            return None
        if not addresses or addresses == self.addresses:
            return None
        log.info("targets %s now resolve to %s (were %s)", self.specs, addresses, self.addresses)
        self.addresses = addresses
        return addresses

    def maybe_refresh(self) -> list[str] | None:
        if self.dynamic and time.monotonic() - self._last >= self.interval_s:
            return self.refresh()
        return None
