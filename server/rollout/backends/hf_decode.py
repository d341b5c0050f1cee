"""The hf backend's forward passes: one step of the running batch (decode every row, prefill the rows that join).

:class:`Decoder` holds what both decode paths share (padding prompts, the model call, sampling, stop checks);
:class:`DynamicDecoder` is the general path on transformers' own cache, where new rows wait for an empty batch.
The slot-cache path, where rows join a running batch, is :class:`~.hf_slot_decode.SlotDecoder`. Everything here
runs on the backend's worker thread.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from rewardmesh.server.rollout.backends.hf_rows import Row, next_uniform
from rewardmesh.server.rollout.backends.requests import trim_at_stop
from rewardmesh.server.rollout.backends.sampling import sample_with_logprobs

__all__ = ["Decoder", "DynamicBatch", "DynamicDecoder", "cache_argument", "positions"]


def cache_argument(lm: Any) -> str:
    """The name the model's forward takes its KV cache under, which its output also returns it as: ``cache`` in the
    transformers releases that renamed it (``past_key_values`` warns there, and goes in 5.40), ``past_key_values``
    in the releases before."""
    try:
        parameters = inspect.signature(lm.forward).parameters
    except (TypeError, ValueError):  # no signature to read: the name every release before the rename takes
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


@dataclass(eq=False)
class DynamicBatch:
    """Worker-thread state of the running batch; the loop only reads ``rows`` and their results."""

    rows: list[Row] = field(default_factory=list)  # in tensor order
    cache: Any = None
    mask: torch.Tensor | None = None  # [rows, past]: 0 on left padding
    next_pos: torch.Tensor | None = None  # [rows]: position id of the next input token
    last: torch.Tensor | None = None  # [rows]: last sampled token (not yet in the cache)
    temps: torch.Tensor | None = None
    top_ks: torch.Tensor | None = None
    top_ps: torch.Tensor | None = None


class Decoder:
    """What both decode paths share: one loaded model, its pad token, and the tokenizer stop strings are read with."""

    def __init__(
        self, lm: Any, *, pad_id: int, device: torch.device, dtype: torch.dtype, bool_mask: bool, tokenizer: Any
    ) -> None:
        self._lm = lm
        self._pad_id = pad_id
        self.device = device
        self.dtype = dtype
        self._bool_mask = bool_mask  # sdpa takes a boolean mask; eager an additive one
        self._decode_tokenizer = tokenizer  # the worker thread's own copy (see HFBackend.__init__)
        self._cache_argument = cache_argument(lm)

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
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_argument: cache},
        )
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits, getattr(out, self._cache_argument)

    def _sample(
        self,
        rows: list[Row],
        logits: torch.Tensor,
        temps: torch.Tensor,
        top_ks: torch.Tensor,
        top_ps: torch.Tensor,
        version: int,
        step: int,
        finished: list[Row],
    ) -> torch.Tensor:
        """Draw every row's next token, record it (and its log-prob and version), collect the rows that end."""
        early = [(i, row.stop_ids) for i, row in enumerate(rows) if len(row.tokens) < row.slot.request.min_tokens]
        for i, stop_ids in early:  # below min_tokens a stop token cannot be drawn, as in vLLM
            logits[i, list(stop_ids)] = float("-inf")
        uniforms = torch.tensor([next_uniform(row) for row in rows], dtype=torch.float32)
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

    def _append(self, row: Row, token: int) -> bool:
        """Record a sampled token; True when it ends the row (stop token, stop string or max_tokens)."""
        row.tokens.append(token)
        if token in row.stop_ids:
            row.finish_reason = "stop"
            return True
        if row.stops and len(row.tokens) >= row.slot.request.min_tokens:
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


class DynamicDecoder(Decoder):
    """The general path: transformers' own cache (any model), rows admitted only into an empty batch."""

    def new_batch(self) -> DynamicBatch:
        return DynamicBatch()

    def step(
        self, batch: DynamicBatch, admit: list[Row], dropped: set[Row], version: int, step: int
    ) -> tuple[DynamicBatch, list[Row]]:
        """One step: drop rows that finished or were cancelled, decode one token for every running row, then
        prefill the admitted rows (their first token) and merge them into the batch.

        Returns the running batch after the step and the rows that finished in it.
        """
        with torch.inference_mode():
            keep = [i for i, row in enumerate(batch.rows) if row.finish_reason is None and row not in dropped]
            if len(keep) < len(batch.rows):
                self._compact(batch, keep)
            finished: list[Row] = []
            if batch.rows:
                logits = self._decode(batch)
                batch.last = self._sample_rows(batch, logits, version, step, finished)
            if admit:  # only into an empty batch on this path (see HFBackend._admit)
                joining, logits = self._prefill(admit)
                joining.last = self._sample_rows(joining, logits, version, step, finished)
                batch = joining
            return batch, finished

    def _sample_rows(
        self, batch: DynamicBatch, logits: torch.Tensor, version: int, step: int, finished: list[Row]
    ) -> torch.Tensor:
        assert batch.temps is not None and batch.top_ks is not None and batch.top_ps is not None
        return self._sample(batch.rows, logits, batch.temps, batch.top_ks, batch.top_ps, version, step, finished)

    def _prefill(self, rows: list[Row]) -> tuple[DynamicBatch, torch.Tensor]:
        """Run the admitted rows' prompts (left-padded to one width): their batch state and last logits."""
        from transformers import DynamicCache

        ids, mask = self._right_aligned([row.slot.request.prompt_ids for row in rows])
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = positions(mask)
        requests = [row.slot.request for row in rows]
        logits, cache = self._forward(ids, mask, pos, DynamicCache(config=self._lm.config))
        return DynamicBatch(
            rows=list(rows),
            cache=cache,
            mask=mask,
            next_pos=pos[:, -1] + 1,
            temps=torch.tensor([r.temperature for r in requests], dtype=torch.float32, device=self.device),
            top_ks=torch.tensor([r.top_k for r in requests], dtype=torch.long, device=self.device),
            top_ps=torch.tensor([r.top_p for r in requests], dtype=torch.float32, device=self.device),
        ), logits

    def _decode(self, batch: DynamicBatch) -> torch.Tensor:
        assert batch.mask is not None and batch.next_pos is not None and batch.last is not None
        ones = torch.ones((batch.mask.shape[0], 1), dtype=batch.mask.dtype, device=batch.mask.device)
        batch.mask = torch.cat([batch.mask, ones], dim=-1)
        logits, batch.cache = self._forward(
            batch.last.unsqueeze(-1), batch.mask, batch.next_pos.unsqueeze(-1), batch.cache
        )
        batch.next_pos = batch.next_pos + 1
        return logits

    def _compact(self, batch: DynamicBatch, keep: list[int]) -> None:
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


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Each real token's position within its row (0 for left padding)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)
