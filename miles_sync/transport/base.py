"""The transport seam: how one flattened bucket travels from the trainer's source rank to every engine.

Four implementations, chosen once by name (their registry rows: `open_rank_transport`, `open_routed_rank`), never
branched on in a hot loop:
- `distributed`: one broadcast per bucket over the update group (gloo on CPU, NCCL on GPU), announced to every
  engine by an `update_weights_from_distributed` POST;
- `colocated`: one `update_weights_from_tensor` POST per engine carrying a handle per engine TP rank (CPU shared
  memory here, CUDA IPC on GPU) to the whole bucket;
- `shard_direct`: the same fan-out, but each engine TP rank's handle maps only its own parameters, as the engine
  stores them (`load_format: "direct"`; miles_sync.transport.shard_direct);
- `p2p`: every trainer rank sends its own shards point to point into each engine rank's own parameters, through a
  custom weight loader the engines run (miles_sync.transport.p2p).

Here: the seam (`Transport`), the engines it reaches (`EngineEndpoint`, `EngineTarget`) and the registry
(`TRANSPORTS`: one `TransportSpec` row per transport, its declared needs). The update group's membership is planned
in miles_sync.transport.membership, the colocated feed assignment in miles_sync.transport.feeds.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from miles_sync.transport.feeds import FeedRole
from miles_sync.transport.membership import EngineEndpoint, GroupMembership
from miles_sync.weights.checksum import TensorHash
from miles_sync.weights.shard_plan import DirectLayout
from miles_sync.weights.shard_routes import Holding, LocalPiece
from miles_sync.wire.api import EngineAPI
from miles_sync.wire.bucket import FlattenedBucket, TensorMeta
from miles_sync.wire.codec import WireEnum
from miles_sync.wire.protocol import Selector

__all__ = [
    "RankForm",
    "RankSetup",
    "RankTransport",
    "RoutedRankTransport",
    "TRANSPORTS",
    "TransportKind",
    "TransportSpec",
    "open_rank_transport",
    "open_routed_rank",
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


@dataclass(frozen=True, kw_only=True)
class RankSetup:
    """What one trainer rank brings to its side of a transport at open. `feeds`: its role in a colocated feed plan
    (None: no plan was given). `connect(url)`: an engine client for the engines this rank talks to (the rank
    transport closes the ones it made). `device`: where its buckets live."""

    is_source: bool
    connect: Callable[[str], EngineAPI] = field(repr=False)
    feeds: FeedRole | None = None
    device: str = "cpu"
    fan_out_timeout_s: float = 120.0  # a member may wait in one collective for a poster's whole HTTP call
    metas: tuple[TensorMeta, ...] = ()  # the export's tensors, for a transport that plans from them
    # Every update request asks the engine to flush its prefix cache as it loads (SGLang's `flush_cache` field;
    # `torch_empty_cache` stays false). Only where the session's pause empties the engine (abort, retract): with
    # requests running (in_place) SGLang refuses the flush and fails the update.
    flush_cache: bool = False


@runtime_checkable
class RankTransport(Protocol):
    """One trainer rank's side of a transport, built at open (`open_rank_transport`) and driven by every trainer
    rank through the same calls: the source delivers each bucket (`send_bucket`) and ends each send (`end_send`,
    also after a failure); every other rank takes part in the send (`follow`, which returns once the source ended
    it; at once where the transport needs only the source)."""

    async def open(self, *, membership: GroupMembership | None, timeout_s: float) -> GroupMembership | None: ...

    async def send_bucket(self, bucket: FlattenedBucket, *, selector: Selector, timeout_s: float) -> None: ...

    async def end_send(self, *, error: str | None) -> None: ...

    async def follow(self, *, timeout_s: float) -> None: ...

    async def close(self, *, timeout_s: float) -> None: ...


class TransportKind(WireEnum):
    """distributed: broadcast over a torch.distributed group; colocated: per-TP-rank tensor handles to each bucket;
    shard_direct: per-TP-rank handles to that rank's own engine parameters; p2p: each trainer rank's own shards,
    point to point into each engine rank's own parameters, through SGLang's custom weight loader hook."""

    DISTRIBUTED = "distributed"
    COLOCATED = "colocated"
    SHARD_DIRECT = "shard_direct"
    P2P = "p2p"


@dataclass(frozen=True, kw_only=True)
class TransportSpec:
    """A registered transport, its one row: where its per-rank factory lives (imported lazily: an async function of
    `module` taking (engines, setup) and returning a RankTransport; None for a transport without that gathered
    form, which `open_rank_transport` refuses), what it needs of the controller and the engines (an update group,
    endpoints), and how buckets reach the engines."""

    module: str
    rank_factory: str | None
    needs_update_group: bool
    endpoints: tuple[str, ...]
    # Buckets travel as handles to CPU shared memory: the sender packs straight into shared buffers, else every
    # bucket would be copied once more into a fresh segment when it is pickled.
    shares_cpu_memory: bool = False
    # Engine ranks map memory of the trainer rank on their own device: every rank of a FeedPlan takes part in
    # each bucket (see miles_sync.transport.fan_out), not only the export source.
    feeds_from_every_rank: bool = False
    # Payloads are the engines' own parameters: the controller gives each endpoint its layout, the source plans from
    # the export's tensor metas, and a session whose selector covers a draft runner is refused (a direct load goes
    # to every selected runner, and a draft has none of the target's names).
    needs_engine_layouts: bool = False
    # Every trainer rank sends its own shards, with no gather, for a source whose ranks hold them (a Megatron
    # ModelSource in raw conversion): the dotted path of an async function taking (engines, setup, bucket_bytes,
    # holdings) and returning a RoutedRankTransport (`open_routed_rank`). A source of full HF tensors (bridge
    # conversion) runs `rank_factory`.
    routed_factory: str | None = None
    # Feeders are spread over the trainer ranks from the engines' TP sizes (feeds.plan_spread_feeds), not tied to
    # the engines' devices: engines anywhere, every trainer rank takes part.
    spreads_feeds: bool = False
    # The engines must be started with this import path as `--custom-weight-loader` (SGLang's flag; the reference
    # engine's too); the posted requests name it as their load_format.
    custom_weight_loader: str | None = None

    # What the rest of the package asks of a row: the flags above are read here (and in miles_sync.config's
    # validation) only, so adding a transport touches its module and its row.

    def form(self, *, raw_conversion: bool, has_feed_plan: bool) -> RankForm:
        """How each trainer rank takes part in a send, for a source of that conversion with (or without) a feed
        plan: routed where the transport has a routed form, the conversion gives each rank its own slices (raw) and
        something says which rank feeds each engine rank (the given plan, or the transport's own spread)."""
        if self.routed_factory is None or not raw_conversion:
            return RankForm.GATHERED
        if has_feed_plan:
            return RankForm.ROUTED
        return RankForm.SPREAD if self.spreads_feeds else RankForm.GATHERED

    def can_pack_ahead(self) -> bool:
        """Whether a rank can pack a send ahead of the session (staged export): not where the only form routes
        each rank's own shards at send time."""
        return self.rank_factory is not None

    def places_colocated(self) -> bool:
        """Whether each engine rank is fed by the trainer rank on its own device (placement bundles shared)."""
        return self.feeds_from_every_rank

    def opens_update_group(self) -> bool:
        return self.needs_update_group

    def sends_engine_parameters(self) -> bool:
        """Whether payloads are the engines' own parameters (endpoints carry their layouts; target runner only)."""
        return self.needs_engine_layouts

    def packs_into_shared_memory(self, device_type: str) -> bool:
        return self.shares_cpu_memory and device_type == "cpu"

    def engine_weight_loaders(self) -> tuple[str, ...]:
        """The `--custom-weight-loader` import paths the engines must be started with."""
        return (self.custom_weight_loader,) if self.custom_weight_loader else ()


class RankForm(WireEnum):
    """gathered: the export source sends the full HF tensors (each rank of a feed plan hands its copy on); routed:
    every rank sends its own shards to the engine ranks the feed plan gives it; spread: the same, with the feeds
    spread over the ranks of each pipeline stage at open (miles_sync.transport.feeds.plan_spread_feeds)."""

    GATHERED = "gathered"
    ROUTED = "routed"
    SPREAD = "spread"


TRANSPORTS: dict[str, TransportSpec] = {  # keyed by TransportKind (a str enum: plain names look up too)
    TransportKind.DISTRIBUTED: TransportSpec(
        module="miles_sync.transport.distributed",
        rank_factory="open_distributed_rank",
        needs_update_group=True,
        endpoints=("/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed"),
    ),
    TransportKind.COLOCATED: TransportSpec(
        module="miles_sync.transport.colocated",
        rank_factory="open_colocated_rank",
        needs_update_group=False,
        endpoints=("/update_weights_from_tensor",),
        shares_cpu_memory=True,
        feeds_from_every_rank=True,
    ),
    TransportKind.SHARD_DIRECT: TransportSpec(
        module="miles_sync.transport.shard_direct",
        rank_factory="open_shard_direct_rank",
        needs_update_group=False,
        endpoints=("/update_weights_from_tensor",),
        feeds_from_every_rank=True,
        needs_engine_layouts=True,
        routed_factory="miles_sync.transport.shard_routed.open_shard_routed_rank",
    ),
    TransportKind.P2P: TransportSpec(
        module="miles_sync.transport.p2p",
        rank_factory=None,  # only the routed form: every trainer rank sends its own shards
        needs_update_group=False,
        endpoints=("/update_weights_from_tensor",),
        needs_engine_layouts=True,
        routed_factory="miles_sync.transport.p2p.open_p2p_routed_rank",
        spreads_feeds=True,
        custom_weight_loader="miles_sync.transport.p2p_loader.load_routed",
    ),
}


def transport_spec(name: str) -> TransportSpec:
    spec = TRANSPORTS.get(name)
    if spec is None:
        raise ValueError(f"unknown transport {name!r}; registered: {', '.join(sorted(TRANSPORTS))}")
    return spec


class SourceRank(RankTransport):
    """A rank's side of a transport that only the export source drives (its `Transport` over every engine, e.g.
    distributed); any other rank holds nothing and its `follow` returns at once."""

    def __init__(self, transport: Transport | None, *, clients: Sequence[EngineAPI] = ()) -> None:
        self._transport = transport
        self._clients = tuple(clients)

    async def open(self, *, membership: GroupMembership | None, timeout_s: float) -> GroupMembership | None:
        if self._transport is None:
            return membership
        return await self._transport.open(membership=membership, timeout_s=timeout_s)

    async def send_bucket(self, bucket: FlattenedBucket, *, selector: Selector, timeout_s: float) -> None:
        if self._transport is None:
            raise TransportError("only the export source sends buckets")
        await self._transport.send_bucket(bucket, selector=selector, timeout_s=timeout_s)

    async def end_send(self, *, error: str | None) -> None:
        return None

    async def follow(self, *, timeout_s: float) -> None:
        return None

    async def close(self, *, timeout_s: float) -> None:
        try:
            if self._transport is not None:
                await self._transport.close(timeout_s=timeout_s)
        finally:
            for client in self._clients:
                await client.close()


def source_rank(
    transport_class: Callable[..., Transport], *, engines: Sequence[EngineEndpoint], setup: RankSetup, **options: Any
) -> SourceRank:
    """A SourceRank whose source builds `transport_class(engines=<every engine's target>, **options)`."""
    if not setup.is_source:
        return SourceRank(None)
    clients = [setup.connect(e.url) for e in engines]
    targets = [EngineTarget(client=c, tp_size=e.tp_size) for c, e in zip(clients, engines)]
    return SourceRank(transport_class(engines=targets, **options), clients=clients)


@dataclass(frozen=True, kw_only=True)
class RoutedOutcome:
    """One routed send as its source saw it: bytes built for engine ranks (each buffer once), buckets, HF tensors
    delivered, and per (direct layout, hash kind) every engine rank's expected digests, where every rank of the
    layout was built. Empty on other ranks."""

    num_bytes: int
    num_buckets: int
    num_tensors: int
    digests: dict[tuple[DirectLayout, TensorHash], tuple[dict[str, str], ...]] = field(default_factory=dict)
    checksums: dict[str, str] = field(default_factory=dict)  # HF checksums, where a TP=1 engine was built whole
    names: tuple[str, ...] = ()  # the HF tensors delivered


@runtime_checkable
class RoutedRankTransport(Protocol):
    """One trainer rank's side of a transport whose ranks each send their own shards (no gather), planned at open
    from every rank's holdings. Every rank calls `send` at once with its own slices (`LocalPiece`s: views that
    must stay valid until it returns), the hash kinds the expected engine digests are wanted in and whether the HF
    checksums are (`checksums`: hashed where a TP=1 engine's parameters are built whole); the source returns
    the outcome and raises naming what failed, other ranks return an empty outcome and raise only when the group
    fails. `on_bucket(index, num_tensors, num_bytes)` runs on the source after each acknowledged bucket (HF tensors
    it completed, bytes built)."""

    async def send(
        self,
        pieces: Iterable[LocalPiece],
        *,
        selector: Selector,
        hashes: Sequence[TensorHash],
        checksums: bool,
        timeout_s: float,
        on_bucket: Callable[[int, int, int], None] | None = None,
    ) -> RoutedOutcome: ...

    async def close(self, *, timeout_s: float) -> None: ...


async def open_routed_rank(
    name: str,
    *,
    engines: Sequence[EngineEndpoint],
    setup: RankSetup,
    bucket_bytes: int,
    holdings: Sequence[tuple[str, Holding]],
) -> RoutedRankTransport:
    """This trainer rank's side of transport `name`'s routed form (its row's `routed_factory`), planned from every
    rank's `holdings` (this rank's: (HF name, Holding) of every slice its converter gives it). Every trainer rank
    calls it at once. Raises ValueError for a transport without a routed form."""
    spec = transport_spec(name)
    if spec.routed_factory is None:
        raise ValueError(f"the {name} transport has no routed form (each rank sending its own shards)")
    module, _, function = spec.routed_factory.rpartition(".")
    factory = getattr(importlib.import_module(module), function)
    return await factory(engines=engines, setup=setup, bucket_bytes=bucket_bytes, holdings=holdings)


async def open_rank_transport(name: str, *, engines: Sequence[EngineEndpoint], setup: RankSetup) -> RankTransport:
    """This trainer rank's side of transport `name` over `engines` (in membership order), built by its registry
    row's `rank_factory`. Every trainer rank calls it at once (a transport fed by every rank may open a group).
    Raises ValueError for a transport with only a routed form (a source of full HF tensors cannot feed it)."""
    spec = transport_spec(name)
    if spec.rank_factory is None:
        raise ValueError(
            f"the {name} transport sends each trainer rank's own shards and has no form for a source of full HF "
            "tensors: it needs raw conversion (sync.conversion=raw); use the distributed transport otherwise"
        )
    factory = getattr(importlib.import_module(spec.module), spec.rank_factory)
    return await factory(engines=engines, setup=setup)
