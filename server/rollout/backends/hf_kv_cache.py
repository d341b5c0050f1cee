"""The hf backend's slot KV cache: preallocated per-row buffers that rows join and leave without copying the cache,
and the test of whether a model's cache can live in it."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

__all__ = ["SlotCache", "cache_layers", "joinable"]


class SlotCache(Cache):
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


def cache_layers(config: Any) -> list[Any]:
    """The cache layers transformers would build for this model (sliding windows, linear attention ...)."""
    from transformers import DynamicCache

    try:
        return list(DynamicCache(config=config).layers)
    except Exception:  # a config DynamicCache cannot read: take the general path
        return []


def joinable(layer: Any) -> bool:
    """A plain full-attention KV layer: [batch, heads, seq, dim] tensors that can be padded and concatenated."""
    from transformers.cache_utils import DynamicLayer

    return type(layer) is DynamicLayer
