"""The suite's pytest settings make a test that checked less than it claims fail loudly: a coroutine never
awaited, an exception nobody could catch (in a destructor, in a thread) and any warning are errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

SUITE = """
import gc
import threading
import warnings


async def check() -> bool:
    return False


def test_a_coroutine_never_awaited():
    check()  # truthy, never evaluated
    gc.collect()


class Broken:
    def __del__(self):
        raise RuntimeError("lost in a destructor")


def test_an_exception_in_a_destructor():
    Broken()
    gc.collect()


def test_an_exception_in_a_thread():
    def fail():
        raise RuntimeError("lost in a thread")

    t = threading.Thread(target=fail)
    t.start()
    t.join()


def test_a_deprecation_warning():
    warnings.warn("an API the project still calls", DeprecationWarning)


def test_a_clean_test_passes():
    assert True
"""


@pytest.mark.integration
def test_vacuous_tests_fail_under_the_suite_settings(tmp_path: Path) -> None:
    suite = tmp_path / "test_vacuous.py"
    suite.write_text(SUITE)
    argv = [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path),
            "-p", "no:cacheprovider", "-q", "-rfE", str(suite)]  # fmt: skip
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    failed = {line.split("::")[1].split(" ")[0] for line in out.splitlines() if line.startswith("FAILED ")}
    assert failed == {
        "test_a_coroutine_never_awaited",
        "test_an_exception_in_a_destructor",
        "test_an_exception_in_a_thread",
        "test_a_deprecation_warning",
    }, out
    assert "1 passed" in out, out
