"""The hf backend's slot-cache decode path: rows join a running batch at any step (plain full-attention models
under sdpa or eager attention), their KV cache in a :class:`~.hf_kv_cache.SlotCache`. Runs on the worker thread."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rewardmesh.server.rollout.backends.hf_decode import Decoder, positions
from rewardmesh.server.rollout.backends.hf_kv_cache import SlotCache, cache_layers
from rewardmesh.server.rollout.backends.hf_rows import Row

__all__ = ["SlotBatch", "SlotDecoder"]


@dataclass(eq=False)
class SlotBatch:
    """Worker-thread state of the running batch on a :class:`SlotCache`: row ``i`` lives in slot ``i``."""

    cache: SlotCache
    rows: list[Row] = field(default_factory=list)
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


class SlotDecoder(Decoder):
    """Rows join and leave the running batch at step boundaries; a step costs the same either way."""

    def new_batch(self) -> SlotBatch:
        """An empty running batch on a fresh slot cache."""
        d = self.device

        def empty(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(0, dtype=dtype, device=d)

        return SlotBatch(
            cache=SlotCache(len(cache_layers(self._lm.config))),
            next_pos=empty(torch.long),
            last=empty(torch.long),
            temps=empty(torch.float32),
            top_ks=empty(torch.long),
            top_ps=empty(torch.float32),
        )

    def step(
        self, batch: SlotBatch, admit: list[Row], dropped: set[Row], version: int, step: int
    ) -> tuple[SlotBatch, list[Row]]:
        """One step: the running rows decode one token each, and the admitted rows' prompts are prefilled.

        Two forward passes when rows join, so a running row is never padded to a new prompt's width (with real
        prompts that padding would cost a running row hundreds of tokens of compute per join). Both write their
        newest token at the same cache column, after which the new rows decode with the others.
        Returns the running batch after the step and the rows that finished in it.
        """
        with torch.inference_mode():
            keep = [i for i, row in enumerate(batch.rows) if row.finish_reason is None and row not in dropped]
            if len(keep) < len(batch.rows):
                self._slot_remove(batch, keep)
            old, new = len(batch.rows), len(admit)
            n = old + new
            if n == 0:
                return batch, []
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
            finished: list[Row] = []
            tokens = self._sample_slots(
                batch, torch.cat(logits) if len(logits) > 1 else logits[0], version, step, finished
            )
            batch.last[:n] = tokens
            return batch, finished

    def _slot_forward(self, batch: SlotBatch, first: int, rows: list[Row], lengths: list[int]) -> torch.Tensor:
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
            pos = batch.next_pos[first : first + n].unsqueeze(-1)
            allowed = (cols.unsqueeze(0) >= start_t.unsqueeze(-1))[:, None, None, :]
        else:  # prompts, right-aligned to the longest
            ids_cpu, real = self._right_aligned([row.slot.request.prompt_ids for row in rows])
            ids, pos = ids_cpu.to(device), positions(real).to(device)
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
            return self._forward(ids, mask, pos, cache)[0]
        finally:
            cache.prompts = []

    def _slot_remove(self, batch: SlotBatch, keep: list[int]) -> None:
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

    def _sample_slots(
        self, batch: SlotBatch, logits: torch.Tensor, version: int, step: int, finished: list[Row]
    ) -> torch.Tensor:
        n = len(batch.rows)
        return self._sample(
            batch.rows, logits, batch.temps[:n], batch.top_ks[:n], batch.top_ps[:n], version, step, finished
        )
