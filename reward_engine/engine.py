"""The set of named pipelines a reward server offers, built from built-in rules and a YAML-shaped config."""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from rewardmesh.common.errors import UnknownReward
from rewardmesh.reward_engine.batcher import BatcherConfig, BatchInfo
from rewardmesh.reward_engine.pipeline import RewardPipeline, WeightedSource
from rewardmesh.reward_engine.types import RewardSource, SourceKind

log = logging.getLogger(__name__)

# Batcher defaults per source kind. Whatever they say, work is handed over only when the sources can start it
# (each source's capacity: reward_engine.types.Capacity). Rules inline run one batch at a time on the event loop,
# each of at most max_batch_size samples and about a millisecond of loop time (batcher.INLINE_BATCH_S). Functions,
# isolated rules, code and judges take work per sample: a batch is at most their free slots (worker processes,
# sandbox slots, requests in flight), each sample answered when its own work is done; max_concurrent_batches x
# max_batch_size still caps the samples in flight (here far above any source's capacity). A model waits a moment
# for a fuller batch; two batches in flight (its capacity) let the second be staged while the first computes.
KIND_BATCHING: dict[SourceKind, BatcherConfig] = {
    SourceKind.RULE: BatcherConfig(max_batch_size=256, max_queue_delay_ms=0, max_concurrent_batches=4),
    SourceKind.FUNCTION: BatcherConfig(max_batch_size=64, max_queue_delay_ms=0, max_concurrent_batches=16),
    SourceKind.JUDGE: BatcherConfig(max_batch_size=64, max_queue_delay_ms=0, max_concurrent_batches=16),
    SourceKind.CODE: BatcherConfig(max_batch_size=64, max_queue_delay_ms=0, max_concurrent_batches=16),
    SourceKind.MODEL: BatcherConfig(max_batch_size=32, max_queue_delay_ms=2, max_concurrent_batches=2),
}
# A config's source `type` -> the class that builds it ("module:Class", imported only when configured: a rule-only
# server never loads torch or aiohttp). The class says its kind (a verifiers environment runs as a function).
SOURCE_TYPES: dict[str, str] = {
    "rule": "rewardmesh.reward_engine.sources.rules:RuleSource",
    "function": "rewardmesh.reward_engine.sources.custom:FunctionSource",
    "model": "rewardmesh.reward_engine.sources.reward_model:ModelSource",
    "judge": "rewardmesh.reward_engine.sources.judge:JudgeSource",
    "code": "rewardmesh.reward_engine.sources.code:CodeSource",
    "verifiers": "rewardmesh.reward_engine.sources.verifiers_env:VerifiersSource",
}


def _source_class(source_type: str) -> type:
    """The class of a config's source `type`, imported now."""
    target = SOURCE_TYPES.get(source_type)
    if target is None:
        raise ValueError(f"unknown source type '{source_type}' (known: {', '.join(SOURCE_TYPES)})")
    module, _, attr = target.partition(":")
    cls: type = getattr(importlib.import_module(module), attr)
    return cls


def build_source(where: str, spec: dict[str, Any]) -> tuple[RewardSource, float]:
    """One source from its config mapping: `type`, optional `name` and `weight`, the rest are options."""
    spec = dict(spec)
    kind = spec.pop("type", None)
    if kind is None:
        raise ValueError(f"{where}: missing 'type' (one of {', '.join(SOURCE_TYPES)})")
    cls = _source_class(str(kind))
    weight = float(spec.pop("weight", 1.0))
    name = str(spec.pop("name", kind))
    declared = spec.pop("extra_keys", None)  # the extras this source reports (ListRewards announces them)
    params = inspect.signature(cls).parameters
    unknown = sorted(set(spec) - set(params))
    if unknown:
        known = sorted(p for p in params if p != "name")
        raise ValueError(f"{where}: unknown option(s) {unknown} for type '{kind}' (known: {known})")
    source: RewardSource = cls(name=name, **spec)
    if declared is not None:
        source.extra_keys = _key_list(f"{where}.extra_keys", declared)
    return source, weight


def _key_list(where: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(k, str) and k for k in value):
        raise ValueError(f"{where}: expected a list of extra names, got {value!r}")
    return tuple(value)


