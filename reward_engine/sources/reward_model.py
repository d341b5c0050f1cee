"""A reward source backed by a sequence-classifier reward model (one forward pass per batch).

How a sample becomes a sequence for the reward model:

* **Same tokenizer** (``retokenize="never"``, or ``"auto"`` with no ``policy_tokenizer`` or one whose
  vocabulary equals the reward model's): ``prompt_ids + response_ids`` are scored as they are.
* **Different tokenizer** (``"always"``, or ``"auto"`` with differing vocabularies): the texts are rebuilt
  as ``[user: prompt_text, assistant: response_text]`` and rendered with the reward model's chat template
  (plain ``prompt_text + response_text`` when it has none), then tokenized by the reward model's tokenizer.
  Empty texts are decoded from the ids with the policy tokenizer (special tokens skipped); without one the
  sample fails with ``InvalidInput``. Note that ``prompt_ids`` usually hold the policy's *templated* prompt,
  so a decoded prompt keeps the policy template's role words; send ``prompt_text`` as the raw user message
  for a faithful re-rendering.

Sequences longer than ``max_length`` (capped by the model's ``max_position_embeddings``) keep their **last**
``max_length`` tokens: the score is read at the final token, so the end of the response must survive and the
start of the prompt is what gets dropped.

Serving: a batch is grouped by length into at most ``length_buckets`` forward passes when that cuts
the padded tokens by a fifth or more; each pass is staged (padded, and on CUDA pinned and copied
non-blocking on a copy stream) before the model is taken, so with two batches in flight (the source's
capacity on an accelerator) the next batch is assembled while this one computes. On the CPU there is nothing to
overlap (staging and the forward pass share the cores): one batch is in flight (``batches_in_flight`` sets another
number). A batch sent first (another tenant's, back from idle) overtakes the batches in flight: it takes the model
before any batch staged or waiting for it, and on the CPU the pass in flight also pauses before its next layer, the
new batch runs, and the paused pass goes on where it stopped, so an arriving step waits for one layer, not a whole
batch. On an accelerator (or under ``torch_compile``) the pass in flight finishes first: the host queues a pass's
kernels layers ahead of the device, so pausing the host would not pause the pass.
``torch_compile: true`` wraps the forward in ``torch.compile(dynamic=True, backend=compile_backend)``; off by default
(the first batch of each shape class compiles, seconds to minutes).

The batch is right-padded with an attention mask, and each row's score is the classifier logit at that row's
last real token (found from its length, not from pad ids, so a sequence that contains the pad token is still
scored at its true end). A sample's score therefore does not depend on its batch-mates.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rewardmesh.common.errors import InvalidInput, SourceFailed, Unavailable
from rewardmesh.reward_engine.devices import resolve_device, resolve_dtype
from rewardmesh.reward_engine.sources import options
from rewardmesh.reward_engine.types import BatchResult, Capacity, RewardInput, RewardOutput, RewardSource, SourceKind

logger = logging.getLogger(__name__)

_RETOKENIZE = ("auto", "always", "never")
# Batches in flight on an accelerator: one computing, the next staged (built, padded, copied) meanwhile, while the
# host is otherwise idle. A third would only wait for the model's lock, holding its samples out of the fair queue.
BATCHES_IN_FLIGHT = 2
# On the CPU, staging and the forward pass share the same cores: nothing overlaps, and a staged batch would only
# hold its samples out of the fair queue (measured: bench.shared_fleet, docs/shared-fleet.md).
CPU_BATCHES_IN_FLIGHT = 1


def _check_options(where: str, retokenize: str, max_length: int, length_buckets: int, batches_in_flight: int) -> None:
    """Reject a reward model's options before anything is loaded, naming the option."""
    options.one_of(where, "retokenize", retokenize, _RETOKENIZE)
    options.integer(where, "max_length", max_length, minimum=1)
    options.integer(where, "length_buckets", length_buckets, minimum=1)
    options.integer(where, "batches_in_flight", batches_in_flight, minimum=0, note=" (0: the device's own)")


