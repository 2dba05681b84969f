"""The transport seam: how one flattened bucket travels from the trainer's source rank to every engine.

Two implementations, chosen once by name (`create_transport`), never branched on in a hot loop:
- `distributed`: one broadcast per bucket over the update group (gloo on CPU, NCCL on GPU), announced to every
  engine by an `update_weights_from_distributed` POST;
- `colocated`: one `update_weights_from_tensor` POST per engine carrying a handle per engine TP rank (CPU shared
  memory here, CUDA IPC on GPU).

Here: the seam (`Transport`), the engines it reaches (`EngineEndpoint`, `EngineTarget`) and the registry
(`TRANSPORTS`: one `TransportSpec` row per transport, its declared needs). The update group's membership is planned
in miles_sync.transport.membership, the colocated feed assignment in miles_sync.transport.feeds.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from miles_sync.transport.membership import GroupMembership
from miles_sync.wire.api import EngineAPI
from miles_sync.wire.bucket import FlattenedBucket
from miles_sync.wire.codec import WireEnum
from miles_sync.wire.protocol import Selector

__all__ = [
    "TransportKind",
    "TRANSPORTS",
    "EngineTarget",
    "Transport",
    "TransportError",
    "TransportSpec",
    "create_transport",
    "needs_update_group",
    "transport_spec",
]


class TransportError(RuntimeError):
    """A bucket (or the group set-up) failed on at least one engine; the message names each engine and cause."""


@dataclass(frozen=True, kw_only=True)
class EngineTarget:
    """An engine as a transport sees it: its client and how many TP ranks it runs."""

    client: EngineAPI
    tp_size: int


@runtime_checkable
class Transport(Protocol):
    """Moves flattened buckets from the trainer's source rank to every engine of one fleet.

    Contract:
    - `open` prepares the path (distributed: start the store, join the group while every engine joins it over
      HTTP, concurrently) and returns the membership with its bound port (None for transports without a group).
      It is called again, with a new membership, after `close`.
    - `send_bucket` delivers one bucket to every engine with the session's `selector` and returns once every
      engine has answered; the bucket's buffer is only read, and must stay untouched until it returns. Any
      engine's failure, or no answer within `timeout_s`, raises TransportError naming each failed engine; the
      transport must then be closed before reuse.
    - `close` releases the group / shared memory on this side and, best effort, on the engines. Idempotent.
    """

    name: str

    async def open(self, *, membership: GroupMembership | None, timeout_s: float) -> GroupMembership | None: ...

    async def send_bucket(self, bucket: FlattenedBucket, *, selector: Selector, timeout_s: float) -> None: ...

    async def close(self, *, timeout_s: float) -> None: ...


class TransportKind(WireEnum):
    """distributed: broadcast over a torch.distributed group; colocated: per-TP-rank tensor handles."""

    DISTRIBUTED = "distributed"
    COLOCATED = "colocated"


@dataclass(frozen=True, kw_only=True)
class TransportSpec:
    """A registered transport: where its class lives (imported lazily) and which engine endpoints it posts to."""

    module: str
    class_name: str
    needs_update_group: bool
    endpoints: tuple[str, ...]
    # Buckets travel as handles to CPU shared memory: the sender packs straight into shared buffers, else every
    # bucket would be copied once more into a fresh segment when it is pickled.
    shares_cpu_memory: bool = False
    # Engine ranks map memory of the trainer rank on their own device: every rank of a FeedPlan takes part in
    # each bucket (see miles_sync.transport.colocated), not only the export source.
    feeds_from_every_rank: bool = False


TRANSPORTS: dict[str, TransportSpec] = {  # keyed by TransportKind (a str enum: plain names look up too)
    TransportKind.DISTRIBUTED: TransportSpec(
        module="miles_sync.transport.distributed",
        class_name="DistributedTransport",
        needs_update_group=True,
        endpoints=("/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed"),
    ),
    TransportKind.COLOCATED: TransportSpec(
        module="miles_sync.transport.colocated",
        class_name="ColocatedTransport",
        needs_update_group=False,
        endpoints=("/update_weights_from_tensor",),
        shares_cpu_memory=True,
        feeds_from_every_rank=True,
    ),
}


def transport_spec(name: str) -> TransportSpec:
    spec = TRANSPORTS.get(name)
    if spec is None:
        raise ValueError(f"unknown transport {name!r}; registered: {', '.join(sorted(TRANSPORTS))}")
    return spec


def needs_update_group(name: str) -> bool:
    """Whether transport `name` broadcasts over an update group (so the controller plans a membership)."""
    return transport_spec(name).needs_update_group


def create_transport(name: str, *, engines: Sequence[EngineTarget], **options: object) -> Transport:
    """Build the transport registered as `name` over `engines` (in membership order); `options` go to its
    constructor (see each implementation)."""
    spec = transport_spec(name)
    cls = getattr(importlib.import_module(spec.module), spec.class_name)
    return cls(engines=engines, **options)
