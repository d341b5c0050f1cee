"""A server's start-up heap leaves the collector's scans."""

from __future__ import annotations

import gc

from rewardmesh.common.gc_tuning import freeze_startup_heap


def test_what_lives_at_start_up_is_never_scanned_again() -> None:
    held = [object() for _ in range(1000)]
    kept = [[k] for k in range(1000)]  # tracked by the collector, as a server's models and tables are
    try:
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        assert frozen >= len(kept)
        assert not any(gc.is_tracked(x) and x in gc.get_objects(generation=2) for x in kept[:10])
    finally:
        gc.unfreeze()
    assert held and gc.get_freeze_count() == 0
