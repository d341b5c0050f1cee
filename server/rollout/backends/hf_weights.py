"""The hf backend's weights: the model's parameters and buffers by name, what an update must match, and the
swap (copy, or adopt the caller's tensors) that the decode loop applies between two steps."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

import torch

from rewardmesh.common.errors import Unavailable
from rewardmesh.common.planes.manifest import validate_weights

__all__ = ["ModelWeights", "WeightSwap"]


@dataclass(eq=False)
class WeightSwap:
    """A weight update handed to the decode loop, applied between two steps."""

    tensors: dict[str, torch.Tensor]
    version: int
    adopt: bool = False  # the caller hands the tensors over: swap storages instead of copying (see adopt_weights)
    done: concurrent.futures.Future[bool] = field(default_factory=concurrent.futures.Future)  # True: adopted


class ModelWeights:
    """A loaded model's parameters and buffers themselves (not detached copies): an adopted update re-points
    their storage."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def load(self, lm: Any) -> None:
        self.state = dict(lm.state_dict(keep_vars=True))

    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if not self.state:
            raise Unavailable("the hf backend is still loading its model; retry when the server reports SERVING")
        return {name: (tuple(t.shape), t.dtype) for name, t in self.state.items()}

    def validate(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise WeightsError on the first tensor that cannot be applied as is (the one validator)."""
        validate_weights(tensors, self.specs())

    def adoptable(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Only a whole update of the same dtypes and device is adopted: then no parameter keeps pointing into an
        older buffer, so the caller may reuse the buffers it handed over before (double buffering)."""
        if tensors.keys() != self.state.keys():
            return False
        return all(
            t.dtype == self.state[n].dtype and t.device == self.state[n].device and t.shape == self.state[n].shape
            for n, t in tensors.items()
        )

    def apply(self, tensors: dict[str, torch.Tensor], *, adopt: bool) -> bool:
        """Copy (or, when ``adopt`` and :meth:`adoptable`, adopt) every tensor; True when adopted. Worker thread,
        between two steps."""
        with torch.no_grad():
            adopted = adopt and self.adoptable(tensors)
            for name, tensor in tensors.items():
                if adopted:
                    self.state[name].data = tensor  # O(1): the parameter now lives in the caller's buffer
                else:
                    self.state[name].copy_(tensor)
        return adopted
