"""The p2p transport: every trainer rank sends its own shards point to point to the engine ranks that keep them,
through SGLang's custom weight loader hook (`--custom-weight-loader`, miles_sync.transport.p2p_loader). For engines
on other nodes: no gather to one source, no broadcast of the whole model to every engine rank, no shared memory.

The plan is shard_direct's routed plan (miles_sync.weights.shard_routes.plan_routed over the engines' direct
layouts, made once at open from every rank's holdings), with the feeders spread over the trainer ranks instead of
tied by devices (miles_sync.transport.feeds.plan_spread_feeds). Per scheduled bucket, on every trainer rank (the
routed fan-out of miles_sync.transport.shard_routed):

    source:     announce the bucket's index
    every rank: exchange the slices other feeders need, build its engine ranks' parameters, hash them (the digests
                their checkers must answer)
    feeders:    per engine rank fed, a ticket (which parameters, from which feeder: no bytes); the channel thread
                sends the parameters and then their SHA-256 digests over the engine's channel and reads the rank's
                status (the digests hashed once, where the build hashed them for SHA-256 engine digests; else on
                the channel thread)
    posters:    POST update_weights_from_tensor with load_format = the loader's import path, one ticket per rank
    feeders:    settle: wait for the channel thread; a failed transfer or a refused parameter fails the bucket on
                every member (the outcomes are all-gathered as for every fan-out)

Channels: one update group per engine, of the trainer ranks that feed it and then the engine's TP ranks, from a TCP
store the source hosts on its node's address (broadcast to the members at open). With pipeline stages every stage
is a routed send of its own (its ranks plan, exchange and feed every engine rank its own layers, stage after stage:
miles_sync.sync.pipeline) over channels of its own: a ticket's `slot` names the stage's source rank, and an engine
rank keeps one channel per slot. A trainer rank joins at its first
send while the engine ranks join from the first ticket, and reuses the channel until the transport closes; after a
send in which any rank's channel failed, every rank drops every channel and the next send joins a new generation
(the loader drops a channel it no longer sees named).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from miles_sync.env import bind_host
from miles_sync.transport.base import RankSetup, TransportError
from miles_sync.transport.fan_out import Collectives, FanOut
from miles_sync.transport.feeds import FeedPlan, FeedRole
from miles_sync.transport.group import UpdateGroup, create_update_group, start_store_server
from miles_sync.transport.membership import EngineEndpoint
from miles_sync.transport.p2p_loader import (
    LOADER_PATH,
    TICKET_NAME,
    ChannelSpec,
    ParamTicket,
    Refusal,
    Status,
    Ticket,
    encode_ticket,
    send_params,
)
from miles_sync.transport.shard_routed import BuiltRank, RoutedRank, all_gather, open_routed, routed_role
from miles_sync.weights.shard_routes import Holding
from miles_sync.wire.payload import encode_inline_named_tensors

__all__: list[str] = []  # reached through the transport registry only


@dataclass(frozen=True, kw_only=True)
class StoreAddress:
    """Source -> members at open: where every channel's rendezvous store listens."""

    host: str
    port: int


@dataclass(frozen=True, kw_only=True)
class _Sent:
    """One engine's transfers of one bucket on this rank, as they ended: each engine TP rank's status."""

    engine: int
    statuses: dict[int, Status]
    names: dict[int, tuple[str, ...]]  # per engine TP rank, the parameters in the order sent


