"""A transformers generation backend with its own micro-batched decode loop.

It exists so the whole mesh (rollouts, streaming rewards, weight sync) runs anywhere, CPU included, without
vLLM. Concurrent requests that arrive within ``batch_wait_ms`` are decoded together; each request's future
resolves the moment its own row finishes, so a short answer never waits for the longest one in its batch.

Threading: every tensor operation (load, prefill, decode steps, weight copies) runs on one dedicated worker
thread, one step per hand-off, so the event loop keeps serving between steps. The loop owns all futures and
bookkeeping; the worker owns the batch tensors. A weights lock taken per micro-batch makes weight swaps land
between batches, never inside one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from server.backends.base import GenerationOutput, GenerationRequest, WeightsError

logger = logging.getLogger(__name__)

ALLOWED_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` means bf16 on a GPU that has it (fp16 otherwise) and fp32 on CPU, where half precision is slow."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, {', '.join(sorted(_DTYPES))}") from None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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
        raise ValueError("prompt_ids is empty: the model needs at least one prompt token")
    if request.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {request.max_tokens}")
    if n + request.max_tokens > max_model_len:
        raise ValueError(
            f"prompt length {n} + max_tokens {request.max_tokens} = {n + request.max_tokens} exceeds "
            f"max_model_len {max_model_len}; lower max_tokens to at most {max(max_model_len - n, 0)}"
        )
    if request.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {request.temperature}")
    if not 0 < request.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {request.top_p}")
    if request.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {request.top_k}")
    if vocab_size is not None:
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt_ids hold ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


# ------------------------------------------------------------------------------------------------ batching


@dataclass(eq=False)
class _Pending:
    request: GenerationRequest
    future: asyncio.Future[GenerationOutput]


@dataclass(eq=False)
class _Row:
    slot: _Pending
    generator: torch.Generator
    stop_ids: frozenset[int]
    stops: tuple[str, ...]
    tail_tokens: int  # how many trailing tokens to decode to be sure a new stop-string match is seen
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # when the request asked for them
    finish_reason: str | None = None


@dataclass(eq=False)
class _Batch:
    """Worker-thread state of one micro-batch; the loop only reads ``rows``' results."""

    rows: list[_Row]
    version: int
    live: list[int] = field(default_factory=list)  # row indices, in tensor order
    cache: Any = None
    mask: torch.Tensor | None = None  # [live, past]: 0 on left padding
    next_pos: torch.Tensor | None = None  # [live]: position id of the next input token
    last: torch.Tensor | None = None  # [live]: last sampled token
    temps: torch.Tensor | None = None
    top_ks: torch.Tensor | None = None
    top_ps: torch.Tensor | None = None
    steps: int = 0


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
        batch_wait_ms: float = 5.0,
        max_model_len: int | None = None,
        num_threads: int | None = None,
    ) -> None:
        """``num_threads`` caps torch's CPU threads for the decode thread only (OpenMP settings are per
        thread); a small model on a busy CPU decodes far faster single-threaded. None keeps torch's default.
        """
        from transformers import AutoConfig, AutoTokenizer

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {batch_wait_ms}")
        self.model = str(model)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_batch_size = max_batch_size
        self.num_threads = num_threads
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
        self.vocab_size: int | None = getattr(self.config, "vocab_size", None)
        self.policy_version = 0

        self._lm: Any = None
        self._state: dict[str, torch.Tensor] = {}
        self._eos: frozenset[int] = frozenset()
        self._pad_id = 0
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduler: asyncio.Task[None] | None = None
        self._start_lock = asyncio.Lock()
        self._weights_lock: asyncio.Lock | None = None
        self._wakeup: asyncio.Event | None = None
        self._pending: collections.deque[_Pending] = collections.deque()
        self._batch: _Batch | None = None
        self._closed = False
        # Observability (and what the tests use to see micro-batching happen).
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=1024)
        self.batch_steps: collections.deque[int] = collections.deque(maxlen=1024)
        self.num_batches = 0

    # ------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        async with self._start_lock:
            if self._closed:
                raise RuntimeError("HFBackend is closed")
            if self._scheduler is not None:
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
                "hf backend: loaded %s on %s (%s) in %.2f s",
                self.model,
                self.device,
                self.dtype,
                time.perf_counter() - t0,
            )
            self._weights_lock = asyncio.Lock()
            self._wakeup = asyncio.Event()
            self._scheduler = asyncio.create_task(self._schedule(), name="hf-backend-scheduler")
            self._scheduler.add_done_callback(self._scheduler_done)

    def _scheduler_done(self, task: asyncio.Task[None]) -> None:
        """A scheduler that died of a bug must not leave callers awaiting forever."""
        if task.cancelled() or task.exception() is None:
            return
        logger.error("hf backend: scheduler failed", exc_info=task.exception())
        self._closed = True
        error = RuntimeError(f"HFBackend scheduler failed: {task.exception()!r}")
        while self._pending:
            slot = self._pending.popleft()
            if not slot.future.done():
                slot.future.set_exception(error)

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM

        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)  # runs on the decode thread: affects only that thread
        lm: Any = AutoModelForCausalLM.from_pretrained(self.model, local_files_only=True, dtype=self.dtype)
        lm.to(self.device)
        lm.eval()
        lm.requires_grad_(False)
        self._lm = lm
        self._state = dict(lm.state_dict())
        self._eos = frozenset(eos_token_ids(self.tokenizer, getattr(lm, "generation_config", None)))
        pad = self.tokenizer.pad_token_id
        self._pad_id = int(pad) if pad is not None else (min(self._eos) if self._eos else 0)
        vocab = lm.get_input_embeddings().weight.shape[0]
        self.vocab_size = int(vocab) if self.vocab_size is None else min(int(self.vocab_size), int(vocab))

    async def close(self) -> None:
        """Stop the decode loop and fail every request still queued or decoding."""
        self._closed = True
        task, self._scheduler = self._scheduler, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        error = RuntimeError("HFBackend closed")
        while self._pending:
            slot = self._pending.popleft()
            if not slot.future.done():
                slot.future.set_exception(error)
        if self._batch is not None:
            for row in self._batch.rows:
                if not row.slot.future.done():
                    row.slot.future.set_exception(error)
            self._batch = None
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, True)

    # --------------------------------------------------------------------------------------------- serving

    @property
    def running(self) -> int:
        """Requests queued plus rows still decoding; cancelled and delivered ones no longer count."""
        queued = sum(1 for slot in self._pending if not slot.future.done())
        batch = self._batch
        active = 0 if batch is None else sum(1 for row in batch.rows if not row.slot.future.done())
        return queued + active

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        if self._closed:
            raise RuntimeError("HFBackend is closed")
        validate_request(request, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        if self._scheduler is None:
            await self.start()
        assert self._wakeup is not None
        future: asyncio.Future[GenerationOutput] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(request, future))
        self._wakeup.set()
        try:
            return await future
        finally:
            # Cancelling the awaiting task cancels `future` too; this also covers being interrupted otherwise.
            if not future.done():
                future.cancel()

    async def _schedule(self) -> None:
        """Collect a micro-batch, decode it under the weights lock, repeat."""
        assert self._wakeup is not None and self._weights_lock is not None and self._loop is not None
        while True:
            while not self._prune_pending():
                self._wakeup.clear()
                await self._wakeup.wait()
            if self.batch_wait_s > 0 and len(self._pending) < self.max_batch_size:
                await asyncio.sleep(self.batch_wait_s)
            slots: list[_Pending] = []
            while self._pending and len(slots) < self.max_batch_size:
                slot = self._pending.popleft()
                if not slot.future.done():
                    slots.append(slot)
            if not slots:
                continue
            async with self._weights_lock:
                await self._run_batch(slots)

    def _prune_pending(self) -> bool:
        while self._pending and self._pending[0].future.done():
            self._pending.popleft()
        return bool(self._pending)

    async def _run_batch(self, slots: list[_Pending]) -> None:
        assert self._loop is not None and self._executor is not None
        batch = _Batch(rows=[self._new_row(slot) for slot in slots], version=self.policy_version)
        self._batch = batch
        self.num_batches += 1
        self.batch_sizes.append(len(slots))
        try:
            while True:
                dropped = {
                    i for i, row in enumerate(batch.rows) if row.finish_reason is None and row.slot.future.done()
                }
                finished, alive = await self._loop.run_in_executor(self._executor, self._step, batch, dropped)
                for i in finished:
                    row = batch.rows[i]
                    if not row.slot.future.done():
                        assert row.finish_reason is not None
                        row.slot.future.set_result(
                            GenerationOutput(
                                token_ids=list(row.tokens),
                                finish_reason=row.finish_reason,
                                num_preempted=0,
                                policy_version=batch.version,
                                logprobs=row.logprobs,
                                token_versions=[batch.version] * len(row.tokens),
                            )
                        )
                if not alive:
                    break
        except asyncio.CancelledError:
            # Only close() cancels the scheduler; nothing will decode these rows any more.
            for row in batch.rows:
                if not row.slot.future.done():
                    row.slot.future.set_exception(RuntimeError("HFBackend closed"))
            raise
        except Exception as exc:
            logger.exception("hf backend: micro-batch of %d failed", len(slots))
            for row in batch.rows:
                if not row.slot.future.done():
                    row.slot.future.set_exception(exc)
        finally:
            self.batch_steps.append(batch.steps)
            if self._batch is batch:
                self._batch = None

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
            logprobs=[] if request.logprobs else None,
        )

    # ------------------------------------------------------------------------------ worker thread: decoding

    def _step(self, batch: _Batch, dropped: set[int]) -> tuple[list[int], bool]:
        """One forward pass (the prefill on the first call) and one sampled token per live row.

        Returns the rows that finished in this step and whether any row is still decoding. Rows that are done
        or cancelled are removed from the batch tensors (and the KV cache) first, so they cost nothing more.
        """
        with torch.inference_mode():
            if batch.cache is None:
                batch.live = [i for i in range(len(batch.rows)) if i not in dropped]
                if not batch.live:
                    return [], False
                logits = self._prefill(batch)
            else:
                keep = [
                    pos for pos, i in enumerate(batch.live) if batch.rows[i].finish_reason is None and i not in dropped
                ]
                if not keep:
                    batch.live = []
                    return [], False
                if len(keep) < len(batch.live):
                    self._compact(batch, keep)
                logits = self._decode(batch)
            batch.steps += 1
            rows = [batch.rows[i] for i in batch.live]
            uniforms = torch.cat([torch.rand(1, generator=row.generator) for row in rows])
            assert batch.temps is not None and batch.top_ks is not None and batch.top_ps is not None
            want = any(row.logprobs is not None for row in rows)
            tokens, logprobs = sample_with_logprobs(
                logits, batch.temps, batch.top_ks, batch.top_ps, uniforms, want_logprobs=want
            )
            batch.last = tokens
            finished: list[int] = []
            lps = logprobs.tolist() if logprobs is not None else [0.0] * len(rows)
            for i, row, token, lp in zip(batch.live, rows, tokens.tolist(), lps, strict=True):
                if row.logprobs is not None:
                    row.logprobs.append(float(lp))
                if self._append(row, int(token)):
                    finished.append(i)
            alive = any(row.finish_reason is None for row in rows)
            return finished, alive

    def _prefill(self, batch: _Batch) -> torch.Tensor:
        from transformers import DynamicCache

        rows = [batch.rows[i] for i in batch.live]
        prompts = [row.slot.request.prompt_ids for row in rows]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, prompt in enumerate(prompts):
            ids[r, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[r, width - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        requests = [row.slot.request for row in rows]
        batch.temps = torch.tensor([r.temperature for r in requests], dtype=torch.float32, device=self.device)
        batch.top_ks = torch.tensor([r.top_k for r in requests], dtype=torch.long, device=self.device)
        batch.top_ps = torch.tensor([r.top_p for r in requests], dtype=torch.float32, device=self.device)
        batch.cache = DynamicCache(config=self._lm.config)
        out = self._lm(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=batch.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        batch.cache = out.past_key_values
        batch.mask = mask
        batch.next_pos = positions[:, -1] + 1
        return out.logits[:, -1, :]

    def _decode(self, batch: _Batch) -> torch.Tensor:
        assert batch.mask is not None and batch.next_pos is not None and batch.last is not None
        ones = torch.ones((batch.mask.shape[0], 1), dtype=batch.mask.dtype, device=batch.mask.device)
        batch.mask = torch.cat([batch.mask, ones], dim=-1)
        out = self._lm(
            input_ids=batch.last.unsqueeze(-1),
            attention_mask=batch.mask,
            position_ids=batch.next_pos.unsqueeze(-1),
            past_key_values=batch.cache,
            use_cache=True,
        )
        batch.cache = out.past_key_values
        batch.next_pos = batch.next_pos + 1
        return out.logits[:, -1, :]

    def _compact(self, batch: _Batch, keep: list[int]) -> None:
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
        batch.live = [batch.live[pos] for pos in keep]

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
                    row.finish_reason = "stop"
                    return True
        if len(row.tokens) >= row.slot.request.max_tokens:
            row.finish_reason = "length"
            return True
        return False

    # -------------------------------------------------------------------------------------------- weights

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if not self._state:
            raise RuntimeError("HFBackend.weight_specs() needs the model: await start() first")
        return {name: (tuple(t.shape), t.dtype) for name, t in self._state.items()}

    def validate_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise WeightsError on the first tensor that cannot be applied as is."""
        if not self._state:
            raise RuntimeError("HFBackend.update_weights() needs the model: await start() first")
        for name, tensor in tensors.items():
            target = self._state.get(name)
            if target is None:
                raise WeightsError(f"unknown tensor {name!r}: the model has no such parameter or buffer")
            if not isinstance(tensor, torch.Tensor):
                raise WeightsError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
            if tensor.dtype not in ALLOWED_WEIGHT_DTYPES:
                raise WeightsError(f"tensor {name!r}: dtype {tensor.dtype} is not one of bfloat16, float16, float32")
            if tuple(tensor.shape) != tuple(target.shape):
                raise WeightsError(
                    f"tensor {name!r}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}"
                )

    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Validate everything, then copy between micro-batches: no batch ever mixes two weight versions."""
        if self._scheduler is None:
            await self.start()
        self.validate_weights(tensors)
        assert self._weights_lock is not None and self._loop is not None and self._executor is not None
        async with self._weights_lock:
            await self._loop.run_in_executor(self._executor, self._apply_weights, tensors)
            self.policy_version = int(version)
        logger.info("hf backend: applied %d tensors, policy_version=%d", len(tensors), version)

    def _apply_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in tensors.items():
                self._state[name].copy_(tensor)
