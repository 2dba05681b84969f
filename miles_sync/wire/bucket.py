"""Flattened buckets: many tensors back to back in one uint8 buffer, so a bucket costs one collective or handle.

Wire rule (SGLang's `flattened_bucket` load format): no padding, ever. The distributed receiver rebuilds the layout
from names/dtypes/shapes alone, placing tensor i at the sum of the byte sizes of tensors 0..i-1, and rejects a
tensor whose offset is not a multiple of its itemsize. The sender therefore packs in `aligned_order` (descending
itemsize): every itemsize is a power of two, so each tensor before a smaller-itemsize one ends on a boundary that
the smaller one accepts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles_sync.wire.dtypes import dtype_from_name as _dtype_from_name
from miles_sync.wire.dtypes import dtype_name as _dtype_name

__all__ = [
    "AtomicUnit",
    "BucketEntry",
    "FlattenedBucket",
    "TensorMeta",
    "bucket_layout",
    "layout_from_metadata",
    "pack_bucket",
    "unpack_bucket",
]


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


# Bytes are moved through a same-width integer view: a bit-exact copy for every dtype, including the ones
# (fp8 scales, packed fp4) whose float kernels are missing on some devices.
_BITS_BY_ITEMSIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, kw_only=True)
class BucketEntry:
    """Where one tensor lives in a flattened buffer: bytes [start, end)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int

    @property
    def num_bytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, kw_only=True)
class FlattenedBucket:
    """A 1-D uint8 buffer and the entries that tile it exactly, in buffer order."""

    buffer: torch.Tensor
    entries: tuple[BucketEntry, ...]

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel()

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]


def aligned_order(metas: Sequence[TensorMeta]) -> list[TensorMeta]:
    """Stable sort by descending itemsize, so every cumulative byte offset is aligned without padding."""
    return sorted(metas, key=lambda m: -m.dtype.itemsize)


def bucket_layout(metas: Sequence[TensorMeta]) -> tuple[BucketEntry, ...]:
    """Where `metas` go in one flattened buffer: in aligned order (`aligned_order`), back to back, no padding; the
    entries `pack_bucket` writes and `unpack_bucket` reads."""
    return _entries_in_order(aligned_order(metas))


def _entries_in_order(metas: Sequence[TensorMeta]) -> tuple[BucketEntry, ...]:
    entries = []
    offset = 0
    for m in metas:
        entries.append(BucketEntry(name=m.name, shape=m.shape, dtype=m.dtype, start=offset, end=offset + m.num_bytes))
        offset += m.num_bytes
    return tuple(entries)


def _check_unique(names: Sequence[str]) -> None:
    seen: set[str] = set()
    dups: set[str] = set()
    for n in names:
        if n in seen:
            dups.add(n)
        seen.add(n)
    if dups:
        raise ValueError(f"Duplicate tensor names in one bucket: {sorted(dups)}")


def _check_buffer(buffer: torch.Tensor, *, what: str, entries: Sequence[BucketEntry]) -> None:
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(
            f"{what} must be a contiguous 1-D uint8 tensor; got dtype={buffer.dtype}, shape={tuple(buffer.shape)}, "
            f"contiguous={buffer.is_contiguous()}"
        )
    max_itemsize = max((e.dtype.itemsize for e in entries), default=1)
    if buffer.storage_offset() % max_itemsize != 0:
        raise ValueError(
            f"{what} starts at storage offset {buffer.storage_offset()}, not a multiple of the largest itemsize "
            f"{max_itemsize} in the bucket; typed views into it would be unaligned"
        )


def _typed_view(buffer: torch.Tensor, entry: BucketEntry) -> torch.Tensor:
    return buffer[entry.start : entry.end].view(entry.dtype).view(entry.shape)


