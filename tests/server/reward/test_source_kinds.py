"""Every source kind has its batching defaults and its ListRewards value, and every config type builds a source
of a known kind."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from rewardmesh.reward_engine.engine import KIND_BATCHING, SOURCE_TYPES, _source_class
from rewardmesh.reward_engine.types import SourceKind
from rewardmesh.server.reward.service import wire_kind
from rewardmesh.v1 import reward_pb2


def test_every_kind_has_batching_defaults() -> None:
    assert set(KIND_BATCHING) == set(SourceKind)


@pytest.mark.parametrize("kind", list(SourceKind))
def test_every_kind_has_its_own_list_rewards_value(kind: SourceKind) -> None:
    wire = reward_pb2.RewardSource(kind=wire_kind(kind)).kind
    assert reward_pb2.RewardSourceKind.Name(wire) == f"REWARD_SOURCE_KIND_{kind.name}"
    assert wire != reward_pb2.REWARD_SOURCE_KIND_UNSPECIFIED


@pytest.mark.parametrize("source_type", sorted(SOURCE_TYPES))
def test_every_config_type_names_a_source_class_of_a_known_kind(source_type: str) -> None:
    module = SOURCE_TYPES[source_type].partition(":")[0]
    try:
        importlib.import_module(module)
    except ImportError as exc:  # an optional framework this environment lacks (verifiers)
        pytest.skip(f"{module}: {exc}")
    cls: Any = _source_class(source_type)
    assert isinstance(cls.kind, SourceKind)


def test_an_unknown_type_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown source type 'rules' \(known: rule, function, model"):
        _source_class("rules")


def test_a_kind_reads_as_its_string() -> None:
    assert SourceKind.RULE == "rule" and f"{SourceKind.MODEL}" == "model"