class ModelSource(RewardSource):
    """Scores samples with a local sequence-classification reward model."""

    kind = SourceKind.MODEL

    def __init__(
        self,
        name: str,
        path: str,
        device: str = "auto",
        dtype: str = "auto",
        max_length: int = 4096,
        policy_tokenizer: str | None = None,
        retokenize: str = "auto",
        score_index: int = 0,
        length_buckets: int = 4,
        torch_compile: bool = False,
        compile_backend: str = "inductor",
        batches_in_flight: int = 0,
    ) -> None:
        """``batches_in_flight``: batches handed to the model at once, one computing and the others staged
        meanwhile (0: the device's own, 2 on an accelerator and 1 on the CPU); the pipeline's
        ``max_concurrent_batches`` (2 for a model by default) still caps it."""
        where = options.source_where("reward model", name)
        self.name = name
        self.target = str(path)
        _check_options(where, retokenize, max_length, length_buckets, batches_in_flight)
        self.length_buckets = length_buckets
        self.device: torch.device = _pick_device(device, name)
        self.dtype: torch.dtype = _pick_dtype(dtype, self.device, name)

        self.tokenizer: PreTrainedTokenizerBase = _load_tokenizer(path, f"reward model {name!r}")
        model = self._load_model(path)
        self._model: PreTrainedModel | None = model
        self.score_index, self.max_length, self.vocab_size, self.pad_token_id = self._read_model_config(
            model, score_index, max_length
        )

        # Read the logit at each row's true last token ourselves when the model is "backbone + linear head"
        # (every decoder *ForSequenceClassification); otherwise trust the model's own pooling.
        head = getattr(model, "score", None)
        backbone = getattr(model, model.base_model_prefix, None)
        self._head: torch.nn.Module | None = head if isinstance(head, torch.nn.Linear) else None
        self._backbone: torch.nn.Module | None = backbone if isinstance(backbone, torch.nn.Module) else None
        self.torch_compile = bool(torch_compile)
        self._forward_fn: Any = self._backbone if self._head is not None and self._backbone is not None else model
        if self.torch_compile:
            # Compiled lazily on the first forward (and again per new shape class): warmup() pays for the first.
            # dynamic=True: batch size and width change from batch to batch.
            self._forward_fn = torch.compile(self._forward_fn, dynamic=True, backend=compile_backend)
        # On CUDA, batch k+1's host-to-device copies run on their own stream while batch k computes.
        self._copy_stream: Any = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

        self.policy_tokenizer: PreTrainedTokenizerBase | None = (
            _load_tokenizer(policy_tokenizer, f"reward model {name!r} policy_tokenizer") if policy_tokenizer else None
        )
        self.retokenizes = self._decide_retokenize(retokenize)

        self._turns = _Turns()  # one forward pass at a time: predictable memory, no thrashing
        self._capacity = self._install_turns(model, batches_in_flight)
        # Rust tokenizers can raise "Already borrowed" when one instance is used from several threads at once.
        self._tokenizer_lock = threading.Lock()
        self._warned_truncation = False
        self._log_loaded(path, compile_backend)

    def _load_model(self, path: str) -> PreTrainedModel:
        """The sequence classifier at ``path``, on this source's device and dtype, in eval mode."""
        try:
            model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True, dtype=self.dtype)
        except Exception as e:  # transformers raises many types; the caller needs one clear message
            raise ValueError(
                f"reward model {self.name!r}: cannot load a sequence classifier from {path}: {type(e).__name__}: {e}"
            ) from e
        model.to(device=self.device, dtype=self.dtype)  # also covers transformers versions that ignore dtype=
        model.eval()
        return model

    def _read_model_config(self, model: Any, score_index: int, max_length: int) -> tuple[int, int, int, int]:
        """The score index (checked against the labels), max length (capped by the model's positions), vocabulary
        size and pad id this source scores with (``model`` is Any: transformers' config attributes are untyped)."""
        text_config = model.config.get_text_config()
        num_labels = int(model.config.num_labels)
        if not 0 <= score_index < num_labels:
            raise ValueError(
                f"reward model {self.name!r}: score_index {score_index} out of range for {num_labels} label(s)"
            )
        max_pos = getattr(text_config, "max_position_embeddings", None)
        capped = min(max_length, int(max_pos)) if max_pos else max_length
        vocab_size = int(model.get_input_embeddings().weight.shape[0])
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = getattr(text_config, "pad_token_id", None)
        if pad is None:
            pad = self.tokenizer.eos_token_id
        return score_index, capped, vocab_size, int(pad) if isinstance(pad, int) else 0

    def _decide_retokenize(self, retokenize: str) -> bool:
        """Whether samples are rebuilt from text: always, never, or (auto) when the policy's vocabulary differs."""
        if retokenize == "always":
            return True
        if retokenize == "never" or self.policy_tokenizer is None:
            return False
        return bool(self.policy_tokenizer.get_vocab() != self.tokenizer.get_vocab())

    def _install_turns(self, model: PreTrainedModel, batches_in_flight: int) -> Capacity:
        """Hook the give-way points into the model and say the source's capacity, naming where a pass gives way."""
        # On the CPU a pass gives way to a batch sent first before each of its layers. Not under torch.compile (the
        # hooks would be traced into the graph), nor on an accelerator, where the host queues layers ahead of the
        # device: pausing the host would not pause what the device has queued.
        layers = layer_stack(self._backbone or model) if self.device.type == "cpu" and not self.torch_compile else None
        for layer in layers or ():
            layer.register_forward_pre_hook(self._turns.give_way_hook)
        # A batch sent first takes the model before the batches staged or waiting for it, wherever it runs; where a
        # pass gives way to it says the unit.
        on_cpu = self.device.type == "cpu"
        batches = batches_in_flight or (CPU_BATCHES_IN_FLIGHT if on_cpu else BATCHES_IN_FLIGHT)
        where = "on the CPU" if on_cpu else f"on {self.device}"
        gives_way = "gives way at its next layer" if layers is not None else "finishes its pass first"
        unit = f"model batch{'es' if batches > 1 else ''} in flight ({where}; the one computing {gives_way})"
        return Capacity(batches, unit, "batch", overtakes=True)

    def _log_loaded(self, path: str, compile_backend: str) -> None:
        logger.info(
            "reward model %r: %s on %s/%s, max_length %d, %s",
            self.name,
            path,
            self.device,
            self.dtype,
            self.max_length,
            "re-tokenizes text" if self.retokenizes else "scores policy token ids",
        )
        if self.torch_compile:
            logger.info(
                "reward model %r: torch.compile on, backend %s (the first batch of each shape class compiles)",
                self.name,
                compile_backend,
            )

    @property
    def capacity(self) -> Capacity:
        """Batches in flight (by default two on an accelerator, the next staged while one computes; one on the CPU),
        which a batch sent first overtakes."""
        return self._capacity

    # ------------------------------------------------------------------------------------------ scoring

    async def score_batch(self, batch: list[RewardInput]) -> BatchResult:
        """Score a batch in a worker thread, so the event loop keeps serving during the forward pass."""
        if self._model is None:
            return [Unavailable(f"reward model {self.name!r} is closed") for _ in batch]
        if not batch:
            return []
        return await asyncio.to_thread(self._score_batch_sync, batch)

    async def score_batch_first(self, batch: list[RewardInput]) -> tuple[BatchResult, float]:
        """As score_batch, ahead of the batches in flight: the pass computing pauses before its next layer (on the CPU)
        or ends, and this batch takes the model next; also how long it waited for that."""
        return await asyncio.to_thread(self._score_batch_ahead, batch)

    def score_tokens(self, token_ids: Sequence[np.ndarray | Sequence[int]]) -> list[float]:
        """Score ready token sequences in one padded batch (synchronous; for offline and benchmark use).

        Raises ``InvalidInput`` if any sequence is empty or holds ids outside the model's vocabulary, and
        whatever the forward pass raises.
        """
        seqs = [self._check_ids(np.asarray(ids), f"token_ids[{i}]") for i, ids in enumerate(token_ids)]
        if not seqs:
            return []
        return self._forward(seqs)

    async def warmup(self) -> None:
        """One tiny forward pass, so the first real batch does not pay for lazy CUDA/kernel initialisation."""
        await asyncio.to_thread(self.score_tokens, [np.arange(min(4, self.vocab_size))])

    async def close(self) -> None:
        """Drop the model (waiting for a forward pass in flight) and give its memory back."""
        await asyncio.to_thread(self._close_sync)

    def _close_sync(self) -> None:
        with self._turns.hold():
            self._model = self._head = self._backbone = self._forward_fn = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---------------------------------------------------------------------------------------- internals

    def _score_batch_ahead(self, batch: list[RewardInput]) -> tuple[BatchResult, float]:
        with self._turns.ahead() as waited:
            return self._score_batch_sync(batch), waited()

    def _score_batch_sync(self, batch: list[RewardInput]) -> BatchResult:
        results: list[RewardOutput | BaseException | None] = [None] * len(batch)
        ready: list[np.ndarray] = []
        where: list[int] = []
        for i, sample in enumerate(batch):
            self._turns.give_way()
            try:
                ready.append(self._sequence(sample))
                where.append(i)
            except InvalidInput as e:
                results[i] = e
            except Exception as e:  # e.g. the reward model's chat template rejects the conversation
                failed = SourceFailed(
                    f"reward model {self.name!r}: cannot build the input of {sample.sample_id!r}: "
                    f"{type(e).__name__}: {e}"
                )
                failed.__cause__ = e
                results[i] = failed
        if ready:
            try:
                scores = self.score_tokens(ready)
            except Unavailable as e:  # closed while this batch waited for the model
                for i in where:
                    results[i] = Unavailable(str(e))
            except Exception as e:
                logger.warning("reward model %r: forward pass over %d samples failed: %r", self.name, len(ready), e)
                for i in where:
                    failed = SourceFailed(
                        f"reward model {self.name!r}: forward pass failed on a batch of {len(ready)}: "
                        f"{type(e).__name__}: {e}"
                    )
                    failed.__cause__ = e
                    results[i] = failed
            else:
                for i, score in zip(where, scores, strict=True):
                    results[i] = RewardOutput(score=score)
        out: BatchResult = []
        for r in results:
            assert r is not None
            out.append(r)
        return out

    def _sequence(self, sample: RewardInput) -> np.ndarray:
        """The token ids the reward model sees for one sample, checked and truncated."""
        if not self.retokenizes:
            ids = np.concatenate([_ids(sample.prompt_ids, "prompt_ids"), _ids(sample.response_ids, "response_ids")])
            if ids.size == 0:
                raise InvalidInput("prompt_ids and response_ids are both empty")
            return self._check_ids(ids, "prompt_ids/response_ids")
        with self._tokenizer_lock:
            prompt = self._text(sample.prompt_text, sample.prompt_ids, "prompt")
            response = self._text(sample.response_text, sample.response_ids, "response")
            conversation = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            if self.tokenizer.chat_template:
                text = self.tokenizer.apply_chat_template(conversation, tokenize=False)
                assert isinstance(text, str)
                encoded = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                encoded = self.tokenizer(prompt + response)["input_ids"]
        ids = np.asarray(encoded, dtype=np.int64)
        if ids.size == 0:
            raise InvalidInput("prompt_text and response_text are both empty")
        return self._check_ids(ids, "prompt_text/response_text")

    def _text(self, text: str, ids: np.ndarray, field: str) -> str:
        if text:
            return text
        token_ids = _ids(ids, f"{field}_ids")
        if token_ids.size == 0:
            return ""
        if self.policy_tokenizer is None:
            raise InvalidInput(
                f"{field}_text is empty: reward model {self.name!r} re-tokenizes text (its tokenizer is "
                f"not the policy's) and has no policy_tokenizer to decode {field}_ids; send {field}_text"
            )
        decoded = self.policy_tokenizer.decode(token_ids.tolist(), skip_special_tokens=True)
        assert isinstance(decoded, str)
        return decoded

    def _check_ids(self, ids: np.ndarray, field: str) -> np.ndarray:
        if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
            raise InvalidInput(f"{field}: expected a 1-D integer array, got shape {ids.shape} {ids.dtype}")
        if ids.size == 0:
            raise InvalidInput(f"{field}: empty sequence")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            # Checked here because an out-of-range id on CUDA is a device-side assert that kills the process.
            bad = lo if lo < 0 else hi
            raise InvalidInput(f"{field}: token id {bad} outside the reward model's vocabulary [0, {self.vocab_size})")
        if ids.size > self.max_length:
            if not self._warned_truncation:
                self._warned_truncation = True
                logger.warning(
                    "reward model %r: truncating a %d-token input to its last %d tokens (further truncations "
                    "are not logged)",
                    self.name,
                    ids.size,
                    self.max_length,
                )
            ids = ids[-self.max_length :]
        return ids.astype(np.int64, copy=False)

    def _forward(self, seqs: list[np.ndarray]) -> list[float]:
        """Score sequences: grouped by length into at most `length_buckets` forward passes (less padding), each
        staged (padded, pinned, copied) before the model is taken, so with two batches in flight one is assembled
        while the other computes. The batch keeps the model from one of its passes to the next (batches in flight
        take it in turns, not pass by pass), giving way between them only to a batch sent first."""
        lengths = np.fromiter((s.size for s in seqs), dtype=np.int64, count=len(seqs))
        scores = np.zeros(len(seqs), dtype=np.float64)
        groups = length_buckets(lengths, self.length_buckets)
        passes = [self._stage([seqs[r] for r in rows], lengths[rows]) for rows in groups]
        with self._turns.hold():
            for k, (rows, staged) in enumerate(zip(groups, passes, strict=True)):
                if k:
                    self._turns.give_way(holding=True)
                scores[rows] = self._run(staged)
        return scores.tolist()

    def _stage(self, seqs: list[np.ndarray], lengths: np.ndarray) -> _Staged:
        """One padded batch on the model's device. On CUDA the host buffers are pinned and the copies are
        non-blocking on a copy stream; the forward waits for them on an event, not on the host."""
        rows, width = len(seqs), int(lengths.max())
        pinned = self._copy_stream is not None
        ids = torch.full((rows, width), self.pad_token_id, dtype=torch.int64, pin_memory=pinned)
        mask = torch.zeros((rows, width), dtype=torch.int64, pin_memory=pinned)
        last = torch.from_numpy(lengths - 1)
        ids_np, mask_np = ids.numpy(), mask.numpy()
        for row, s in enumerate(seqs):
            ids_np[row, : s.size] = s
            mask_np[row, : s.size] = 1
        if not pinned:
            return _Staged(ids.to(self.device), mask.to(self.device), last.to(self.device), None, ())
        last = last.pin_memory()
        with torch.cuda.stream(self._copy_stream):
            on_device = [t.to(self.device, non_blocking=True) for t in (ids, mask, last)]
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        # The pinned host buffers must outlive their asynchronous copies: the staged batch holds them.
        return _Staged(on_device[0], on_device[1], on_device[2], ready, (ids, mask, last))

    def _run(self, staged: _Staged) -> np.ndarray:
        """One forward pass over a staged batch; the caller holds the model."""
        with torch.inference_mode():  # inference_mode is per thread: it must be set here
            forward = self._forward_fn
            if self._model is None or forward is None:
                raise Unavailable(f"reward model {self.name!r} is closed")
            ids_t, mask_t, last = staged.ids, staged.mask, staged.last
            if staged.ready is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(staged.ready)
                for t in (ids_t, mask_t, last):
                    t.record_stream(current)  # their memory is not reused before this stream is done with them
            if self._head is not None and self._backbone is not None:
                out: Any = forward(input_ids=ids_t, attention_mask=mask_t, use_cache=False)
                hidden = out[0]  # last_hidden_state, [batch, width, hidden]
                rows = torch.arange(ids_t.shape[0], device=self.device)
                logits = self._head(hidden[rows, last])
            else:
                logits = forward(input_ids=ids_t, attention_mask=mask_t).logits
            return logits[:, self.score_index].float().cpu().numpy().astype(np.float64)


