"""Pure planning over tensor metadata: which atomic units travel in which bucket.

Nothing here touches tensor data, processes or the network; every function is a pure function of small records.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from miles_sync.wire.bucket import AtomicUnit

__all__: list[str] = []  # nothing here is imported from outside miles_sync.sync


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """The units that travel together in bucket `index` (0-based, in send order)."""

    index: int
    units: tuple[AtomicUnit, ...]
    num_bytes: int

    @property
    def num_tensors(self) -> int:
        return sum(len(u.tensors) for u in self.units)


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
