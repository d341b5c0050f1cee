"""The flake hunt (`make flake-hunt`) reports every test that failed in any run, with its failure and a replay
command, and runs its own load generator where stress-ng is missing."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from tests.support import flake_hunt

SUITE = """
import os

def test_passes():
    assert True

def test_fails():
    assert os.environ.get("NEVER_SET") == "set", "boom: the failure text"
"""


@pytest.mark.slow
@pytest.mark.integration
def test_a_failing_test_is_reported_with_its_failure_and_a_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite = tmp_path / "test_sample_suite.py"
    suite.write_text(SUITE)
    code = flake_hunt.main(["--runs", "2", "--load", "0", "--seed", "17", "--out", str(tmp_path / "out"), str(suite)])
    out = capsys.readouterr().out
    assert code == 1
    assert "1 test(s) failed at least once" in out and "test_fails" in out and "test_passes" not in out
    assert "failed in 2 of 2 run(s): seeds 17, " in out
    assert "--random-order-seed=17" in out and "boom: the failure text" in out
    assert len(list((tmp_path / "out").glob("run-*.xml"))) == 2


@pytest.mark.slow
@pytest.mark.integration
def test_a_clean_suite_reports_no_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    suite = tmp_path / "test_clean_suite.py"
    suite.write_text("def test_passes():\n    assert True\n")
    assert flake_hunt.main(["--runs", "1", "--load", "0", "--out", str(tmp_path / "out"), str(suite)]) == 0
    assert "no test failed in 1 run(s)" in capsys.readouterr().out


def test_node_ids_come_back_from_junit_class_names() -> None:
    assert flake_hunt.node_id("tests.test_waiting", "test_x[a-b]") == "tests/test_waiting.py::test_x[a-b]"
    assert flake_hunt.node_id("tests.test_waiting.TestThing", "test_y") == "tests/test_waiting.py::TestThing::test_y"


def test_without_stress_ng_the_load_is_burner_processes_one_per_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flake_hunt.shutil, "which", lambda name: None)
    with flake_hunt.cpu_load(20) as load:
        burners = [p for p in multiprocessing.active_children() if p.name == flake_hunt.BURNER]
        assert "burner processes at 20%" in load and len(burners) == (os.cpu_count() or 1)
        assert all(p.is_alive() for p in burners)
    assert not any(p.is_alive() for p in burners)
