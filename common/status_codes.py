"""gRPC status codes as results carry them (the number in `RewardResult.error.code`) and their names."""

from __future__ import annotations

import grpc

_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def code_name(code: int) -> str:
    """'DEADLINE_EXCEEDED' for 4; the number itself for a code gRPC does not define (a newer peer's)."""
    return _NAMES.get(code, str(code))
