"""Shard-direct without a gather: every trainer rank converts its own Megatron shards and sends each engine rank's
feeder only the slices that feeder does not hold; each feeder builds its engine ranks' own parameters
(`load_format: "direct"`, as miles_sync.transport.shard_direct) from its own slices and the ones it received.

The plan (miles_sync.weights.shard_routes.plan_routed) is made once at open, on every rank alike: each rank's
holdings (what its converter gives it, from one conversion pass) are all-gathered over the fan-out group, which
here has every trainer rank as a member (`FeedRole.every_rank`; every rank of one pipeline stage where the stages
send one after another, each its own layers: p2p). It is replayed every sync. Per scheduled bucket:

    source:  announce the bucket's index (no bytes: nobody gathers anything)
    every rank: send the slices other feeders need (point to point, all posted at once), receive its own
    feeders: build each (layout, engine rank) buffer from its slices, hash every parameter as built (the digests
             its engine rank's checker must answer), encode one direct payload per engine rank it feeds
    posters: POST update_weights_from_tensor, as every fan-out does (miles_sync.transport.fan_out)

After the send every rank all-gathers its digests, so the source returns each engine layout's expected per-rank
digests without ever holding a full tensor. A direct load runs no weight loader, so payloads name the target's
parameters only (the session refuses a selector that covers a draft runner, as for shard_direct).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from miles_sync.transport.base import RankSetup, RoutedOutcome, RoutedRankTransport, TransportError
from miles_sync.transport.fan_out import Collectives, FanOut, ReceiveBuffer, open_posting_fan_out
from miles_sync.transport.feeds import FeedRole
from miles_sync.transport.membership import EngineEndpoint
from miles_sync.weights.checksum import (
    TensorHash,
    raw_sha256_digest,
    sglang_digest,
    sglang_reported_name,
    tensor_checksum,
)
from miles_sync.weights.shard_plan import DirectLayout, DirectParam, assemble_param, matrix_shape, plan_direct
from miles_sync.weights.shard_routes import Build, Holding, LocalPiece, Route, RoutedSchedule, plan_routed
from miles_sync.wire.bucket import BucketEntry, TensorMeta, bucket_layout, unpack_bucket
from miles_sync.wire.payload import encode_named_tensors
from miles_sync.wire.protocol import LoadFormat, Selector
from miles_sync.wire.text import raise_if

__all__: list[str] = []  # reached through the transport registry only

_TARGET_ROLE = "target"


@dataclass(frozen=True, kw_only=True)
class RoutedBucketIndex:
    """Source -> members: the next bucket of the schedule every member already holds."""

    index: int


@dataclass(frozen=True, kw_only=True)
class RankHoldings:
    """A member's holdings, all-gathered at open: every HF slice it converts its own shards into."""

    rank: int
    holdings: tuple[tuple[str, Holding], ...]


@dataclass(frozen=True, kw_only=True)
class BuildDigests:
    """What one build's engine rank must answer, per hash kind: {reported name: digest}; and, for a build of a
    TP=1 engine (which holds every HF tensor whole), the HF checksum of every tensor it assembled."""

    build: Build
    digests: dict[TensorHash, dict[str, str]]
    checksums: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class _Failed:
    """A member's bucket that could not be built: `encode` reports it through the group."""

    message: str


@dataclass(frozen=True, kw_only=True)
class BuiltRank:
    """One engine rank's parameters of a bucket as its feeder built them: (name, view into the build's buffer) in
    order, and their SHA-256 digests concatenated where the build hashed them (SHA-256 engine digests), else None."""

    engine: int  # membership index
    tp_rank: int
    tensors: list[tuple[str, torch.Tensor]]
    sha256: bytes | None


