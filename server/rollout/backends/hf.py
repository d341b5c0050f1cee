"""A transformers generation backend with its own continuously batched decode loop.

It exists so the whole mesh (rollouts, streaming rewards, weight sync) runs anywhere, CPU included, without
vLLM. Rows join and leave one running batch at step boundaries: a finished or cancelled row leaves (its KV
cache slot is freed), and a request that arrives while others decode is prefilled in the same forward pass as
the running rows' next token and joins, so it never waits for the longest row of a batch it missed. The KV
cache is preallocated per row (hf_kv_cache.SlotCache), so joining and leaving copy no cache. Models whose cache
is not plain full attention (sliding windows, linear attention) or whose attention takes no 4-D mask run on
transformers' own cache instead, where new rows wait for an empty batch. Admission is bounded by ``max_num_seqs``
rows and ``max_batch_tokens`` (each row reserves prompt + max_tokens). Each request's future resolves the
moment its own row finishes.

Threading: every tensor operation (load, prefill, decode steps, weight copies) runs on one dedicated worker
thread, whose decode loop steps on its own: new requests and weight swaps reach it through a queue it drains
at each step boundary, and finished rows go back to the event loop in one call per step, so a busy CPU never
charges a thread hand-off per token. The event loop owns the futures; the worker owns the batch. A weight swap
lands between two steps, never inside one; rows decoding across a swap continue on the new weights (their
KV cache from the old ones is kept, as vLLM's ``pause_generation(mode="keep")`` does), and each token records
the version that produced it.

This module is the backend itself (lifecycle, admission, the decode loop); its parts: hf_decode and
hf_slot_decode (the two decode paths), hf_kv_cache (the slot KV cache), hf_rows (requests and rows),
hf_weights (the model's weights and swaps), sampling, and requests (checks shared with the vLLM backend).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import queue
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rewardmesh.reward_engine.devices import resolve_device, resolve_dtype
from rewardmesh.server.rollout.backends.base import Backend, GenerationOutput, GenerationRequest
from rewardmesh.server.rollout.backends.hf_decode import DynamicBatch, DynamicDecoder
from rewardmesh.server.rollout.backends.hf_kv_cache import cache_layers, joinable
from rewardmesh.server.rollout.backends.hf_rows import Pending, Row
from rewardmesh.server.rollout.backends.hf_slot_decode import SlotBatch, SlotDecoder
from rewardmesh.server.rollout.backends.hf_weights import ModelWeights, WeightSwap
from rewardmesh.server.rollout.backends.requests import eos_token_ids, validate_request

logger = logging.getLogger(__name__)
# Rows decoded together when the server config leaves max_num_seqs unset (vLLM's engine argument of that name, which
# the vllm backend is given instead, has vLLM's own default).
DEFAULT_MAX_NUM_SEQS = 32


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


# ------------------------------------------------------------------------------------------------- backend


def _check_options(
    max_num_seqs: int, batch_wait_ms: float, max_batch_tokens: int | None, num_threads: int | None
) -> None:
    """Reject the backend's limits before any file is read, naming the option."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    if batch_wait_ms < 0:
        raise ValueError(f"batch_wait_ms must be >= 0, got {batch_wait_ms}")
    if max_batch_tokens is not None and max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be at least 1, got {max_batch_tokens}")
    if num_threads is not None and num_threads < 0:
        raise ValueError(f"num_threads must be >= 0 (0: torch's default), got {num_threads}")


