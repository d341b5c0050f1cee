"""vLLM weight loading: the worker extension that stages and commits chunks next to the model, the chunking of a
state dict into safetensors messages, and the checkpoint's tensor names and shapes.

vLLM imports :class:`RewardMeshWorkerExtension` by name in its worker processes (``worker_extension_cls``); this
module imports vLLM only inside functions, so it loads on machines without vLLM.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rewardmesh.server.rollout.backends.base import WeightsNotApplied

WORKER_EXTENSION = f"{__name__}.RewardMeshWorkerExtension"
CHUNK_BYTES = 512 * 1024 * 1024  # one RPC message; keeps peak host memory bounded for large models

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


PART_SEP = "#"  # "name#i/n#d0xd1...": piece i of n of a tensor split to fit a chunk; never in a parameter name


class RewardMeshWorkerExtension:
    """Mixed into vLLM's worker (GPU or CPU); each method runs inside a worker process, next to the model.

    vLLM requires the methods not to clash with the worker's own, hence the prefix.
    """

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def rewardmesh_stage_weights(self, blob: bytes) -> int:
        """Decode one chunk and hold it until commit, so a half-sent update is never applied."""
        from safetensors.torch import load

        staged: dict[str, torch.Tensor] = self.__dict__.setdefault("_rewardmesh_staged", {})
        staged.update(load(bytes(blob)))
        return len(staged)

    def rewardmesh_check_weights(self, expected: list[str]) -> str:
        """Join split tensors and check the staged set is exactly ``expected``, loading nothing: "" when it is,
        else why not. A result rather than an exception, so the backend tells a refusal (the old weights serve on)
        from a failed load even where vLLM passes a worker's exceptions on as text."""
        staged: dict[str, torch.Tensor] = self.__dict__.get("_rewardmesh_staged", {})
        try:
            tensors = _complete(join_parts(staged), expected)
        except WeightsNotApplied as exc:
            return str(exc)
        self.__dict__["_rewardmesh_staged"] = tensors
        return ""

    def rewardmesh_commit_weights(self, expected: list[str] | None = None) -> int:
        """Join split tensors, check the staged set is exactly ``expected``, then load it in one call.

        Everything is checked before the first tensor is loaded, so a missing chunk or piece applies nothing
        (WeightsNotApplied). The call runs between engine steps (or while the engine is paused), so decoding
        sees old or new.
        """
        staged: dict[str, torch.Tensor] = self.__dict__.pop("_rewardmesh_staged", {})
        tensors = _complete(join_parts(staged), expected)
        if tensors:
            self._rewardmesh_load(list(tensors.items()))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        return len(tensors)

    def _rewardmesh_load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's in-place (layerwise) reload where the release has it, else the model's own ``load_weights``.

        After loading, vLLM processes weights into kernel formats (on CPU it repacks every linear weight and
        leaves an empty parameter behind), so a second plain ``load_weights`` would fail there; the layerwise
        reload puts checkpoint-format tensors back through that processing. Releases whose runner has no
        ``reload_weights(weights_iterator=...)`` keep their weights as loaded and take ``load_weights``.
        """
        # The worker's get_model() unwraps CUDA-graph wrappers; model_runner.model is the older spelling.
        getter = getattr(self, "get_model", None)
        model = getter() if callable(getter) else self.model_runner.model
        runner_reload = getattr(self.model_runner, "reload_weights", None)
        if callable(runner_reload) and "weights_iterator" in inspect.signature(runner_reload).parameters:
            worker_reload = getattr(self, "reload_weights", None)  # sets vLLM's current config around the call
            reload = worker_reload if callable(worker_reload) else runner_reload
            reload(weights_iterator=iter(weights), is_checkpoint_format=True)
        else:
            model.load_weights(weights)
        _refresh_tied_head(model)

    def rewardmesh_discard_weights(self) -> int:
        staged: dict[str, torch.Tensor] = self.__dict__.pop("_rewardmesh_staged", {})
        return len(staged)


def _complete(tensors: dict[str, torch.Tensor], expected: list[str] | None) -> dict[str, torch.Tensor]:
    """``tensors`` when they are exactly ``expected`` (None: anything goes), else WeightsNotApplied naming the
    difference."""
    if expected is not None and set(tensors) != set(expected):
        missing = sorted(set(expected) - set(tensors))[:5]
        extra = sorted(set(tensors) - set(expected))[:5]
        raise WeightsNotApplied(f"staged weights incomplete: missing {missing}, unexpected {extra}; nothing applied")
    return tensors


def _refresh_tied_head(model: Any) -> None:
    """An output head tied to the embeddings is never loaded itself (its checkpoint name is skipped), so its
    kernel-format copy (on a CPU, the packed GEMM weight made after the first load) still holds the first
    weights: process the head again from the shared, now updated, tensor."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", False):
        return
    method = getattr(head, "quant_method", None)
    process = getattr(method, "process_weights_after_loading", None)
    if callable(process):
        process(head)