class PayloadSink(Protocol):
    """Where a routed delivery's builds go, the one step its transports differ in. `encode` turns a bucket's builds
    (one per engine rank this rank feeds, None where it has nothing in the bucket) into the payloads posted in
    their place; `settle` waits for whatever the payloads set going besides the posts and names each failure;
    `connect` runs on every rank once the fan-out is open, before the plan, and `end_send` after every send,
    failed or not (either may run collectives over the fan-out); `close` frees what the sink holds.
    `load_format` is what the posted requests carry."""

    load_format: LoadFormat | str

    async def connect(self, fan_out: FanOut) -> None: ...

    def encode(self, built: Sequence[BuiltRank | None]) -> list[str | None]: ...

    def settle(self) -> list[str]: ...

    async def end_send(self, fan_out: FanOut) -> None: ...

    def close(self) -> None: ...


class InlineSink:
    """shard_direct's sink: each engine rank's parameters posted inline as its direct payload."""

    load_format = LoadFormat.DIRECT

    async def connect(self, fan_out: FanOut) -> None:
        return None

    def encode(self, built: Sequence[BuiltRank | None]) -> list[str | None]:
        return [None if b is None else encode_named_tensors(b.tensors) for b in built]

    def settle(self) -> list[str]:
        return []

    async def end_send(self, fan_out: FanOut) -> None:
        return None

    def close(self) -> None:
        return None


