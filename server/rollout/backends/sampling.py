"""Per-row temperature / top-k / top-p sampling of a batch's next tokens, with the drawn tokens' log-probs."""

from __future__ import annotations

import torch

__all__ = ["sample", "sample_with_logprobs"]


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
