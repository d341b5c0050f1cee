"""Where the repository and the CLI are, for tests that start processes or read files (wherever the test sits)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The rewardmesh command, run by this interpreter (the venv's), as a user runs it.
CLI = [sys.executable, "-m", "rewardmesh.server.cli"]
