"""The fan-out: how the trainer ranks of a feed plan take one bucket to every engine rank, each fed by its own
trainer rank, shared by the colocated, shard_direct and p2p transports (each brings its own `Delivery`).

A FeedPlan (miles_sync.transport.feeds) says which trainer rank feeds each engine rank and which one posts each
engine's request. Its ranks and the export source form a fan-out group (gloo, created when the sender opens, so it
never interleaves with the export's collectives on the trainer's default group; its devices bind each rank's own
address). On several nodes this is how a bucket reaches every node: over the trainer's own group, from the source to
the feeding ranks, each on its engines' node; a handle never crosses a node (`feed_node_problems` refuses such a
plan before any sync). Per bucket, on every member:

    source: announce the bucket (what its delivery says of it + the selector)   -- the delivery moves its bytes
    feeders: encode one payload per engine rank they feed (the delivery's), all-gather them
    posters: POST update_weights_from_tensor, payload i = engine rank i's feeder's; all-gather outcomes

Every member learns every outcome, so the whole group fails a bucket together and no feeder frees (or reuses) its
buffer before the engines it feeds answered. After the last bucket, or a failure, the source announces the end of
the send; followers return then. Each collective has the group's timeout, and one bucket's exchange always runs to
its end (it is shielded from cancellation), so a failing rank still completes the collectives its peers are in.
A plan whose only member is the source (`FeedPlan.single_source`, the default without devices) runs the same steps
without a group.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import pickle
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch

from miles_sync.transport.base import EngineTarget, RankSetup, RankTransport, TransportError
from miles_sync.transport.feeds import FeedRole
from miles_sync.transport.group import gloo_device
from miles_sync.transport.membership import EngineEndpoint, GroupMembership
from miles_sync.wire.api import EngineAPI
from miles_sync.wire.bucket import FlattenedBucket
from miles_sync.wire.protocol import LoadFormat, Selector, UpdateWeightsFromTensorRequest

__all__ = ["find_source_rank"]

T = TypeVar("T")

# ---- records exchanged over the fan-out group (pickled by torch's object collectives) ----------------------------


@dataclass(frozen=True, kw_only=True)
class BucketAnnouncement:
    """Source -> members: the next bucket, described by the delivery (`contents`: what every member needs to know
    to receive its bytes and encode its payloads)."""

    index: int
    selector: Selector
    contents: Any


@dataclass(frozen=True, kw_only=True)
class SendEnd:
    """Source -> members: the send is over (`error`: why it stopped early, None after the last bucket)."""

    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class FedPayload:
    """One engine rank's payload, encoded by its feeder from the feeder's own copy of the bucket."""

    engine: int
    tp_rank: int
    feeder: int
    payload: str


@dataclass(frozen=True, kw_only=True)
class RankHandles:
    """A member's payloads for one bucket, or why it has none."""

    rank: int
    payloads: tuple[FedPayload, ...]
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class RankOutcomes:
    """A member's failures for one bucket: its own, and those of the engines it posted to ("url: cause")."""

    rank: int
    failures: tuple[str, ...]


# ---- the group: gloo, or nothing when the source is the only member ----------------------------------------------


class Collectives(Protocol):
    """The fan-out group as a delivery uses it: `member` is this rank's index in the group, `root` the source's;
    `send_buffers`/`recv_buffers` move buffers point to point (by member index), in order."""

    member: int
    root: int

    def broadcast_object(self, obj: Any) -> Any: ...

    def broadcast_buffer(self, buffer: torch.Tensor) -> None: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def send_buffers(self, buffers: Sequence[torch.Tensor], *, to: int) -> None: ...

    def recv_buffers(self, buffers: Sequence[torch.Tensor], *, source: int) -> None: ...

    def exchange_buffers(
        self, *, sends: Mapping[int, Sequence[torch.Tensor]], recvs: Mapping[int, Sequence[torch.Tensor]]
    ) -> None:
        """Send `sends[m]` to member m and receive `recvs[m]` from member m, each list in order, all at once (two
        members may send to each other); returns when every transfer is done."""
        ...

    def destroy(self) -> None: ...


