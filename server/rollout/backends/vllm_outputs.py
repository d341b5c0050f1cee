"""vLLM generation requests and outputs: SamplingParams and token prompts from a GenerationRequest, and vLLM's
final RequestOutput back to a GenerationOutput (log-probs, per-token versions, preemptions, stop strings)."""

from __future__ import annotations

import functools
from typing import Any

from rewardmesh.server.rollout.backends.base import GenerationFailed, GenerationOutput, GenerationRequest
from rewardmesh.server.rollout.backends.requests import trim_at_stop


def sampling_params(request: GenerationRequest, n: int = 1) -> Any:
    """vLLM's SamplingParams for `n` samples of one prompt, text detokenized only for stop strings.

    n = 1: the final output only. n > 1: each sample's tokens as deltas, in two outputs (its first token and its
    end, as a stream interval longer than the sample makes it), since only deltas report each sample as it
    finishes: a final-only request with n > 1 answers when its last sample ends. The samples' seeds are vLLM's:
    `seed + k` for sample k.

    One object per distinct setting, shared by every request that has it: building SamplingParams validates
    every field (a measurable share of the front end's CPU at thousands of short samples per second), and vLLM
    copies the params per request before it changes any of them.
    """
    from vllm import SamplingParams

    return _sampling_params(
        SamplingParams,  # part of the key: the objects belong to the vLLM that made them
        n,
        request.max_tokens,
        request.temperature,
        request.top_p,
        request.top_k,
        request.seed,
        tuple(request.stop),
        tuple(request.stop_token_ids),
        request.logprobs,
        request.ignore_eos,
        request.min_tokens,
    )


@functools.lru_cache(maxsize=4096)
def _sampling_params(
    params_cls: Any,
    n: int,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: tuple[str, ...],
    stop_token_ids: tuple[int, ...],
    logprobs: bool,
    ignore_eos: bool,
    min_tokens: int,
) -> Any:
    from vllm.sampling_params import RequestOutputKind

    options: dict[str, Any] = {}
    fields = _fields(params_cls)
    if n > 1 and "stream_interval" in fields:  # per request where vLLM has it (0.32); else the engine's default
        options["stream_interval"] = max_tokens
    if "skip_clone" in fields:
        # Each request's copy may be shallow: what vLLM changes on it per request is assigned, not mutated,
        # except the set of stop ids, to which it adds the same model's eos ids each time.
        options["skip_clone"] = True
    return params_cls(
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k if top_k > 0 else -1,  # -1: off, in every vLLM version
        seed=seed,
        stop=list(stop) or None,
        stop_token_ids=list(stop_token_ids) or None,
        detokenize=bool(stop),  # stop strings are matched on text; otherwise skip the work
        logprobs=0 if logprobs else None,  # 0: only the sampled token's
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        output_kind=RequestOutputKind.FINAL_ONLY if n == 1 else RequestOutputKind.DELTA,
        **options,
    )


def _fields(cls: type) -> set[str]:
    """Constructor fields of a msgspec struct or dataclass (SamplingParams is one or the other by release)."""
    names = getattr(cls, "__struct_fields__", None)
    if names is None:
        names = getattr(cls, "__dataclass_fields__", {})
    return set(names)


def token_prompt(prompt_ids: list[int]) -> Any:
    """A token prompt: ``vllm.inputs.tokens_input()`` where vLLM has it (TokensPrompt is deprecated)."""
    try:
        from vllm.inputs import tokens_input
    except ImportError:
        from vllm import TokensPrompt

        return TokensPrompt(prompt_token_ids=prompt_ids)
    return tokens_input(prompt_ids)


def to_output(
    tokenizer: Any, request: GenerationRequest, completion: Any, metrics: Any, version: int, same_weights: bool = False
) -> GenerationOutput:
    """One sample's finished CompletionOutput (all its tokens) and its request's metrics -> GenerationOutput;
    finish_reason "error" raises GenerationFailed.

    ``same_weights``: no weight update began while the request ran, so every token is ``version``'s
    even where vLLM reports no per-token versions.
    """
    reason = completion.finish_reason or "abort"
    if reason == "error":
        raise GenerationFailed(
            f"vLLM failed this request (finish_reason 'error', stop_reason {completion.stop_reason!r})"
        )
    if reason not in ("stop", "length", "abort"):
        reason = "stop"  # e.g. "repetition": the engine ended the sequence on purpose
    token_ids = completion.token_ids
    if token_ids and type(token_ids[0]) is not int:  # numpy ints from some releases' paths
        token_ids = [int(t) for t in token_ids]
    else:
        token_ids = list(token_ids)
    logprobs = _token_logprobs(completion, token_ids) if request.logprobs else None
    versions = _token_versions(completion, len(token_ids))
    if versions is None and same_weights:
        versions = [version] * len(token_ids)
    if request.stop and isinstance(completion.stop_reason, str):
        # vLLM cuts the stop string from the text but not always from token_ids; drop whole tokens the
        # same way HFBackend does, so both backends return the same ids.
        kept = trim_at_stop(tokenizer, token_ids, request.stop)
        if kept is not None:
            token_ids = kept
    n = len(token_ids)
    preempted = getattr(metrics, "num_preemptions", None)
    return GenerationOutput(
        token_ids=token_ids,
        finish_reason=reason,
        num_preempted=int(preempted) if isinstance(preempted, int) else -1,
        policy_version=min(versions[:n], default=version) if versions else version,
        logprobs=logprobs[:n] if logprobs is not None else None,
        token_versions=versions[:n] if versions is not None else None,
    )


class SampleDeltas:
    """The samples of one n > 1 request, put together from vLLM's deltas: each sample's tokens and log-probs
    arrive in pieces (several samples' pieces may share one output), its end with its finish reason."""

    def __init__(self) -> None:
        self._tokens: dict[int, list[int]] = {}
        self._logprobs: dict[int, list[Any]] = {}

    def add(self, completion: Any) -> Any | None:
        """Take one delta; the sample's whole CompletionOutput once it finished (else None)."""
        k = completion.index
        tokens = self._tokens.setdefault(k, [])
        tokens.extend(completion.token_ids)
        if completion.logprobs is not None:
            self._logprobs.setdefault(k, []).extend(completion.logprobs)
        if completion.finish_reason is None:
            return None
        completion.token_ids = self._tokens.pop(k)
        completion.logprobs = self._logprobs.pop(k, None)
        return completion


def _token_logprobs(completion: Any, token_ids: list[int]) -> list[float] | None:
    """The sampled token's log-prob at each position, from vLLM's per-position {token id: Logprob} maps."""
    positions = getattr(completion, "logprobs", None)
    if positions is None or len(positions) < len(token_ids):
        return None
    out: list[float] = []
    for i, token in enumerate(token_ids):
        entry = positions[i].get(token) if positions[i] is not None else None
        if entry is None:
            return None
        out.append(float(getattr(entry, "logprob", entry)))
    return out


def _token_versions(completion: Any, n: int) -> list[int] | None:
    """Per-token versions from vLLM 0.33's ``weight_versions`` spans (labels this backend set: int strings)."""
    spans = getattr(completion, "weight_versions", None)
    if not spans:
        return None
    versions: list[int] = [-1] * n
    for span in spans:
        try:
            label = int(span.version)
        except (TypeError, ValueError):
            return None  # labelled by someone else: unknown
        start, end = max(0, span.start), min(n, span.end)
        if start < end:
            versions[start:end] = [label] * (end - start)
    return None if -1 in versions else versions
