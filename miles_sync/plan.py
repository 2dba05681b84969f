"""Pure planning over tensor metadata: which atomic units travel in which bucket.

Nothing here touches tensor data, processes or the network; every function is a pure function of small records.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

__all__ = ["AtomicUnit", "BucketPlan", "PlanSummary", "TensorMeta", "plan_buckets", "plan_summary"]


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


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """The units that travel together in bucket `index` (0-based, in send order)."""

    index: int
    units: tuple[AtomicUnit, ...]
    num_bytes: int

    @property
    def num_tensors(self) -> int:
        return sum(len(u.tensors) for u in self.units)

    def tensor_order(self) -> list[TensorMeta]:
        """All tensors of the bucket in wire order (aligned: descending itemsize, otherwise as emitted)."""
        # Imported here because bucket.py builds on TensorMeta from this module.
        from miles_sync.bucket import aligned_order

        return aligned_order([t for u in self.units for t in u.tensors])


def plan_buckets(units: Iterable[AtomicUnit], *, cap_bytes: int) -> Iterator[BucketPlan]:
    """Group a stream of units into buckets of at most `cap_bytes`, lazily and in stream order.

    Greedy: a unit joins the open bucket unless that would push it past the cap, in which case the open bucket is
    emitted first. A unit never straddles two buckets; a unit larger than the cap travels alone. Nothing is dropped
    or reordered, so concatenating the buckets' units gives back the input. Each bucket is yielded as soon as it is
    closed, so export of later units can overlap sending earlier buckets. Raises ValueError (at call time, not on
    first iteration) when `cap_bytes` <= 0.
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be positive; got {cap_bytes}")
    return _greedy_buckets(iter(units), cap_bytes=cap_bytes)


def _greedy_buckets(units: Iterator[AtomicUnit], *, cap_bytes: int) -> Iterator[BucketPlan]:
    index = 0
    pending: list[AtomicUnit] = []
    pending_bytes = 0
    for unit in units:
        if pending and pending_bytes + unit.num_bytes > cap_bytes:
            yield BucketPlan(index=index, units=tuple(pending), num_bytes=pending_bytes)
            index += 1
            pending, pending_bytes = [], 0
        pending.append(unit)
        pending_bytes += unit.num_bytes
    if pending:
        yield BucketPlan(index=index, units=tuple(pending), num_bytes=pending_bytes)


@dataclass(frozen=True, kw_only=True)
class PlanSummary:
    """Totals over a bucket plan, for logs and benchmark reports."""

    num_buckets: int
    num_units: int
    num_tensors: int
    num_bytes: int
    max_bucket_bytes: int


def plan_summary(plans: Iterable[BucketPlan]) -> PlanSummary:
    """Totals over `plans` (consumes the iterable)."""
    num_buckets = num_units = num_tensors = num_bytes = max_bucket_bytes = 0
    for p in plans:
        num_buckets += 1
        num_units += len(p.units)
        num_tensors += p.num_tensors
        num_bytes += p.num_bytes
        max_bucket_bytes = max(max_bucket_bytes, p.num_bytes)
    return PlanSummary(
        num_buckets=num_buckets,
        num_units=num_units,
        num_tensors=num_tensors,
        num_bytes=num_bytes,
        max_bucket_bytes=max_bucket_bytes,
    )
