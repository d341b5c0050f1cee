"""Options from flags, environment and a YAML file, in that order of precedence, for every entry point."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")
ENV_PREFIX = "REWARDMESH_"


def load_yaml(path: str | Path | None) -> dict[str, Any]:
    if not path:
        return {}
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"config file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SystemExit(f"config file {p} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"config file {p} must hold a mapping at the top level")
    return data


def _coerce(value: Any, like: Any, name: str) -> Any:
    if like is None or value is None:
        return value
    kind = type(like)
    try:
        if kind is bool and isinstance(value, str):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind is list and isinstance(value, str):
            return [v for v in value.split(",") if v]
        if kind is list and isinstance(value, dict):  # a YAML mapping for a KEY=VALUE list (engine args)
            return [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in value.items()]
        return kind(value)
    except (TypeError, ValueError):
        raise SystemExit(f"option {name}: cannot read {value!r} as {kind.__name__}") from None


def resolve(cls: type[T], args: argparse.Namespace, file_section: dict[str, Any]) -> T:
    """Build dataclass `cls`: flag if given, else REWARDMESH_<NAME>, else the file's value, else the default."""
    unknown = sorted(set(file_section) - {f.name for f in fields(cls)})  # type: ignore[arg-type]
    if unknown:
        raise SystemExit(f"config file: unknown option(s) {unknown} (known: {[f.name for f in fields(cls)]})")  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[operator]
        flag = getattr(args, f.name, None)
        env = os.environ.get(ENV_PREFIX + f.name.upper())
        if flag is not None:
            value = flag
        elif env is not None:
            value = env
        elif f.name in file_section:
            value = file_section[f.name]
        else:
            value = default
        values[f.name] = _coerce(value, default, f.name)
    return cls(**values)
