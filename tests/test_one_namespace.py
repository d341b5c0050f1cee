"""One copy of every module: each is importable by its path under `rewardmesh.`, and by no second top-level name.

rewardmesh/ links the repository's folders (rewardmesh/common -> ../common, rewardmesh/v1 -> ../protos/rewardmesh/v1),
so with the repository's root on sys.path (pytest's rootdir, a `python` started there) `import common` would load a
second copy of every module beside `rewardmesh.common`: registries that do not see each other, classes that
`isinstance` tells apart. Each linked folder refuses to load under any name but its own (rewardmesh/_links.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.paths import REPO

# Optional dependencies (the extras that bring them): a module needing one that is not installed is skipped, named.
OPTIONAL = {"vllm": "vllm", "verl": "verl", "trl": "trl", "tqdm": "demo", "matplotlib": "demo",
            "prometheus_client": "prometheus", "opentelemetry.exporter": "otlp"}  # fmt: skip

# In a process of its own, started as pytest starts (the repository's root first on sys.path): importing every
# module (and, were a guard missing, a second copy of some) must not touch this process.
WALK = """
import importlib, json, pkgutil, sys
sys.path.insert(0, sys.argv[1])
optional = json.loads(sys.argv[2])
import rewardmesh

out = {"modules": [], "failed": {}, "skipped": {}, "second": {}}

def failed(name, exc):
    missing = getattr(exc, "name", None) or ""  # a ModuleNotFoundError's module
    extra = next((e for dep, e in optional.items() if missing == dep or missing.startswith(dep + ".")), None)
    if isinstance(exc, ModuleNotFoundError) and extra is not None:
        out["skipped"][name] = f"needs {missing} (pip install 'rewardmesh[{extra}]')"
    else:
        out["failed"][name] = f"{type(exc).__name__}: {exc}"

for info in pkgutil.walk_packages(rewardmesh.__path__, "rewardmesh.", onerror=lambda n: failed(n, sys.exc_info()[1])):
    out["modules"].append(info.name)
    try:
        importlib.import_module(info.name)
    except Exception as exc:
        failed(info.name, exc)

for name in out["modules"]:
    rest = name.removeprefix("rewardmesh.")
    second = "protos.rewardmesh." + rest if rest.split(".")[0] == "v1" else rest
    try:
        importlib.import_module(second)
    except ImportError:
        continue
    out["second"][name] = second
linked = {name.split(".")[1] for name in out["modules"]} - {"v1"} | {"protos"}  # the folders' own names
# (the namespace packages `protos` and `protos.rewardmesh` hold no code of their own: no copy of anything)
out["loaded_twice"] = sorted(m for m, mod in sys.modules.items()
                             if m.split(".")[0] in linked and getattr(mod.__spec__, "origin", None))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_every_module_imports_under_rewardmesh_and_under_no_second_name() -> None:
    run = subprocess.run([sys.executable, "-c", WALK, str(REPO), json.dumps(OPTIONAL)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.splitlines()[-1])
    modules = out["modules"]
    for linked in ("common", "server", "client", "reward_engine", "demo", "v1"):  # every link was walked
        assert f"rewardmesh.{linked}" in modules and any(m.startswith(f"rewardmesh.{linked}.") for m in modules)
    assert "rewardmesh.server.rollout.backends.vllm_backend" in modules  # subpackages too
    assert out["failed"] == {}, out["failed"]
    assert out["second"] == {}, f"importable under a second name: {out['second']}"
    assert out["loaded_twice"] == [], out["loaded_twice"]
    for name, reason in out["skipped"].items():  # reported, not failed: an optional dependency is missing
        print(f"skipped {name}: {reason}")
