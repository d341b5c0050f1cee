"""Load a callable named by 'module:function' or 'path/to/file.py:function' (custom reward functions, and
the calls an isolated worker process re-loads by name)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rewardmesh.common.errors import describe_exception

_file_counter = itertools.count()


@dataclass(frozen=True)
class FunctionSpec:
    """A parsed 'module:function' or 'path/to/file.py:function' (path made absolute)."""

    spec: str  # as configured, for messages
    target: str  # module name, or absolute file path
    attr: str  # attribute path inside the module, may be dotted (Class.method)
    is_file: bool

    @property
    def resolved(self) -> str:
        """The spec a worker process re-loads: independent of the worker's working directory."""
        return f"{self.target}:{self.attr}"


def parse_spec(spec: str) -> FunctionSpec:
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"function: expected 'module:function' or 'path/to/file.py:function', got {spec!r}")
    target, _, attr = spec.rpartition(":")
    target, attr = target.strip(), attr.strip()
    if not target or not attr:
        raise ValueError(f"function: {spec!r} needs both parts of 'module:function' or 'path/to/file.py:function'")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    if is_file:
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise ValueError(f"function {spec!r}: file {path} does not exist")
        target = path
    return FunctionSpec(spec=spec, target=target, attr=attr, is_file=is_file)


def _import_file(path: str, module_name: str) -> Any:
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    # Registered so that dataclasses, pickling and the like inside the user's module work.
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def load_function(spec: FunctionSpec, module_name: str | None = None) -> Callable[..., Any]:
    """Import the module or file and return the callable, raising ValueError that says what is wrong.

    A file is executed under a fresh module name each time (``module_name`` or a counter), so a
    source built after the file was edited sees the new code; modules are imported normally.
    """
    where = f"function {spec.spec!r}"
    if spec.is_file:
        if module_name is None:
            digest = hashlib.sha1(spec.target.encode()).hexdigest()[:10]
            module_name = f"_rewardmesh_fn_{digest}_{next(_file_counter)}"
        try:
            module = _import_file(spec.target, module_name)
        except Exception as exc:
            raise ValueError(f"{where}: loading {spec.target} raised {describe_exception(exc)}") from exc
    else:
        try:
            module = importlib.import_module(spec.target)
        except ModuleNotFoundError as exc:
            if exc.name and (spec.target == exc.name or spec.target.startswith(exc.name + ".")):
                raise ValueError(f"{where}: no module named {spec.target!r} (is it on sys.path?)") from exc
            raise ValueError(f"{where}: importing {spec.target!r} raised {describe_exception(exc)}") from exc
        except Exception as exc:
            raise ValueError(f"{where}: importing {spec.target!r} raised {describe_exception(exc)}") from exc
    obj: Any = module
    for part in spec.attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{where}: {spec.target!r} has no attribute {spec.attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{where}: {spec.attr!r} is a {type(obj).__name__}, not a callable")
    fn: Callable[..., Any] = obj
    return fn