class _Turns:
    """Who runs the model: one forward pass at a time, and the passes of a batch sent first (`ahead`) before the
    others, which give way to it between their layers and between the samples they are built from (`give_way`), and
    go on once that batch is done, a paused pass before any new one. At most two batches' activations are live: the
    paused one's and the one ahead."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._busy = False  # a pass runs on the model
        self._ahead = 0  # batches sent first, not done yet
        self._paused = 0  # passes that gave way in the middle, holding their activations
        self._mine = threading.local()  # whether this thread's batch was sent first
        self.waiting = 0  # batches waiting to take the model

    @contextmanager
    def ahead(self) -> Iterator[Callable[[], float]]:
        """This thread's batch runs ahead of the others until it is done: its passes first, theirs paused. Yields
        how long, so far, it has waited for the model (for the pass computing to pause)."""
        with self._cv:
            self._ahead += 1
        self._mine.ahead = True
        self._mine.waited = 0.0
        try:
            yield lambda: float(self._mine.waited)
        finally:
            self._mine.ahead = False
            with self._cv:
                self._ahead -= 1
                self._cv.notify_all()

    def _first(self) -> bool:
        return bool(getattr(self._mine, "ahead", False))

    def _waits(self) -> bool:
        return bool(self._ahead) and not self._first()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """The model, for a batch's passes, once no pass runs and neither a batch sent first nor a paused pass is owed
        it (unless this is the batch sent first)."""
        since = time.monotonic()
        with self._cv:
            self.waiting += 1
            while self._busy or (not self._first() and (self._ahead or self._paused)):
                self._cv.wait()
            self.waiting -= 1
            self._busy = True
        if self._first():
            self._mine.waited += time.monotonic() - since
        try:
            yield
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def give_way(self, *, holding: bool = False) -> None:
        """Work of a batch not sent first pauses here while one sent first is not done (`holding`: this thread's
        pass has the model, and lets it go meanwhile): the host's cores and the interpreter are what the batch sent
        first runs on too."""
        if not self._waits():
            return
        with self._cv:
            if holding:
                self._busy = False
                self._paused += 1
                self._cv.notify_all()
            while self._waits() or (holding and self._busy):
                self._cv.wait()
            if holding:
                self._paused -= 1
                self._busy = True

    def give_way_hook(self, module: torch.nn.Module, args: Any) -> None:
        """A forward pre-hook on each layer: the pass gives way here (see `give_way`)."""
        self.give_way(holding=True)


def layer_stack(backbone: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's stack of layers (the list of modules holding most of its parameters), where a pass may pause."""
    best, most = None, 0
    for module in backbone.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1:
            size = sum(p.numel() for p in module.parameters())
            if size > most:
                best, most = module, size
    return best


