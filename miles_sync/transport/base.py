"""The transport seam: how one flattened bucket travels from the trainer's source rank to every engine.

Two implementations, chosen once by name (`create_transport`), never branched on in a hot loop:
- `distributed`: one broadcast per bucket over the update group (gloo on CPU, NCCL on GPU), announced to every
  engine by an `update_weights_from_distributed` POST;
- `colocated`: one `update_weights_from_tensor` POST per engine carrying a handle per engine TP rank (CPU shared
  memory here, CUDA IPC on GPU).

Group membership is planned here as pure records: the controller owns it (ranks, world size, address), the
distributed transport executes it. The trainer source is rank 0; engine i's TP rank r is
rank_offset_i + r, offsets packed in engine order after the source.

The colocated feed assignment is planned here too (`plan_feeds`): which trainer rank hands its own copy of each
bucket to which engine TP rank (the one on the same device: a CUDA IPC handle only opens on its own GPU), and which
trainer rank posts each engine's request. The colocated transport executes it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from miles_sync.wire.api import EngineAPI
from miles_sync.wire.bucket import FlattenedBucket
from miles_sync.wire.codec import WireEnum
from miles_sync.wire.protocol import InitWeightsUpdateGroupRequest, Selector

__all__ = [
    "TransportKind",
    "TRANSPORTS",
    "Device",
    "EngineEndpoint",
    "EngineFeed",
    "EngineRanks",
    "EngineTarget",
    "FeedPlan",
    "FeedRole",
    "GroupMembership",
    "Transport",
    "TransportError",
    "TransportSpec",
    "create_transport",
    "feed_node_problems",
    "needs_update_group",
    "plan_feeds",
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

    client: EngineAPI
    tp_size: int


@dataclass(frozen=True, kw_only=True)
class EngineRanks:
    url: str
    rank_offset: int
    tp_size: int


@dataclass(frozen=True, kw_only=True)
class GroupMembership:
    """Who is in the update group and where it meets. `master_port` 0: the source rank lets the OS pick a port
    when it starts the store, and reports it back in the membership it returns from `Transport.open`.
    `master_address` None: the source rank's own bind address (its node's, miles_sync.env.bind_host), filled in
    the same way; so with pipeline stages each stage's group meets on its own source rank's node."""

    group_name: str
    backend: str
    master_address: str | None
    master_port: int
    world_size: int
    engines: tuple[EngineRanks, ...]

    source_rank: int = 0

    def with_port(self, port: int) -> GroupMembership:
        return replace(self, master_port=port)

    def bound_to(self, *, address: str, port: int) -> GroupMembership:
        """The membership as the source rank started its store: at `address`:`port`."""
        return replace(self, master_address=address, master_port=port)

    def init_request(self, url: str) -> InitWeightsUpdateGroupRequest:
        """The /init_weights_update_group body for the engine at `url` (needs the bound address and port)."""
        if self.master_address is None:
            raise ValueError(f"update group {self.group_name!r} has no master address yet (the source binds it)")
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
    master_address: str | None,
    master_port: int = 0,
) -> GroupMembership:
    """Ranks for the source (0) and each engine, in the given order. Pure. `master_address` None: the source
    rank binds its own address when it opens the group.

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


@dataclass(frozen=True, kw_only=True, order=True)
class Device:
    """One accelerator (or, on CPU clusters, one placement bundle): `node` is the node's address, or the name of
    the placement group when devices come from a placement plan (all of a bundle sits on one node); `index` is
    the device or bundle index there. Two processes on equal Devices can open each other's IPC handles."""

    node: str
    index: int


@dataclass(frozen=True, kw_only=True)
class EngineFeed:
    """Who serves one engine: `feeders[r]` is the trainer rank whose copy of each bucket engine TP rank r maps;
    `poster` gathers the engine's handles and posts its `update_weights_from_tensor` request."""

    feeders: tuple[int, ...]
    poster: int


