"""The record the export streams to senders: one atomic unit of full, HF-named tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_sync.plan import AtomicUnit


@dataclass(frozen=True, kw_only=True)
class ExportedUnit:
    """One atomic unit as produced by `iter_hf_units`.

    `tensors` holds the full HF-named tensors in `meta.tensors` order on the stage's source rank (every rank when
    exporting with `source_rank_only=False`) and is None elsewhere. Shapes and dtypes always equal `meta`'s.
    The tensors may share storage with a temporary gather buffer: a consumer that keeps one past the next
    iteration step must not rely on it being a view of the model.
    """

    meta: AtomicUnit
    tensors: tuple[torch.Tensor, ...] | None

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs in unit order; raises on ranks that hold no tensors."""
        if self.tensors is None:
            raise ValueError(f"unit {self.meta.key!r} holds no tensors on this rank (not the export source)")
        return [(m.name, t) for m, t in zip(self.meta.tensors, self.tensors, strict=True)]
