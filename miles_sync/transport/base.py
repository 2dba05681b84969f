"""The transport seam: how one flattened bucket travels from the trainer's source rank to every engine.

Two implementations, chosen once by name (`create_transport`), never branched on in a hot loop:
- `distributed`: one broadcast per bucket over the update group (gloo on CPU, NCCL on GPU), announced to every
  engine by an `update_weights_from_distributed` POST;
- `colocated`: one `update_weights_from_tensor` POST per engine carrying a handle per engine TP rank (CPU shared
  memory here, CUDA IPC on GPU).

Group membership is planned here as pure records: the controller owns it (ranks, world size, address), the
distributed transport executes it. The trainer source is rank 0; engine i's TP rank r is
rank_offset_i + r, offsets packed in engine order after the source.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from miles_sync.bucket import FlattenedBucket
from miles_sync.engine.client import EngineClient
from miles_sync.protocol import InitWeightsUpdateGroupRequest, Selector

__all__ = [
    "TRANSPORTS",
    "EngineEndpoint",
    "EngineRanks",
    "EngineTarget",
    "GroupMembership",
    "Transport",
    "TransportError",
    "TransportSpec",
    "create_transport",
    "needs_update_group",
    "plan_membership",
    "transport_spec",
]


class TransportError(RuntimeError):
    """A bucket (or the group set-up) failed on at least one engine; the message names each engine and cause."""


@dataclass(frozen=True, kw_only=True)
class EngineEndpoint:
    """An engine as the controller tells the source about it: where it listens and how many TP ranks it runs."""

    url: str
    tp_size: int


@dataclass(frozen=True, kw_only=True)
class EngineTarget:
    """An engine as a transport sees it: its client and how many TP ranks it runs."""

    client: EngineClient
    tp_size: int


@dataclass(frozen=True, kw_only=True)
class EngineRanks:
    url: str
    rank_offset: int
    tp_size: int


@dataclass(frozen=True, kw_only=True)
class GroupMembership:
    """Who is in the update group and where it meets. `master_port` 0: the source rank lets the OS pick a port
    when it starts the store, and reports it back in the membership it returns from `Transport.open`."""

    group_name: str
    backend: str
    master_address: str
    master_port: int
    world_size: int
    engines: tuple[EngineRanks, ...]

    source_rank: int = 0

    def with_port(self, port: int) -> GroupMembership:
        return replace(self, master_port=port)

    def init_request(self, url: str) -> InitWeightsUpdateGroupRequest:
        """The /init_weights_update_group body for the engine at `url` (needs the bound port)."""
        for engine in self.engines:
            if engine.url == url:
                return InitWeightsUpdateGroupRequest(
                    master_address=self.master_address,
                    master_port=self.master_port,
                    rank_offset=engine.rank_offset,
                    world_size=self.world_size,
                    group_name=self.group_name,
                    backend=self.backend,
                )
        raise ValueError(f"engine {url} is not a member of update group {self.group_name!r}")


def plan_membership(
    *,
    engines: Sequence[EngineEndpoint],
    group_name: str,
    backend: str,
    master_address: str,
    master_port: int = 0,
) -> GroupMembership:
    """Ranks for the source (0) and each engine, in the given order. Pure.

    Raises ValueError naming every duplicate URL and every non-positive tp_size.
    """
    problems = []
    urls = [e.url for e in engines]
    duplicates = sorted({u for u in urls if urls.count(u) > 1})
    if duplicates:
        problems.append(f"duplicate engine URLs {duplicates}")
    bad_tp = [f"{e.url} tp_size={e.tp_size}" for e in engines if e.tp_size < 1]
    if bad_tp:
        problems.append(f"tp_size must be >= 1: {', '.join(bad_tp)}")
    if not engines:
        problems.append("an update group needs at least one engine")
    if not 0 <= master_port < 2**16:
        problems.append(f"master_port={master_port} is not 0 (OS-chosen) or a TCP port")
    if problems:
        raise ValueError(f"cannot plan update group {group_name!r}: " + "; ".join(problems))
    ranks = []
    offset = 1  # rank 0 is the trainer source
    for engine in engines:
        ranks.append(EngineRanks(url=engine.url, rank_offset=offset, tp_size=engine.tp_size))
        offset += engine.tp_size
    return GroupMembership(
        group_name=group_name,
        backend=backend,
        master_address=master_address,
        master_port=master_port,
        world_size=offset,
        engines=tuple(ranks),
    )


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


TRANSPORTS: dict[str, TransportSpec] = {
    "distributed": TransportSpec(
        module="miles_sync.transport.distributed",
        class_name="DistributedTransport",
        needs_update_group=True,
        endpoints=("/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed"),
    ),
    "colocated": TransportSpec(
        module="miles_sync.transport.colocated",
        class_name="ColocatedTransport",
        needs_update_group=False,
        endpoints=("/update_weights_from_tensor",),
        shares_cpu_memory=True,
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