class _Staged:
    """A padded batch on the model's device, ready for the forward pass."""

    __slots__ = ("hold", "ids", "last", "mask", "ready")

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, last: torch.Tensor, ready: Any, hold: tuple) -> None:
        self.ids, self.mask, self.last, self.ready, self.hold = ids, mask, last, ready, hold


def length_buckets(
    lengths: np.ndarray, max_buckets: int, *, min_saving: float = 0.2, min_rows: int = 4
) -> list[np.ndarray]:
    """Row indices grouped by length into at most `max_buckets` forward passes.

    Starting from one group of all rows (sorted by length), a group is split in two at the point that saves the
    most padded tokens (rows x longest row), as long as that saves at least `min_saving` of the batch's padded
    tokens and leaves `min_rows` rows on each side: a forward pass has a fixed cost (kernel launches on a GPU),
    so a batch of similar lengths stays one pass. Scores do not depend on the grouping (see `_forward`).
    """
    order = np.argsort(lengths, kind="stable")
    groups = [order]
    while len(groups) < max_buckets:
        padded = sum(len(g) * int(lengths[g[-1]]) for g in groups)
        best: tuple[int, int, int] | None = None  # (saving, group, split)
        for gi, g in enumerate(groups):
            n = len(g)
            if n < 2 * min_rows:
                continue
            ls = lengths[g]
            k = np.arange(min_rows, n - min_rows + 1)
            saving = (k * (int(ls[-1]) - ls[k - 1])).astype(np.int64)  # the first k rows padded to ls[k-1]
            at = int(np.argmax(saving))
            if best is None or int(saving[at]) > best[0]:
                best = (int(saving[at]), gi, int(k[at]))
        if best is None or best[0] < min_saving * padded:
            break
        _, gi, cut = best
        g = groups.pop(gi)
        groups[gi:gi] = [g[:cut], g[cut:]]
    return groups


def _ids(ids: np.ndarray, field: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise InvalidInput(f"{field}: expected a 1-D integer array, got shape {arr.shape} {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _pick_device(device: str, name: str) -> torch.device:
    try:
        return resolve_device(device)
    except ValueError as e:
        raise ValueError(f"reward model {name!r}: {e}") from None


def _pick_dtype(dtype: str, device: torch.device, name: str) -> torch.dtype:
    try:
        return resolve_dtype(dtype, device)
    except ValueError as e:
        raise ValueError(f"reward model {name!r}: {e}") from None


def _load_tokenizer(path: str, what: str) -> PreTrainedTokenizerBase:
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"{what}: {path} is not a local directory (models are loaded from local files only; "
            "download the model first)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ValueError(f"{what}: cannot load a tokenizer from {path}: {type(e).__name__}: {e}") from e
    assert isinstance(tokenizer, PreTrainedTokenizerBase)
    return tokenizer