class Channels:
    """This trainer rank's channel to each engine it feeds (module docstring): joined on the channel thread at the
    first send to it, reused, dropped together (`drop`) after a failed send or at close."""

    def __init__(
        self,
        *,
        plan: FeedPlan,
        rank: int,
        address: StoreAddress,
        store: object | None,
        timeout_s: float,
        backend: str = "gloo",
        slot: int = 0,
    ):
        self._plan = plan
        self._slot = slot  # the stage's export source rank: the engine ranks keep one channel per slot
        self._backend = backend  # nccl where the builds live on a GPU (untested here: no GPU), gloo on CPU
        self._rank = rank
        self._address = address
        self._store = store  # the source's store server (kept alive here), None elsewhere
        self._timeout_s = timeout_s
        self._fleet = f"miles-sync-p2p-{address.host}-{address.port}"
        self._generation = 0
        self._groups: dict[int, UpdateGroup] = {}
        self._lock = threading.Lock()
        self.broken = False

    def feeders(self, engine: int) -> tuple[int, ...]:
        return tuple(sorted(set(self._plan.engines[engine].feeders)))

    def spec(self, engine: int, *, rank: int) -> ChannelSpec:
        """Engine `engine`'s channel as group rank `rank` sees it."""
        feeders = self.feeders(engine)
        return ChannelSpec(
            group_name=f"{self._fleet}-e{engine}-g{self._generation}",
            master_address=self._address.host,
            master_port=self._address.port,
            world_size=len(feeders) + len(self._plan.engines[engine].feeders),
            rank=rank,
            backend=self._backend,
            timeout_s=self._timeout_s,
            slot=self._slot,
        )

    def engine_rank(self, engine: int, tp_rank: int) -> int:
        """Engine TP rank `tp_rank`'s rank in its engine's channel."""
        return len(self.feeders(engine)) + tp_rank

    def own_rank(self, engine: int) -> int:
        return self.feeders(engine).index(self._rank)

    def group(self, engine: int) -> UpdateGroup:
        """This rank's channel to `engine`, joined now if it is not yet (blocks until the engine's ranks join)."""
        with self._lock:
            group = self._groups.get(engine)
            if group is not None and group.is_usable:
                return group
            spec = self.spec(engine, rank=self.own_rank(engine))
        group = create_update_group(
            master_address=spec.master_address,
            master_port=spec.master_port,
            rank=spec.rank,
            world_size=spec.world_size,
            group_name=spec.group_name,
            backend=spec.backend,
            timeout_s=spec.timeout_s,
            store=self._store,  # the source's own server, where it is a member; everyone else connects
        )
        with self._lock:
            self._groups[engine] = group
        return group

    def drop(self) -> None:
        """Destroy every channel; the next send joins a new generation."""
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
            self._generation += 1
            self.broken = False
        for group in groups:
            group.destroy()

    def close(self) -> None:
        self.drop()
        self._store = None


