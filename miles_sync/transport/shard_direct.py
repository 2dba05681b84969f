"""Shard-direct transport: each engine TP rank receives only its own parameters, exactly as the engine stores them,
loaded with SGLang's `load_format: "direct"` (see miles_sync.weights.shard_plan).

It runs the fan-out (miles_sync.transport.fan_out: the same feed plan, group, posts and failure rules)
with its own delivery. At open the source plans every engine layout of the fleet once (`plan_direct` over the
export's tensor metas; a refused plan fails the open, before any session). Per bucket:

    source:  take the bucket's tensors (and the parts of a fused parameter kept from earlier buckets), build every
             parameter they complete into one buffer per (engine layout, TP rank), announce what each holds, and
             send each feeder only the buffers of the engine ranks it feeds (point to point)
    feeders: receive those into their own shared memory and encode one direct payload per engine rank they feed
    posters: POST update_weights_from_tensor (load_format "direct"), payload i = engine rank i's parameters

So an engine rank maps only its shard (about 1/TP of the model), already fused, padded and in the engine's
post-load layout, and a feeder receives only what its engine ranks keep. A direct load runs no weight loader and no
post-processing and is applied by every runner the session's selector covers, so payloads name the target's
parameters only and the session refuses a selector that covers a draft runner (miles_sync.sync.session).
A send that ends with a parameter incomplete (a part never sent) fails at its end, naming it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from miles_sync.transport.base import RankSetup
from miles_sync.transport.fan_out import Collectives, FedRank, ReceiveBuffer, open_fed_rank
from miles_sync.transport.feeds import FeedRole
from miles_sync.transport.membership import EngineEndpoint
from miles_sync.weights.shard_plan import DirectLayout, DirectPlan, build_param, plan_direct
from miles_sync.wire.bucket import BucketEntry, FlattenedBucket, TensorMeta, bucket_layout, unpack_bucket
from miles_sync.wire.payload import encode_named_tensors
from miles_sync.wire.protocol import LoadFormat
from miles_sync.wire.text import raise_if

__all__: list[str] = []  # reached through the transport registry only

Key = tuple[int, int]  # (engine layout index, TP rank): engines of one layout share each rank's bytes


@dataclass(frozen=True, kw_only=True)
class RankContents:
    """What one (engine layout, TP rank) buffer of a bucket holds: its engine parameters, laid out as a flattened
    bucket is (`bucket_layout`: aligned order, back to back)."""

    layout: int
    tp_rank: int
    num_bytes: int
    entries: tuple[BucketEntry, ...]


@dataclass(frozen=True, kw_only=True)
class DirectContents:
    """A bucket as the source announces it: every (layout, rank) buffer a member receives."""

    ranks: tuple[RankContents, ...]

    def of(self, key: Key) -> RankContents | None:
        return next((r for r in self.ranks if (r.layout, r.tp_rank) == key), None)


class DirectDelivery:
    """The fan-out delivery of the shard-direct transport (module docstring). `layouts[j]` is engine j's layout;
    `metas`: the export's tensors, needed on the source only (it plans and builds)."""

    load_format = LoadFormat.DIRECT

    def __init__(
        self,
        *,
        role: FeedRole,
        layouts: Sequence[DirectLayout],
        metas: Sequence[TensorMeta],
        device: torch.device,
    ) -> None:
        distinct = list(dict.fromkeys(layouts))
        self._layout_of = [distinct.index(layout) for layout in layouts]
        self._role = role
        self._device = device
        self._buffers: dict[Key, ReceiveBuffer] = {}
        members = role.members
        self._keys_of = {m: self.keys_fed_by(rank) for m, rank in enumerate(members)}
        self._plans: list[DirectPlan] = []
        if role.rank == role.source_rank:
            if not metas:
                raise ValueError("the shard_direct transport needs the export's tensor metas; this source gives none")
            self._plans = [plan_direct(metas, layout=layout) for layout in distinct]
        self._parts = [plan.parts() for plan in self._plans]
        self._params = [[{p.name: p for p in params} for params in plan.ranks] for plan in self._plans]
        self._pending: dict[str, torch.Tensor] = {}  # parts of parameters not complete yet (copies)
        # Every buffer the source builds, and its builders: only the source builds, one thread per buffer (`prepare`).
        self._keys = tuple(sorted({k for keys in self._keys_of.values() for k in keys}))
        self._builders: ThreadPoolExecutor | None = None
        if self._plans:
            self._builders = ThreadPoolExecutor(max_workers=len(self._keys), thread_name_prefix="miles-sync-build")
        self._done: list[set[str]] = [set() for _ in self._plans]

    def keys_fed_by(self, rank: int) -> tuple[Key, ...]:
        """The (layout, TP rank) buffers trainer rank `rank` needs for the engine ranks it feeds, sorted."""
        return tuple(sorted({(self._layout_of[j], r) for j, r in self._role.plan.feeds_of(rank)}))

    # ---- Delivery ----------------------------------------------------------------------------------------------

    def prepare(self, bucket: FlattenedBucket) -> tuple[DirectContents, dict[Key, torch.Tensor]]:
        tensors = dict(unpack_bucket(bucket.buffer, bucket.entries))
        available = {**self._pending, **tensors}
        ready = [
            [n for n, parts in self._parts[i].items() if n not in self._done[i] and all(p in available for p in parts)]
            for i in range(len(self._plans))
        ]
        if self._builders is None:
            raise AssertionError("only the export source prepares buckets")
        # Each (layout, rank) buffer is built on a thread of its own (torch's copies release the GIL): the engine
        # ranks wait for these bytes, so their cores are free while the source builds.
        built = list(self._builders.map(lambda key: self._build(key, ready[key[0]], available), self._keys))
        contents = [rank for rank, _ in built]
        local = {key: buffer for key, (_, buffer) in zip(self._keys, built)}
        for i, names in enumerate(ready):
            self._done[i].update(names)
        self._keep_pending(tensors)
        return DirectContents(ranks=tuple(contents)), local

    def receive(
        self, contents: DirectContents, local: dict[Key, torch.Tensor] | None, collectives: Collectives
    ) -> dict[Key, torch.Tensor]:
        if local is not None:  # the source: every other member gets its own buffers, in key order
            for member, keys in self._keys_of.items():
                buffers = [local[k] for k in keys if _has_bytes(contents, k)]
                if member != collectives.member and buffers:
                    collectives.send_buffers(buffers, to=member)
            return local
        own = {}
        for key in self._keys_of[collectives.member]:
            rank = contents.of(key)
            if rank is not None and rank.num_bytes:
                own[key] = self._buffer(key).take(rank.num_bytes)
        if own:
            collectives.recv_buffers(list(own.values()), source=collectives.root)
        return own

    def encode(
        self, contents: DirectContents, local: Mapping[Key, torch.Tensor], *, feeds: Sequence[tuple[int, int]]
    ) -> list[str | None]:
        payloads: list[str | None] = []
        for j, tp_rank in feeds:
            key = (self._layout_of[j], tp_rank)
            rank = contents.of(key)
            if rank is None or not rank.entries:
                payloads.append(None)
                continue
            payloads.append(encode_named_tensors(unpack_bucket(local[key], rank.entries)))
        return payloads

    def settle(self) -> list[str]:
        return []

    def end_send(self) -> str | None:
        incomplete = [
            f"{name} (missing {[p for p in parts if p not in self._pending] or 'nothing'})"
            for i, parts_of in enumerate(self._parts)
            for name, parts in parts_of.items()
            if name not in self._done[i]
        ]
        if not incomplete:
            return None
        return (
            f"the send ended with {len(incomplete)} engine parameter(s) never delivered (a part was not sent): "
            + "; ".join(incomplete[:8])
        )

    def close(self) -> None:
        if self._builders is not None:
            self._builders.shutdown(wait=False)

    def reset(self) -> None:
        self._pending.clear()
        for done in self._done:
            done.clear()

    # ---- internals ---------------------------------------------------------------------------------------------

    def _build(
        self, key: Key, names: Sequence[str], available: Mapping[str, torch.Tensor]
    ) -> tuple[RankContents, torch.Tensor]:
        """The parameters `names` of one (layout, rank) key, built into its buffer from the `available` tensors."""
        layout, tp_rank = key
        params = {name: self._params[layout][tp_rank][name] for name in names}
        entries = bucket_layout([p.meta for p in params.values()])
        num_bytes = entries[-1].end if entries else 0
        buffer = self._buffer(key).take(num_bytes)
        weight_layout = self._plans[layout].layout.weight_layout
        for e in entries:
            build_param(params[e.name], available, out=buffer[e.start : e.end], weight_layout=weight_layout)
        return RankContents(layout=layout, tp_rank=tp_rank, num_bytes=num_bytes, entries=entries), buffer

    def _buffer(self, key: Key) -> ReceiveBuffer:
        if key not in self._buffers:
            self._buffers[key] = ReceiveBuffer(self._device)
        return self._buffers[key]

    def _keep_pending(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy the bucket's tensors that a parameter still waits on (the bucket's buffer is reused); drop kept
        parts whose parameters are all built."""
        waiting = {
            p
            for i, parts_of in enumerate(self._parts)
            for name, parts in parts_of.items()
            if name not in self._done[i]
            for p in parts
        }
        for name in list(self._pending):
            if name not in waiting:
                del self._pending[name]
        for name, tensor in tensors.items():
            if name in waiting and name not in self._pending:
                self._pending[name] = tensor.clone()


def _has_bytes(contents: DirectContents, key: Key) -> bool:
    rank = contents.of(key)
    return rank is not None and rank.num_bytes > 0


async def open_shard_direct_rank(*, engines: Sequence[EngineEndpoint], setup: RankSetup) -> FedRank:
    """This rank's side of the shard-direct transport: the colocated fan-out (`open_fed_rank`) with the direct
    delivery. Raises ValueError, before anything opens, for an engine without a layout (the controller reads each
    engine's), or, on the source, for a plan the layouts refuse."""
    missing = [e.url for e in engines if e.direct is None]
    raise_if(
        [f"{url}: its parameter layout is unknown" for url in missing],
        what="the shard_direct transport needs every engine's parameter layout",
    )
    layouts = [e.direct for e in engines]

    def delivery(role: FeedRole) -> DirectDelivery:
        return DirectDelivery(role=role, layouts=layouts, metas=setup.metas, device=torch.device(setup.device))

    return await open_fed_rank(engines=engines, setup=setup, delivery=delivery)