class _Solo:
    """The source alone: every collective is the identity."""

    member = 0
    root = 0

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def broadcast_buffer(self, buffer: torch.Tensor) -> None:
        return None

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def send_buffers(self, buffers: Sequence[torch.Tensor], *, to: int) -> None:
        raise AssertionError("the source alone sends to nobody")

    def recv_buffers(self, buffers: Sequence[torch.Tensor], *, source: int) -> None:
        raise AssertionError("the source alone receives from nobody")

    def exchange_buffers(
        self, *, sends: Mapping[int, Sequence[torch.Tensor]], recvs: Mapping[int, Sequence[torch.Tensor]]
    ) -> None:
        if any(sends.values()) or any(recvs.values()):
            raise AssertionError("the source alone exchanges with nobody")

    def destroy(self) -> None:
        return None


class _GlooGroup:
    """The fan-out members' own gloo group, the source (member index `root`) the root of broadcasts. Built on the
    trainer's default store (a key prefix per fan-out) with an explicit device on this rank's bind address, so it
    binds where the rank's node is, not where the default group's interface happens to be. Objects travel pickled
    (the members are one trainer's ranks); every collective waits at most the group's timeout."""

    def __init__(self, group: Any, *, rank: int, root: int, size: int, timeout_s: float) -> None:
        self._group = group
        self._rank = self.member = rank
        self._root = self.root = root
        self._size = size
        self._timeout = timedelta(seconds=timeout_s)

    def broadcast_object(self, obj: Any) -> Any:
        data = pickle.dumps(obj) if self._rank == self._root else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self.broadcast_buffer(size)
        payload = _bytes_tensor(data) if self._rank == self._root else torch.empty(int(size), dtype=torch.uint8)
        self.broadcast_buffer(payload)
        return obj if self._rank == self._root else pickle.loads(payload.numpy().tobytes())

    def broadcast_buffer(self, buffer: torch.Tensor) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = self._root
        options.rootTensor = 0
        options.timeout = self._timeout
        self._wait(self._group.broadcast([buffer], options))

    def all_gather_object(self, obj: Any) -> list[Any]:
        data = pickle.dumps(obj)
        sizes = self._all_gather(torch.tensor([len(data)], dtype=torch.int64))
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: len(data)] = _bytes_tensor(data)
        gathered = self._all_gather(padded)
        return [pickle.loads(g[: int(s)].numpy().tobytes()) for g, s in zip(gathered, sizes)]

    def send_buffers(self, buffers: Sequence[torch.Tensor], *, to: int) -> None:
        works = [self._group.send([b], to, tag) for tag, b in enumerate(buffers)]
        for work in works:
            self._wait(work)

    def recv_buffers(self, buffers: Sequence[torch.Tensor], *, source: int) -> None:
        works = [self._group.recv([b], source, tag) for tag, b in enumerate(buffers)]
        for work in works:
            self._wait(work)

    def exchange_buffers(
        self, *, sends: Mapping[int, Sequence[torch.Tensor]], recvs: Mapping[int, Sequence[torch.Tensor]]
    ) -> None:
        # Every transfer is posted before any is waited for: a member that sent first and received second would
        # otherwise wait on a peer doing the same.
        works = [self._group.send([b], to, tag) for to, buffers in sends.items() for tag, b in enumerate(buffers)]
        works += [self._group.recv([b], src, tag) for src, buffers in recvs.items() for tag, b in enumerate(buffers)]
        for work in works:
            self._wait(work)

    def destroy(self) -> None:
        with contextlib.suppress(Exception):  # a group broken by a peer may refuse a clean shutdown
            self._group.shutdown()

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        from torch.distributed.distributed_c10d import AllgatherOptions

        outputs = [torch.empty_like(tensor) for _ in range(self._size)]
        options = AllgatherOptions()
        options.timeout = self._timeout
        self._wait(self._group.allgather([outputs], [tensor], options))
        return outputs

    def _wait(self, work: Any) -> None:
        if work.wait(self._timeout) is False:
            raise TimeoutError(f"fan-out collective timed out after {self._timeout.total_seconds()} s")


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