class ChannelSink:
    """p2p's sink for the routed delivery (shard_routed.PayloadSink): each engine rank's build sent over its engine's
    channel instead of posted; the payloads are tickets, posted with load_format = the loader's path. After every
    send the ranks agree whether any channel failed, and if so all drop theirs."""

    load_format = LOADER_PATH

    def __init__(self, *, role: FeedRole, timeout_s: float, device: str) -> None:
        self._role = role
        self._timeout_s = timeout_s
        self._backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        self._channels: Channels | None = None
        fed = {j for j, _ in role.plan.feeds_of(role.rank)}
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(8, len(fed))), thread_name_prefix="miles-sync-p2p")
        self._pending: list[Future] = []

    async def connect(self, fan_out: FanOut) -> None:
        """Join the channel store at open (every rank at once): the source starts it on its node's address and
        broadcasts where it listens over the fan-out."""
        store = None
        if self._role.rank == self._role.source_rank:
            store = start_store_server(host=bind_host(), timeout_s=self._timeout_s)
        address = await fan_out.collective(
            _store_address, None if store is None else StoreAddress(host=bind_host(), port=store.port)
        )
        self._channels = Channels(
            plan=self._role.plan,
            rank=self._role.rank,
            address=address,
            store=store,
            timeout_s=self._timeout_s,
            backend=self._backend,
            slot=self._role.source_rank,
        )

    def encode(self, built: Sequence[BuiltRank | None]) -> list[str | None]:
        """One ticket per engine rank this rank feeds (None where it has nothing in this bucket); the builds go to
        the channel thread, which sends them while the posters post the tickets."""
        channels = self._channels
        if channels is None:
            raise TransportError("the p2p delivery has no channels (open it first)")
        payloads: list[str | None] = []
        sends: dict[int, dict[int, list[torch.Tensor]]] = {}
        names: dict[int, dict[int, tuple[str, ...]]] = {}
        digests: dict[int, dict[int, bytes | None]] = {}
        for b in built:
            if b is None:
                payloads.append(None)
                continue
            own, engine_rank = channels.own_rank(b.engine), channels.engine_rank(b.engine, b.tp_rank)
            ticket = Ticket(
                channel=channels.spec(b.engine, rank=engine_rank),
                params=tuple(
                    ParamTicket(name=n, source=own, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
                    for n, t in b.tensors
                ),
            )
            payloads.append(encode_inline_named_tensors([(TICKET_NAME, encode_ticket(ticket))]))
            sends.setdefault(b.engine, {})[engine_rank] = [t for _, t in b.tensors]
            names.setdefault(b.engine, {})[b.tp_rank] = tuple(n for n, _ in b.tensors)
            # Hashed already where the engine digests are SHA-256 (verification on): sent as they are.
            digests.setdefault(b.engine, {})[engine_rank] = b.sha256
        self._pending = [
            self._pool.submit(self._send, channels, j, per_rank, names[j], digests[j]) for j, per_rank in sends.items()
        ]
        return payloads

    def settle(self) -> list[str]:
        """Wait for this bucket's transfers (the posts have answered); every failure and refusal, named."""
        pending, self._pending = self._pending, []
        problems = []
        deadline = time.monotonic() + self._timeout_s
        for future in pending:
            try:
                sent: _Sent = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                problems.append(f"trainer rank {self._role.rank}: a channel transfer did not finish in time")
                self._mark_broken()
                continue
            except Exception as exc:
                problems.append(f"trainer rank {self._role.rank}: {exc}")
                self._mark_broken()
                continue
            for tp_rank, status in sorted(sent.statuses.items()):
                sent_names = sent.names[tp_rank]
                if status.refusal is not Refusal.NONE:
                    name = sent_names[status.refused_index]
                    problems.append(
                        f"engine {sent.engine} TP rank {tp_rank} refused {name} from trainer rank "
                        f"{self._role.rank}: {status.refusal.describe()}"
                    )
                elif status.checked != len(sent_names):
                    problems.append(
                        f"engine {sent.engine} TP rank {tp_rank} checked {status.checked} of the "
                        f"{len(sent_names)} parameters trainer rank {self._role.rank} sent"
                    )
        return problems

    async def end_send(self, fan_out: FanOut) -> None:
        channels = self._channels
        if channels is None:
            return
        try:
            broken = await fan_out.collective(all_gather, channels.broken)
        except BaseException:
            broken = [True]  # the group itself failed: nothing here can be trusted
        if any(broken):
            channels.drop()

    def close(self) -> None:
        try:
            self._pool.shutdown(wait=False, cancel_futures=True)
        finally:
            if self._channels is not None:
                self._channels.close()

    # ---- the channel thread ------------------------------------------------------------------------------------

    def _send(
        self,
        channels: Channels,
        engine: int,
        per_rank: dict[int, list[torch.Tensor]],
        names: dict[int, tuple],
        digests: Mapping[int, bytes | None],
    ) -> _Sent:
        try:
            group = channels.group(engine)
            statuses = send_params(group, per_rank, timeout_s=self._timeout_s, digests=digests)
        except Exception as exc:
            raise TransportError(f"channel to engine {engine} failed: {type(exc).__name__}: {exc}") from None
        first = channels.engine_rank(engine, 0)
        return _Sent(engine=engine, statuses={r - first: s for r, s in statuses.items()}, names=names)

    def _mark_broken(self) -> None:
        if self._channels is not None:
            self._channels.broken = True


def _store_address(collectives: Collectives, address: StoreAddress | None) -> StoreAddress:
    return collectives.broadcast_object(address)


async def open_p2p_routed_rank(
    *, engines: Sequence[EngineEndpoint], setup: RankSetup, bucket_bytes: int, holdings: Sequence[tuple[str, Holding]]
) -> RoutedRank:
    """This rank's side of a p2p send over `engines` (every trainer rank at once): the routed fan-out of every
    trainer rank into a ChannelSink (shard_routed.open_routed), the source's channel store (its address broadcast
    to all), then the routed plan from every rank's `holdings`. Raises ValueError, on every rank alike, for an
    engine without a layout or a plan that leaves a slice unheld, before any byte moves."""
    role = routed_role(engines=engines, setup=setup, transport="p2p", feeds="its spread feed plan")
    sink = ChannelSink(role=role, timeout_s=setup.fan_out_timeout_s, device=setup.device)
    return await open_routed(
        role=role, engines=engines, setup=setup, bucket_bytes=bucket_bytes, holdings=holdings, sink=sink
    )
