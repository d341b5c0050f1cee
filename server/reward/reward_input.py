"""A Sample message as the engine's RewardInput: every size checked against the server's limits, ids checked
but made into arrays only when a source reads them, texts decoded from ids when a rule or judge needs them."""

from __future__ import annotations

from typing import Any

import numpy as np

from rewardmesh.common.errors import InvalidInput
from rewardmesh.common.tensors import ids_checked, ids_from
from rewardmesh.reward_engine.types import RewardInput, WireInput
from rewardmesh.server.decoding import decoder
from rewardmesh.server.limits import DEFAULT_LIMITS, Limits, check, extra_info
from rewardmesh.v1 import common_pb2


def to_reward_input(sample: common_pb2.Sample, tokenizer: Any = None, lim: Limits = DEFAULT_LIMITS) -> RewardInput:
    """Decode and validate a Sample; InvalidInput names the offending field (and the limit it is over)."""
    sid, data_source, ground_truth = sample.sample_id, sample.data_source, sample.ground_truth
    prompt_text, response_text = sample.prompt_text, sample.response_text
    most = lim.max_text_chars
    if (  # one cheap test per sample; the named checks only when something is over
        len(sid) > lim.max_sample_id_chars
        or len(prompt_text) > most
        or len(response_text) > most
        or len(ground_truth) > most
        or len(data_source) > most
    ):
        texts = (prompt_text, response_text, ground_truth, data_source)
        check(len(sid), lim.max_sample_id_chars, "sample.sample_id length", "max_sample_id_chars")
        for name, text in zip(("prompt_text", "response_text", "ground_truth", "data_source"), texts, strict=True):
            check(len(text), lim.max_text_chars, f"sample.{name} length", "max_text_chars")
    # Checked here, made into arrays only if a source reads them (WireInput): rules and judges never do.
    prompt_ids = ids_checked(sample.prompt_ids, "sample.prompt_ids")
    response_ids = ids_checked(sample.response_ids, "sample.response_ids")
    n_prompt, n_response = _count(prompt_ids), _count(response_ids)
    if n_prompt > lim.max_tensor_elements or n_response > lim.max_tensor_elements:
        check(n_prompt, lim.max_tensor_elements, "sample.prompt_ids size", "max_tensor_elements")
        check(n_response, lim.max_tensor_elements, "sample.response_ids size", "max_tensor_elements")
    mask = None
    if sample.HasField("response_mask"):
        mask = ids_from(sample.response_mask, "sample.response_mask")
        if mask.shape != (n_response,):
            raise InvalidInput(
                f"sample.response_mask has shape {list(mask.shape)}, but sample.response_ids has [{n_response}]"
            )
    extra: dict[str, Any] = {}
    if sample.HasField("extra_info"):
        extra = extra_info(sample.extra_info, "sample.extra_info", lim)
    inp = WireInput.of(
        sid, prompt_ids, response_ids, prompt_text, response_text, data_source, ground_truth, extra, mask
    )
    if tokenizer is not None and ((not prompt_text and n_prompt) or (not response_text and n_response)):
        decode = decoder(tokenizer)
        if not prompt_text and n_prompt:
            inp.prompt_text = decode(inp.prompt_ids.tolist())
        if not response_text and n_response:
            inp.response_text = decode(inp.response_ids.tolist())
    return inp


def _count(ids: bytes | np.ndarray) -> int:
    """Elements of what ids_checked returned."""
    return len(ids) >> 2 if ids.__class__ is bytes else ids.size  # type: ignore[union-attr]
