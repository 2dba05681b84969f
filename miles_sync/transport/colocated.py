"""Colocated transport: each bucket as handles to the source's memory, one payload per engine TP rank.

The engine maps the handle (CPU shared memory here, CUDA IPC on GPU), copies what it keeps and answers; until then
the source's buffer must stay alive and untouched, so `send_bucket` returns only after every engine answered. Each
TP rank gets its own encoded payload: a payload carries one pending reference to the shared segment, released when
that one receiver opens it, so one payload decoded twice would drop the source's own reference. The segment is
released when the source drops the buffer (the sender keeps its two CPU pack buffers until it closes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from miles_sync.bucket import FlattenedBucket
from miles_sync.protocol import LoadFormat, Selector, UpdateWeightsFromTensorRequest
from miles_sync.tensor_payload import FlattenedTensorMetadata, encode_flattened_bucket
from miles_sync.transport.base import EngineTarget, GroupMembership, TransportError

__all__ = ["ColocatedTransport", "flattened_metadata"]


def flattened_metadata(bucket: FlattenedBucket) -> list[FlattenedTensorMetadata]:
    """SGLang's per-tensor records of a flattened bucket (byte ranges; `numel` counts bytes). Pure."""
    return [
        FlattenedTensorMetadata(
            name=e.name, shape=tuple(e.shape), dtype=e.dtype, start_idx=e.start, end_idx=e.end, numel=e.num_bytes
        )
        for e in bucket.entries
    ]


class ColocatedTransport:
    """Posts every bucket to every engine concurrently; one bucket in flight at a time."""

    name = "colocated"

    def __init__(self, *, engines: Sequence[EngineTarget]) -> None:
        if not engines:
            raise ValueError("ColocatedTransport needs at least one engine")
        self._engines = tuple(engines)

    async def open(self, *, membership: GroupMembership | None, timeout_s: float) -> None:
        if membership is not None:
            raise ValueError("the colocated transport uses no update group; pass membership=None")
        return None

    async def send_bucket(self, bucket: FlattenedBucket, *, selector: Selector, timeout_s: float) -> None:
        metadata = flattened_metadata(bucket)
        requests = [
            UpdateWeightsFromTensorRequest(
                serialized_named_tensors=tuple(
                    encode_flattened_bucket(buffer=bucket.buffer, metadata=metadata) for _ in range(e.tp_size)
                ),
                load_format=LoadFormat.FLATTENED_BUCKET,
                flush_cache=False,  # the session flushes once before the first bucket
                selector=selector,
            )
            for e in self._engines
        ]
        # The client times each call out itself (EngineError), so gather cannot wait forever.
        results = await asyncio.gather(
            *(e.client.update_weights_from_tensor(r, timeout_s=timeout_s) for e, r in zip(self._engines, requests)),
            return_exceptions=True,
        )
        failures = [f"{e.client.url}: {r}" for e, r in zip(self._engines, results) if isinstance(r, BaseException)]
        if failures:
            raise TransportError(f"bucket of {len(bucket.entries)} tensors failed: " + "; ".join(failures))

    async def close(self, *, timeout_s: float) -> None:
        return None  # nothing is held between buckets: the sender owns the buffers and their shared memory
