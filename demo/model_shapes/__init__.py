"""Released models' architectures and sizes (the JSON configs beside this file), for random models of real size.

Light on purpose (no torch): the CLI lists the names without loading the model libraries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


@dataclass(frozen=True)
class ModelShape:
    """A released model's architecture and sizes (a config file here) as a policy or a reward model."""

    config: str  # file name beside this module
    kind: str  # "policy" (causal LM) | "reward_model" (sequence classifier, one logit)

    def fields(self) -> dict[str, Any]:
        """The config's fields (transformers' names), its description left out."""
        fields: dict[str, Any] = json.loads((HERE / self.config).read_text())
        fields.pop("description", None)
        return fields


SHAPES: dict[str, ModelShape] = {
    "qwen2.5-0.5b": ModelShape("qwen2.5-0.5b.json", "policy"),
    "qwen2.5-1.5b": ModelShape("qwen2.5-1.5b.json", "policy"),
    "qwen2.5-0.5b-rm": ModelShape("qwen2.5-0.5b.json", "reward_model"),
}