def join_parts(staged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors from staged chunks: pieces named ``name#i/n#shape`` are concatenated and reshaped."""
    whole: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    meta: dict[str, tuple[int, tuple[int, ...]]] = {}
    for key, tensor in staged.items():
        if PART_SEP not in key:
            whole[key] = tensor
            continue
        name, index, dims = key.split(PART_SEP)
        i, n = (int(x) for x in index.split("/"))
        parts.setdefault(name, {})[i] = tensor
        meta[name] = (n, tuple(int(d) for d in dims.split("x")) if dims else ())
    for name, pieces in parts.items():
        n, shape = meta[name]
        if sorted(pieces) != list(range(n)):
            raise WeightsNotApplied(f"tensor {name!r}: {len(pieces)} of {n} pieces arrived; nothing applied")
        whole[name] = torch.cat([pieces[i] for i in range(n)]).reshape(shape)
    return whole


# ---------------------------------------------------------------------------------------- checkpoint specs


def model_dir(model: str) -> Path | None:
    """The local directory holding the checkpoint: the path itself, or the Hugging Face cache's snapshot."""
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]))
    except Exception:  # not cached (yet): vLLM downloads it at start
        return None


def checkpoint_specs(model_dir: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Tensor names, shapes and dtypes from the safetensors headers (no tensor data is read).

    These are the checkpoint (Hugging Face) names that vLLM's ``load_weights`` accepts; vLLM's own parameter
    names differ (fused qkv / gate_up projections), so this, not ``named_parameters``, is what a trainer's
    state dict must match. Tied embeddings also accept ``lm_head.weight``, as a transformers state dict has it.
    """
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files (only safetensors checkpoints are supported)")
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(part.get_dtype(), torch.float32)
                specs[name] = (tuple(int(d) for d in part.get_shape()), dtype)
    config = _read_json(model_dir / "config.json") or {}
    embed = specs.get("model.embed_tokens.weight")
    if config.get("tie_word_embeddings") and embed is not None and "lm_head.weight" not in specs:
        specs["lm_head.weight"] = embed
    return specs


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def iter_chunks(
    tensors: dict[str, torch.Tensor], *, skip: set[str] | None = None, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[bytes]:
    """safetensors-encode CPU copies of ``tensors``, one chunk of about ``chunk_bytes`` at a time.

    Only the chunk being built is held on the host; a tensor larger than ``chunk_bytes`` is split into
    flat pieces (``name#i/n#shape``) that :func:`join_parts` puts back together in the worker.
    """
    from safetensors.torch import save

    skip = skip or set()
    current: dict[str, torch.Tensor] = {}
    size = 0
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if name in skip:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > chunk_bytes:
            if current:
                yield save(current)
                current, size, seen = {}, 0, set()
            flat = tensor.detach().reshape(-1)
            per = max(1, chunk_bytes // tensor.element_size())
            n = math.ceil(flat.numel() / per)
            shape = "x".join(str(d) for d in tensor.shape)
            for i in range(n):
                piece = flat[i * per : (i + 1) * per].to("cpu").clone()
                yield save({f"{name}{PART_SEP}{i}/{n}{PART_SEP}{shape}": piece})
            continue
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:  # tied tensors share storage, which safetensors refuses to write twice
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        current[name] = t
        size += nbytes
        if size >= chunk_bytes:
            yield save(current)
            current, size, seen = {}, 0, set()
    if current:
        yield save(current)


def pack_chunks(
    tensors: dict[str, torch.Tensor], *, skip: set[str] | None = None, chunk_bytes: int = CHUNK_BYTES
) -> list[bytes]:
    """Every chunk of :func:`iter_chunks` at once (tests; the backend streams them)."""
    return list(iter_chunks(tensors, skip=skip, chunk_bytes=chunk_bytes))


def weight_transfer_requests() -> tuple[Any, Any]:
    """vLLM's request types for its weight-transfer engine (init, update)."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

    return WeightTransferInitRequest, WeightTransferUpdateRequest