def pack_bucket(named: Sequence[tuple[str, torch.Tensor]], *, out: torch.Tensor | None = None) -> FlattenedBucket:
    """Copy `named` into one flattened buffer in aligned order; inputs may be non-contiguous, 0-dim or empty.

    With `out` (a preallocated contiguous 1-D uint8 tensor, e.g. one half of a double buffer) the bytes are written
    into its prefix and `buffer` is a view of that prefix; `out` must hold at least the bucket's bytes and is
    mutated. Without `out` a buffer is allocated on the device of the first tensor (CPU for an empty bucket).
    The inputs are only read.
    """
    names = [n for n, _ in named]
    _check_unique(names)
    for _, t in named:
        _dtype_name(t.dtype)  # rejects dtypes the receiver cannot decode, before any byte moves
    tensors = dict(named)
    metas = [TensorMeta(name=n, shape=tuple(t.shape), dtype=t.dtype) for n, t in named]
    entries = bucket_layout(metas)
    total = entries[-1].end if entries else 0
    if out is None:
        device = named[0][1].device if named else torch.device("cpu")
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
    else:
        _check_buffer(out, what="out", entries=entries)
        if out.numel() < total:
            raise ValueError(f"out holds {out.numel()} bytes but the bucket {names} needs {total}")
        buffer = out[:total]
    with torch.no_grad():
        for e in entries:
            # Same-width integer views make the copy bitwise; copy_ handles any input strides in one pass.
            bits = _BITS_BY_ITEMSIZE[e.dtype.itemsize]
            _typed_view(buffer, e).view(bits).copy_(tensors[e.name].view(bits))
    return FlattenedBucket(buffer=buffer, entries=entries)


def layout_from_metadata(
    *,
    names: Sequence[str],
    dtypes: Sequence[str | torch.dtype],
    shapes: Sequence[Sequence[int]],
) -> tuple[BucketEntry, ...]:
    """The receiver's layout: tensors back to back in the given order, exactly as the wire rule defines it.

    Dtypes may be wire names or torch dtypes. Raises ValueError for lists of different lengths, a negative
    dimension, or a tensor whose offset is not a multiple of its itemsize ("Unaligned received tensor ..."),
    naming every offending tensor.
    """
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names, dtypes and shapes must have one entry per tensor; got {len(names)} names, "
            f"{len(dtypes)} dtypes, {len(shapes)} shapes"
        )
    resolved = [d if isinstance(d, torch.dtype) else _dtype_from_name(d) for d in dtypes]
    shape_tuples = [tuple(int(d) for d in s) for s in shapes]
    negative = [f"{n} {s}" for n, s in zip(names, shape_tuples) if any(d < 0 for d in s)]
    if negative:
        raise ValueError(f"Negative dimension in received tensor(s): {'; '.join(negative)}")
    metas = [TensorMeta(name=n, shape=s, dtype=d) for n, s, d in zip(names, shape_tuples, resolved)]
    entries = _entries_in_order(metas)
    unaligned = [
        f"Unaligned received tensor {e.name} ({_dtype_name(e.dtype)}, shape {e.shape}): offset {e.start} is not a "
        f"multiple of itemsize {e.dtype.itemsize}"
        for e in entries
        if e.start % e.dtype.itemsize != 0
    ]
    if unaligned:
        raise ValueError("; ".join(unaligned))
    return entries


def unpack_bucket(buffer: torch.Tensor, entries: Sequence[BucketEntry]) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy typed views of `buffer`, one per entry, in entry order.

    The views alias the buffer: writing to one writes the buffer, and they stay valid only while the buffer's
    memory does. Raises ValueError when the buffer size differs from the entries' total or an entry is malformed.
    """
    _check_buffer(buffer, what="buffer", entries=entries)
    total = entries[-1].end if entries else 0
    if buffer.numel() != total:
        raise ValueError(f"buffer holds {buffer.numel()} bytes but the entries describe {total}")
    bad = []
    offset = 0
    for e in entries:
        meta = TensorMeta(name=e.name, shape=e.shape, dtype=e.dtype)
        if e.start != offset or e.num_bytes != meta.num_bytes or e.start % e.dtype.itemsize != 0:
            bad.append(f"{e.name} [{e.start}, {e.end}) (expected start {offset}, {meta.num_bytes} bytes)")
        offset = e.end
    if bad:
        raise ValueError(f"Entries do not tile the buffer back to back with aligned offsets: {'; '.join(bad)}")
    return [(e.name, _typed_view(buffer, e)) for e in entries]
