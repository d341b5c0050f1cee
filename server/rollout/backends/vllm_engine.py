"""vLLM engine construction: ``KEY=VALUE`` engine arguments parsed and checked against the installed vLLM's
``AsyncEngineArgs`` (a misspelt option fails at once, naming it, not after minutes of booting), the backend's
defaults, and the engine built and shut down."""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import importlib
import inspect
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


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


def engine_args_from_env() -> dict[str, Any]:
    """REWARDMESH_ENGINE_ARG (``KEY=VALUE,...``), the variable `rewardmesh serve rollout` reads too: engine
    arguments for an engine built outside the CLI (tests, the demo, the bench), e.g. attention_backend=TRITON_ATTN
    for a vLLM build without flash-attention kernels."""
    return parse_engine_args([a for a in os.environ.get("REWARDMESH_ENGINE_ARG", "").split(",") if a])


# Tokens between two outputs of a streamed request: more than any sample has, so a request of n samples reports each
# in two outputs (its first token, its end) rather than one per token per sample.
STREAM_INTERVAL = 1 << 20


def complete_engine_args(kwargs: dict[str, Any], known: set[str]) -> dict[str, Any]:
    """The backend's defaults for what the caller left unset (checked first; the caller's values win):
    processed log-probs, vLLM's "ipc" weight transfer where the release has it, stats logging off, as the
    offline ``LLM`` class has it (``disable_log_stats=False`` turns it on), and a stream interval longer than any
    sample (the backend's only streamed requests are groups of samples; see STREAM_INTERVAL)."""
    check_engine_args(kwargs, known)
    out = dict(kwargs)
    if "stream_interval" in known and "stream_interval" not in out:
        out["stream_interval"] = STREAM_INTERVAL
    if "logprobs_mode" in known and "logprobs_mode" not in out:
        # the log-prob of the distribution actually sampled from (after temperature, top-k, top-p)
        out["logprobs_mode"] = "processed_logprobs"
    if "weight_transfer_config" in known and "weight_transfer_config" not in out and ipc_transfer_loads():
        from vllm.config import WeightTransferConfig

        # CUDA IPC updates from a colocated trainer. The handles reach the workers as a pickle this server
        # builds itself from checked fields (update_weights_ipc); vLLM unpickles them only with this set.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        out["weight_transfer_config"] = WeightTransferConfig(backend="ipc")
    if "disable_log_stats" in known and "disable_log_stats" not in out:
        out["disable_log_stats"] = True
    return out


def ipc_transfer_loads() -> bool:
    """Whether this vLLM's "ipc" weight-transfer engine can be loaded here. Some releases import packages for it
    that an install may lack (0.26 imports ray); the engine would then fail to start, so the backend leaves the
    transfer engine off and CUDA IPC updates take the layerwise load path instead."""
    try:
        importlib.import_module("vllm.distributed.weight_transfer.ipc_engine")
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("vllm"):
            return True  # the module moved in this release: vLLM itself decides
        logger.warning("vLLM's ipc weight transfer is off: it needs %r, which is not installed", exc.name)
        return False
    return True


def uses_ipc_transfer(kwargs: dict[str, Any]) -> bool:
    """Whether the engine arguments choose vLLM's "ipc" weight-transfer backend."""
    config = kwargs.get("weight_transfer_config")
    return getattr(config, "backend", None) == "ipc" or (isinstance(config, dict) and config.get("backend") == "ipc")


def build_engine(kwargs: dict[str, Any]) -> Any:
    """vLLM's async engine from complete engine arguments; blocking (it loads and profiles the model).

    The engine is created with the offline ``LLM`` class's usage context, so the scheduler limits the caller
    left unset (``max_num_seqs``, ``max_num_batched_tokens``) are the ones ``LLM`` picks for this machine, not
    the smaller defaults of a bare ``AsyncLLM``.
    """
    from vllm import AsyncEngineArgs

    try:
        from vllm.v1.engine.async_llm import AsyncLLM as engine_cls
    except ImportError:  # older releases: the V0 async engine has the same generate/abort API
        from vllm import AsyncLLMEngine as engine_cls

    args = AsyncEngineArgs(**kwargs)
    context = llm_usage_context()
    if context is not None and "usage_context" in inspect.signature(engine_cls.from_engine_args).parameters:
        return engine_cls.from_engine_args(args, usage_context=context)
    return engine_cls.from_engine_args(args)


def llm_usage_context() -> Any:
    """``UsageContext.LLM_CLASS`` of the installed vLLM (None where it has none)."""
    try:
        from vllm.usage.usage_lib import UsageContext
    except ImportError:
        return None
    return getattr(UsageContext, "LLM_CLASS", None)


async def shutdown_engine(engine: Any) -> None:
    """Stop the engine and its worker processes (``shutdown`` or the V0 engine's ``shutdown_background_loop``)."""
    shutdown = getattr(engine, "shutdown", None) or getattr(engine, "shutdown_background_loop", None)
    if shutdown is not None:
        result = shutdown()
        if asyncio.iscoroutine(result):
            await result
