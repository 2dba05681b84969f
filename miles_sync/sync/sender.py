"""The trainer side of a sync: exported units -> bucket plan -> flattened buckets -> transport.

Double buffering: bucket i+1 is exported and packed (in a worker thread) while bucket i is in flight, into the
other of two buffers of up to `bucket_bytes` each; a buffer is reused only after its bucket was acknowledged by every
engine. Memory on the source rank stays bounded by two buffers plus the units of the bucket being packed (and one
unit the planner looked ahead at), never the whole model. On the CPU the two buffers live as long as the sender
(see `Sender._send_buffers`) and grow only to the largest bucket seen, so a small model never holds `bucket_bytes`;
on a GPU each send allocates its own. After each send the freed host heap is handed back to the OS (`trim_heap`).
Buffers live in `miles_sync.sync.buffers`, the export + pack streams in `miles_sync.sync.packing`, and the
`WeightSource` protocol the Sender implements in `miles_sync.sync.weight_source`.

The sender also returns the checksum of every tensor it sent, hashed from the packed bytes, i.e. exactly what went
on the wire; the session compares them with each engine's checksums. Given an engine digest plan, the same hasher
thread also predicts what each engine layout's checker answers per TP rank (miles_sync.sync.engine_digests).

The transport is this rank's side of it (`miles_sync.transport.base.RankTransport`, built at open from the
registry row): the source sends each bucket through it and ends each send, also after a failure; every other rank
follows the send while it drains the export stream (a colocated feed plan gives each of its ranks a copy of each
bucket for the engine ranks on its device; the distributed transport needs only the source).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from miles_sync.engine.client import EngineClient
from miles_sync.export.units import ExportedUnit
from miles_sync.sync.buffers import DoubleBuffer, FreshBuffers, trim_heap
from miles_sync.sync.engine_digests import EngineDigester, EngineDigestPlan, EngineLayout, PredictedDigests
from miles_sync.sync.packing import PackedBucket, PackStream, StagedStream, bucket_checksums, bucket_tensors
from miles_sync.sync.report import BucketProgress
from miles_sync.sync.weight_source import SendResult, StageResult, WeightDigests, WeightSource
from miles_sync.transport.base import TRANSPORTS, RankSetup, RankTransport, open_rank_transport, transport_spec
from miles_sync.transport.feeds import FeedRole
from miles_sync.transport.membership import EngineEndpoint, GroupMembership
from miles_sync.weights.fp8 import Fp8Block
from miles_sync.wire.bucket import TensorMeta
from miles_sync.wire.protocol import Selector
from miles_sync.wire.text import raise_if

__all__ = ["SenderSettings"]

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class SenderSettings:
    """How the source rank sends, chosen by the controller per update group (so one trainer can serve several).

    `transport`: a registered transport name (the source rank's; the other ranks only take part in the export and,
    colocated, in the fan-out). `call_timeout_s` bounds one whole open or send call on a rank (ModelSource); the
    bucket and HTTP timeouts bound each step. `hash_buckets`: see `Sender`.
    """

    transport: str
    bucket_bytes: int
    bucket_timeout_s: float
    open_timeout_s: float
    http_timeout_s: float
    call_timeout_s: float
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr, a log or a report
    admin_api_key: str | None = field(default=None, repr=False)  # the engines' admin key, where they have one
    device: str = "cpu"
    hash_buckets: bool = True  # checksums of what was sent: verification needs them (see Sender)
    # Block-FP8 export (miles_sync.weights.fp8): the source quantizes every quantized linear weight after the
    # gather and sends it with its weight_scale_inv; None sends the export's own dtypes.
    quantization: Fp8Block | None = None
    # Every update request flushes the engine's prefix cache as it loads (transport.base.RankSetup.flush_cache), in
    # place of the session's /flush_cache call, whose handler on a CPU SGLang server also runs a full gc.collect()
    # in the scheduler (0.41-0.48 s per call measured here). Only for pauses that empty the engine (abort, retract).
    flush_cache: bool = False

    def engine_client(self, url: str) -> EngineClient:
        """A client of the engine at `url` with these settings' timeout and keys."""
        return EngineClient(url, timeout_s=self.http_timeout_s, api_key=self.api_key, admin_api_key=self.admin_api_key)

    def __post_init__(self) -> None:
        problems = []
        if self.transport not in TRANSPORTS:
            problems.append(f"transport={self.transport!r} is not one of {sorted(TRANSPORTS)}")
        names = ("bucket_bytes", "bucket_timeout_s", "open_timeout_s", "http_timeout_s", "call_timeout_s")
        problems += [f"{name}={getattr(self, name)} must be positive" for name in names if not getattr(self, name) > 0]
        if (
            self.quantization is not None
            and self.transport in TRANSPORTS
            and TRANSPORTS[self.transport].sends_engine_parameters()
        ):
            problems.append(
                f"transport={self.transport!r} sends the engines' own parameters, planned from the exported dtypes: "
                f"block-FP8 quantization is not supported with it"
            )
        raise_if(problems, what="invalid SenderSettings")