# Every trainer rank opens every fan-out (open is collective), so this counter names the same fan-out on all ranks.
_FAN_OUT_GENERATIONS = itertools.count()


def _open_gloo(members: Sequence[int], *, source_rank: int, timeout_s: float) -> Collectives | None:
    """Collective over the trainer ranks that may be members (every trainer rank, or every rank of one pipeline
    stage for a stage's routed send: each calls it, member or not, the same number of times): None off the group.
    The store prefix names the members, so two stages' groups opened at the same generation never meet."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    generation = next(_FAN_OUT_GENERATIONS)
    if dist.get_rank() not in members:
        return None
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    options._devices = [gloo_device()]
    ranks = "-".join(str(r) for r in members)
    store = dist.PrefixStore(f"miles_sync/fan_out/{generation}/{ranks}/", _get_default_store())
    rank = list(members).index(dist.get_rank())
    group = dist.ProcessGroupGloo(store, rank, len(members), options)
    return _GlooGroup(group, rank=rank, root=list(members).index(source_rank), size=len(members), timeout_s=timeout_s)


def find_source_rank(*, is_source: bool, group: Any = None) -> tuple[tuple[int, ...], int]:
    """The global ranks of `group` (the trainer's default group when None; one pipeline stage's group for a stage's
    routed send), ascending, and its export source's rank, agreed by every rank of it (a collective, for `open`
    only; the group's timeout bounds it). Raises ValueError unless exactly one rank of it is the source."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (dist.get_rank(), bool(is_source)), group=group)
    sources = [rank for rank, flag in gathered if flag]
    if len(sources) != 1:
        raise ValueError(f"trainer ranks {sources} are export sources; a fan-out needs exactly one")
    return tuple(sorted(rank for rank, _ in gathered)), sources[0]


# ---- one rank's side of the fan-out -------------------------------------------------------------------------------