class RoutedDelivery:
    """The fan-out delivery of a routed send (module docstring) into `sink`. `layouts[j]` is engine j's layout;
    `metas` the export's tensors (every rank plans from them); `bucket_bytes` caps the largest build of a bucket."""

    def __init__(
        self,
        *,
        role: FeedRole,
        layouts: Sequence[DirectLayout],
        metas: Sequence[TensorMeta],
        bucket_bytes: int,
        device: torch.device,
        sink: PayloadSink,
    ) -> None:
        if not metas:
            raise ValueError("a routed shard_direct send needs the export's tensor metas; this rank gives none")
        self._distinct = list(dict.fromkeys(layouts))
        self._layout_of = [self._distinct.index(layout) for layout in layouts]
        self._role = role
        self._device = device
        self._bucket_bytes = bucket_bytes
        self._metas = {m.name: m for m in metas}
        self._plans = [plan_direct(metas, layout=layout) for layout in self._distinct]
        self._params = [[{p.name: p for p in params} for params in plan.ranks] for plan in self._plans]
        plan = role.plan
        self._builds = tuple(
            sorted(
                {
                    Build(layout=self._layout_of[j], tp_rank=r, feeder=f)
                    for f in role.members
                    for j, r in plan.feeds_of(f)
                },
                key=lambda b: (b.feeder, b.layout, b.tp_rank),
            )
        )
        self._member_of = {rank: i for i, rank in enumerate(role.members)}
        self._schedule: RoutedSchedule | None = None
        self._buffers: dict[Build, ReceiveBuffer] = {}
        self._pieces: dict[str, list[LocalPiece]] = {}
        self._hashes: tuple[TensorHash, ...] = ()
        self._wants_checksums = False
        self._digests: dict[Build, dict[TensorHash, dict[str, str]]] = {}
        self._checksums: dict[Build, dict[str, str]] = {}
        self._sha256: dict[tuple[Build, str], bytes] = {}  # full SHA-256 of each parameter built (SHA-256 engines)
        self.sink = sink

    @property
    def load_format(self) -> LoadFormat | str:
        return self.sink.load_format

    @property
    def schedule(self) -> RoutedSchedule:
        if self._schedule is None:
            raise TransportError("the routed send was not planned (open it first)")
        return self._schedule

    def plan(self, collectives: Collectives, holdings: Sequence[tuple[str, Holding]]) -> RoutedSchedule:
        """All-gather every member's holdings and plan the send (the same schedule on every member; a refused plan
        raises the same ValueError on every member, before any byte moves)."""
        gathered: list[RankHoldings] = collectives.all_gather_object(
            RankHoldings(rank=self._role.rank, holdings=tuple(holdings))
        )
        every: dict[str, list[Holding]] = defaultdict(list)
        for rank in gathered:
            for name, holding in rank.holdings:
                every[name].append(holding)
        self._schedule = plan_routed(self._plans, every, builds=self._builds, bucket_bytes=self._bucket_bytes)
        return self._schedule

    def load(
        self,
        pieces: Iterable[LocalPiece],
        *,
        hashes: Sequence[TensorHash],
        checksums: bool,
    ) -> None:
        """This rank's own slices for the next send (views stay valid until it ends), the hash kinds its builds'
        digests are wanted in and whether its TP=1 builds' HF checksums are."""
        self._pieces = defaultdict(list)
        for piece in pieces:
            self._pieces[piece.hf_name].append(piece)
        self._hashes = tuple(dict.fromkeys(hashes))
        self._wants_checksums = checksums
        self._digests = {}
        self._checksums = {}
        self._sha256 = {}

    def digests(self) -> tuple[BuildDigests, ...]:
        """The digests of every parameter this rank built in the last send."""
        return tuple(
            BuildDigests(build=b, digests=d, checksums=self._checksums.get(b, {})) for b, d in self._digests.items()
        )

    def num_bytes(self, bucket: int | None = None) -> int:
        """Bytes of every build's parameters (each build once) per send, or in bucket `bucket`."""
        names = None if bucket is None else set(self.schedule.buckets[bucket].names)
        return sum(
            p.num_bytes
            for b in self._builds
            for p in self._params[b.layout][b.tp_rank].values()
            if names is None or p.name in names
        )

    def checksums(self, gathered: Sequence[Sequence[BuildDigests]]) -> dict[str, str]:
        """The HF checksums of every tensor, from the first TP=1 build among the members' `digests()` (empty when
        the fleet has no TP=1 engine: then no engine answers HF-named digests either)."""
        return next((dict(b.checksums) for rank in gathered for b in rank if b.checksums), {})

    def expected(
        self, gathered: Sequence[Sequence[BuildDigests]]
    ) -> dict[tuple[DirectLayout, TensorHash], tuple[dict[str, str], ...]]:
        """Per (layout, hash kind), every engine rank's digests from the members' `digests()`; a layout some rank
        of which nobody built is left out (its engines are verified by replica agreement)."""
        by_rank: dict[tuple[int, TensorHash, int], dict[str, str]] = {}
        for rank_digests in gathered:
            for built in rank_digests:
                for kind, digests in built.digests.items():
                    by_rank.setdefault((built.build.layout, kind, built.build.tp_rank), digests)
        out = {}
        for index, layout in enumerate(self._distinct):
            for kind in self._hashes:
                ranks = [by_rank.get((index, kind, r)) for r in range(layout.tp_size)]
                if all(r is not None for r in ranks):
                    out[(layout, kind)] = tuple(ranks)
        return out

    # ---- Delivery ----------------------------------------------------------------------------------------------

    def prepare(self, bucket: object) -> tuple[object, object]:
        raise TransportError("a routed send has no source bucket: its source announces each scheduled bucket")

    def receive(
        self, contents: RoutedBucketIndex, local: object | None, collectives: Collectives
    ) -> dict[Build, tuple[tuple[BucketEntry, ...], torch.Tensor]] | _Failed:
        bucket = self.schedule.buckets[contents.index]
        me = self._role.rank
        problems: list[str] = []
        sends: dict[int, list[torch.Tensor]] = defaultdict(list)
        for route in bucket.sends(me):
            try:
                data = self._read(route).contiguous()
            except TransportError as exc:  # still send the slice's size: the feeder waits for it
                problems.append(str(exc))
                data = torch.zeros(self._slice_shape(route), dtype=self._metas[route.hf_name].dtype)
            sends[self._member_of[route.feeder]].append(data.to(self._device))
        incoming = bucket.receives(me)
        received: dict[Route, torch.Tensor] = {}
        recvs: dict[int, list[torch.Tensor]] = defaultdict(list)
        for route in incoming:
            buffer = torch.empty(self._slice_shape(route), dtype=self._metas[route.hf_name].dtype, device=self._device)
            received[route] = buffer
            recvs[self._member_of[route.source]].append(buffer)
        collectives.exchange_buffers(sends=sends, recvs=recvs)
        routes_of: dict[tuple[Build, str], list[Route]] = defaultdict(list)
        for route in bucket.routes:
            if route.feeder == me:
                routes_of[(Build(layout=route.layout, tp_rank=route.tp_rank, feeder=me), route.param)].append(route)
        if problems:  # reported by `encode`, through the group: every member fails this bucket together
            return _Failed(message="; ".join(problems))
        try:
            built = {
                build: self._build(build, bucket.names, routes_of, received)
                for build in self._builds
                if build.feeder == me
            }
        except Exception as exc:
            return _Failed(message=f"rank {me} could not build its engine ranks' parameters: {exc}")
        return built

    def encode(
        self,
        contents: RoutedBucketIndex,
        local: Mapping[Build, tuple[tuple[BucketEntry, ...], torch.Tensor]] | _Failed,
        *,
        feeds: Sequence[tuple[int, int]],
    ) -> list[str | None]:
        if isinstance(local, _Failed):
            raise TransportError(local.message)
        built: list[BuiltRank | None] = []
        for j, tp_rank in feeds:
            build = Build(layout=self._layout_of[j], tp_rank=tp_rank, feeder=self._role.rank)
            entries, buffer = local.get(build, ((), None))
            if not entries:
                built.append(None)
                continue
            tensors = unpack_bucket(buffer, entries)
            sha256 = self._sha256_of(build, [n for n, _ in tensors])
            built.append(BuiltRank(engine=j, tp_rank=tp_rank, tensors=tensors, sha256=sha256))
        return self.sink.encode(built)

    def settle(self) -> list[str]:
        return self.sink.settle()

    def end_send(self) -> str | None:
        return None

    def reset(self) -> None:
        self._pieces = {}

    def close(self) -> None:
        try:
            self.sink.close()
        finally:
            self._buffers.clear()

    # ---- internals ---------------------------------------------------------------------------------------------

    def _build(
        self,
        build: Build,
        names: Sequence[str],
        routes_of: Mapping[tuple[Build, str], Sequence[Route]],
        received: Mapping[Route, torch.Tensor],
    ) -> tuple[tuple[BucketEntry, ...], torch.Tensor]:
        """This bucket's parameters of one build, assembled into its buffer and hashed."""
        params: dict[str, DirectParam] = self._params[build.layout][build.tp_rank]
        entries = bucket_layout([params[n].meta for n in names if n in params])
        buffer = self._buffer(build).take(entries[-1].end if entries else 0)
        weight_layout = self._distinct[build.layout].weight_layout
        digests = self._digests.setdefault(build, {kind: {} for kind in self._hashes})
        is_whole = self._distinct[build.layout].tp_size == 1
        checksums = self._checksums.setdefault(build, {}) if is_whole and self._wants_checksums else None
        for e in entries:
            param = params[e.name]
            writes = (
                (r.dim, r.offset, received[r] if r in received else self._read(r)) for r in routes_of[(build, e.name)]
            )
            hf = None if checksums is None else functools.partial(self._hf_checksums, param, checksums)
            tensor = assemble_param(
                param, writes, out=buffer[e.start : e.end], weight_layout=weight_layout, before_layout=hf
            )
            reported = sglang_reported_name(_TARGET_ROLE, param.name)
            for kind in self._hashes:
                if kind is TensorHash.SHA256:  # the full digest kept: p2p sends it with the bytes (BuiltRank.sha256)
                    full = self._sha256[(build, param.name)] = raw_sha256_digest(tensor)
                    digests[kind][reported] = full.hex()[:16]  # sglang_tensor_hash, without hashing again
                else:
                    digests[kind][reported] = sglang_digest(tensor, kind)
        return entries, buffer

    def _sha256_of(self, build: Build, names: Sequence[str]) -> bytes | None:
        """The SHA-256 digests of `names` as `build` built them in this send, concatenated in that order; None unless
        every one was hashed (only when engine digests of the SHA-256 kind are wanted)."""
        digests = [self._sha256.get((build, name)) for name in names]
        return None if any(d is None for d in digests) else b"".join(d for d in digests if d is not None)

    def _hf_checksums(self, param: DirectParam, out: dict[str, str], matrix: torch.Tensor) -> None:
        """At TP=1 each piece of a parameter is a whole HF tensor: its checksum, as a gathered send reports it."""
        for piece in param.pieces:
            meta = self._metas[piece.hf_name]
            out[piece.hf_name] = tensor_checksum(
                matrix.narrow(piece.dim, piece.offset, piece.length).reshape(meta.shape)
            )

    def _read(self, route: Route) -> torch.Tensor:
        piece = next((p for p in self._pieces.get(route.hf_name, ()) if p.covers(route)), None)
        if piece is None:
            raise TransportError(
                f"rank {self._role.rank} holds no slice [{route.start}, {route.end}) along dim {route.dim} of "
                f"{route.hf_name}, which the plan routes from it (its shards changed layout since open?)"
            )
        return piece.read(route)

    def _slice_shape(self, route: Route) -> tuple[int, int]:
        rows, cols = matrix_shape(self._metas[route.hf_name].shape)
        length = route.end - route.start
        return (length, cols) if route.dim == 0 else (rows, length)

    def _buffer(self, build: Build) -> ReceiveBuffer:
        if build not in self._buffers:
            self._buffers[build] = ReceiveBuffer(self._device)
        return self._buffers[build]


