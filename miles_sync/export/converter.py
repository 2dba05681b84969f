"""The converter seam: how megatron-core parameters become HF-named tensors and back.

A converter speaks in *canonical* megatron names: the names a TP=1, PP=1, EP=1 model would have
(`decoder.layers.{global layer}...`, `mlp.experts.{global expert}...`), so family code never sees parallelism.
The gather (`export/megatron.py`) and the loader (`export/loader.py`) translate local names, gather or slice
tensor-parallel shards, and call the converter for the merge change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch


class ShardMerge(Enum):
    """How one megatron tensor (all TP shards together) maps onto HF tensors."""

    COPY = "copy"  # one HF tensor, same values, split along the parameter's partition dim
    VOCAB = "vocab"  # one HF tensor; megatron pads rows to a multiple of the TP size, HF does not
    QKV = "qkv"  # q, k, v; megatron interleaves [q heads of group g; k_g; v_g] group by group
    GATE_UP = "gate_up"  # gate, up; every TP shard holds [gate shard; up shard]


@dataclass(frozen=True, kw_only=True)
class TensorMapping:
    """Where one canonical megatron parameter goes in the HF checkpoint.

    Parameters that share `unit_key` travel in one atomic unit (a layer's q/k/v weight and bias, one expert's
    gate/up/down), in the order the model lists them. `is_exported` is False for a parameter that is only a
    copy of another unit's tensor (the untied-on-paper lm_head of a tied model's last pipeline stage): it is read
    on import and never exported twice.
    """

    megatron_name: str
    megatron_shape: tuple[int, ...]  # full (all TP shards, padded vocab) shape
    unit_key: str
    merge: ShardMerge
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    is_exported: bool = True


# read(hf_name, dim, start, stop) -> the slice [start, stop) of that HF tensor along dim, or all of it when dim is
# None. The loader backs it with safetensors slices, so a rank reads only the rows or columns of its own shard.
SliceReader = Callable[[str, "int | None", int, int], torch.Tensor]


class Converter(Protocol):
    """One model family's mapping between megatron-core parameters and HF-named tensors.

    Contract: `map_param` is pure and total over the parameters the family's models have; it raises ValueError
    naming a parameter it does not know (never guesses). `to_hf` receives every TP shard of one parameter in
    tensor-parallel rank order and returns the HF tensors in `mapping.hf_names` order. `read_shard` returns the
    local shard of tensor-parallel rank `rank` of `size`, reading only what that shard needs through `read`.
    `to_hf` then `read_shard` (or the reverse) is bit-exact for every rank and size.
    """

    arch: str

    def map_param(self, name: str, full_shape: tuple[int, ...]) -> TensorMapping: ...

    def to_hf(
        self, mapping: TensorMapping, shards: Sequence[torch.Tensor], *, partition_dim: int | None
    ) -> tuple[torch.Tensor, ...]: ...

    def read_shard(
        self,
        mapping: TensorMapping,
        read: SliceReader,
        *,
        partition_dim: int | None,
        rank: int,
        size: int,
        dtype: torch.dtype,
    ) -> torch.Tensor: ...