@dataclass(frozen=True, kw_only=True)
class FeedPlan:
    """The colocated feed assignment of one fleet, engines in membership order (see `plan_feeds`)."""

    num_trainers: int
    engines: tuple[EngineFeed, ...]

    @classmethod
    def single_source(cls, *, tp_sizes: Sequence[int], rank: int = 0, num_trainers: int = 1) -> FeedPlan:
        """Every engine rank fed and posted by trainer rank `rank`: the layout of a caller that gave no devices
        (one copy of each bucket, every engine rank maps it; on GPU that only works where they share a device)."""
        return cls(
            num_trainers=num_trainers,
            engines=tuple(EngineFeed(feeders=(rank,) * tp, poster=rank) for tp in tp_sizes),
        )

    @property
    def feeding_ranks(self) -> tuple[int, ...]:
        """Trainer ranks that hold a copy of every bucket, ascending."""
        return tuple(sorted({r for e in self.engines for r in (*e.feeders, e.poster)}))

    def feeds_of(self, rank: int) -> tuple[tuple[int, int], ...]:
        """(engine index, TP rank) of every engine rank that `rank` feeds, in engine order."""
        return tuple((j, r) for j, e in enumerate(self.engines) for r, f in enumerate(e.feeders) if f == rank)

    def posted_by(self, rank: int) -> tuple[int, ...]:
        """Indices of the engines whose requests `rank` posts."""
        return tuple(j for j, e in enumerate(self.engines) if e.poster == rank)

    def check_engines(self, engines: Sequence[EngineEndpoint]) -> None:
        """Raise ValueError naming every engine whose TP size differs from the plan's (or a count mismatch)."""
        problems = []
        if len(engines) != len(self.engines):
            problems.append(f"the plan covers {len(self.engines)} engine(s), the fleet has {len(engines)}")
        problems.extend(
            f"engine {j} ({e.url}) runs {e.tp_size} TP rank(s), the plan feeds {len(f.feeders)}"
            for j, (e, f) in enumerate(zip(engines, self.engines))
            if e.tp_size != len(f.feeders)
        )
        if problems:
            raise ValueError("the colocated feed plan does not match the engines: " + "; ".join(problems))


@dataclass(frozen=True, kw_only=True)
class FeedRole:
    """One trainer rank's view of a FeedPlan: its own rank and the export source's (which packs every bucket)."""

    plan: FeedPlan
    rank: int
    source_rank: int

    @classmethod
    def single_source(cls, *, tp_sizes: Sequence[int]) -> FeedRole:
        """The source (rank 0) alone, feeding and posting every engine rank: the role without devices."""
        return cls(plan=FeedPlan.single_source(tp_sizes=tp_sizes), rank=0, source_rank=0)

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks of the fan-out group: the source and every feeding rank, ascending."""
        return tuple(sorted({self.source_rank, *self.plan.feeding_ranks}))

    @property
    def is_member(self) -> bool:
        return self.rank in self.members


def plan_feeds(*, trainer_devices: Sequence[Device], engine_devices: Sequence[Sequence[Device]]) -> FeedPlan:
    """Assign every engine TP rank the trainer rank on its own device (the lowest such rank), and every engine the
    feeder of its TP rank 0 as poster. Pure.

    `trainer_devices[i]`: trainer rank i's device; `engine_devices[j][r]`: engine j's TP rank r's. Raises
    ValueError naming every engine rank without a co-located trainer rank (and empty inputs), before any sync.
    """
    problems = []
    if not trainer_devices:
        problems.append("no trainer ranks")
    if not engine_devices:
        problems.append("no engines")
    problems.extend(f"engine {j} has no TP ranks" for j, ranks in enumerate(engine_devices) if not ranks)
    first_rank: dict[Device, int] = {}
    for rank, device in enumerate(trainer_devices):
        first_rank.setdefault(device, rank)
    orphans = [
        f"engine {j} TP rank {r} on {d}"
        for j, ranks in enumerate(engine_devices)
        for r, d in enumerate(ranks)
        if d not in first_rank
    ]
    if orphans:
        problems.append(
            "no trainer rank shares a device with " + ", ".join(orphans) + f" (trainer devices: {sorted(first_rank)})"
        )
    if problems:
        raise ValueError("cannot plan colocated feeds: " + "; ".join(problems))
    engines = []
    for ranks in engine_devices:
        feeders = tuple(first_rank[d] for d in ranks)
        engines.append(EngineFeed(feeders=feeders, poster=feeders[0]))
    return FeedPlan(num_trainers=len(trainer_devices), engines=tuple(engines))


def feed_node_problems(
    *,
    plan: FeedPlan,
    trainer_nodes: Sequence[str],
    engines: Sequence[EngineEndpoint],
    engine_nodes: Sequence[str],
) -> list[str]:
    """Every engine rank whose feeder, or engine whose poster, runs on another node than the engine. Pure.

    Colocated payloads are handles to memory (CPU shared memory, CUDA IPC) that open only on the node that holds
    it, so each engine must be fed from a trainer rank on its own node: the bucket reaches that node over the
    trainer's own group, never as a handle. `trainer_nodes[i]`: trainer rank i's node address; `engine_nodes[j]`:
    engine j's (the host of its URL). Each problem names the engine, its node and the nodes it has trainer ranks
    on, so a layout without a trainer rank on an engine's node is refused before any sync.
    """
    problems = []
    for j, (engine, feed, node) in enumerate(zip(engines, plan.engines, engine_nodes)):
        local = [r for r, n in enumerate(trainer_nodes) if n == node]
        strangers = sorted(
            {f"rank {r} on {trainer_nodes[r]}" for r in (*feed.feeders, feed.poster) if trainer_nodes[r] != node}
        )
        if strangers:
            where = f"trainer ranks {local} are on it" if local else "no trainer rank runs on it"
            problems.append(
                f"engine {j} ({engine.url}) on node {node} would be fed across nodes by {', '.join(strangers)} "
                f"({where})"
            )
    return problems


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
