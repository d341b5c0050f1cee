"""Rule-based rewards: a registry of cheap, deterministic verl-style scorers and the source that runs them.

Rules have verl's signature ``compute_score(data_source, solution_str, ground_truth, extra_info)``
returning a float or a dict with a "score" key, so verl's built-in scorers and user rules can be
registered unchanged and give the same rewards here as inside verl.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rewardmesh.common.errors import InvalidInput, RewardError, SourceFailed, UnknownReward, describe_exception
from rewardmesh.reward_engine.isolation import Call, IsolatedPool, spec_of
from rewardmesh.reward_engine.sources import options
from rewardmesh.reward_engine.sources.verl_compat import to_output
from rewardmesh.reward_engine.types import (
    BatchResult,
    Capacity,
    Outcome,
    RewardInput,
    RewardOutput,
    RewardSource,
    SourceKind,
)

RuleFn = Callable[[str, str, str, dict[str, Any] | None], float | dict[str, Any]]


@dataclass(frozen=True)
class Rule:
    """A registered rule: its function and what the registry knows of how it runs. Calling it calls the function."""

    fn: RuleFn
    # False: the rule's parsing is bounded and linear-time (clipped input, simple regexes, no evaluation), so it
    # runs inline on the event loop, where a worker round trip would cost more than the rule. Every other rule
    # runs isolated in worker processes under a time and memory budget (see rewardmesh.reward_engine.isolation).
    isolate: bool = True
    # Warm-up hooks ("module:function()") a worker runs as it starts, for rules with a costly first import.
    preload: tuple[str, ...] = ()
    # The extras the rule may report (ListRewards announces them, so every caller builds the same columns).
    extras: tuple[str, ...] = ()

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None
    ) -> float | dict[str, Any]:
        return self.fn(data_source, solution_str, ground_truth, extra_info)


RULES: dict[str, Rule] = {}  # the one registry, by name


def register_rule(
    name: str,
    *,
    replace: bool = False,
    isolate: bool = True,
    preload: tuple[str, ...] = (),
    extras: tuple[str, ...] = (),
) -> Callable[[RuleFn], RuleFn]:
    """Decorator adding a rule under ``name``; a duplicate name is an error unless ``replace``,
    so two modules cannot silently shadow each other's rule. ``isolate=False`` declares the rule's
    work bounded and linear in a clipped input, so it may run inline; leave it True for anything
    that parses or evaluates what a policy wrote. ``extras``: the names of the extras it may return."""
    if not name or not isinstance(name, str):
        raise ValueError("rule name must be a non-empty string")

    def decorator(fn: RuleFn) -> RuleFn:
        if name in RULES and RULES[name].fn is not fn and not replace:
            raise ValueError(f"rule {name!r} is already registered (pass replace=True to override it)")
        RULES[name] = Rule(fn, isolate=isolate, preload=preload, extras=extras)
        return fn

    return decorator


def get_rule(name: str) -> RuleFn:
    try:
        return RULES[name].fn
    except KeyError:
        raise UnknownReward(f"unknown rule {name!r}; known rules: {', '.join(sorted(RULES))}") from None


# --------------------------------------------------------------------------------------------- gsm8k

# verl matches only the last 300 characters: regexes over long rollouts are slow and the answer is at the end.
_GSM8K_CLIP_CHARS = 300
_GSM8K_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_FLEXIBLE_RE = re.compile(r"(\-?[0-9\.\,]+)")


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """verl's gsm8k extract_solution: strict = last ``#### N``; flexible = last number in the text.

    Strict is faithful to verl, so rewards match verl's, quirks included: "#### 72." yields "72.",
    which does not equal "72". Flexible deliberately differs: verl's regex takes "72." from "the
    answer is 72." and a bare "," from prose, so it drops trailing dots/commas, skips matches
    without a digit and removes thousands separators, i.e. it really is "the last number".
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    if len(solution_str) > _GSM8K_CLIP_CHARS:
        solution_str = solution_str[-_GSM8K_CLIP_CHARS:]
    if method == "strict":
        found = _GSM8K_STRICT_RE.findall(solution_str)
        if not found:
            return None
        return str(found[-1]).replace(",", "").replace("$", "")
    for candidate in reversed(_GSM8K_FLEXIBLE_RE.findall(solution_str)):
        number = str(candidate).rstrip(".,").replace(",", "")
        if any(ch.isdigit() for ch in number):
            return number
    return None


