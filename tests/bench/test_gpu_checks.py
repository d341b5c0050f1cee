"""The one GPU script on a machine without a CUDA GPU: it stops at the first step that needs one and says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import gpu_checks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the steps would really run")


def test_without_a_gpu_the_run_stops_at_the_first_step_that_needs_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = gpu_checks.main(["--only", "rollout-tiny,reward-model", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 2
    assert "stopped at rollout-tiny: it needs a CUDA GPU" in out and "not run: rollout-tiny, reward-model" in out
    steps = json.loads((tmp_path / "gpu_checks.json").read_text())["steps"]
    assert [(s["name"], s["result"]) for s in steps] == [("rollout-tiny", "not run"), ("reward-model", "not run")]
    assert "| rollout-tiny" in (tmp_path / "gpu_checks.md").read_text()
    assert not list(tmp_path.glob("*.log"))  # nothing was started


def test_the_plan_names_every_check_and_an_unknown_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_checks.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    steps = ("vllm-tests", "cuda-ipc-tests", "reward-model-tests", "rollout-tiny", "rollout-1.5b", "reward-model")
    for name in (*steps, "weight-sync"):
        assert f"\n{name}: " in out
    assert "rollout-1.5b: needs a CUDA GPU" in out
    assert "cuda-ipc-tests: runs" in out and "reward-model-tests: runs" in out
    with pytest.raises(SystemExit):
        gpu_checks.main(["--only", "rollout-70b"])
    assert "unknown step(s) rollout-70b" in capsys.readouterr().err
