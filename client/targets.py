"""Target lists: comma-separated HOST:PORT, or dns:///name:port expanded to every address it resolves to.

A headless Service resolves to every pod. Expanding it here, rather than leaving it to gRPC's
round_robin, lets the clients balance by outstanding work per pod, keep one long-lived Score
stream per pod, and broadcast weights to every rollout pod.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence


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
