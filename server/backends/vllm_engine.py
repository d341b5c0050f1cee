"""vLLM engine options: ``KEY=VALUE`` engine arguments parsed and checked against the installed vLLM's
``AsyncEngineArgs``, so a misspelt option fails at once, naming it, instead of after minutes of booting."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any


def parse_engine_args(items: list[str] | dict[str, Any] | None) -> dict[str, Any]:
    """``KEY=VALUE`` strings (flags, environment) or a mapping (YAML) -> engine keyword arguments.

    Values are read as YAML scalars, so ``0.5`` is a float, ``true`` a bool and ``{"a": 1}`` a dict;
    ``-`` in keys becomes ``_`` so vLLM's CLI spelling works too.
    """
    import yaml

    if not items:
        return {}
    if isinstance(items, dict):
        return {str(k).replace("-", "_"): v for k, v in items.items()}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"engine arg {item!r}: expected KEY=VALUE")
        try:
            parsed = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            parsed = value
        out[key.strip().replace("-", "_")] = parsed
    return out


def check_engine_args(kwargs: dict[str, Any], known: set[str]) -> None:
    """Raise ValueError naming every key the engine's argument dataclass does not have (with a suggestion)."""
    unknown = sorted(k for k in kwargs if k not in known)
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ValueError(f"unknown vLLM engine argument(s): {', '.join(hints)}; see vllm.AsyncEngineArgs")


def engine_arg_names() -> set[str]:
    """The fields of the installed vLLM's AsyncEngineArgs."""
    from vllm import AsyncEngineArgs

    return {f.name for f in dataclasses.fields(AsyncEngineArgs)}