def batcher_config(where: str, kind: SourceKind, overrides: dict[str, Any] | None) -> BatcherConfig:
    base = KIND_BATCHING[kind]
    values = {f.name: getattr(base, f.name) for f in fields(BatcherConfig)}
    for key, value in (overrides or {}).items():
        if key not in values:
            raise ValueError(f"{where}.batching: unknown option '{key}' (known: {sorted(values)})")
        values[key] = type(values[key])(value)
    try:
        return BatcherConfig(**values)
    except ValueError as exc:
        raise ValueError(f"{where}.batching: {exc}") from None


class RewardEngine:
    """Named pipelines, started and stopped together."""

    def __init__(self) -> None:
        self.pipelines: dict[str, RewardPipeline] = {}
        # Called after every executed batch (metrics, batch spans); listeners may be added at any time.
        self.batch_listeners: list[Callable[[str, BatchInfo], None]] = []

    def _on_batch(self, pipeline: str, info: BatchInfo) -> None:
        for listener in self.batch_listeners:
            listener(pipeline, info)

    def get(self, name: str) -> RewardPipeline:
        if not name:
            raise UnknownReward(
                f"reward: empty; name a pipeline (this server offers: {', '.join(sorted(self.pipelines))})"
            )
        try:
            return self.pipelines[name]
        except KeyError:
            raise UnknownReward(
                f"reward: no pipeline named '{name}' (this server offers: {', '.join(sorted(self.pipelines))})"
            ) from None

    def add(self, pipeline: RewardPipeline) -> None:
        if pipeline.name in self.pipelines:
            raise ValueError(f"pipeline '{pipeline.name}' is defined twice")
        self.pipelines[pipeline.name] = pipeline

    def add_builtin_rules(self, **rule_options: Any) -> None:
        """One pipeline per built-in rule, named after the rule, and `code` (programs against tests in the
        sandbox); ``rule_options`` (timeout_s, memory_mb,
        workers) set the isolation budget of those that run in worker processes, started on first use."""
        from rewardmesh.reward_engine.sources.rules import RULES, RuleSource

        for rule in sorted(RULES):
            if rule not in self.pipelines:
                self.add(
                    RewardPipeline(
                        rule,
                        [WeightedSource(RuleSource(name=rule, rule=rule, prestart=False, **rule_options))],
                        batcher_config(rule, SourceKind.RULE, None),
                        description=f"built-in rule '{rule}'",
                        on_batch=self._on_batch,
                    )
                )
        if "code" not in self.pipelines:  # programs against tests in the sandbox, proven on first use
            from rewardmesh.reward_engine.sources.code import CodeSource

            code = CodeSource(name="code", prestart=False)
            description = "built-in code execution against tests in the sandbox"
            batching = batcher_config("code", SourceKind.CODE, None)
            pipeline = RewardPipeline(
                "code", [WeightedSource(code)], batching, description=description, on_batch=self._on_batch
            )
            self.add(pipeline)

    def add_from_config(self, config: dict[str, Any]) -> None:
        """Pipelines from a mapping `{name: {description, batching, sources: [{type, ...}]}}`."""
        for name, spec in (config or {}).items():
            where = f"pipelines.{name}"
            if not isinstance(spec, dict) or not spec.get("sources"):
                raise ValueError(f"{where}: needs a 'sources' list")
            unknown = sorted(set(spec) - {"sources", "batching", "description", "extra_keys"})
            if unknown:
                known = "batching, description, extra_keys, sources"
                raise ValueError(f"{where}: unknown key(s) {unknown} (known: {known})")
            declared = spec.get("extra_keys")
            built = [build_source(f"{where}.sources[{i}]", s) for i, s in enumerate(spec["sources"])]
            sources = [WeightedSource(src, w) for src, w in built]
            kind = sources[0].source.kind  # a model's batching wins: a pipeline with one waits on it
            if any(ws.source.kind is SourceKind.MODEL for ws in sources):
                kind = SourceKind.MODEL
            self.add(
                RewardPipeline(
                    str(name),
                    sources,
                    batcher_config(where, kind, spec.get("batching")),
                    description=str(spec.get("description", "")),
                    on_batch=self._on_batch,
                    extra_keys=None if declared is None else _key_list(f"{where}.extra_keys", declared),
                )
            )

    async def warmup(self) -> None:
        for pipeline in self.pipelines.values():
            await pipeline.warmup()
            log.info("pipeline %s ready: %s", pipeline.name, pipeline.describe_capacity())

    async def close(self, *, drain: bool = True) -> None:
        for pipeline in self.pipelines.values():
            await pipeline.close(drain=drain)