class RoutedRank(RoutedRankTransport):
    """One trainer rank's side of a routed send (shard_direct's routed form, p2p): its fan-out (every trainer rank
    is a member) and delivery. Every rank calls `send` at once with its own slices; the source leads each scheduled
    bucket, the others follow; the delivery's sink ends every send on every rank."""

    def __init__(self, *, fan_out: FanOut, delivery: RoutedDelivery, clients: Sequence[object]) -> None:
        self._fan_out = fan_out
        self._delivery = delivery
        self._clients = tuple(clients)

    async def plan(self, holdings: Sequence[tuple[str, Holding]]) -> RoutedSchedule:
        """Plan the send from every rank's holdings (a collective over the fan-out: every rank at once)."""
        return await self._fan_out.collective(self._delivery.plan, holdings)

    async def send(
        self,
        pieces: Iterable[LocalPiece],
        *,
        selector: Selector,
        hashes: Sequence[TensorHash],
        checksums: bool,
        timeout_s: float,
        on_bucket: Callable[[int, int, int], None] | None = None,
    ) -> RoutedOutcome:
        """Send this rank's slices (every rank at once). The source returns the outcome with every layout's expected
        digests and raises TransportError naming what failed; other ranks return an empty outcome and raise only
        when the group itself fails. `on_bucket(index, num_tensors, num_bytes)` runs on the source after each
        acknowledged bucket."""
        schedule = self._delivery.schedule
        self._delivery.load(pieces, hashes=hashes, checksums=checksums)
        error: BaseException | None = None
        try:
            if self._fan_out.is_source:
                try:
                    for index, bucket in enumerate(schedule.buckets):
                        await self._fan_out.announce(
                            RoutedBucketIndex(index=index),
                            selector=selector,
                            timeout_s=timeout_s,
                            what=f"routed bucket {index + 1}/{len(schedule.buckets)} ({len(bucket.names)} parameters)",
                        )
                        if on_bucket is not None:
                            on_bucket(index, len(bucket.hf_names), self._delivery.num_bytes(index))
                except BaseException as exc:
                    error = exc
                await self._fan_out.end(error=None if error is None else f"the source failed: {error}")
            else:
                await self._fan_out.follow(timeout_s=timeout_s)
        except BaseException as exc:
            error = error or exc
        # Every member enters this gather, after a failure too (the source released the followers first): a member
        # missing from it would leave its peers blocked until the group's timeout.
        gathered: list = []
        try:
            gathered = await self._fan_out.collective(all_gather, self._delivery.digests())
        except BaseException:
            if error is None:
                raise
        finally:
            self._delivery.reset()
            await self._delivery.sink.end_send(self._fan_out)
        if error is not None:
            raise error
        if not self._fan_out.is_source:
            return RoutedOutcome(num_bytes=0, num_buckets=0, num_tensors=0)
        return RoutedOutcome(
            num_bytes=self._delivery.num_bytes(),
            num_buckets=len(schedule.buckets),
            num_tensors=sum(len(b.hf_names) for b in schedule.buckets),
            names=tuple(n for b in schedule.buckets for n in b.hf_names),
            digests=self._delivery.expected(gathered),
            checksums=self._delivery.checksums(gathered),
        )

    async def close(self, *, timeout_s: float) -> None:
        try:
            self._fan_out.close()
        finally:
            for client in self._clients:
                await client.close()


