"""How megatron-core TP shards merge into HF tensors and split back, in both directions (pure).

Export merges the shards of one parameter (tensor-parallel rank order) into HF tensors; import builds one rank's
shard from slices of the HF tensors, so a rank never reads rows or columns that belong to another rank.
All functions are pure: no processes, no I/O beyond the `read` callable handed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles_sync.export.converter import ShardMerge, SliceReader, TensorMapping


@dataclass(frozen=True, kw_only=True)
class AttentionDims:
    """Shape of grouped-query attention, as megatron lays out `linear_qkv` (query groups = KV heads)."""

    num_query_groups: int
    heads_per_group: int
    head_dim: int

    @property
    def rows_per_group(self) -> int:
        return (self.heads_per_group + 2) * self.head_dim


def hf_shapes(
    merge: ShardMerge, megatron_shape: tuple[int, ...], *, attention: AttentionDims, vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """Shapes of the HF tensors one full megatron tensor becomes, in `hf_names` order."""
    rows, rest = megatron_shape[0], tuple(megatron_shape[1:])
    if merge is ShardMerge.COPY:
        return (tuple(megatron_shape),)
    if merge is ShardMerge.VOCAB:
        return ((vocab_size, *rest),)
    if merge is ShardMerge.QKV:
        groups = attention.num_query_groups
        assert rows == groups * attention.rows_per_group, (rows, attention)
        kv_rows = groups * attention.head_dim
        return ((groups * attention.heads_per_group * attention.head_dim, *rest), (kv_rows, *rest), (kv_rows, *rest))
    if merge is ShardMerge.GATE_UP:
        assert rows % 2 == 0, megatron_shape
        return ((rows // 2, *rest), (rows // 2, *rest))
    raise AssertionError(merge)


def merge_shards(
    merge: ShardMerge,
    shards: Sequence[torch.Tensor],
    *,
    partition_dim: int | None,
    attention: AttentionDims,
    vocab_size: int,
) -> tuple[torch.Tensor, ...]:
    """Full HF tensors from every TP shard of one parameter. A replicated parameter passes exactly one shard."""
    if partition_dim is None:
        assert len(shards) == 1 and merge is ShardMerge.COPY, (merge, len(shards))
        return (shards[0],)
    if merge is ShardMerge.COPY:
        return (_cat(shards, partition_dim),)
    # The remaining merges are column-parallel: shards stack along dim 0.
    assert partition_dim == 0, (merge, partition_dim)
    if merge is ShardMerge.VOCAB:
        return (_cat(shards, 0)[:vocab_size],)
    if merge is ShardMerge.QKV:
        per_shard = [_split_qkv(s, attention) for s in shards]
        return tuple(_cat([parts[i] for parts in per_shard], 0) for i in range(3))
    if merge is ShardMerge.GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return (_cat([h[0] for h in halves], 0), _cat([h[1] for h in halves], 0))
    raise AssertionError(merge)


def read_shard(
    merge: ShardMerge,
    mapping: TensorMapping,
    read: SliceReader,
    *,
    partition_dim: int | None,
    rank: int,
    size: int,
    attention: AttentionDims,
) -> torch.Tensor:
    """Shard `rank` of `size` of the megatron parameter described by `mapping`, built from HF slices."""
    names, shapes = mapping.hf_names, mapping.hf_shapes
    if partition_dim is None or (size == 1 and merge is ShardMerge.COPY):
        assert merge is ShardMerge.COPY, (merge, mapping.megatron_name)
        return read(names[0], None, 0, 0)
    if merge is ShardMerge.COPY:
        step = shapes[0][partition_dim] // size
        return read(names[0], partition_dim, rank * step, (rank + 1) * step)
    assert partition_dim == 0, (merge, partition_dim)
    if merge is ShardMerge.VOCAB:
        return _read_padded_rows(
            read,
            names[0],
            vocab_size=shapes[0][0],
            shard_rows=mapping.megatron_shape[0] // size,
            rank=rank,
            trailing=shapes[0][1:],
        )
    if merge is ShardMerge.QKV:
        groups = attention.num_query_groups // size
        q_rows = groups * attention.heads_per_group * attention.head_dim
        kv_rows = groups * attention.head_dim
        q = read(names[0], 0, rank * q_rows, (rank + 1) * q_rows)
        k = read(names[1], 0, rank * kv_rows, (rank + 1) * kv_rows)
        v = read(names[2], 0, rank * kv_rows, (rank + 1) * kv_rows)
        rest = tuple(q.shape[1:])
        parts = [q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)]
        return torch.cat(parts, dim=1).reshape(groups * attention.rows_per_group, *rest)
    if merge is ShardMerge.GATE_UP:
        step = shapes[0][0] // size
        gate = read(names[0], 0, rank * step, (rank + 1) * step)
        up = read(names[1], 0, rank * step, (rank + 1) * step)
        return torch.cat([gate, up], dim=0)
    raise AssertionError(merge)


def _split_qkv(shard: torch.Tensor, attention: AttentionDims) -> tuple[torch.Tensor, ...]:
    rest = tuple(shard.shape[1:])
    grouped = shard.reshape(-1, attention.heads_per_group + 2, attention.head_dim, *rest)
    hpg = attention.heads_per_group
    return (
        grouped[:, :hpg].reshape(-1, *rest),
        grouped[:, hpg].reshape(-1, *rest),
        grouped[:, hpg + 1].reshape(-1, *rest),
    )


def _cat(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    # A single part is returned as is: TP=1 exports are views of the parameter, not copies.
    return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=dim)


def _read_padded_rows(
    read: SliceReader, name: str, *, vocab_size: int, shard_rows: int, rank: int, trailing: tuple[int, ...]
) -> torch.Tensor:
    # Megatron pads the vocabulary so every TP rank holds shard_rows rows; rows past the HF vocab are zeros.
    start, stop = rank * shard_rows, (rank + 1) * shard_rows
    real = read(name, 0, min(start, vocab_size), min(stop, vocab_size))
    if real.shape[0] == shard_rows:
        return real
    padding = torch.zeros((shard_rows - real.shape[0], *trailing), dtype=real.dtype)
    return torch.cat([real, padding], dim=0)
