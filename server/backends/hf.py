"""A transformers generation backend with its own continuously batched decode loop.

It exists so the whole mesh (rollouts, streaming rewards, weight sync) runs anywhere, CPU included, without
vLLM. Rows join and leave one running batch at step boundaries: a finished or cancelled row leaves (its KV
cache rows are dropped), and a request that arrives while others decode is prefilled and joins at the next
step, so it never waits for the longest row of a batch it missed. Admission is bounded by ``max_batch_size``
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

from client.weights import validate_weights
from reward_engine.devices import resolve_device, resolve_dtype
from reward_engine.errors import InvalidInput, Unavailable
from server.backends.base import GenerationOutput, GenerationRequest

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
        self._can_join = True  # False for caches whose layers cannot be padded and merged (sliding windows ...)
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: asyncio.Future[None] | None = None  # the decode loop, running on the worker thread
        self._start_lock = asyncio.Lock()
        self._inbox: queue.SimpleQueue[_Pending | _WeightSwap | None] = queue.SimpleQueue()  # None: stop
        self._pending: collections.deque[_Pending] = collections.deque()  # worker-owned: not yet admitted
        self._outstanding: set[asyncio.Future[GenerationOutput]] = set()  # loop-owned: every unanswered call
        self._batch = _Batch()
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
                self._batch = _Batch()
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
                adopted = swap.adopt and self._adoptable(swap.tensors)
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

    def _adoptable(self, tensors: dict[str, torch.Tensor]) -> bool:
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
        if running and not self._can_join:
            return []
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

    def _step(self, batch: _Batch, admit: list[_Row], dropped: set[_Row], version: int, step: int) -> list[_Row]:
        """One step: drop rows that finished or were cancelled, decode one token for every running row, then
        prefill the admitted rows (their first token) and merge them into the batch.

        Returns the rows that finished in this step.
        """
        with torch.inference_mode():
            keep = [i for i, row in enumerate(batch.rows) if row.finish_reason is None and row not in dropped]
            if len(keep) < len(batch.rows):
                self._compact(batch, keep)
            finished: list[_Row] = []
            if batch.rows and admit and self._can_join:
                logits = self._decode_and_prefill(batch, admit)  # one forward pass for both
                batch.last = self._sample_rows(batch, logits, version, step, finished)
                return finished
            if batch.rows:
                logits = self._decode(batch)
                batch.last = self._sample_rows(batch, logits, version, step, finished)
            if admit:
                joining, logits = self._prefill(admit)
                joining.last = self._sample_rows(joining, logits, version, step, finished)
                self._merge(batch, joining)
            return finished

    def _decode_and_prefill(self, batch: _Batch, admit: list[_Row]) -> torch.Tensor:
        """Decode the running rows and prefill the admitted ones in a single forward pass.

        The input is ``width`` tokens per row, right-aligned: a running row's last token after padding, a
        new row's whole prompt. New rows get masked (all-zero) cache rows for the running rows' history.
        Afterwards each row's cache keeps only the columns its mask attends to, left-padded again, so neither
        the padding of this step nor the new rows' empty history stays in the cache.
        """
        assert batch.mask is not None and batch.next_pos is not None and batch.last is not None
        assert batch.temps is not None and batch.top_ks is not None and batch.top_ps is not None
        device = batch.mask.device
        old, new = len(batch.rows), len(admit)
        prompts = [row.slot.request.prompt_ids for row in admit]
        width = max(len(p) for p in prompts)
        past = batch.mask.shape[1]
        ids = torch.full((old + new, width), self._pad_id, dtype=torch.long)
        step_mask = torch.zeros((old + new, width), dtype=torch.long)
        ids[:old, -1] = batch.last.cpu()
        step_mask[:old, -1] = 1
        for r, prompt in enumerate(prompts, start=old):
            ids[r, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            step_mask[r, width - len(prompt) :] = 1
        ids, step_mask = ids.to(device), step_mask.to(device)
        positions = (step_mask.cumsum(-1) - 1).clamp(min=0)
        positions[:old, -1] = batch.next_pos
        history = torch.cat([batch.mask, batch.mask.new_zeros((new, past))])
        mask = torch.cat([history, step_mask], dim=-1)
        for layer in batch.cache.layers:
            layer.keys = torch.cat([layer.keys, layer.keys.new_zeros((new, *layer.keys.shape[1:]))])
            layer.values = torch.cat([layer.values, layer.values.new_zeros((new, *layer.values.shape[1:]))])
        out = self._lm(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=batch.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        batch.cache = out.past_key_values
        # Keep the attended columns of each row, in order, right-aligned: a stable sort puts the masked
        # columns first, and the row's longest-kept count bounds the new width.
        kept = mask.bool()
        keep = int(kept.sum(-1).max())
        order = torch.sort(kept.to(torch.int8), dim=-1, stable=True).indices[:, -keep:]
        batch.mask = mask.gather(1, order)
        for layer in batch.cache.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
        requests = [row.slot.request for row in admit]
        batch.rows = [*batch.rows, *admit]
        batch.next_pos = torch.cat([batch.next_pos + 1, positions[old:, -1] + 1])
        batch.temps = torch.cat([batch.temps, torch.tensor([r.temperature for r in requests], device=device)])
        batch.top_ks = torch.cat([batch.top_ks, torch.tensor([r.top_k for r in requests], device=device)])
        batch.top_ps = torch.cat([batch.top_ps, torch.tensor([r.top_p for r in requests], device=device)])
        return out.logits[:, -1, :]

    def _sample_rows(
        self, batch: _Batch, logits: torch.Tensor, version: int, step: int, finished: list[_Row]
    ) -> torch.Tensor:
        assert batch.temps is not None and batch.top_ks is not None and batch.top_ps is not None
        uniforms = torch.cat([torch.rand(1, generator=row.generator) for row in batch.rows])
        want = any(row.logprobs is not None for row in batch.rows)
        tokens, logprobs = sample_with_logprobs(
            logits, batch.temps, batch.top_ks, batch.top_ps, uniforms, want_logprobs=want
        )
        lps = logprobs.tolist() if logprobs is not None else [0.0] * len(batch.rows)
        for row, token, lp in zip(batch.rows, tokens.tolist(), lps, strict=True):
            if row.first_step < 0:
                row.first_step = step
            row.versions.append(version)
            if row.logprobs is not None:
                row.logprobs.append(float(lp))
            if self._append(row, int(token)):
                finished.append(row)
        return tokens

    def _prefill(self, rows: list[_Row]) -> tuple[_Batch, torch.Tensor]:
        """Run the admitted rows' prompts (left-padded to one width): their batch state and last logits."""
        from transformers import DynamicCache

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
        cache = DynamicCache(config=self._lm.config)
        out = self._lm(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = out.past_key_values
        self._can_join = all(_joinable(layer) for layer in getattr(cache, "layers", [None]))
        return _Batch(
            rows=list(rows),
            cache=cache,
            mask=mask,
            next_pos=positions[:, -1] + 1,
            temps=torch.tensor([r.temperature for r in requests], dtype=torch.float32, device=self.device),
            top_ks=torch.tensor([r.top_k for r in requests], dtype=torch.long, device=self.device),
            top_ps=torch.tensor([r.top_p for r in requests], dtype=torch.float32, device=self.device),
        ), out.logits[:, -1, :]

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
        """Keep only rows ``keep`` (tensor positions), then cut the left padding no remaining row needs."""
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
        if self._can_join:
            start = int(batch.mask.any(0).int().argmax())  # first column some row attends to
            if start > 0:
                batch.mask = batch.mask[:, start:]
                for layer in batch.cache.layers:
                    layer.keys, layer.values = layer.keys[..., start:, :], layer.values[..., start:, :]

    def _merge(self, batch: _Batch, joining: _Batch) -> None:
        """Append ``joining``'s rows to ``batch``: both left-padded to one cache width, then concatenated."""
        if not batch.rows:
            batch.rows, batch.cache, batch.mask, batch.next_pos = (
                joining.rows,
                joining.cache,
                joining.mask,
                joining.next_pos,
            )
            batch.last, batch.temps, batch.top_ks, batch.top_ps = (
                joining.last,
                joining.temps,
                joining.top_ks,
                joining.top_ps,
            )
            return
        assert batch.mask is not None and joining.mask is not None
        width = max(batch.mask.shape[1], joining.mask.shape[1])
        batch.mask = torch.cat([_left_pad(batch.mask, width), _left_pad(joining.mask, width)])
        for old, new in zip(batch.cache.layers, joining.cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width, -2), _left_pad(new.keys, width, -2)])
            old.values = torch.cat([_left_pad(old.values, width, -2), _left_pad(new.values, width, -2)])
        for name in ("next_pos", "last", "temps", "top_ks", "top_ps"):
            setattr(batch, name, torch.cat([getattr(batch, name), getattr(joining, name)]))
        batch.rows = [*batch.rows, *joining.rows]

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


def _joinable(layer: Any) -> bool:
    """A plain full-attention KV layer: [batch, heads, seq, dim] tensors that can be padded and concatenated."""
    from transformers.cache_utils import DynamicLayer

    return type(layer) is DynamicLayer


def _left_pad(t: torch.Tensor, width: int, dim: int = -1) -> torch.Tensor:
    """``t`` with zeros prepended along ``dim`` up to ``width`` (mask zeros mean "not attended")."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