class ReceiveBuffer:
    """A member's own copy of what it receives of the current bucket: grows to the largest bucket, then reused (one
    bucket in flight). On CPU it lives in a shared-memory segment, so a handle maps this rank's memory, with no copy
    at encoding."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._buffer: torch.Tensor | None = None

    def take(self, num_bytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < num_bytes:
            self._buffer = None  # freed before the larger one is allocated
            buffer = torch.empty(num_bytes, dtype=torch.uint8, device=self._device)
            if self._device.type == "cpu":
                buffer.untyped_storage()._share_filename_cpu_()
            self._buffer = buffer
        return self._buffer[:num_bytes]


class Delivery(Protocol):
    """How one bucket's bytes reach the members of a fan-out and become each engine rank's payload; the FanOut
    runs the steps in order on every member, on its collectives thread.

    - `prepare` (source only): what every member is told about the bucket (`BucketAnnouncement.contents`) and the
      source's own local data;
    - `receive` (every member, with the source's local data on the source, None elsewhere): move the bytes over
      `collectives`; returns this member's local data, which stays valid until the bucket's posts answered;
    - `encode`: one payload per engine rank in `feeds` ((engine index, TP rank) pairs), in that order, or None
      for an engine rank that has nothing in this bucket;
    - `settle` (every member, after the bucket's posts answered): the failures of what the member's payloads set
      going besides the posts (a p2p transfer), named; empty for a delivery whose posts carry everything;
    - `end_send` (source only): called once after the last bucket of a send succeeded; a problem found then (the
      send left something undelivered) is returned, None otherwise. `reset` forgets a send's state; `close` frees
      what the delivery holds (the fan-out closes it).
    `load_format` is what the posted requests carry (a custom weight loader's import path for p2p)."""

    load_format: LoadFormat | str

    def prepare(self, bucket: FlattenedBucket) -> tuple[Any, Any]: ...

    def receive(self, contents: Any, local: Any | None, collectives: Collectives) -> Any: ...

    def encode(self, contents: Any, local: Any, *, feeds: Sequence[tuple[int, int]]) -> list[str | None]: ...

    def settle(self) -> list[str]: ...

    def end_send(self) -> str | None: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


class FanOut:
    """One trainer rank's side of a fan-out (module docstring) with a `delivery` deciding how each bucket's bytes
    travel. The source calls `lead` per bucket and `end` once per send; every other member calls `follow` once per
    send. Collectives run, in order, on one thread of their own; HTTP posts on the caller's event loop.
    `engines[j]` is engine j's target on the rank that posts its request (None elsewhere)."""

    def __init__(
        self,
        *,
        role: FeedRole,
        collectives: Collectives,
        engines: Sequence[EngineTarget | None],
        delivery: Delivery,
        flush_cache: bool = False,
    ) -> None:
        if len(engines) != len(role.plan.engines):
            raise ValueError(f"{len(engines)} engine targets for a feed plan of {len(role.plan.engines)} engines")
        missing = [j for j in role.plan.posted_by(role.rank) if engines[j] is None]
        if missing:
            raise ValueError(f"rank {role.rank} posts engines {missing} but has no target for them")
        self._role = role
        self._collectives = collectives
        self._engines = tuple(engines)
        self._delivery = delivery
        self._flush_cache = flush_cache  # each request flushes the engine's prefix cache (RankSetup.flush_cache)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-sync-fan-out")
        self._pending: asyncio.Future | None = None
        self._num_buckets = 0  # buckets of the current send so far

    @property
    def role(self) -> FeedRole:
        return self._role

    @property
    def is_source(self) -> bool:
        return self._role.rank == self._role.source_rank

    async def lead(self, bucket: FlattenedBucket, *, selector: Selector, timeout_s: float) -> None:
        """Source: deliver one bucket through the group. Raises TransportError naming every failure (the whole
        group saw the same ones). The exchange runs to its end even if the caller is cancelled."""
        what = f"bucket of {len(bucket.entries)} tensors"
        try:
            contents, local = await self._run(self._delivery.prepare, bucket)
        except Exception as exc:  # nothing was announced: the members still wait for the next message
            raise TransportError(f"{what} could not be prepared: {exc}") from exc
        await self.announce(contents, local, selector=selector, timeout_s=timeout_s, what=what)

    async def announce(
        self, contents: Any, local: Any | None = None, *, selector: Selector, timeout_s: float, what: str
    ) -> None:
        """Source: deliver one bucket the delivery describes by `contents` (with the source's `local` data, where
        its delivery prepared any), as `lead` does after `prepare`; `what` names it in errors."""
        announcement = BucketAnnouncement(index=self._num_buckets, selector=selector, contents=contents)
        self._pending = asyncio.ensure_future(self._exchange(announcement, local, is_lead=True, timeout_s=timeout_s))
        failures = await asyncio.shield(self._pending)
        if failures:
            raise TransportError(f"{what} failed: " + "; ".join(failures))

    async def collective(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(collectives, *args)` on the group's thread, between buckets: for a delivery's own collectives
        (planning at open, results after a send), which every member must enter at once."""
        return await self._run(fn, self._collectives, *args)

    async def end(self, *, error: str | None) -> None:
        """Source: the send is over; lets every follower return. Waits for a bucket still in exchange first. Raises
        TransportError when the delivery finds the send incomplete (after the followers were released)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            with contextlib.suppress(BaseException):
                await pending
        problem = self._delivery.end_send() if error is None else None
        self._delivery.reset()
        self._num_buckets = 0
        await self._run(self._collectives.broadcast_object, SendEnd(error=error or problem))
        if problem is not None:
            raise TransportError(problem)

    async def follow(self, *, timeout_s: float) -> None:
        """Every other member: take part in each bucket until the source ends the send. Failures of a bucket are
        the source's to report (it raises them); this raises only when the group itself fails."""
        self._num_buckets = 0  # what a send that broke off left behind is not this send's
        while True:
            message = await self._run(self._collectives.broadcast_object, None)
            if isinstance(message, SendEnd):
                self._num_buckets = 0
                return
            if not isinstance(message, BucketAnnouncement):
                raise TransportError(f"rank {self._role.rank}: unexpected fan-out message {type(message).__name__}")
            await self._exchange(message, None, is_lead=False, timeout_s=timeout_s)

    def close(self) -> None:
        try:
            self._collectives.destroy()
        finally:
            self._delivery.close()
            self._thread.shutdown(wait=False)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def _exchange(
        self, announcement: BucketAnnouncement, local: Any | None, *, is_lead: bool, timeout_s: float
    ) -> list[str]:
        """One bucket on every member: announcement (the source's, `is_lead`), bytes, handles, posts, outcomes."""
        self._num_buckets += 1
        if is_lead:
            await self._run(self._collectives.broadcast_object, announcement)
        local = await self._run(self._delivery.receive, announcement.contents, local, self._collectives)
        handles: list[RankHandles] = await self._run(
            self._collectives.all_gather_object, self._encode(announcement, local)
        )
        own = await self._post(announcement, handles, timeout_s=timeout_s)
        own += await self._run(self._delivery.settle)
        outcomes: list[RankOutcomes] = await self._run(
            self._collectives.all_gather_object, RankOutcomes(rank=self._role.rank, failures=tuple(own))
        )
        return [f for outcome in outcomes for f in outcome.failures]

    def _encode(self, announcement: BucketAnnouncement, local: Any) -> RankHandles:
        rank = self._role.rank
        feeds = self._role.plan.feeds_of(rank)
        try:
            encoded = self._delivery.encode(announcement.contents, local, feeds=feeds)
            payloads = tuple(
                FedPayload(engine=j, tp_rank=r, feeder=rank, payload=p)
                for (j, r), p in zip(feeds, encoded)
                if p is not None
            )
        except Exception as exc:  # reported through the group, so every member fails this bucket together
            return RankHandles(rank=rank, payloads=(), error=f"rank {rank} could not encode its handles: {exc}")
        return RankHandles(rank=rank, payloads=payloads)

    async def _post(
        self, announcement: BucketAnnouncement, handles: Sequence[RankHandles], *, timeout_s: float
    ) -> list[str]:
        """Post this rank's engines' requests concurrently; returns their failures (and the feeders' errors). An
        engine none of whose ranks has a payload in this bucket gets no request."""
        errors = [h.error for h in handles if h.error is not None]
        if errors:
            return errors if self.is_source else []  # one copy of each feeder error is enough
        by_rank = {(p.engine, p.tp_rank): p for h in handles for p in h.payloads}
        posted, requests = [], []
        for j in self._role.plan.posted_by(self._role.rank):
            payloads = [by_rank.get((j, r)) for r in range(len(self._role.plan.engines[j].feeders))]
            if all(p is None for p in payloads):
                continue
            missing = [r for r, p in enumerate(payloads) if p is None]
            if missing:
                return [f"engine {j}: no payload for TP ranks {missing} (every rank of a request needs one)"]
            posted.append(j)
            requests.append(
                UpdateWeightsFromTensorRequest(
                    serialized_named_tensors=tuple(p.payload for p in payloads),
                    load_format=self._delivery.load_format,
                    flush_cache=self._flush_cache,
                    selector=announcement.selector,
                )
            )
        # The client times each call out itself (EngineError), so gather cannot wait forever.
        results = await asyncio.gather(
            *(
                self._engines[j].client.update_weights_from_tensor(r, timeout_s=timeout_s)
                for j, r in zip(posted, requests)
            ),
            return_exceptions=True,
        )
        return [f"{self._engines[j].client.url}: {r}" for j, r in zip(posted, results) if isinstance(r, BaseException)]


def open_fan_out(
    *,
    role: FeedRole,
    engines: Sequence[EngineTarget | None],
    timeout_s: float,
    delivery: Delivery,
    flush_cache: bool = False,
) -> FanOut | None:
    """Create this rank's side of the fan-out. With more than one member this is a collective over the trainer's
    default group that every trainer rank must enter (`open`, never during a send); returns None on a rank that
    is not a member. Blocking."""
    if len(role.members) == 1:  # the source alone: no group, on any rank (new_group must be called by all or none)
        if not role.is_member:
            return None
        return FanOut(role=role, collectives=_Solo(), engines=engines, delivery=delivery, flush_cache=flush_cache)
    collectives = _open_gloo(role.members, source_rank=role.source_rank, timeout_s=timeout_s)
    if collectives is None:
        return None
    return FanOut(role=role, collectives=collectives, engines=engines, delivery=delivery, flush_cache=flush_cache)


class FedRank(RankTransport):
    """One trainer rank's side of a fan-out transport (colocated, shard_direct): its FanOut (None on a rank outside
    the feed plan); the source leads each bucket through it, every other member follows."""

    def __init__(self, *, fan_out: FanOut | None, clients: Sequence[EngineAPI]) -> None:
        self._fan_out = fan_out
        self._clients = tuple(clients)

    async def open(self, *, membership: GroupMembership | None, timeout_s: float) -> GroupMembership | None:
        if membership is not None:
            raise ValueError("a fan-out transport uses no update group; pass membership=None")
        return None

    async def send_bucket(self, bucket: FlattenedBucket, *, selector: Selector, timeout_s: float) -> None:
        if self._fan_out is None or not self._fan_out.is_source:
            raise TransportError("only the export source sends buckets")
        await self._fan_out.lead(bucket, selector=selector, timeout_s=timeout_s)

    async def end_send(self, *, error: str | None) -> None:
        if self._fan_out is not None:
            await self._fan_out.end(error=error)

    async def follow(self, *, timeout_s: float) -> None:
        if self._fan_out is not None:
            await self._fan_out.follow(timeout_s=timeout_s)

    async def close(self, *, timeout_s: float) -> None:
        try:
            if self._fan_out is not None:
                self._fan_out.close()
        finally:
            for client in self._clients:
                await client.close()


async def open_fed_rank(
    *, engines: Sequence[EngineEndpoint], setup: RankSetup, delivery: Callable[[FeedRole], Delivery]
) -> FedRank:
    """This rank's fan-out role (the given one, else the source alone), the clients of the engines whose requests
    it posts and its FanOut with `delivery(role)`: a collective over the trainer's default group when the plan has
    several members, so every rank of the plan opens at once."""
    role = setup.feeds
    if role is not None:
        role.plan.check_engines(engines)
    elif setup.is_source:
        role = FeedRole.single_source(tp_sizes=[e.tp_size for e in engines])
    if role is None:  # a non-source rank outside any plan: nothing to take part in
        return FedRank(fan_out=None, clients=())
    fan_out, clients = await open_posting_fan_out(role=role, engines=engines, setup=setup, delivery=delivery(role))
    return FedRank(fan_out=fan_out, clients=clients)


async def open_posting_fan_out(
    *, role: FeedRole, engines: Sequence[EngineEndpoint], setup: RankSetup, delivery: Delivery
) -> tuple[FanOut | None, list[EngineAPI]]:
    """`role`'s FanOut with `delivery` (`open_fan_out`, on a thread: with several members a collective over the
    trainer's default group) and the clients of the engines whose requests this rank posts, which the caller
    closes with the fan-out; they are closed here if the fan-out fails to open."""
    clients = {j: setup.connect(engines[j].url) for j in sorted(set(role.plan.posted_by(role.rank)))}
    targets = [
        EngineTarget(client=clients[j], tp_size=e.tp_size) if j in clients else None for j, e in enumerate(engines)
    ]
    try:
        fan_out = await asyncio.to_thread(
            open_fan_out,
            role=role,
            engines=targets,
            timeout_s=setup.fan_out_timeout_s,
            delivery=delivery,
            flush_cache=setup.flush_cache,
        )
    except BaseException:
        for client in clients.values():
            await client.close()
        raise
    return fan_out, list(clients.values())
