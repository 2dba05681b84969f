"""The record the export streams to senders: one atomic unit of full, HF-named tensors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from miles_sync.wire.bucket import AtomicUnit, TensorMeta

# Projections a layer's converter emits as one unit (their Megatron parameter is fused).
_FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


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


def units_from_hf_tensors(tensors: Mapping[str, torch.Tensor], names: Iterable[str]) -> list[ExportedUnit]:
    """Atomic units over whole HF-named tensors (the tensors themselves, no copies), grouped the way the converters
    emit them: a layer's q/k/v together, its gate/up together, every other tensor alone; in the order of `names`,
    a group at its first member. For a source that holds an HF state dict rather than a Megatron model."""
    units, taken = [], set()
    for name in names:
        if name in taken:
            continue
        group = [name]
        for fused in _FUSED_PROJECTIONS:
            for part in fused:
                if f".{part}." in name:
                    group = [name.replace(f".{part}.", f".{p}.") for p in fused]
        taken.update(group)
        metas = tuple(TensorMeta(name=n, shape=tuple(tensors[n].shape), dtype=tensors[n].dtype) for n in group)
        unit = AtomicUnit(key=group[0], tensors=metas)
        units.append(ExportedUnit(meta=unit, tensors=tuple(tensors[n] for n in group)))
    return units