def _gsm8k_ground_truth(ground_truth: str) -> str:
    """Accept both verl's preprocessed answer ("72") and the raw gsm8k answer ("...#### 72")."""
    text = ground_truth.strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    return text.replace(",", "")


def gsm8k_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict[str, float]:
    """verl's gsm8k compute_score, returning a dict whose extras say why: ``acc`` (answer correct)
    and ``format`` (a strict ``#### N`` answer was present, whatever the method)."""
    answer = extract_gsm8k_answer(solution_str, method)
    has_format = extract_gsm8k_answer(solution_str, "strict") is not None
    correct = answer is not None and answer == _gsm8k_ground_truth(ground_truth)
    if answer is None:
        value = 0.0
    else:
        value = score if correct else format_score
    return {"score": float(value), "acc": 1.0 if correct else 0.0, "format": 1.0 if has_format else 0.0}


@register_rule("gsm8k", isolate=False, extras=("acc", "format"))
def gsm8k(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Strict gsm8k (verl's default): only a ``#### N`` answer counts."""
    return gsm8k_score(solution_str, ground_truth, method="strict")


@register_rule("gsm8k_flexible", isolate=False, extras=("acc", "format"))
def gsm8k_flexible(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Flexible gsm8k: the last number in the response is the answer."""
    return gsm8k_score(solution_str, ground_truth, method="flexible")


# ---------------------------------------------------------------------------------------------- math


class _DropTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeouts are off; that is our deliberate choice, not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


_math_lock = threading.Lock()
_math_fns: tuple[Callable[..., Any], Callable[..., Any]] | None = None


def _math_verify() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Import math-verify on first use: it costs ~0.5 s and most pipelines never score math."""
    global _math_fns
    with _math_lock:
        if _math_fns is None:
            from math_verify import parse, verify

            for logger_name in ("math_verify.parser", "math_verify.grader"):
                logging.getLogger(logger_name).addFilter(_DropTimeoutWarning())
            _math_fns = (parse, verify)
        return _math_fns


_MATH_WARMUP = "rewardmesh.reward_engine.sources.rules:_math_verify()"


def math_score(solution_str: str, ground_truth: str) -> dict[str, float]:
    """Compare the response's final answer (e.g. ``\\boxed{...}``) with ground_truth via math-verify.

    Thread safety: math-verify's default timeouts use ``signal.alarm``, which raises ValueError
    outside the main thread and would fire into whatever the main thread (the event loop) is doing
    inside it. We always pass ``parsing_timeout=None`` / ``timeout_seconds=None`` to turn them off,
    so this runs in any thread; the price is no internal time limit on pathological inputs
    (``\\boxed{9^{9^{9}}}`` runs for hours), which is why a RuleSource runs this rule in an isolated
    worker process under a time and memory budget.
    """
    parse, verify = _math_verify()
    gold_text = ground_truth.strip()
    if not gold_text:
        raise InvalidInput("ground_truth is empty; the math rule needs the reference answer")
    if "\\boxed" not in gold_text:
        gold_text = "\\boxed{" + gold_text + "}"
    gold = parse(gold_text, parsing_timeout=None)
    if not gold:
        raise InvalidInput(f"ground_truth {ground_truth[:80]!r} is not a parseable math answer")
    predicted = parse(solution_str, parsing_timeout=None)
    correct = bool(predicted) and bool(verify(gold, predicted, timeout_seconds=None))
    return {
        "score": 1.0 if correct else 0.0,
        "acc": 1.0 if correct else 0.0,
        "parsed": float(bool(predicted)),
    }


@register_rule("math", preload=(_MATH_WARMUP,), extras=("acc", "parsed"))
def math_rule(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Math answer equivalence via math-verify (1/0), with ``parsed`` = an answer was found."""
    return math_score(solution_str, ground_truth)


# -------------------------------------------------------------------------------------- format, etc.

_BOXED_RE = re.compile(r"\\boxed\s*\{\s*[^\s}]")


@register_rule("format", isolate=False, extras=("boxed", "hash_answer"))
def format_rule(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """1 if the response states a final answer as ``#### N`` or a non-empty ``\\boxed{...}``."""
    has_hash = extract_gsm8k_answer(solution_str, "strict") is not None
    has_boxed = _BOXED_RE.search(solution_str) is not None
    return {
        "score": 1.0 if (has_hash or has_boxed) else 0.0,
        "hash_answer": 1.0 if has_hash else 0.0,
        "boxed": 1.0 if has_boxed else 0.0,
    }


@register_rule("noop", isolate=False)
def noop(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None) -> float:
    """0.0 without looking at the sample: measures transport and batching cost alone."""
    return 0.0


@register_rule("length", isolate=False)
def length(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None) -> float:
    """-len(response)/1000: a trivial, input-dependent score for tests and smoke runs."""
    return -len(solution_str) / 1000.0


_LEADING_NUMBER = re.compile(r"\s*(-?\d+)")  # the number a response opens with (first_number, near_number)


@register_rule("first_number", isolate=False, extras=("acc", "format"))
def first_number(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """1 if the response opens with the ground-truth number, 0.1 if it opens with a wrong number, else 0.

    The demo's task (one-token answers to single-digit additions): the small format credit gives a
    random tiny policy a gradient from the first step.
    """
    match = _LEADING_NUMBER.match(solution_str)
    if match is None:
        return {"score": 0.0, "acc": 0.0, "format": 0.0}
    correct = match.group(1) == ground_truth.strip()
    return {"score": 1.0 if correct else 0.1, "acc": float(correct), "format": 1.0}


@register_rule("near_number", isolate=False, extras=("acc", "format"))
def near_number(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """`first_number` with partial credit for a near miss: 1 if right, else 0.1 + 0.5 x max(0, 1 - |error| / 10).

    Reward shaping for the demo: a wrong answer closer to the truth scores higher, so every GRPO group
    ranks its samples (not only the rare group holding the exact answer), and `acc` stays exact.
    """
    match = _LEADING_NUMBER.match(solution_str)
    if match is None:
        return {"score": 0.0, "acc": 0.0, "format": 0.0}
    try:
        error = abs(int(match.group(1)) - int(ground_truth.strip()))
    except ValueError:  # a non-numeric ground truth: only the format credit
        return {"score": 0.1, "acc": 0.0, "format": 1.0}
    if error == 0:
        return {"score": 1.0, "acc": 1.0, "format": 1.0}
    return {"score": 0.1 + 0.5 * max(0.0, 1.0 - error / 10), "acc": 0.0, "format": 1.0}


# ---------------------------------------------------------------------------------------------- auto

_GSM8K_MARKERS = ("gsm8k",)
_MATH_MARKERS = ("math", "aime", "amc", "numina", "olympiad", "dapo", "deepscaler")


def rule_for_data_source(data_source: str) -> str:
    """The rule verl's default_compute_score would pick for a data_source, by name."""
    lowered = data_source.lower()
    if any(marker in lowered for marker in _GSM8K_MARKERS):
        return "gsm8k"
    if any(marker in lowered for marker in _MATH_MARKERS):
        return "math"
    raise UnknownReward(
        f"rule 'auto' has no scorer for data_source {data_source!r}; it knows names containing "
        f"{', '.join(_GSM8K_MARKERS)} (-> gsm8k) or {', '.join(_MATH_MARKERS)} (-> math)"
    )


@register_rule("auto", preload=(_MATH_WARMUP,), extras=("acc", "format", "parsed"))
def auto(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float | dict[str, Any]:
    """Dispatch on data_source like verl's default_compute_score, for mixed-dataset batches."""
    rule = RULES[rule_for_data_source(data_source)].fn
    return rule(data_source, solution_str, ground_truth, extra_info)


# -------------------------------------------------------------------------------------------- source

# Inline rules run on the event loop; yield to it at least this often so a big batch does not stall
# the server's other requests.
_YIELD_EVERY_S = 0.02
ISOLATION_MODES = ("auto", "process", "inline")


class RuleSource(RewardSource):
    """Runs a registered rule on each sample: isolated in warm worker processes (a pool per source; its capacity
    is its workers), or inline for rules registered as bounded (``isolate=False``; no limit: a batch runs at once).

    Config keys:
      rule: the registered name.
      isolation: "auto" (the rule's registration decides), "process" or "inline" (on the event loop,
        no budget: only for rules you trust to be cheap on any input).
      timeout_s: running time per sample in a worker; over it the worker is killed and replaced and
        the sample is DeadlineExceeded.
      memory_mb: how much one sample may grow its worker's memory; over it ResourceExhausted (0: no limit).
      workers: worker processes for this source.
      prestart: start the workers when the server starts (else on the first sample; the server's
        built-in rule pipelines start theirs on first use, so unused rules cost nothing).
    A rule that a worker cannot import (defined inside a function or in ``__main__``) runs inline under
    "auto" and is refused under "process".
    """

    kind = SourceKind.RULE

    def __init__(
        self,
        name: str,
        rule: str,
        isolation: str = "auto",
        timeout_s: float = 10.0,
        memory_mb: int = 1024,
        workers: int = 2,
        prestart: bool = True,
    ) -> None:
        where = options.source_where("rule source", name)
        options.text(where, "rule", rule)
        try:
            self._fn = get_rule(rule)
        except UnknownReward as exc:
            raise ValueError(f"{where}: 'rule': {exc}") from exc
        options.one_of(where, "isolation", isolation, ISOLATION_MODES)
        options.positive(where, "timeout_s", timeout_s)
        options.integer(where, "memory_mb", memory_mb, minimum=0, note=" (0: no limit)")
        options.integer(where, "workers", workers, minimum=1)
        self.name = name
        self.target = rule
        registered = RULES[rule]
        self.extra_keys = registered.extras
        self._what = f"rule {rule!r}"
        spec = spec_of(self._fn)
        if isolation == "process" and spec is None:
            raise ValueError(
                f"{where}: rule {rule!r} cannot be imported by a worker process (define it at module level)"
            )
        isolate = isolation == "process" or (isolation == "auto" and registered.isolate and spec is not None)
        self._spec = spec
        self.prestart = bool(prestart)
        self.pool: IsolatedPool | None = None
        if isolate and spec is not None:
            preload = (spec, *registered.preload)
            self.pool = IsolatedPool(
                f"rule-{name}", workers=workers, timeout_s=timeout_s, memory_mb=memory_mb, preload=preload
            )

    @property
    def mode(self) -> str:
        """Where samples run: "process" or "inline"."""
        return "inline" if self.pool is None else "process"

    def _score_one(self, sample: RewardInput) -> RewardOutput | BaseException:
        try:
            value = self._fn(sample.data_source, sample.response_text, sample.ground_truth, sample.extra_info)
        except RewardError as exc:
            return exc  # already says what is wrong (unknown data_source, bad ground_truth)
        except Exception as exc:
            return SourceFailed(f"{self._what} raised {describe_exception(exc)}")
        try:
            return to_output(value, self._what)
        except SourceFailed as exc:
            return exc

    @property
    def capacity(self) -> Capacity:
        """Isolated: per sample, the worker processes (plus a spare for each slow call that stepped aside).
        Inline: no limit, a batch runs on the event loop as it is handed over."""
        if self.pool is not None:
            return Capacity(self.pool.slots, "worker processes", "sample", aside=self.pool.stragglers)
        return Capacity()

    def on_capacity(self, wake: Callable[[], None]) -> None:
        if self.pool is not None:
            self.pool.on_capacity(wake)

    async def score_batch(self, batch: list[RewardInput]) -> BatchResult:
        if self.pool is not None:
            return list(await self.pool.run(self._calls(batch)))
        results: BatchResult = []
        last_yield = time.monotonic()
        for sample in batch:
            results.append(self._score_one(sample))
            if time.monotonic() - last_yield > _YIELD_EVERY_S:
                await asyncio.sleep(0)
                last_yield = time.monotonic()
        return results

    def start_each(self, batch: list[RewardInput]) -> list[asyncio.Future[Outcome]] | None:
        """Isolated: each sample's call queued for a worker now. Inline: None, a batch runs at once."""
        if self.pool is not None:
            return self.pool.submit(self._calls(batch))
        return None

    def _calls(self, batch: list[RewardInput]) -> list[Call]:
        assert self._spec is not None
        args = [(s.data_source, s.response_text, s.ground_truth, s.extra_info) for s in batch]
        return [Call(self._spec, {}, self._what, verl=True, args=a) for a in args]

    async def warmup(self) -> None:
        """Start the worker processes now, so the first batch does not wait for them."""
        if self.pool is not None and self.prestart:
            await self.pool.warmup()

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