class Sender(WeightSource):
    """Sends the weights one export stream yields: the WeightSource in the trainer's process.

    `settings`: how it sends (transport, bucket size, timeouts, keys, device, hashing); one record, as the
    controller chose it. `export()` returns a fresh stream of ExportedUnits per call (the model's current weights);
    `names()` the HF names that stream covers, without exporting. `is_source`: False on a rank that is not the
    export source; `send` then only consumes the stream, so every rank runs the export's collectives in the same
    order. After a failed bucket the rest of the stream is still consumed, for the same reason, before the error is
    raised. The engine clients and the transport are built in `open`, on the caller's event loop.

    `feeds`: this rank's role in a colocated feed plan (every rank of the plan gets one, the source included).
    Without it a colocated source feeds every engine rank itself (`FeedPlan.single_source`). Opening with a plan of
    several ranks is a collective over the trainer's default group: every trainer rank must open at once. `metas`:
    the export's tensors (names, shapes, dtypes) without exporting, for a transport that plans from them
    (shard_direct); only the source reads them.

    `settings.hash_buckets`: checksum every tensor sent (SHA-256, on a thread of its own while the bucket is on the
    wire). Verification needs them; without them (verify off) a send costs one pass less over the bytes, no sync
    leaves a verified baseline, and after a failed send the controller cannot tell an untouched engine from a
    partial one, so it holds every engine the session reached paused.
    """

    can_stage = True
    can_predict = True

    def __init__(
        self,
        *,
        settings: SenderSettings,
        export: Callable[[], Iterable[ExportedUnit]],
        names: Callable[[], Iterable[str]],
        is_source: bool = True,
        feeds: FeedRole | None = None,
        metas: Callable[[], Iterable[TensorMeta]] | None = None,
    ) -> None:
        if feeds is not None and (feeds.rank == feeds.source_rank) != is_source:
            raise ValueError(
                f"feeds: rank {feeds.rank} with source rank {feeds.source_rank} needs a transport exactly on the source"
            )
        self._settings = settings
        self.flushes_cache = settings.flush_cache
        self._transport_name = settings.transport if is_source else None
        self._export = export
        self._names = names
        self._device = torch.device(settings.device)
        self._rank: RankTransport | None = None  # this rank's side of the transport, built at open
        self._staged: StagedStream | None = None
        self._buffers: DoubleBuffer | None = None
        self._feeds = feeds
        self._metas = metas

    @property
    def is_source(self) -> bool:
        return self._transport_name is not None

    async def exported_names(self) -> tuple[str, ...]:
        return tuple(self._names())

    async def open(
        self, *, engines: Sequence[EngineEndpoint], membership: GroupMembership | None
    ) -> GroupMembership | None:
        """Build this rank's side of the transport (miles_sync.transport.base.open_rank_transport) and open it: the
        source joins the update group while the engines do; other ranks return `membership` as given."""
        await self.close()
        setup = RankSetup(
            is_source=self.is_source,
            connect=self._settings.engine_client,
            feeds=self._feeds,
            device=str(self._device),
            # A member may wait in one collective for a poster's whole HTTP call and the transfer.
            fan_out_timeout_s=2 * self._settings.bucket_timeout_s,
            metas=tuple(self._metas()) if self._metas is not None and self.is_source else (),
            flush_cache=self._settings.flush_cache,
        )
        rank = await open_rank_transport(self._settings.transport, engines=engines, setup=setup)
        try:
            bound = await rank.open(membership=membership, timeout_s=self._settings.open_timeout_s)
        except BaseException:
            await rank.close(timeout_s=self._settings.open_timeout_s)
            raise
        self._rank = rank
        return bound

    def _send_buffers(self) -> DoubleBuffer:
        """The pack buffers of a send. On the CPU they are kept from one send to the next: fresh ones cost a page
        fault per 4 KiB and an munmap per bucket, about as long as the copy into them. On a GPU the caching
        allocator already reuses the blocks, and holding them would keep 2 buckets of device memory through
        training, so each send allocates its own."""
        if self._device.type != "cpu":
            return DoubleBuffer(cap_bytes=self._settings.bucket_bytes, device=self._device)
        if self._buffers is None:
            self._buffers = DoubleBuffer(
                cap_bytes=self._settings.bucket_bytes, device=self._device, shared=self._shares_cpu_memory
            )
        return self._buffers

    @property
    def _shares_cpu_memory(self) -> bool:
        return self._transport_name is not None and transport_spec(self._transport_name).packs_into_shared_memory(
            self._device.type
        )

    async def close(self) -> None:
        self._staged = None
        self._buffers = None
        rank, self._rank = self._rank, None
        if rank is not None:
            await rank.close(timeout_s=self._settings.open_timeout_s)

    async def stage(
        self, *, selector: Selector | None = None, engine_digests: EngineDigestPlan | None = None
    ) -> StageResult:
        """Export and pack every bucket now (every rank, as for `send`); the next `send` transfers these. With a
        `selector` and an `engine_digests` plan the source rank also predicts the plan's engine digests now, and a
        send with the same selector and plan returns them instead of hashing inside the pause. A later `stage`
        replaces all of it; `close` drops it."""
        start = time.perf_counter()
        self._staged = None
        stream = PackStream(
            self._export(),
            cap_bytes=self._settings.bucket_bytes,
            buffers=FreshBuffers(device=self._device, shared=self._shares_cpu_memory),
            hash_inline=self._settings.hash_buckets,
            quantization=self._settings.quantization,
        )
        digester = None
        if self.is_source and selector is not None and engine_digests:
            digester = EngineDigester(engine_digests, names=self._names(), selector=selector)
        digest_s = 0.0

        def pack_all(packed: Iterator[PackedBucket]) -> list[PackedBucket]:
            nonlocal digest_s
            buckets = list(packed)
            if digester is not None:  # in send order, as a send's hasher thread would feed it
                begin = time.perf_counter()
                for bucket in buckets:
                    digester.add(bucket_tensors(bucket.bucket))
                digest_s = time.perf_counter() - begin
            return buckets

        buckets = await self._consume(stream, pack_all, empty=[], thread="miles-sync-stage")
        digests = None
        if digester is not None:  # it exists only with a selector and a plan
            digests = PredictedDigests(selector=selector, plan=engine_digests, checksums=digester.finish())
        self._staged = StagedStream(buckets, export_s=stream.export_s, pack_s=stream.pack_s, digests=digests)
        return StageResult(
            num_bytes=sum(b.bucket.num_bytes for b in buckets),
            num_buckets=len(buckets),
            export_s=stream.export_s,
            pack_s=stream.pack_s,
            stage_s=time.perf_counter() - start,
            engine_layouts=0 if digests is None else len(digests.checksums),
            digest_s=digest_s,
        )

    async def predict(self, *, selector: Selector, engine_digests: EngineDigestPlan | None = None) -> WeightDigests:
        """Export, pack and hash every bucket as a send would, and send nothing (WeightSource.predict): each bucket
        is hashed and freed before the next is packed. Needs no open transport; drops anything staged."""
        start = time.perf_counter()
        self._staged = None
        stream = PackStream(
            self._export(),
            cap_bytes=self._settings.bucket_bytes,
            buffers=FreshBuffers(device=self._device, shared=False),
            hash_inline=False,
            quantization=self._settings.quantization,
        )
        digester = None
        if self.is_source and engine_digests:
            digester = EngineDigester(engine_digests, names=self._names(), selector=selector)

        def hash_all(packed: Iterator[PackedBucket]) -> dict[str, str]:
            checksums: dict[str, str] = {}
            for bucket in packed:  # each one freed before the next is packed
                checksums.update(bucket_checksums(bucket.bucket))
                if digester is not None:
                    digester.add(bucket_tensors(bucket.bucket))
            trim_heap()
            return checksums

        checksums = await self._consume(stream, hash_all, empty={}, thread="miles-sync-predict")
        return WeightDigests(
            checksums=checksums,
            engine_checksums=_engine_checksums(None, digester),
            predict_s=time.perf_counter() - start,
        )

    async def _consume(
        self, stream: PackStream, consume: Callable[[Iterator[PackedBucket]], T], *, empty: T, thread: str
    ) -> T:
        """`consume` the stream's buckets on a worker thread of its own, on the source rank; any other rank drains
        the stream instead (the export's collectives still pair up with the source's) and returns `empty`. After a
        failure the rest is drained too (as in send: the other ranks' collectives must still pair up)."""

        def run() -> T:
            if not self.is_source:
                stream.drain()
                return empty
            try:
                return consume(iter(stream.next_bucket, None))
            except Exception:
                with contextlib.suppress(Exception):  # the original failure is the one to report
                    stream.drain()
                raise

        worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread)
        try:
            return await asyncio.get_running_loop().run_in_executor(worker, run)
        finally:
            worker.shutdown(wait=False)

    async def send(
        self,
        *,
        selector: Selector,
        on_bucket: Callable[[BucketProgress], None] | None = None,
        engine_digests: EngineDigestPlan | None = None,
    ) -> SendResult:
        """Export (or replay the staged buckets) and send them; see WeightSource. With `engine_digests`, the source
        also returns each planned layout's expected per-rank digests (`SendResult.engine_checksums`)."""
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        staged, self._staged = self._staged, None
        predicted = None
        if staged is not None:
            stream: PackStream | StagedStream = staged
            if staged.digests is not None and staged.digests.matches(selector=selector, plan=engine_digests):
                predicted = staged.digests.checksums  # hashed before the pause
        else:
            stream = PackStream(
                self._export(),
                cap_bytes=self._settings.bucket_bytes,
                buffers=self._send_buffers(),
                hash_inline=False,
                quantization=self._settings.quantization,
            )
        # One worker thread runs the whole stream. Not waited for on exit: after a cancellation it finishes the
        # bucket it is packing on its own, and the event loop must not block on it.
        worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-sync-pack")
        try:
            if not self.is_source:
                await self._follow(loop.run_in_executor(worker, stream.drain))
                return _nothing_sent(export_s=stream.export_s, start=start)
            digester = (
                EngineDigester(engine_digests, names=self._names(), selector=selector)
                if engine_digests and predicted is None
                else None
            )
            try:
                totals = await self._send_buckets(
                    stream, worker=worker, selector=selector, start=start, on_bucket=on_bucket, digester=digester
                )
            except BaseException as exc:
                with contextlib.suppress(Exception):  # the original failure is the one to report
                    await self._end_send(error=f"the source failed: {str(exc) or type(exc).__name__}")
                raise
            await self._end_send(error=None)
        finally:
            worker.submit(trim_heap)  # after the stream, off the event loop; nobody waits for it
            worker.shutdown(wait=False)
        return SendResult(
            num_bytes=totals.num_bytes,
            num_buckets=totals.num_buckets,
            num_tensors=totals.num_tensors,
            checksums=totals.checksums,
            export_s=stream.export_s,
            pack_s=stream.pack_s,
            send_s=time.perf_counter() - start,
            engine_checksums=_engine_checksums(predicted, digester),
            quantize_s=stream.quantize_s,
        )

    async def _follow(self, draining: asyncio.Future) -> None:
        """A non-source rank: drain the export and, as a fan-out member, take part in every bucket; both run to
        their end (the peers' collectives pair up with them) before the first failure is raised."""
        following = [] if self._rank is None else [self._rank.follow(timeout_s=self._settings.bucket_timeout_s)]
        results = await asyncio.gather(draining, *following, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _end_send(self, *, error: str | None) -> None:
        if self._rank is not None:
            await self._rank.end_send(error=error)

    async def _send_buckets(
        self,
        stream: PackStream,
        *,
        worker: ThreadPoolExecutor,
        selector: Selector,
        start: float,
        on_bucket: Callable[[BucketProgress], None] | None,
        digester: EngineDigester | None,
    ) -> _Totals:
        transport = self._rank
        if transport is None:
            raise RuntimeError("Sender.send before open(): the transport is not built")
        loop = asyncio.get_running_loop()
        totals = _Totals()
        in_flight: tuple[asyncio.Task, asyncio.Future, PackedBucket] | None = None
        # Bucket i is hashed on its own thread while it is on the wire (the checksums are needed only once the send
        # is over), so the hash is off the path from packing to broadcasting. Both finish before bucket i + 2 is
        # packed into the same buffer: the loop awaits them before it starts bucket i + 1. The engine digester
        # runs there too, bucket by bucket in send order, and copies what it keeps past a bucket.
        hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-sync-hash")
        try:
            while True:
                packed = await loop.run_in_executor(worker, stream.next_bucket)  # while bucket i is in flight
                if in_flight is not None:
                    task, hashing, sent = in_flight
                    await task
                    checksums = await hashing
                    totals.add(sent, checksums, start=start, on_bucket=on_bucket)
                    in_flight = None
                if packed is None:
                    return totals
                task = asyncio.create_task(
                    transport.send_bucket(packed.bucket, selector=selector, timeout_s=self._settings.bucket_timeout_s)
                )
                if (packed.checksums is None and self._settings.hash_buckets) or digester is not None:
                    hashing = loop.run_in_executor(hasher, self._hash_bucket, packed, digester)
                else:
                    hashing = loop.create_future()
                    hashing.set_result(packed.checksums or {})
                in_flight = (task, hashing, packed)
        except BaseException as exc:
            if in_flight is not None:
                in_flight[0].cancel()
                await asyncio.gather(in_flight[0], in_flight[1], return_exceptions=True)
            if isinstance(exc, Exception):  # not on cancellation: the canceller wants control back now
                with contextlib.suppress(Exception):  # the original failure is the one to report
                    await loop.run_in_executor(worker, stream.drain)
            raise
        finally:
            hasher.shutdown(wait=False)

    def _hash_bucket(self, packed: PackedBucket, digester: EngineDigester | None) -> dict[str, str]:
        """On the hasher thread: the bucket's checksums (staged buckets bring theirs) and its engine digests."""
        checksums = packed.checksums
        if checksums is None:
            checksums = bucket_checksums(packed.bucket) if self._settings.hash_buckets else {}
        if digester is not None:
            digester.add(bucket_tensors(packed.bucket))
        return checksums


def _engine_checksums(
    predicted: dict[EngineLayout, tuple[dict[str, str], ...]] | None, digester: EngineDigester | None
) -> dict[EngineLayout, tuple[dict[str, str], ...]]:
    """A send's engine digests: those its staged export predicted, else its own digester's, else none."""
    if predicted is not None:
        return predicted
    return {} if digester is None else digester.finish()


class _Totals:
    def __init__(self) -> None:
        self.num_bytes = 0
        self.num_buckets = 0
        self.num_tensors = 0
        self.checksums: dict[str, str] = {}

    def add(
        self,
        packed: PackedBucket,
        checksums: dict[str, str],
        *,
        start: float,
        on_bucket: Callable[[BucketProgress], None] | None,
    ) -> None:
        self.checksums.update(checksums)
        self.num_bytes += packed.bucket.num_bytes
        self.num_buckets += 1
        self.num_tensors += len(packed.bucket.entries)
        if on_bucket is not None:
            on_bucket(
                BucketProgress(
                    index=packed.plan.index,
                    num_bytes=packed.bucket.num_bytes,
                    num_tensors=len(packed.bucket.entries),
                    total_bytes=self.num_bytes,
                    elapsed_s=time.perf_counter() - start,
                )
            )


def _nothing_sent(*, export_s: float, start: float) -> SendResult:
    """A non-source rank's result: it ran the export's collectives and sent nothing."""
    return SendResult(
        num_bytes=0,
        num_buckets=0,
        num_tensors=0,
        checksums={},
        export_s=export_s,
        pack_s=0.0,
        send_s=time.perf_counter() - start,
    )
