"""max_num_seqs, the most sequences a rollout server decodes together: the hf backend's rows, vLLM's engine argument
of that name; max_batch_size, its deprecated name, still read (with a warning)."""

from __future__ import annotations

import logging

import pytest

from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.server.cli import build_parser
from rewardmesh.server.config import resolve
from rewardmesh.server.rollout.backends.hf import DEFAULT_MAX_NUM_SEQS, HFBackend
from rewardmesh.server.rollout.backends.vllm_backend import VLLMBackend
from rewardmesh.server.rollout.server import RolloutServerConfig, backend_options


def options(*flags: str, section: dict[str, object] | None = None) -> dict[str, object]:
    return backend_options(resolve(RolloutServerConfig, build_parser().parse_args(["serve", "rollout", *flags]),
                                   section or {}))  # fmt: skip


def test_unset_leaves_each_backend_its_own_default(tiny_models: TinyModelPaths) -> None:
    assert "max_num_seqs" not in options() and "max_num_seqs" not in options("--backend", "vllm")
    assert HFBackend(str(tiny_models.policy), num_threads=1).max_num_seqs == DEFAULT_MAX_NUM_SEQS


def test_both_backends_get_it(tiny_models: TinyModelPaths) -> None:
    assert options("--max-num-seqs", "8")["max_num_seqs"] == 8
    assert options(section={"max_num_seqs": 6})["max_num_seqs"] == 6
    vllm = options("--backend", "vllm", "--max-num-seqs", "16")
    assert vllm["max_num_seqs"] == 16
    backend = VLLMBackend(str(tiny_models.policy), **vllm)  # type: ignore[arg-type]
    assert backend.engine_options["max_num_seqs"] == 16  # what vllm.AsyncEngineArgs is built from


def test_the_deprecated_name_is_read_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rewardmesh.server.rollout.server"):
        assert options("--max-batch-size", "8")["max_num_seqs"] == 8
        assert options("--backend", "vllm", section={"max_batch_size": 12})["max_num_seqs"] == 12
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("max_batch_size is deprecated" in w and "max_num_seqs" in w for w in warnings)
    assert "read as max_num_seqs=12" in warnings[1] and "vllm backend" in warnings[1]


def test_conflicting_values_are_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="max_batch_size 8 and max_num_seqs 4 both set"):
        options("--max-batch-size", "8", "--max-num-seqs", "4")
    with pytest.raises(ValueError, match="max_num_seqs 4 and engine_arg max_num_seqs=8 disagree"):
        options("--backend", "vllm", "--max-num-seqs", "4", "--engine-arg", "max_num_seqs=8")
    assert options("--backend", "vllm", "--max-num-seqs", "4", "--engine-arg", "max_num_seqs=4")["max_num_seqs"] == 4
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        options("--max-num-seqs", "-1")
