"""Extras every caller can rely on: each pipeline announces its extra keys in ListRewards (a rule's own, a judge's
judge_raw, a function's or a pipeline's configured extra_keys, prefixed per source in a combination), and verl's
adapter reports exactly those, NaN where a sample has none."""

from __future__ import annotations

import math

import pytest

from rewardmesh.client.integrations.scoring import MeshScorer
from rewardmesh.client.integrations.verl import FIXED_KEYS, extra_info_of
from rewardmesh.server.reward.server import build_engine
from rewardmesh.v1 import reward_pb2
from tests.support.servers import FNS, fn_pipeline, reward_server


async def test_list_rewards_announces_each_pipelines_extra_keys() -> None:
    pipelines = {
        "declared": {**fn_pipeline("sleepy"), "extra_keys": ["delay"]},
        "undeclared": fn_pipeline("sleepy"),
        "by_source": {"sources": [{"type": "function", "function": f"{FNS}:sleepy", "extra_keys": ["delay"]}]},
        "mixed": {
            "sources": [
                {"type": "rule", "rule": "gsm8k", "name": "g"},
                {"type": "rule", "rule": "format", "name": "f"},
            ]
        },
    }
    async with reward_server(pipelines) as server:
        announced = {}
        for name in ("declared", "undeclared", "by_source", "mixed", "auto", "gsm8k"):
            announced[name] = await MeshScorer(server.address, name).extra_keys()
    assert announced["declared"] == announced["by_source"] == ("delay",)
    assert announced["undeclared"] == ()
    assert announced["mixed"] == ("f/boxed", "f/hash_answer", "f/score", "g/acc", "g/format", "g/score")
    assert announced["auto"] == ("acc", "format", "parsed") and announced["gsm8k"] == ("acc", "format")


def test_verl_extra_info_is_the_announced_keys_nan_filled() -> None:
    result = reward_pb2.RewardResult(sample_id="s", score=1.0, extras={"acc": 1.0, "format": 1.0, "other": 2.0})
    info = extra_info_of(result, ("acc", "format", "parsed"), "auto")
    assert list(info) == [*FIXED_KEYS, "acc", "format", "parsed"]
    assert info["acc"] == 1.0 and math.isnan(info["parsed"])


def test_extra_keys_must_be_a_list_of_names() -> None:
    with pytest.raises(ValueError, match=r"pipelines.p.extra_keys: expected a list of extra names"):
        build_engine({"p": {**fn_pipeline("sleepy"), "extra_keys": "delay"}})
