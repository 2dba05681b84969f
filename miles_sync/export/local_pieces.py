"""A trainer rank's own Megatron shard as HF-coordinate pieces, with no gather: the first step of a shard-owned sync.

`local_pieces` converts one rank's shard of one parameter into the slices of HF tensors it holds: exactly the slices
the converter's `read_shard` reads to build that shard (`miles_sync.weights.shard_routes.converter_holdings` plans
with the same reads), with the values the converter's `to_hf` gives the shard on its own. The converter contract
(`to_hf` then `read_shard` is bit-exact) makes the pieces bit-exact: reading the shard back from them gives it again,
and the pieces of every rank tile the gathered HF tensors.
"""

from __future__ import annotations

import torch

from miles_sync.export.converter import Converter, TensorMapping
from miles_sync.weights.shard_routes import LocalPiece

__all__: list[str] = []  # reached through miles_sync.export.megatron.iter_local_pieces


def shard_reads(
    converter: Converter, mapping: TensorMapping, *, partition_dim: int | None, rank: int, size: int
) -> list[tuple[str, int | None, int, int]]:
    """The HF slices (name, dim, start, stop) `read_shard` reads for shard `rank` of `size`, in its order."""
    reads = []
    shapes = dict(zip(mapping.hf_names, mapping.hf_shapes))

    def read(name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        reads.append((name, dim, start, stop))
        shape = list(shapes[name])
        if dim is not None:
            shape[dim] = stop - start
        return torch.zeros(shape)

    converter.read_shard(mapping, read, partition_dim=partition_dim, rank=rank, size=size, dtype=torch.float32)
    return reads


def local_pieces(
    converter: Converter,
    mapping: TensorMapping,
    shard: torch.Tensor,
    *,
    partition_dim: int | None,
    rank: int,
    size: int,
) -> list[LocalPiece]:
    """Rank `rank`'s shard of `mapping`'s parameter as the HF pieces it holds. The converter merges the one shard
    as if it were the whole parameter (q/k/v of its query groups, its gate and up halves, its block of columns);
    each result is cut to the extent its read has (a vocab shard's padding rows are dropped). Views where the merge
    makes them."""
    reads = shard_reads(converter, mapping, partition_dim=partition_dim, rank=rank, size=size)
    merged = converter.to_hf(mapping, [shard], partition_dim=None if partition_dim is None else partition_dim)
    if len(reads) != len(merged):
        raise AssertionError(f"{mapping.megatron_name}: {len(reads)} reads but {len(merged)} merged tensors")
    pieces = []
    for (name, dim, start, stop), tensor in zip(reads, merged):
        if dim is not None:
            tensor = tensor.narrow(dim, 0, stop - start)
        pieces.append(LocalPiece(hf_name=name, dim=dim, start=start, end=stop, tensor=tensor))
    return pieces
