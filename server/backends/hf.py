"""A transformers generation backend with its own continuously batched decode loop.

It exists so the whole mesh (rollouts, streaming rewards, weight sync) runs anywhere, CPU included, without
vLLM. Rows join and leave one running batch at step boundaries: a finished or cancelled row leaves (its KV
cache slot is freed), and a request that arrives while others decode is prefilled in the same forward pass as
the running rows' next token and joins, so it never waits for the longest row of a batch it missed. The KV
cache is preallocated per row (:class:`_SlotCache`), so joining and leaving copy no cache. Models whose cache
is not plain full attention (sliding windows, linear attention) or whose attention takes no 4-D mask run on
transformers' own cache instead, where new rows wait for an empty batch. Admission is bounded by ``max_batch_size``
rows and ``max_batch_tokens`` (each row reserves prompt + max_tokens). Each request's future resolves the
moment its own row finishes.

Threading: every tensor operation (load, prefill, decode steps, weight copies) runs on one dedicated worker
thread, whose decode loop steps on its own: new requests and weight swaps reach it through a queue it drains
at each step boundary, and finished rows go back to the event loop in one call per step, so a busy CPU never
charges a thread hand-off per token. The event loop owns the futures; the worker owns the batch. A weight swap
lands between two steps, never inside one; rows decoding across a swap continue on the new weights (their
KV cache from the old ones is kept, as vLLM's ``pause_generation(mode="keep")`` does), and each token records
the version that produced it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import queue
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from rewardmesh.common.weights import validate_weights
from rewardmesh.reward_engine.devices import resolve_device, resolve_dtype
from rewardmesh.reward_engine.errors import InvalidInput, Unavailable
from rewardmesh.server.backends.base import GenerationOutput, GenerationRequest

logger = logging.getLogger(__name__)


def eos_token_ids(tokenizer: Any, generation_config: Any = None) -> set[int]:
    """The tokenizer's eos plus the generation config's (chat models often end turns on a second token)."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, list | tuple):
        ids.update(int(i) for i in gen_eos)
    return ids


def trim_at_stop(tokenizer: Any, token_ids: list[int], stops: list[str] | tuple[str, ...]) -> list[int] | None:
    """Cut ``token_ids`` before the earliest stop string in their text, or None when there is none.

    Only whole tokens are kept: a token whose text runs into the stop string is dropped with it, so the
    returned ids decode to text that ends at or before the match and never contains it.
    """
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    hits = [pos for pos in (text.find(s) for s in stops if s) if pos >= 0]
    if not hits:
        return None
    cut = min(hits)
    keep = len(token_ids)
    while keep > 0:
        prefix = tokenizer.decode(token_ids[:keep], skip_special_tokens=True)
        if len(prefix) <= cut and text.startswith(prefix):
            break
        keep -= 1
    return list(token_ids[:keep])


