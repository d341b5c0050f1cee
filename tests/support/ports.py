"""Local ports for tests: one that refuses every connection, one free for a server told its port."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def refusing_port() -> Iterator[int]:
    """A port held bound but not listening while the block runs: connections are refused, and no server the
    test starts meanwhile can be given it (a port bound once and released can be, and then it answers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def free_port() -> int:
    """A port free now, for a server process that must be told its port before it starts.

    Taken below the kernel's ephemeral range where there is room, since that range is where every bind to port 0
    and every outgoing connection get theirs: between this call and the server's bind, no other socket of the host
    is given it by chance. Without room below it, a port the kernel picks.
    """
    low = _ephemeral_low()
    below = range(max(1024, low - 8192), low)
    for port in random.sample(below, min(64, len(below))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux); 1024 where it cannot be read."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 1024