def all_gather(collectives: Collectives, obj: object) -> list:
    """Every member's `obj`, in member order (for `FanOut.collective`)."""
    return collectives.all_gather_object(obj)


def routed_role(*, engines: Sequence[EngineEndpoint], setup: RankSetup, transport: str, feeds: str) -> FeedRole:
    """This rank's role with every trainer rank a member. Raises ValueError for an engine without a layout, no feed
    plan (`feeds` names the one `transport` needs) or a plan that does not match the engines."""
    raise_if(
        [f"{e.url}: its parameter layout is unknown" for e in engines if e.direct is None],
        what=f"the {transport} transport needs every engine's parameter layout",
    )
    if setup.feeds is None:
        raise ValueError(f"a routed {transport} send needs {feeds} (which trainer rank feeds each engine rank)")
    role = dataclasses.replace(setup.feeds, every_rank=True)
    role.plan.check_engines(engines)
    return role


async def open_routed(
    *,
    role: FeedRole,
    engines: Sequence[EngineEndpoint],
    setup: RankSetup,
    bucket_bytes: int,
    holdings: Sequence[tuple[str, Holding]],
    sink: PayloadSink,
) -> RoutedRank:
    """This rank's side of a routed send into `sink` over `engines`: its fan-out with every trainer rank a member
    (a collective over the trainer's default group: every rank opens at once), the sink connected over it, then
    the plan from every rank's `holdings` (a collective over the fan-out). Everything opened is closed again on a
    failure."""
    delivery = RoutedDelivery(
        role=role,
        layouts=[e.direct for e in engines],
        metas=setup.metas,
        bucket_bytes=bucket_bytes,
        device=torch.device(setup.device),
        sink=sink,
    )
    fan_out, clients = await open_posting_fan_out(role=role, engines=engines, setup=setup, delivery=delivery)
    if fan_out is None:
        raise AssertionError(f"rank {role.rank} is not a member of a fan-out of every rank")
    rank = RoutedRank(fan_out=fan_out, delivery=delivery, clients=clients)
    try:
        await sink.connect(fan_out)
        await rank.plan(holdings)
    except BaseException:
        await rank.close(timeout_s=setup.fan_out_timeout_s)
        raise
    return rank


async def open_shard_routed_rank(
    *, engines: Sequence[EngineEndpoint], setup: RankSetup, bucket_bytes: int, holdings: Sequence[tuple[str, Holding]]
) -> RoutedRank:
    """shard_direct's routed form over `engines` (`open_routed` with the inline sink). Raises ValueError, on every
    rank alike, for an engine without a layout, a feed plan that does not match the engines, or a plan that leaves
    a slice unheld, before any byte moves."""
    role = routed_role(engines=engines, setup=setup, transport="shard_direct", feeds="a colocated feed plan")
    return await open_routed(
        role=role, engines=engines, setup=setup, bucket_bytes=bucket_bytes, holdings=holdings, sink=InlineSink()
    )
