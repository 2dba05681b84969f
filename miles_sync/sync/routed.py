"""The trainer side of a routed sync: every trainer rank sends its own shards, with no gather (`RoutedSender`).

For a transport with a routed form (`TransportSpec.routed_factory`: shard_direct) and a source whose ranks hold
their own Megatron shards (miles_sync.sync.source.ModelSource, raw conversion, with a colocated feed plan). Per
send every rank converts its own shards into the HF slices it holds (`pieces()`: no collective) and the routed
transport delivers each engine rank's own parameters from them (miles_sync.transport.shard_routed). No rank ever
holds a full tensor it does not feed, so the send's checks are the engines' own parameters: the source returns,
per engine layout of the plan, the digests each engine rank must answer (hashed by its feeder as it built them),
and the HF checksums where a TP=1 engine's feeder assembled every tensor whole (a fleet of TP>1 engines only has
no engine answering HF-named digests).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence

from miles_sync.sync.engine_digests import EngineDigestPlan, EngineLayout
from miles_sync.sync.report import BucketProgress
from miles_sync.sync.sender import SenderSettings
from miles_sync.sync.weight_source import SendResult, WeightSource
from miles_sync.transport.base import RankSetup, RoutedRankTransport, open_routed_rank
from miles_sync.transport.feeds import FeedRole
from miles_sync.transport.membership import EngineEndpoint, GroupMembership
from miles_sync.weights.shard_routes import Holding, LocalPiece
from miles_sync.wire.bucket import TensorMeta
from miles_sync.wire.protocol import Selector

__all__: list[str] = []  # used by miles_sync.sync.source only


class RoutedSender(WeightSource):
    """A routed sync on one trainer rank (module docstring). `pieces()` converts this rank's current shards into
    the HF slices it holds (views); `metas()` the export's tensors (every rank plans from them); `names()` the HF
    names a send covers. `feeds`: this rank's role in the colocated feed plan. Opening and sending are collective
    over every trainer rank."""

    def __init__(
        self,
        *,
        settings: SenderSettings,
        pieces: Callable[[], Iterable[LocalPiece]],
        metas: Callable[[], Sequence[TensorMeta]],
        names: Callable[[], Iterable[str]],
        feeds: FeedRole,
    ) -> None:
        if settings.quantization is not None:
            raise ValueError(
                f"the {settings.transport} transport routes each rank's own shards and does not quantize; "
                "sync.quantization needs a gathered send"
            )
        self._settings = settings
        self.flushes_cache = settings.flush_cache
        self._pieces = pieces
        self._metas = metas
        self._names = names
        self._feeds = feeds
        self._rank: RoutedRankTransport | None = None

    @property
    def is_source(self) -> bool:
        return self._feeds.rank == self._feeds.source_rank

    async def exported_names(self) -> tuple[str, ...]:
        return tuple(self._names())

    async def open(
        self, *, engines: Sequence[EngineEndpoint], membership: GroupMembership | None
    ) -> GroupMembership | None:
        """Plan the routed send to `engines` from every rank's holdings (one conversion pass here); every trainer
        rank at once. No update group: returns `membership` as given (None)."""
        await self.close()
        holdings = await asyncio.to_thread(self._holdings)
        setup = RankSetup(
            is_source=self.is_source,
            connect=self._settings.engine_client,
            feeds=self._feeds,
            device=self._settings.device,
            fan_out_timeout_s=2 * self._settings.bucket_timeout_s,
            metas=tuple(self._metas()),
            flush_cache=self._settings.flush_cache,
        )
        self._rank = await asyncio.wait_for(
            open_routed_rank(
                self._settings.transport,
                engines=engines,
                setup=setup,
                bucket_bytes=self._settings.bucket_bytes,
                holdings=holdings,
            ),
            timeout=self._settings.open_timeout_s,
        )
        return membership

    async def send(
        self,
        *,
        selector: Selector,
        on_bucket: Callable[[BucketProgress], None] | None = None,
        engine_digests: EngineDigestPlan | None = None,
    ) -> SendResult:
        """Convert this rank's shards and send them; the source returns every planned layout's expected per-rank
        digests (`SendResult.engine_checksums`) and the HF checksums a TP=1 engine's build gives."""
        rank = self._rank
        if rank is None:
            raise RuntimeError("send before open()")
        start = time.perf_counter()
        pieces = await asyncio.to_thread(lambda: list(self._pieces()))
        export_s = time.perf_counter() - start
        layouts = engine_digests.layouts if engine_digests else ()
        sent = [0]

        def progress(index: int, num_tensors: int, num_bytes: int) -> None:
            sent[0] += num_bytes
            if on_bucket is not None:
                on_bucket(
                    BucketProgress(
                        index=index,
                        num_bytes=num_bytes,
                        num_tensors=num_tensors,
                        total_bytes=sent[0],
                        elapsed_s=time.perf_counter() - start,
                    )
                )

        outcome = await rank.send(
            pieces,
            selector=selector,
            hashes=[layout.tensor_hash for layout in layouts],
            checksums=self._settings.hash_buckets,
            timeout_s=self._settings.bucket_timeout_s,
            on_bucket=progress,
        )
        expected: dict[EngineLayout, tuple[dict[str, str], ...]] = {
            layout: outcome.digests[(layout.direct_layout, layout.tensor_hash)]
            for layout in layouts
            if (layout.direct_layout, layout.tensor_hash) in outcome.digests
        }
        return SendResult(
            num_bytes=outcome.num_bytes,
            num_buckets=outcome.num_buckets,
            num_tensors=outcome.num_tensors,
            checksums=outcome.checksums,
            export_s=export_s,
            pack_s=0.0,
            send_s=time.perf_counter() - start,
            engine_checksums=expected,
            names=outcome.names,
        )

    async def close(self) -> None:
        rank, self._rank = self._rank, None
        if rank is not None:
            await rank.close(timeout_s=self._settings.open_timeout_s)

    def _holdings(self) -> list[tuple[str, Holding]]:
        rank = self._feeds.rank
        return [
            (p.hf_name, Holding(rank=rank, dim=p.dim, start=p.start, end=p.end))
            for p in self._pieces()
            if p.dim is None or p.end > p.start
        ]
