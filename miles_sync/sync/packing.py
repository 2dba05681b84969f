"""Export + pack: exported units -> bucket plans -> flattened buckets in pack buffers, one bucket at a time.

`PackStream` runs a live export (on the sender's worker thread); `StagedStream` replays buckets that
`Sender.stage` packed ahead. With a block-FP8 spec, `PackStream` quantizes each unit as it leaves the export,
before the planner sizes it: on the source rank, after the gather, so only the FP8 bytes and scales are packed and
hashed, and a weight and its scales stay in one unit (one bucket). Both yield `PackedBucket`s in plan order, and
`drain()` consumes the rest of the export (its collectives must pair up across ranks, also after a failure).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from miles_sync.export.units import ExportedUnit, quantize_unit
from miles_sync.sync.buffers import BucketBuffers
from miles_sync.sync.engine_digests import PredictedDigests
from miles_sync.sync.plan import BucketPlan, plan_buckets
from miles_sync.weights.checksum import tensor_checksum
from miles_sync.weights.fp8 import Fp8Block
from miles_sync.wire.bucket import FlattenedBucket, pack_bucket, unpack_bucket

__all__: list[str] = []  # nothing here is imported from outside miles_sync.sync


def pair_with_plans(
    units: Iterable[ExportedUnit], *, cap_bytes: int
) -> Iterator[tuple[BucketPlan, list[ExportedUnit]]]:
    """Stream (bucket plan, its exported units) pairs, lazily and in export order.

    The planner sees only metadata; the units wait in a queue until their bucket closes, so at most one bucket's
    units plus the one unit that closed it are held at any time.
    """
    waiting: deque[ExportedUnit] = deque()

    def metadata() -> Iterator:
        for unit in units:
            waiting.append(unit)
            yield unit.meta

    for plan in plan_buckets(metadata(), cap_bytes=cap_bytes):
        taken = [waiting.popleft() for _ in plan.units]
        assert all(u.meta is m for u, m in zip(taken, plan.units)), "planner reordered units"
        yield plan, taken


@dataclass(frozen=True, kw_only=True)
class PackedBucket:
    """A packed bucket; `checksums` is None until they are computed (a live send hashes a bucket while it is on
    the wire, a staged one hashes ahead)."""

    plan: BucketPlan
    bucket: FlattenedBucket
    checksums: dict[str, str] | None


def bucket_checksums(bucket: FlattenedBucket) -> dict[str, str]:
    """Checksum of every tensor in the bucket, from the packed bytes (what the engines receive)."""
    return {name: tensor_checksum(view) for name, view in bucket_tensors(bucket)}


def bucket_tensors(bucket: FlattenedBucket) -> list[tuple[str, torch.Tensor]]:
    """(name, view into the bucket's buffer) of every tensor, in packing order; the views live as long as the buffer
    holds this bucket."""
    return list(unpack_bucket(bucket.buffer, bucket.entries))


class StagedStream:
    """Buckets packed by `Sender.stage`, replayed in order by the next send; the export already ran. `digests`:
    the engine digests stage predicted from them (None when it was given no plan)."""

    def __init__(
        self,
        buckets: Sequence[PackedBucket],
        *,
        export_s: float,
        pack_s: float,
        digests: PredictedDigests | None = None,
    ) -> None:
        self._buckets = deque(buckets)
        self.export_s = export_s
        self.pack_s = pack_s
        self.quantize_s = 0.0  # quantized at stage time, not during the send that replays it
        self.digests = digests

    def next_bucket(self) -> PackedBucket | None:
        # popleft: a sent bucket's buffer is freed as soon as the transport is done with it.
        return self._buckets.popleft() if self._buckets else None

    def drain(self) -> None:
        self._buckets.clear()


class PackStream:
    """Export + (quantize) + pack, one bucket per `next_bucket()` call; runs on one worker thread (export may issue
    collectives, and CUDA streams are per thread). `quantization`: block-FP8 spec, None sends the export's dtypes.
    `quantize_s` is the time spent quantizing (not part of `export_s`)."""

    def __init__(
        self,
        units: Iterable[ExportedUnit],
        *,
        cap_bytes: int,
        buffers: BucketBuffers,
        hash_inline: bool,
        quantization: Fp8Block | None = None,
    ) -> None:
        self._quantization = quantization
        self._pairs = pair_with_plans(self._timed(units), cap_bytes=cap_bytes)
        self._buffers = buffers
        self._hash_inline = hash_inline
        self._seen: set[str] = set()
        self.export_s = 0.0
        self.pack_s = 0.0
        self.quantize_s = 0.0

    def _timed(self, units: Iterable[ExportedUnit]) -> Iterator[ExportedUnit]:
        iterator = iter(units)
        while True:
            start = time.perf_counter()
            unit = next(iterator, None)
            self.export_s += time.perf_counter() - start
            if unit is None:
                return
            if self._quantization is not None:
                start = time.perf_counter()
                unit = quantize_unit(unit, self._quantization)
                self.quantize_s += time.perf_counter() - start
            yield unit

    def next_bucket(self) -> PackedBucket | None:
        pair = next(self._pairs, None)
        if pair is None:
            return None
        plan, units = pair
        start = time.perf_counter()
        named = [item for unit in units for item in unit.named()]
        repeated = sorted({name for name, _ in named} & self._seen)
        if repeated:
            # Checked before sending: a repeated name would make the engine's checksum ambiguous.
            raise ValueError(f"the export stream yielded tensor(s) {repeated} more than once")
        self._seen.update(name for name, _ in named)
        bucket = pack_bucket(named, out=self._buffers.for_bucket(plan.index, plan.num_bytes))
        checksums = bucket_checksums(bucket) if self._hash_inline else None
        self.pack_s += time.perf_counter() - start
        return PackedBucket(plan=plan, bucket=bucket, checksums=checksums)

    def drain(self) -> None:
        for _ in self._pairs:
            pass
