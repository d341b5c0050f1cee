"""Checks of a source's constructor arguments. They come from YAML, so any type may arrive; each check fails with a
ValueError naming the source and the key, as "judge source 'j': 'max_tokens' must be an integer >= 1, got 0"."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any


def source_where(kind: str, name: Any) -> str:
    """ "judge source 'j'": what every message about the source starts with; the name must be a non-empty string."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind}: 'name' must be a non-empty string, got {name!r}")
    return f"{kind} {name!r}"


def _fail(where: str, key: str, wants: str, value: Any) -> ValueError:
    return ValueError(f"{where}: '{key}' must be {wants}, got {value!r}")


def _real(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def integer(where: str, key: str, value: Any, *, minimum: int, note: str = "") -> int:
    """An int >= ``minimum`` (a bool is not one); ``note`` explains a special value, as " (0: no limit)"."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(where, key, f"an integer >= {minimum}{note}", value)
    return value


def number(where: str, key: str, value: Any) -> float:
    """Any int or float (a bool is not one)."""
    if not _real(value):
        raise _fail(where, key, "a number", value)
    return float(value)


def positive(where: str, key: str, value: Any) -> float:
    """A number > 0."""
    if not _real(value) or not value > 0:
        raise _fail(where, key, "a positive number", value)
    return float(value)


def non_negative(where: str, key: str, value: Any, *, note: str = "") -> float:
    """A number >= 0; ``note`` explains 0, as " (0 = unlimited)"."""
    if not _real(value) or not value >= 0:
        raise _fail(where, key, f">= 0{note}", value)
    return float(value)


def one_of(where: str, key: str, value: Any, choices: Collection[str]) -> str:
    """One of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise _fail(where, key, f"one of {', '.join(choices)}", value)
    return value


def text(where: str, key: str, value: Any, *, empty: bool = False) -> str:
    """A string, non-empty unless ``empty``."""
    if not isinstance(value, str) or (not value and not empty):
        raise _fail(where, key, "a string" if empty else "a non-empty string", value)
    return value
