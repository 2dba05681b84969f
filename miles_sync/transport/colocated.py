"""Colocated transport: every engine TP rank maps a bucket in the memory of the trainer rank on its own device.

The fan-out of miles_sync.transport.fan_out (feed plan, group, posts, failure rules) with its flattened-bucket
delivery: the source broadcasts each flattened bucket to the plan's feeders, and each feeder hands every engine rank
it feeds one handle to its own copy (CPU shared memory here, CUDA IPC on GPU); each engine rank slices its share.
A payload carries one pending reference to its shared segment, released when its one receiver opens it, so every
engine rank gets a payload encoded for it alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles_sync.transport.base import RankSetup
from miles_sync.transport.fan_out import Collectives, FedRank, ReceiveBuffer, open_fed_rank
from miles_sync.transport.membership import EngineEndpoint
from miles_sync.wire.bucket import BucketEntry, FlattenedBucket
from miles_sync.wire.payload import FlattenedTensorMetadata, encode_flattened_bucket
from miles_sync.wire.protocol import LoadFormat

__all__: list[str] = []  # reached through the transport registry only


def flattened_metadata(entries: Sequence[BucketEntry]) -> list[FlattenedTensorMetadata]:
    """SGLang's per-tensor records of a flattened bucket's entries (byte ranges; `numel` counts bytes). Pure."""
    return [
        FlattenedTensorMetadata(
            name=e.name, shape=tuple(e.shape), dtype=e.dtype, start_idx=e.start, end_idx=e.end, numel=e.num_bytes
        )
        for e in entries
    ]


@dataclass(frozen=True, kw_only=True)
class FlattenedContents:
    """A flattened bucket's layout; its bytes follow in one broadcast."""

    num_bytes: int
    entries: tuple[BucketEntry, ...]


class FlattenedDelivery:
    """The colocated transport's delivery: the source broadcasts the whole flattened bucket, every feeder keeps a
    copy and hands each engine rank it feeds one flattened-bucket handle to it (each rank slices its share)."""

    load_format = LoadFormat.FLATTENED_BUCKET

    def __init__(self, device: torch.device) -> None:
        self._buffer = ReceiveBuffer(device)

    def prepare(self, bucket: FlattenedBucket) -> tuple[FlattenedContents, torch.Tensor]:
        return FlattenedContents(num_bytes=bucket.num_bytes, entries=tuple(bucket.entries)), bucket.buffer

    def receive(self, contents: FlattenedContents, local: torch.Tensor | None, collectives: Collectives) -> Any:
        buffer = self._buffer.take(contents.num_bytes) if local is None else local
        collectives.broadcast_buffer(buffer)
        return buffer

    def encode(
        self, contents: FlattenedContents, local: torch.Tensor, *, feeds: Sequence[tuple[int, int]]
    ) -> list[str | None]:
        metadata = flattened_metadata(contents.entries)
        return [encode_flattened_bucket(buffer=local, metadata=metadata) for _ in feeds]

    def settle(self) -> list[str]:
        return []

    def end_send(self) -> str | None:
        return None

    def reset(self) -> None:
        return None

    def close(self) -> None:
        return None


async def open_colocated_rank(*, engines: Sequence[EngineEndpoint], setup: RankSetup) -> FedRank:
    """This rank's side of the colocated transport (`open_fed_rank` with the flattened-bucket delivery)."""
    return await open_fed_rank(
        engines=engines, setup=setup, delivery=lambda role: FlattenedDelivery(torch.device(setup.device))
    )
