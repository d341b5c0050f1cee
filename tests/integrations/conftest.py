"""Ray, which verl imports, kept on the loopback address: on Linux a local Ray instance otherwise binds and
registers its node under the host's outward address, which ties the tests to the machine's network setup. Set
before any test module imports verl (Ray reads it once, at import)."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
