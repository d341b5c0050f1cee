"""Layers point one way: the import-linter contracts in pyproject.toml hold for the installed package."""

from __future__ import annotations

import os
from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # lint-imports reads the contracts from ./pyproject.toml


def test_the_import_contracts_hold(in_repo_root: None, capsys: pytest.CaptureFixture[str]) -> None:
    code = lint_imports(no_cache=True, no_logo=True)
    report = capsys.readouterr().out
    assert code == 0, report
    assert "0 broken" in report


def test_the_graph_sees_every_folder_through_the_package_links() -> None:
    """The contracts are only as good as the graph: each folder linked into rewardmesh/ must be in it."""
    graph = grimp.build_graph("rewardmesh", include_external_packages=True)
    for module in ("server.cli", "client.trainer", "reward_engine.batcher", "common.tensors", "demo.mesh", "v1"):
        assert f"rewardmesh.{module}" in graph.modules, module
    # An edge the CLI has by design (the ignored exception of the layers contract) is seen, so edges are read.
    assert graph.direct_import_exists(importer="rewardmesh.server.cli", imported="rewardmesh.demo.rl_demo")
    assert graph.direct_import_exists(importer="rewardmesh.client.fanout", imported="grpc")
    assert os.path.islink(ROOT / "rewardmesh" / "server")
