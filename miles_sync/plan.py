"""Pure planning over tensor metadata: which atomic units travel in which bucket.

Nothing here touches tensor data, processes or the network; every function is a pure function of small records.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    """Name, shape and dtype of one HF-named tensor; enough to size and place it in a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def num_bytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class AtomicUnit:
    """Tensors that must arrive in one load call (a layer's q/k/v, gate/up, weight + scale, one expert).

    Invariant: a unit never straddles two buckets, because some loaders fuse the parts only when all arrive
    together. `tensors` keeps the order the producer emitted; `key` identifies the unit in logs and errors.
    """

    key: str
    tensors: tuple[TensorMeta, ...]

    @property
    def num_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tensors)
