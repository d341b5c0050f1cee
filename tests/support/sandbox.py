"""What tests of the code sandbox share: the skip where bubblewrap is missing, and the pool's uids as held now."""

from __future__ import annotations

import shutil

import pytest

from rewardmesh.reward_engine.sandbox.executor import Sandbox

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make install)")


def held_uids(sandbox: Sandbox, *aside: int | None) -> list[int]:
    """Every uid the pool holds, sorted: the slots', the spare's, the kept sandboxes', the free ones, and ``aside``
    (those of jobs that stepped aside). Each uid held once means no two live sandboxes share one."""
    with sandbox._lock:
        warm = sandbox.warm
        kept = [uid for _, uid in warm.kept]
        return sorted([*aside, *warm.uid_of, warm.spare_uid, *kept, *warm.free_uids])  # type: ignore[list-item]