def validate_request(request: GenerationRequest, *, max_model_len: int, vocab_size: int | None) -> None:
    """Reject what would otherwise fail inside a shared batch (and take its neighbours down with it)."""
    n = len(request.prompt_ids)
    if n == 0:
        raise InvalidInput("prompt_ids is empty: the model needs at least one prompt token")
    if request.max_tokens < 1:
        raise InvalidInput(f"max_tokens must be at least 1, got {request.max_tokens}")
    if n + request.max_tokens > max_model_len:
        raise InvalidInput(
            f"prompt length {n} + max_tokens {request.max_tokens} = {n + request.max_tokens} exceeds "
            f"max_model_len {max_model_len}; lower max_tokens to at most {max(max_model_len - n, 0)}"
        )
    if request.temperature < 0:
        raise InvalidInput(f"temperature must be >= 0, got {request.temperature}")
    if not 0 < request.top_p <= 1:
        raise InvalidInput(f"top_p must be in (0, 1], got {request.top_p}")
    if request.top_k < 0:
        raise InvalidInput(f"top_k must be >= 0 (0: off), got {request.top_k}")
    if vocab_size is not None:
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidInput(f"prompt_ids hold ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


# ------------------------------------------------------------------------------------------------ batching


def default_num_threads() -> int:
    """Half the CPU cores this process may use, 1 to 8.

    Torch's default (every core) spins OpenMP threads against whatever else runs on the machine: on a busy
    2-core box a small model's decode step then slows by 10x or more. A small model gains little from more
    threads; a large one on a big CPU still gets several.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2))


@dataclass(eq=False)
class _Pending:
    request: GenerationRequest
    future: asyncio.Future[GenerationOutput]
    arrival_step: int  # steps completed when the request arrived


@dataclass(eq=False)
class _WeightSwap:
    """A weight update handed to the decode loop, applied between two steps."""

    tensors: dict[str, torch.Tensor]
    version: int
    adopt: bool = False  # the caller hands the tensors over: swap storages instead of copying (see adopt_weights)
    done: concurrent.futures.Future[bool] = field(default_factory=concurrent.futures.Future)  # True: adopted


@dataclass(eq=False)
class _Row:
    slot: _Pending
    generator: torch.Generator
    stop_ids: frozenset[int]
    stops: tuple[str, ...]
    tail_tokens: int  # how many trailing tokens to decode to be sure a new stop-string match is seen
    reserve: int  # prompt + max_tokens: what this row counts against max_batch_tokens
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # when the request asked for them
    versions: list[int] = field(default_factory=list)  # weights version of each token
    finish_reason: str | None = None
    first_step: int = -1  # the step that produced its first token
    start: int = 0  # slot cache: the column of its first token
    uniforms: list[float] = field(default_factory=list)  # its generator's next draws, drawn a few at a time


@dataclass(eq=False)
class _Batch:
    """Worker-thread state of the running batch; the loop only reads ``rows`` and their results."""

    rows: list[_Row] = field(default_factory=list)  # in tensor order
    cache: Any = None
    mask: torch.Tensor | None = None  # [rows, past]: 0 on left padding
    next_pos: torch.Tensor | None = None  # [rows]: position id of the next input token
    last: torch.Tensor | None = None  # [rows]: last sampled token (not yet in the cache)
    temps: torch.Tensor | None = None
    top_ks: torch.Tensor | None = None
    top_ps: torch.Tensor | None = None


# ------------------------------------------------------------------------------------- the slot KV cache


class _SlotCache(Cache):
    """The running batch's KV cache in preallocated buffers, one slot (row) per running request.

    Why: transformers' DynamicCache concatenates every layer's whole cache on every step, and rows joining or
    leaving a padded batch cost a copy of the whole cache each. Here a step writes only its new columns in place,
    a joining row writes its prompt into a free slot, and a leaving row is replaced by the batch's last row (one
    row copied), so a step costs the same whether or not rows come and go.

    Layout: ``[rows, kv_heads, columns, head_dim]`` per layer. Every row's tokens are contiguous columns
    ``[start, w)`` ending at the shared write column ``w``: a decode pass writes each row's token at column
    ``w``; a joining row's prompt (its own pass in the same step) goes right-aligned to end at ``w`` too.
    Attention reads columns ``[lo, w]`` (``lo``: the earliest live start) under a 4-D mask the backend builds,
    so nothing before a row's start or after a prompt token's own position is seen. Columns left of ``lo`` are
    dead; they are reclaimed by moving the live window to the left when the buffer's end is reached (amortized:
    at most every half capacity).
    """

    def __init__(self, num_layers: int) -> None:
        from transformers.cache_utils import DynamicLayer

        super().__init__(layers=[DynamicLayer() for _ in range(num_layers)])
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.row_cap = 0
        self.col_cap = 0
        self.lo = 0  # first live column
        self.w = 0  # next column to write (exclusive end of every row's tokens)
        # The plan of the forward pass in flight, set by the backend before it calls the model:
        self.first = 0  # the pass covers slots first .. first+n-1, in tensor order
        self.n = 0
        self.read_lo = 0  # first column the attention reads
        self.prompts: list[tuple[int, int]] = []  # (row of the pass, prompt length) of rows that join in it
        self.grows = 0  # buffers reallocated larger (observability; the tests check both kinds of relayout)
        self.shifts = 0  # live columns moved within the buffers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.w - self.lo

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k[layer_idx], self.v[layer_idx]
        if k is None or v is None:  # first pass: the model says what a layer's K/V look like
            k = key_states.new_zeros((self.row_cap, key_states.shape[1], self.col_cap, key_states.shape[-1]))
            v = value_states.new_zeros((self.row_cap, value_states.shape[1], self.col_cap, value_states.shape[-1]))
            self.k[layer_idx], self.v[layer_idx] = k, v
        first, end, w = self.first, self.first + self.n, self.w
        k[first:end, :, w] = key_states[:, :, -1]  # every row's newest token (a running row's only one)
        v[first:end, :, w] = value_states[:, :, -1]
        for r, length in self.prompts:  # the rest of a new row's prompt, right before it
            k[first + r, :, w + 1 - length : w] = key_states[r, :, -length:-1]
            v[first + r, :, w + 1 - length : w] = value_states[r, :, -length:-1]
        return k[first:end, :, self.read_lo : w + 1], v[first:end, :, self.read_lo : w + 1]

    def reserve(self, rows: int, longest_prompt: int) -> int:
        """Make room for a pass over ``rows`` rows whose longest new prompt has ``longest_prompt`` tokens.

        Returns how far the live columns moved (add it to every row's start).
        """
        span = self.w - self.lo
        grow_rows = rows > self.row_cap
        if not grow_rows and self.w + 1 <= self.col_cap and longest_prompt <= self.w + 1:
            return 0
        # Place the live window so that it ends at new_w >= longest_prompt - 1, with room for the write.
        new_w = max(span, longest_prompt - 1)
        col_cap = self.col_cap
        if 2 * (new_w + 1) > col_cap:  # less than half would be free: double (amortized O(1) per step)
            col_cap = max(64, 2 * (new_w + 1), 2 * col_cap)
        row_cap = max(self.row_cap, rows) if not grow_rows else max(rows, 2 * self.row_cap)
        shift = new_w - self.w
        old_rows = min(self.row_cap, rows)
        for store in (self.k, self.v):
            for i, t in enumerate(store):
                if t is None:
                    continue
                live = t[:old_rows, :, self.lo : self.w]
                if row_cap != self.row_cap or col_cap != self.col_cap:
                    fresh = t.new_zeros((row_cap, t.shape[1], col_cap, t.shape[-1]))
                    fresh[:old_rows, :, new_w - span : new_w] = live
                    store[i] = fresh
                    self.grows += 1
                elif shift:
                    t[:old_rows, :, new_w - span : new_w] = live.clone()  # the windows may overlap
                    self.shifts += 1
        self.row_cap, self.col_cap = row_cap, col_cap
        self.lo, self.w = new_w - span, new_w
        return shift

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the live columns of rows ``src`` into rows ``dst`` (filling the slots of rows that left)."""
        for store in (self.k, self.v):
            for t in store:
                if t is not None:
                    t[dst, :, self.lo : self.w] = t[src, :, self.lo : self.w]


@dataclass(eq=False)
class _SlotBatch:
    """Worker-thread state of the running batch on a :class:`_SlotCache`: row ``i`` lives in slot ``i``."""

    cache: _SlotCache
    rows: list[_Row] = field(default_factory=list)
    # Per slot, sized to the cache's row capacity; entries past len(rows) are stale.
    next_pos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    last: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    temps: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    top_ks: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    top_ps: torch.Tensor = field(default_factory=lambda: torch.zeros(0))

    def grow(self, rows: int) -> None:
        for name in ("next_pos", "last", "temps", "top_ks", "top_ps"):
            t = getattr(self, name)
            if t.shape[0] < rows:
                fresh = t.new_zeros(max(rows, 2 * t.shape[0]))
                fresh[: t.shape[0]] = t
                setattr(self, name, fresh)


def sample(
    logits: torch.Tensor,
    temps: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Per-row temperature / top-k / top-p sampling (see :func:`sample_with_logprobs`)."""
    return sample_with_logprobs(logits, temps, top_ks, top_ps, uniforms)[0]


def sample_with_logprobs(
    logits: torch.Tensor,
    temps: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    want_logprobs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row temperature / top-k / top-p sampling by inverse CDF over token ids, and on request the log-prob
    of each drawn token under the distribution it was drawn from.

    The CDF runs in token-id order (not sorted order), so the tiny logit differences between a row decoded
    alone and the same row decoded in a padded batch only move a boundary a hair: with the same uniform draw
    the same token comes out, which is what makes seeds reproducible across batch compositions.

    Log-probs follow vLLM's ``processed_logprobs``: log-softmax of the logits divided by the temperature (1
    for greedy rows) with the tokens top-k/top-p removed masked out, so they sum to one over what could be
    drawn and match what a learner computes from the same logits.
    """
    logits = logits.float()
    greedy = temps <= 1e-5
    picked = logits.argmax(-1)
    if bool(greedy.all()) and not want_logprobs:
        return picked, None
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps.clamp(min=1e-5)).unsqueeze(-1)
    probs = scaled.softmax(-1)
    vocab = probs.shape[-1]
    drop: torch.Tensor | None = None
    if bool((top_ks > 0).any()) or bool((top_ps < 1).any()):
        # Filters only ever zero entries of `probs`, so a row without filters keeps bit-identical
        # probabilities whether or not its neighbours in the batch use them.
        sorted_probs, order = probs.sort(-1, descending=True)
        ranks = torch.arange(vocab, device=probs.device).unsqueeze(0)
        k = torch.where(top_ks > 0, top_ks, torch.full_like(top_ks, vocab)).unsqueeze(-1)
        outside_k = ranks >= k
        kept = sorted_probs.masked_fill(outside_k, 0.0)
        kept = kept / kept.sum(-1, keepdim=True)  # top-p applies to what top-k leaves
        above = kept.cumsum(-1) - kept  # mass of the better-ranked tokens
        p = top_ps.unsqueeze(-1)
        drop_sorted = outside_k | ((above > p) & (p < 1))
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    cdf = probs.double().cumsum(-1)
    target = uniforms.to(cdf.device, torch.float64) * cdf[:, -1]
    drawn = torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1).clamp(max=vocab - 1)
    tokens = torch.where(greedy, picked, drawn)
    if not want_logprobs:
        return tokens, None
    if drop is not None:
        scaled = scaled.masked_fill(drop, float("-inf"))
    logprobs = scaled.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs


