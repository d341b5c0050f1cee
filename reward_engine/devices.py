"""The one dtype/device resolver, for every model the project loads (policy backends, reward models)."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def resolve_device(device: str) -> torch.device:
    """``auto``: the GPU when there is one, else the CPU. ValueError for a malformed or absent device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        picked = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"bad device {device!r}: {e}") from e
    if picked.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return picked


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on a GPU that has it, fp16 on one that does not (half precision is what a GPU is fast
    at; vLLM picks the same), fp32 on a CPU, where half precision is slow."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use auto or one of {', '.join(sorted(DTYPES))}") from None