class HFBackend(Backend):
    """transformers causal LM behind the Backend protocol (see base.py)."""

    name = "hf"
    device: torch.device  # always in this process

    def __init__(
        self,
        model: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_batch_tokens: int | None = None,
        batch_wait_ms: float = 5.0,
        max_model_len: int | None = None,
        num_threads: int | None = None,
    ) -> None:
        """``max_batch_tokens`` bounds the running batch's KV cache: the sum of prompt + max_tokens over its
        rows (default ``max_num_seqs * max_model_len``, i.e. only the row count binds); a request larger
        than the budget still runs, alone. ``batch_wait_ms`` is how long an idle backend waits for company
        before its first prefill; once a batch runs, newcomers join at the next step without waiting.
        ``num_threads`` sets torch's CPU threads for the decode thread only (OpenMP settings are per thread;
        default :func:`default_num_threads`, 0 keeps torch's own default of every core).
        """
        from transformers import AutoConfig, AutoTokenizer

        _check_options(max_num_seqs, batch_wait_ms, max_batch_tokens, num_threads)
        self.model = str(model)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_num_seqs = max_num_seqs
        self.num_threads = default_num_threads() if num_threads is None else num_threads
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.config = AutoConfig.from_pretrained(self.model, local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model, local_files_only=True)
        # The worker thread decodes with its own copy: a fast tokenizer shared across threads can raise
        # "Already borrowed" when the servicer encodes while the decode loop checks stop strings.
        self._decode_tokenizer = AutoTokenizer.from_pretrained(self.model, local_files_only=True)
        self.max_model_len = self._context_length(max_model_len)
        self.max_batch_tokens = max_batch_tokens or max_num_seqs * self.max_model_len
        self.vocab_size: int | None = getattr(self.config, "vocab_size", None)
        self.policy_version = 0

        self._lm: Any = None
        self._weights = ModelWeights()
        self._eos: frozenset[int] = frozenset()
        self._decoder: DynamicDecoder | SlotDecoder | None = None  # set once the model is loaded
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: asyncio.Future[None] | None = None  # the decode loop, running on the worker thread
        self._start_lock = asyncio.Lock()
        self._inbox: queue.SimpleQueue[Pending | WeightSwap | None] = queue.SimpleQueue()  # None: stop
        self._pending: collections.deque[Pending] = collections.deque()  # worker-owned: not yet admitted
        self._outstanding: set[asyncio.Future[GenerationOutput]] = set()  # loop-owned: every unanswered call
        self._batch: DynamicBatch | SlotBatch = DynamicBatch()
        self._use_slots = False  # the slot cache path (plain full-attention models under sdpa or eager)
        self._closed = False
        # Observability (and what the tests use to see continuous batching happen, by counting steps).
        self.steps = 0  # forward steps completed (each: one decode of the running rows and/or one prefill)
        self.num_batches = 0  # admissions: groups of requests prefilled together
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=1024)  # rows per admission
        self.running_sizes: collections.deque[int] = collections.deque(maxlen=4096)  # rows decoded per step
        self.admission_waits: collections.deque[int] = collections.deque(maxlen=1024)  # steps to first token

    def _context_length(self, max_model_len: int | None) -> int:
        """The longest prompt + completion served: ``max_model_len``, or the model's own limit when it is None."""
        limit = getattr(self.config, "max_position_embeddings", None)
        if max_model_len is None:
            if limit is None:
                raise ValueError(f"{self.model}: config has no max_position_embeddings; pass max_model_len")
            max_model_len = int(limit)
        elif limit is not None and max_model_len > limit:
            logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d", max_model_len, limit)
        return int(max_model_len)

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
        self.unusable = f"the hf decode loop failed: {worker.exception()!r}"
        if self.on_failure is not None:  # the server reports NOT_SERVING: it can generate nothing more
            self.on_failure(worker.exception())
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
        self._weights.load(lm)
        self._eos = frozenset(eos_token_ids(self.tokenizer, getattr(lm, "generation_config", None)))
        pad = self.tokenizer.pad_token_id
        pad_id = int(pad) if pad is not None else (min(self._eos) if self._eos else 0)
        vocab = lm.get_input_embeddings().weight.shape[0]
        self.vocab_size = int(vocab) if self.vocab_size is None else min(int(self.vocab_size), int(vocab))
        attention = getattr(lm.config, "_attn_implementation", None)
        layers = cache_layers(lm.config)
        # The slot cache (see SlotDecoder) where the model allows it: plain full-attention models under sdpa or eager.
        self._use_slots = attention in ("sdpa", "eager") and bool(layers) and all(joinable(x) for x in layers)
        decoder = SlotDecoder if self._use_slots else DynamicDecoder
        self._decoder = decoder(lm, pad_id=pad_id, device=self.device, dtype=self.dtype,
                                bool_mask=attention == "sdpa", tokenizer=self._decode_tokenizer)  # fmt: skip
        self._batch = self._new_batch()

    def _new_batch(self) -> DynamicBatch | SlotBatch:
        """An empty running batch, of the loaded model's decode path."""
        return self._decoder.new_batch() if self._decoder is not None else DynamicBatch()

    async def close(self) -> None:
        """Stop the decode loop and fail every request still queued or decoding."""
        self._closed = True
        worker, self._worker = self._worker, None
        if worker is not None:
            self._inbox.put(None)
            with contextlib.suppress(Exception):
                await asyncio.shield(worker)
        self._fail_outstanding(RuntimeError("HFBackend closed"))
        self._batch = DynamicBatch()
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
        self._inbox.put(Pending(request, future, self.steps))
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
            if idle and self.batch_wait_s > 0 and len(self._pending) < self.max_num_seqs:
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
                self._batch, finished = self._step(batch, admit, dropped, version, self.steps + 1)
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
            if isinstance(item, WeightSwap):
                self._swap_weights(item)
            else:
                self._pending.append(item)

    def _swap_weights(self, swap: WeightSwap) -> None:
        """Between two steps: copy (or adopt) every tensor, then label the tokens that follow with the new version."""
        try:
            adopted = self._weights.apply(swap.tensors, adopt=swap.adopt)
            self.policy_version = swap.version
        except BaseException as exc:
            if swap.done.set_running_or_notify_cancel():  # (a caller gone meanwhile must not kill this thread)
                swap.done.set_exception(exc)
        else:
            if swap.done.set_running_or_notify_cancel():
                swap.done.set_result(adopted)

    def _step(
        self, batch: DynamicBatch | SlotBatch, admit: list[Row], dropped: set[Row], version: int, step: int
    ) -> tuple[DynamicBatch | SlotBatch, list[Row]]:
        """One step of the loaded model's decode path: the running batch after it, and the rows that finished."""
        decoder = self._decoder
        if isinstance(decoder, SlotDecoder) and isinstance(batch, SlotBatch):
            return decoder.step(batch, admit, dropped, version, step)
        assert isinstance(decoder, DynamicDecoder) and isinstance(batch, DynamicBatch)
        return decoder.step(batch, admit, dropped, version, step)

    @staticmethod
    def _output(row: Row, version: int) -> GenerationOutput:
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
    def _fail_rows(rows: list[Row], error: BaseException) -> None:
        for row in rows:
            if not row.slot.future.done():
                row.slot.future.set_exception(error)

    def _admit(self, running: list[Row]) -> list[Row]:
        """Queued requests, first come first served, while rows and the token budget allow.

        A request that does not fit waits at the head of the queue (nothing overtakes it, so it cannot
        starve); one larger than the whole budget runs alone.
        """
        if running and not self._use_slots:
            return []  # the general path admits into an empty batch only
        reserved = sum(row.reserve for row in running)
        rows: list[Row] = []
        while self._pending and len(running) + len(rows) < self.max_num_seqs:
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

    def _new_row(self, slot: Pending) -> Row:
        request = slot.request
        generator = torch.Generator()
        generator.manual_seed(request.seed if request.seed is not None else secrets.randbits(63))
        stops = tuple(s for s in request.stop if s)
        return Row(
            slot=slot,
            generator=generator,
            stop_ids=(frozenset() if request.ignore_eos else self._eos) | frozenset(request.stop_token_ids),
            stops=stops,
            tail_tokens=max((len(s) for s in stops), default=0) + 8,
            reserve=len(request.prompt_ids) + request.max_tokens,
            logprobs=[] if request.logprobs else None,
        )

    # -------------------------------------------------------------------------------------------- weights

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self._weights.specs()

    takes_deltas = True

    def served_weights(self) -> dict[str, torch.Tensor]:
        """The tensors the model serves now, by name (read-only for the caller: a delta update starts from them);
        detached, so each keeps pointing at these bytes after an update swaps a parameter's storage."""
        return {name: t.detach() for name, t in self._weights.state.items()}

    def validate_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise WeightsError on the first tensor that cannot be applied as is (the one validator)."""
        self._weights.validate(tensors)

    def adoptable(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether adopt_weights would take these tensors themselves (see ModelWeights.adoptable)."""
        return self._weights.adoptable(tensors)

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
        swap = WeightSwap(tensors, int(version), adopt)
        self._inbox.put(swap)
        adopted = await asyncio.shield(asyncio.wrap_future(swap.done))  # queued: it happens whatever the caller does
        logger.info("hf backend: %s %d tensors, policy_version=%d", "adopted" if adopted else "applied",
                    len(tensors), version)  # fmt: skip
        return adopted