# ------------------------------------------------------------------------------------------------- backend


class HFBackend:
    """transformers causal LM behind the Backend protocol (see base.py)."""

    name = "hf"

    def __init__(
        self,
        model: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_batch_size: int = 32,
        max_batch_tokens: int | None = None,
        batch_wait_ms: float = 5.0,
        max_model_len: int | None = None,
        num_threads: int | None = None,
    ) -> None:
        """``max_batch_tokens`` bounds the running batch's KV cache: the sum of prompt + max_tokens over its
        rows (default ``max_batch_size * max_model_len``, i.e. only the row count binds); a request larger
        than the budget still runs, alone. ``batch_wait_ms`` is how long an idle backend waits for company
        before its first prefill; once a batch runs, newcomers join at the next step without waiting.
        ``num_threads`` sets torch's CPU threads for the decode thread only (OpenMP settings are per thread;
        default :func:`default_num_threads`, 0 keeps torch's own default of every core).
        """
        from transformers import AutoConfig, AutoTokenizer

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {batch_wait_ms}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be at least 1, got {max_batch_tokens}")
        if num_threads is not None and num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0: torch's default), got {num_threads}")
        self.model = str(model)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_batch_size = max_batch_size
        self.num_threads = default_num_threads() if num_threads is None else num_threads
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.config = AutoConfig.from_pretrained(self.model, local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model, local_files_only=True)
        # The worker thread decodes with its own copy: a fast tokenizer shared across threads can raise
        # "Already borrowed" when the servicer encodes while the decode loop checks stop strings.
        self._decode_tokenizer = AutoTokenizer.from_pretrained(self.model, local_files_only=True)
        limit = getattr(self.config, "max_position_embeddings", None)
        if max_model_len is None:
            if limit is None:
                raise ValueError(f"{self.model}: config has no max_position_embeddings; pass max_model_len")
            max_model_len = int(limit)
        elif limit is not None and max_model_len > limit:
            logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d", max_model_len, limit)
        self.max_model_len = int(max_model_len)
        self.max_batch_tokens = max_batch_tokens or max_batch_size * self.max_model_len
        self.vocab_size: int | None = getattr(self.config, "vocab_size", None)
        self.policy_version = 0

        self._lm: Any = None
        self._state: dict[str, torch.Tensor] = {}
        self._eos: frozenset[int] = frozenset()
        self._pad_id = 0
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: asyncio.Future[None] | None = None  # the decode loop, running on the worker thread
        self._start_lock = asyncio.Lock()
        self._inbox: queue.SimpleQueue[_Pending | _WeightSwap | None] = queue.SimpleQueue()  # None: stop
        self._pending: collections.deque[_Pending] = collections.deque()  # worker-owned: not yet admitted
        self._outstanding: set[asyncio.Future[GenerationOutput]] = set()  # loop-owned: every unanswered call
        self._batch: _Batch | _SlotBatch = _Batch()
        self._use_slots = False  # the slot cache path (plain full-attention models under sdpa or eager)
        self._bool_mask = True  # sdpa takes a boolean mask; eager an additive one
        self._closed = False
        # Observability (and what the tests use to see continuous batching happen, by counting steps).
        self.steps = 0  # forward steps completed (each: one decode of the running rows and/or one prefill)
        self.num_batches = 0  # admissions: groups of requests prefilled together
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=1024)  # rows per admission
        self.running_sizes: collections.deque[int] = collections.deque(maxlen=4096)  # rows decoded per step
        self.admission_waits: collections.deque[int] = collections.deque(maxlen=1024)  # steps to first token

    # ------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        async with self._start_lock:
            if self._closed:
                raise RuntimeError("HFBackend is closed")
            if self._worker is not None:
                return
            self._loop = asyncio.get_running_loop()
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-backend")
            t0 = time.perf_counter()
            try:
                await self._loop.run_in_executor(self._executor, self._load)
            except BaseException:
                self._executor.shutdown(wait=False)
                self._executor = None
                raise
            logger.info(
                "hf backend: loaded %s on %s (%s, %d decode thread(s)) in %.2f s",
                self.model,
                self.device,
                self.dtype,
                self.num_threads or torch.get_num_threads(),
                time.perf_counter() - t0,
            )
            # The decode loop occupies the (single) worker thread from now on: it steps without a hand-off to
            # the event loop per step, which on a busy CPU costs a scheduler time slice each way.
            self._worker = self._loop.run_in_executor(self._executor, self._decode_loop)
            self._worker.add_done_callback(self._worker_done)

    def _worker_done(self, worker: asyncio.Future[None]) -> None:
        """A decode loop that died of a bug must not leave callers awaiting forever."""
        if worker.cancelled() or worker.exception() is None:
            return
        logger.error("hf backend: decode loop failed", exc_info=worker.exception())
        self._closed = True
        self._fail_outstanding(RuntimeError(f"HFBackend decode loop failed: {worker.exception()!r}"))

    def _fail_outstanding(self, error: BaseException) -> None:
        for future in list(self._outstanding):
            if not future.done():
                future.set_exception(error)

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM

        if self.num_threads:
            torch.set_num_threads(self.num_threads)  # runs on the decode thread: affects only that thread
        lm: Any = AutoModelForCausalLM.from_pretrained(self.model, local_files_only=True, dtype=self.dtype)
        lm.to(self.device)
        lm.eval()
        lm.requires_grad_(False)
        self._lm = lm
        # The parameters and buffers themselves (not detached copies): adopt_weights re-points their storage.
        self._state = dict(lm.state_dict(keep_vars=True))
        self._eos = frozenset(eos_token_ids(self.tokenizer, getattr(lm, "generation_config", None)))
        pad = self.tokenizer.pad_token_id
        self._pad_id = int(pad) if pad is not None else (min(self._eos) if self._eos else 0)
        vocab = lm.get_input_embeddings().weight.shape[0]
        self.vocab_size = int(vocab) if self.vocab_size is None else min(int(self.vocab_size), int(vocab))
        attention = getattr(lm.config, "_attn_implementation", None)
        layers = _cache_layers(lm.config)
        self._use_slots = attention in ("sdpa", "eager") and bool(layers) and all(_joinable(x) for x in layers)
        self._bool_mask = attention == "sdpa"
        self._batch = self._new_batch()

    def _new_batch(self) -> _Batch | _SlotBatch:
        """An empty running batch: on the slot cache where the model allows it (see :class:`_SlotCache`)."""
        if not self._use_slots:
            return _Batch()
        d = self.device

        def empty(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(0, dtype=dtype, device=d)

        return _SlotBatch(
            cache=_SlotCache(len(_cache_layers(self._lm.config))),
            next_pos=empty(torch.long),
            last=empty(torch.long),
            temps=empty(torch.float32),
            top_ks=empty(torch.long),
            top_ps=empty(torch.float32),
        )

    async def close(self) -> None:
        """Stop the decode loop and fail every request still queued or decoding."""
        self._closed = True
        worker, self._worker = self._worker, None
        if worker is not None:
            self._inbox.put(None)
            with contextlib.suppress(Exception):
                await asyncio.shield(worker)
        self._fail_outstanding(RuntimeError("HFBackend closed"))
        self._batch = _Batch()
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, True)

    # --------------------------------------------------------------------------------------------- serving

    @property
    def running(self) -> int:
        """Requests queued plus rows still decoding; cancelled and delivered ones no longer count."""
        return sum(1 for future in self._outstanding if not future.done())

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        if self._closed:
            raise RuntimeError("HFBackend is closed")
        validate_request(request, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        if self._worker is None:
            await self.start()
        future: asyncio.Future[GenerationOutput] = asyncio.get_running_loop().create_future()
        self._outstanding.add(future)
        self._inbox.put(_Pending(request, future, self.steps))
        try:
            return await future
        finally:
            self._outstanding.discard(future)
            # Cancelling the awaiting task cancels `future` too (the decode loop drops its row at the next
            # step); this also covers being interrupted otherwise.
            if not future.done():
                future.cancel()

    # ----------------------------------------------------------------------- worker thread: the decode loop

    def _decode_loop(self) -> None:
        """Step until told to stop: take what arrived, drop what left, admit what fits, decode and prefill.

        Runs on the worker thread. Results go back to the event loop in one call per step.
        """
        assert self._loop is not None
        while True:
            batch = self._batch
            running = [row for row in batch.rows if row.finish_reason is None and not row.slot.future.done()]
            idle = not running and not self._pending
            if not self._drain_inbox(block=idle):
                return
            if idle and self.batch_wait_s > 0 and len(self._pending) < self.max_batch_size:
                time.sleep(self.batch_wait_s)  # an idle backend waits a moment for company
                if not self._drain_inbox(block=False):
                    return
            admit = self._admit(running)
            if not running and not admit:
                continue
            dropped = {row for row in batch.rows if row.finish_reason is None and row.slot.future.done()}
            if admit:
                self.num_batches += 1
                self.batch_sizes.append(len(admit))
            self.running_sizes.append(len(running) + len(admit))
            version = self.policy_version
            try:
                finished = self._step(batch, admit, dropped, version, self.steps + 1)
            except Exception as exc:
                logger.exception("hf backend: a step over %d row(s) failed", len(running) + len(admit))
                failed = [row for row in [*batch.rows, *admit] if row.finish_reason is None]
                self._loop.call_soon_threadsafe(self._fail_rows, failed, exc)
                self._batch = self._new_batch()
                continue
            self.steps += 1
            for row in admit:
                self.admission_waits.append(row.first_step - row.slot.arrival_step)
            if finished:
                outputs = [(row.slot.future, self._output(row, version)) for row in finished]
                self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _drain_inbox(self, *, block: bool) -> bool:
        """Move new requests to the pending queue and apply weight swaps; False when told to stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is None:
                return False
            if isinstance(item, _WeightSwap):
                self._swap_weights(item)
            else:
                self._pending.append(item)

    def _swap_weights(self, swap: _WeightSwap) -> None:
        """Between two steps: copy (or adopt) every tensor, then label the tokens that follow with the new version."""
        try:
            with torch.no_grad():
                adopted = swap.adopt and self.adoptable(swap.tensors)
                for name, tensor in swap.tensors.items():
                    if adopted:
                        self._state[name].data = tensor  # O(1): the parameter now lives in the caller's buffer
                    else:
                        self._state[name].copy_(tensor)
            self.policy_version = swap.version
        except BaseException as exc:
            swap.done.set_exception(exc)
        else:
            swap.done.set_result(adopted)

    def adoptable(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Only a whole update of the same dtypes and device is adopted: then no parameter keeps pointing into an
        older buffer, so the caller may reuse the buffers it handed over before (double buffering)."""
        if tensors.keys() != self._state.keys():
            return False
        return all(
            t.dtype == self._state[n].dtype and t.device == self._state[n].device and t.shape == self._state[n].shape
            for n, t in tensors.items()
        )

    @staticmethod
    def _output(row: _Row, version: int) -> GenerationOutput:
        assert row.finish_reason is not None
        return GenerationOutput(
            token_ids=list(row.tokens),
            finish_reason=row.finish_reason,
            num_preempted=0,
            policy_version=min(row.versions, default=version),
            logprobs=row.logprobs,
            token_versions=list(row.versions),
        )

    @staticmethod
    def _deliver(outputs: list[tuple[asyncio.Future[GenerationOutput], GenerationOutput]]) -> None:
        for future, output in outputs:
            if not future.done():
                future.set_result(output)

    @staticmethod
    def _fail_rows(rows: list[_Row], error: BaseException) -> None:
        for row in rows:
            if not row.slot.future.done():
                row.slot.future.set_exception(error)

    def _admit(self, running: list[_Row]) -> list[_Row]:
        """Queued requests, first come first served, while rows and the token budget allow.

        A request that does not fit waits at the head of the queue (nothing overtakes it, so it cannot
        starve); one larger than the whole budget runs alone.
        """
        if running and not self._use_slots:
            return []  # the general path admits into an empty batch only
        reserved = sum(row.reserve for row in running)
        rows: list[_Row] = []
        while self._pending and len(running) + len(rows) < self.max_batch_size:
            slot = self._pending[0]
            if slot.future.done():
                self._pending.popleft()
                continue
            need = len(slot.request.prompt_ids) + slot.request.max_tokens
            if (running or rows) and reserved + need > self.max_batch_tokens:
                break
            self._pending.popleft()
            rows.append(self._new_row(slot))
            reserved += need
        return rows

    def _new_row(self, slot: _Pending) -> _Row:
        request = slot.request
        generator = torch.Generator()
        generator.manual_seed(request.seed if request.seed is not None else secrets.randbits(63))
        stops = tuple(s for s in request.stop if s)
        return _Row(
            slot=slot,
            generator=generator,
            stop_ids=self._eos | frozenset(request.stop_token_ids),
            stops=stops,
            tail_tokens=max((len(s) for s in stops), default=0) + 8,
            reserve=len(request.prompt_ids) + request.max_tokens,
            logprobs=[] if request.logprobs else None,
        )

    # ------------------------------------------------------------------------------ worker thread: decoding

    def _step(
        self, batch: _Batch | _SlotBatch, admit: list[_Row], dropped: set[_Row], version: int, step: int
    ) -> list[_Row]:
        """One step: drop rows that finished or were cancelled, decode one token for every running row, then
        prefill the admitted rows (their first token) and merge them into the batch.

        Returns the rows that finished in this step.
        """
        if isinstance(batch, _SlotBatch):
            return self._slot_step(batch, admit, dropped, version, step)
        with torch.inference_mode():
            keep = [i for i, row in enumerate(batch.rows) if row.finish_reason is None and row not in dropped]
            if len(keep) < len(batch.rows):
                self._compact(batch, keep)
            finished: list[_Row] = []
            if batch.rows:
                logits = self._decode(batch)
                batch.last = self._sample_rows(batch, logits, version, step, finished)
            if admit:  # only into an empty batch on this path (see _admit)
                joining, logits = self._prefill(admit)
                joining.last = self._sample_rows(joining, logits, version, step, finished)
                self._batch = batch = joining
            return finished

    # ------------------------------------------------------------------- worker thread: the slot-cache path

    def _slot_step(
        self, batch: _SlotBatch, admit: list[_Row], dropped: set[_Row], version: int, step: int
    ) -> list[_Row]:
        """One step: the running rows decode one token each, and the admitted rows' prompts are prefilled.

        Two forward passes when rows join, so a running row is never padded to a new prompt's width (with real
        prompts that padding would cost a running row hundreds of tokens of compute per join). Both write their
        newest token at the same cache column, after which the new rows decode with the others.
        """
        with torch.inference_mode():
            keep = [i for i, row in enumerate(batch.rows) if row.finish_reason is None and row not in dropped]
            if len(keep) < len(batch.rows):
                self._slot_remove(batch, keep)
            old, new = len(batch.rows), len(admit)
            n = old + new
            if n == 0:
                return []
            cache = batch.cache
            lengths = [len(row.slot.request.prompt_ids) for row in admit]
            shift = cache.reserve(n, max(lengths, default=1))
            if shift:
                for row in batch.rows:
                    row.start += shift
            batch.grow(cache.row_cap)
            w = cache.w
            for row, length in zip(admit, lengths, strict=True):
                row.start = w + 1 - length
            device = batch.last.device
            logits = []
            if old:
                logits.append(self._slot_forward(batch, 0, batch.rows, [1] * old))
            if admit:
                logits.append(self._slot_forward(batch, old, admit, lengths))
                requests = [row.slot.request for row in admit]
                batch.next_pos[old:n] = torch.tensor(lengths, device=device)
                batch.temps[old:n] = torch.tensor([r.temperature for r in requests], device=device)
                batch.top_ks[old:n] = torch.tensor([r.top_k for r in requests], device=device)
                batch.top_ps[old:n] = torch.tensor([r.top_p for r in requests], device=device)
            cache.w = w + 1
            batch.rows = [*batch.rows, *admit]
            cache.lo = min(row.start for row in batch.rows)
            batch.next_pos[:old] += 1
            finished: list[_Row] = []
            tokens = self._sample_slots(
                batch, torch.cat(logits) if len(logits) > 1 else logits[0], version, step, finished
            )
            batch.last[:n] = tokens
            return finished

    def _slot_forward(self, batch: _SlotBatch, first: int, rows: list[_Row], lengths: list[int]) -> torch.Tensor:
        """One forward pass over slots ``first ..`` (``lengths``: new tokens per row, 1 for a running row); the
        last position's logits. Each row's newest token lands at the cache's write column ``w``."""
        cache = batch.cache
        n, w, width = len(rows), cache.w, max(lengths)
        device = batch.last.device
        starts = [row.start for row in rows]
        read_lo = min(starts)
        cols = torch.arange(read_lo, w + 1, device=device)
        start_t = torch.tensor(starts, device=device)
        if width == 1:  # decoding: one token per row
            ids = batch.last[first : first + n].unsqueeze(-1)
            positions = batch.next_pos[first : first + n].unsqueeze(-1)
            allowed = (cols.unsqueeze(0) >= start_t.unsqueeze(-1))[:, None, None, :]
        else:  # prompts, right-aligned to the longest
            ids_cpu, real = self._right_aligned([row.slot.request.prompt_ids for row in rows])
            ids, positions = ids_cpu.to(device), _positions(real).to(device)
            # Query q of a row with L tokens sees its columns from its start up to its own position,
            # w + 1 - L + (q - width + L); a padding query sees what the row's first real one does.
            news = torch.tensor(lengths, device=device)
            q = torch.arange(width, device=device)
            ends = (w + 1 - news).unsqueeze(-1) + (q.unsqueeze(0) - width + news.unsqueeze(-1)).clamp(min=0)
            c = cols.view(1, 1, -1)
            allowed = ((c >= start_t.view(-1, 1, 1)) & (c <= ends.unsqueeze(-1))).unsqueeze(1)
        if self._bool_mask:
            mask = allowed
        else:  # eager attention adds its mask to the scores
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=device)
            mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        cache.first, cache.n, cache.read_lo = first, n, read_lo
        cache.prompts = [(r, length) for r, length in enumerate(lengths) if length > 1]
        try:
            return self._forward(ids, mask, positions, cache)[0]
        finally:
            cache.prompts = []

    def _right_aligned(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts left-padded to the longest (CPU): their ids and the mask of real tokens."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, prompt in enumerate(prompts):
            ids[r, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[r, width - len(prompt) :] = 1
        return ids, mask

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> tuple[torch.Tensor, Any]:
        """The model over ``ids`` with its KV cache: the last position's logits and the cache it returns."""
        out = self._lm(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits, out.past_key_values

    def _slot_remove(self, batch: _SlotBatch, keep: list[int]) -> None:
        """Keep rows ``keep``: each row that leaves a slot below the new row count takes a kept row from the end."""
        n, kept = len(batch.rows), len(keep)
        kept_set = set(keep)
        holes = [i for i in range(kept) if i not in kept_set]
        movers = [j for j in range(kept, n) if j in kept_set]
        rows = batch.rows
        if holes:
            device = batch.last.device
            src = torch.tensor(movers, device=device)
            dst = torch.tensor(holes, device=device)
            batch.cache.move_rows(src, dst)
            for name in ("next_pos", "last", "temps", "top_ks", "top_ps"):
                t = getattr(batch, name)
                t[dst] = t[src]
            rows = list(rows)
            for hole, mover in zip(holes, movers, strict=True):
                rows[hole] = rows[mover]
        batch.rows = rows[:kept]
        if batch.rows:
            batch.cache.lo = min(row.start for row in batch.rows)
        else:
            batch.cache.lo = batch.cache.w = 0

    def _sample_rows(
        self, batch: _Batch, logits: torch.Tensor, version: int, step: int, finished: list[_Row]
    ) -> torch.Tensor:
        assert batch.temps is not None and batch.top_ks is not None and batch.top_ps is not None
        return self._sample(batch.rows, logits, batch.temps, batch.top_ks, batch.top_ps, version, step, finished)

    def _sample_slots(
        self, batch: _SlotBatch, logits: torch.Tensor, version: int, step: int, finished: list[_Row]
    ) -> torch.Tensor:
        n = len(batch.rows)
        return self._sample(
            batch.rows, logits, batch.temps[:n], batch.top_ks[:n], batch.top_ps[:n], version, step, finished
        )

    def _sample(
        self,
        rows: list[_Row],
        logits: torch.Tensor,
        temps: torch.Tensor,
        top_ks: torch.Tensor,
        top_ps: torch.Tensor,
        version: int,
        step: int,
        finished: list[_Row],
    ) -> torch.Tensor:
        """Draw every row's next token, record it (and its log-prob and version), collect the rows that end."""
        uniforms = torch.tensor([_next_uniform(row) for row in rows], dtype=torch.float32)
        want = any(row.logprobs is not None for row in rows)
        tokens, logprobs = sample_with_logprobs(logits, temps, top_ks, top_ps, uniforms, want_logprobs=want)
        lps = logprobs.tolist() if logprobs is not None else None
        for i, (row, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
            if row.first_step < 0:
                row.first_step = step
            row.versions.append(version)
            if row.logprobs is not None and lps is not None:
                row.logprobs.append(float(lps[i]))
            if self._append(row, int(token)):
                finished.append(row)
        return tokens

    def _prefill(self, rows: list[_Row]) -> tuple[_Batch, torch.Tensor]:
        """Run the admitted rows' prompts (left-padded to one width): their batch state and last logits."""
        from transformers import DynamicCache

        ids, mask = self._right_aligned([row.slot.request.prompt_ids for row in rows])
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = _positions(mask)
        requests = [row.slot.request for row in rows]
        logits, cache = self._forward(ids, mask, positions, DynamicCache(config=self._lm.config))
        return _Batch(
            rows=list(rows),
            cache=cache,
            mask=mask,
            next_pos=positions[:, -1] + 1,
            temps=torch.tensor([r.temperature for r in requests], dtype=torch.float32, device=self.device),
            top_ks=torch.tensor([r.top_k for r in requests], dtype=torch.long, device=self.device),
            top_ps=torch.tensor([r.top_p for r in requests], dtype=torch.float32, device=self.device),
        ), logits

    def _decode(self, batch: _Batch) -> torch.Tensor:
        assert batch.mask is not None and batch.next_pos is not None and batch.last is not None
        ones = torch.ones((batch.mask.shape[0], 1), dtype=batch.mask.dtype, device=batch.mask.device)
        batch.mask = torch.cat([batch.mask, ones], dim=-1)
        logits, batch.cache = self._forward(
            batch.last.unsqueeze(-1), batch.mask, batch.next_pos.unsqueeze(-1), batch.cache
        )
        batch.next_pos = batch.next_pos + 1
        return logits

    def _compact(self, batch: _Batch, keep: list[int]) -> None:
        """Keep only rows ``keep`` (tensor positions)."""
        if not keep:
            batch.rows, batch.cache, batch.mask, batch.next_pos, batch.last = [], None, None, None, None
            batch.temps = batch.top_ks = batch.top_ps = None
            return
        assert batch.mask is not None and batch.next_pos is not None and batch.last is not None
        assert batch.temps is not None and batch.top_ks is not None and batch.top_ps is not None
        index = torch.tensor(keep, dtype=torch.long, device=batch.mask.device)
        batch.cache.batch_select_indices(index)
        batch.mask = batch.mask.index_select(0, index)
        batch.next_pos = batch.next_pos.index_select(0, index)
        batch.last = batch.last.index_select(0, index)
        batch.temps = batch.temps.index_select(0, index)
        batch.top_ks = batch.top_ks.index_select(0, index)
        batch.top_ps = batch.top_ps.index_select(0, index)
        batch.rows = [batch.rows[i] for i in keep]

    def _append(self, row: _Row, token: int) -> bool:
        """Record a sampled token; True when it ends the row (stop token, stop string or max_tokens)."""
        row.tokens.append(token)
        if token in row.stop_ids:
            row.finish_reason = "stop"
            return True
        if row.stops:
            tail = self._decode_tokenizer.decode(row.tokens[-row.tail_tokens :], skip_special_tokens=True)
            if any(s in tail for s in row.stops):
                kept = trim_at_stop(self._decode_tokenizer, row.tokens, row.stops)
                if kept is not None:
                    row.tokens = kept
                    if row.logprobs is not None:
                        del row.logprobs[len(kept) :]
                    del row.versions[len(kept) :]
                    row.finish_reason = "stop"
                    return True
        if len(row.tokens) >= row.slot.request.max_tokens:
            row.finish_reason = "length"
            return True
        return False

    # -------------------------------------------------------------------------------------------- weights

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if not self._state:
            raise Unavailable("the hf backend is still loading its model; retry when the server reports SERVING")
        return {name: (tuple(t.shape), t.dtype) for name, t in self._state.items()}

    def validate_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise WeightsError on the first tensor that cannot be applied as is (the one validator)."""
        validate_weights(tensors, self.weight_specs())

    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Validate everything, then copy between two steps: no step ever sees half of the new weights."""
        await self._submit(tensors, version, adopt=False)

    async def adopt_weights(self, tensors: dict[str, torch.Tensor], version: int) -> bool:
        """Like update_weights, but the model takes the tensors themselves (no copy) when they are a whole update
        of the model's dtypes and device; returns True then. The caller must never write them afterwards; the
        tensors the model held before are free once this returns True (the caller may receive into them)."""
        return await self._submit(tensors, version, adopt=True)

    async def _submit(self, tensors: dict[str, torch.Tensor], version: int, *, adopt: bool) -> bool:
        if self._worker is None:
            await self.start()
        self.validate_weights(tensors)
        swap = _WeightSwap(tensors, int(version), adopt)
        self._inbox.put(swap)
        adopted = await asyncio.wrap_future(swap.done)
        logger.info("hf backend: %s %d tensors, policy_version=%d", "adopted" if adopted else "applied",
                    len(tensors), version)  # fmt: skip
        return adopted


def _cache_layers(config: Any) -> list[Any]:
    """The cache layers transformers would build for this model (sliding windows, linear attention ...)."""
    from transformers import DynamicCache

    try:
        return list(DynamicCache(config=config).layers)
    except Exception:  # a config DynamicCache cannot read: take the general path
        return []


def _joinable(layer: Any) -> bool:
    """A plain full-attention KV layer: [batch, heads, seq, dim] tensors that can be padded and concatenated."""
    from transformers.cache_utils import DynamicLayer

    return type(layer) is DynamicLayer


def _next_uniform(row: _Row) -> float:
    """The row's next uniform draw; a greedy row draws none (it never uses one).

    Draws come from the row's own generator 32 at a time: ``torch.rand(32)`` yields the same numbers as 32
    calls of ``torch.rand(1)``, so seeded outputs are unchanged, for a 32nd of the per-call cost.
    """
    if row.slot.request.temperature <= 1e-5:
        return 0.0
    if not row.uniforms:
        row.uniforms = torch.rand(32, generator=row.generator).tolist()[::-1]
    return row.uniforms.pop()


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Each real token's position within its row (0 for left padding)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)
