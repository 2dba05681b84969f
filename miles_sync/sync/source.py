"""One trainer rank's share of every sync: `ModelSource`.

It is what a sync needs from one rank: the export of its Megatron model (every rank runs the gather's
collectives; the stage's source rank receives the full HF tensors) and, on the source rank, the sender that packs
and ships them. Given a colocated feed plan (`feeds`), every rank of the plan also takes part in each colocated
bucket: it hands its own copy to the engine ranks on its device; with a transport that has a routed form
(shard_direct) and raw conversion, every rank instead converts its own shards and sends the slices each engine rank
keeps, with no gather (miles_sync.sync.routed). It owns a private event loop thread, so its
blocking methods work the same from a plain Ray actor, an async actor (through `__ray_call__`) or a script.
Pipelines with their own trainer actors create one through `miles_sync.embedding.attach_model`;
`miles_sync.job.trainer.TrainerWorker` does the same for the model it builds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from miles_sync.env import LOOPBACK_HOST, bind_host
from miles_sync.export.registry import ConversionMode, build_exporter
from miles_sync.sync.adapter import AdapterPayload, encode_adapter
from miles_sync.sync.engine_digests import EngineDigestPlan
from miles_sync.sync.report import BucketProgress
from miles_sync.sync.routed import RoutedSender
from miles_sync.sync.sender import Sender, SenderSettings
from miles_sync.sync.weight_source import SendResult, StageResult, WeightDigests
from miles_sync.transport.base import RankForm, transport_spec
from miles_sync.transport.fan_out import find_source_rank
from miles_sync.transport.feeds import FeedPlan, FeedRole, plan_spread_feeds
from miles_sync.transport.membership import EngineEndpoint, GroupMembership
from miles_sync.weights.shard_routes import LocalPiece
from miles_sync.wire.protocol import Selector

__all__ = [
    "ModelSource",
    "RankInfo",
    "RankSendResult",
]

T = TypeVar("T")
_LOOP_STOP_S = 5.0


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """One trainer rank as the controller sees it."""

    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    is_source: bool  # receives the full HF tensors and sends them
    num_exported_tensors: int
    node: str = LOOPBACK_HOST  # the address this rank binds (its node's on a cluster: miles_sync.env.bind_host)
    feeds: FeedPlan | None = None  # the colocated feed plan this rank follows


@dataclass(frozen=True, kw_only=True)
class RankSendResult:
    """One rank's part of a send. `progress`: the source's per-bucket events, in order (empty elsewhere)."""

    rank: int
    result: SendResult
    progress: tuple[BucketProgress, ...]


class _LoopThread:
    """An asyncio loop on a daemon thread; `run` submits a coroutine and waits for it with a timeout."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], *, timeout_s: float, what: str) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            if future.done():
                raise  # the coroutine's own TimeoutError, with its own message
            future.cancel()
            raise TimeoutError(f"{what} did not finish within {timeout_s} s") from None

    def stop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_LOOP_STOP_S)
        if not self._thread.is_alive():
            self._loop.close()


class ModelSource:
    """One rank's Megatron model as a weight source. Blocking methods; call them from one thread at a time.

    Needs torch.distributed and megatron-core model parallelism initialized (the pipeline's own). Every rank of
    the model must `send` at the same time (the export's collectives pair up across ranks); `open` and `close`
    only do work on the source rank. The model must not be trained while a send runs.
    """

    def __init__(
        self,
        model: Any,
        *,
        hf_config: Any,
        conversion: ConversionMode = ConversionMode.RAW,
        collective_timeout_s: float,
        feeds: FeedPlan | None = None,
    ) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from miles_sync.export.megatron import is_export_source

        if not collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s={collective_timeout_s} must be positive")
        if feeds is not None and ps.get_pipeline_model_parallel_world_size() > 1:
            # Opening a feed plan is a collective over the whole trainer group, but the stages' sources open one
            # after another (one update group each, miles_sync.sync.pipeline): the plan would deadlock.
            raise ValueError(
                "a colocated feed plan spans the whole trainer group and cannot be used with pipeline stages "
                f"(pp={ps.get_pipeline_model_parallel_world_size()}); pass feeds=None: each stage's source rank "
                "then feeds every engine rank itself"
            )
        if feeds is not None and feeds.num_trainers != dist.get_world_size():
            raise ValueError(
                f"the colocated feed plan covers {feeds.num_trainers} trainer ranks, the trainer group has "
                f"{dist.get_world_size()}"
            )
        self._feeds = feeds
        self._conversion = ConversionMode(conversion)
        self._model, self._hf_config = model, hf_config
        self._adapters: Any = None  # LoRA adapters to sync instead of the base (attach_adapters)
        self._adapter_flatten_min_bytes = 0
        self._adapter_hold: list | None = None  # tensors the last adapter payload points at
        self._export_units, metadata = build_exporter(
            model, hf_config=hf_config, conversion=conversion, timeout_s=collective_timeout_s
        )
        self._is_source = is_export_source()
        self._metas = tuple(t for unit in metadata for t in unit.tensors)
        self._names = tuple(t.name for t in self._metas)
        rank = dist.get_rank()
        self._info = RankInfo(
            rank=rank,
            world_size=dist.get_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            is_source=self._is_source,
            num_exported_tensors=len(self._names),
            node=bind_host(),
            feeds=feeds,
        )
        self._loop = _LoopThread(name=f"miles-sync-source-{rank}")
        self._sender: Sender | RoutedSender | None = None
        self._call_timeout_s = collective_timeout_s

    def _form(self, transport: str) -> RankForm:
        return transport_spec(transport).form(
            raw_conversion=self._conversion is ConversionMode.RAW, has_feed_plan=self._feeds is not None
        )

    def describe(self) -> RankInfo:
        return self._info

    def exported_names(self) -> tuple[str, ...]:
        """The HF names one send covers on this stage (metadata only; no collective)."""
        return self._names

    def open(
        self, *, engines: Sequence[EngineEndpoint], membership: GroupMembership | None, settings: SenderSettings
    ) -> GroupMembership | None:
        """(Re)build the sender for `engines`; on the source rank this joins the update group while the engines do.
        Returns the membership bound to its port (non-source ranks return `membership` as given)."""
        self.close(timeout_s=settings.call_timeout_s)
        role = None
        feeds = self._feeds
        form = self._form(settings.transport)
        if form is RankForm.SPREAD:
            # Feeds spread over this stage's ranks: with pipeline stages each stage opens and sends on its own turn
            # (miles_sync.sync.pipeline), feeding every engine rank its own layers, so nothing spans two stages.
            stage_ranks, source_rank = self._stage_ranks()
            feeds = plan_spread_feeds(
                num_trainers=self._info.world_size, tp_sizes=[e.tp_size for e in engines], ranks=stage_ranks
            )
            role = FeedRole(plan=feeds, rank=self._info.rank, source_rank=source_rank, stage_ranks=stage_ranks)
        elif feeds is not None:  # what the plan means is the transport's to decide (miles_sync.transport)
            # Every rank opens at once, before any send: the one moment a collective on the default group cannot
            # interleave with the export's.
            _, source_rank = find_source_rank(is_source=self._is_source)
            role = FeedRole(plan=feeds, rank=self._info.rank, source_rank=source_rank)
        sender: Sender | RoutedSender
        if form is not RankForm.GATHERED:
            sender = RoutedSender(
                settings=settings,
                pieces=self._local_pieces,
                metas=lambda: self._metas,
                names=self.exported_names,
                feeds=role,
            )
        else:
            sender = Sender(
                settings=settings,
                export=self._export_units,
                names=self.exported_names,
                is_source=self._is_source,
                feeds=role,
                metas=lambda: self._metas,
            )
        bound = self._loop.run(
            sender.open(engines=engines, membership=membership),
            timeout_s=settings.call_timeout_s,
            what=f"rank {self._info.rank} opening the {settings.transport} transport",
        )
        self._sender = sender
        self._call_timeout_s = settings.call_timeout_s
        return bound

    def _stage_ranks(self) -> tuple[tuple[int, ...], int]:
        """The global ranks of this rank's pipeline stage, ascending, and its export source's: gathered over the
        stage's own tensor-and-data-parallel group (every rank of the stage at once; only this stage opens now)."""
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        try:
            return find_source_rank(is_source=self._is_source, group=group)
        except ValueError as exc:
            raise ValueError(f"pipeline stage {self._info.pp_rank}: {exc}") from None

    def send(
        self,
        *,
        selector: Selector,
        on_bucket: Callable[[BucketProgress], None] | None = None,
        engine_digests: EngineDigestPlan | None = None,
    ) -> RankSendResult:
        """Export and (on the source rank) send the current weights once. Raises on any failure; the transport must
        then be re-opened (the controller does it at the next sync). `on_bucket` is called on this rank's loop
        thread as each bucket is acknowledged (the result's `progress` lists them all as well); it must not block.
        `engine_digests`: the layouts whose engine digests the source rank predicts (other ranks ignore it)."""
        sender = self._sender
        if sender is None:
            raise RuntimeError(f"rank {self._info.rank}: send before open()")
        progress: list[BucketProgress] = []
        result = self._loop.run(
            sender.send(
                selector=selector,
                on_bucket=functools.partial(_record, progress, on_bucket),
                engine_digests=engine_digests,
            ),
            timeout_s=self._call_timeout_s,
            what=f"rank {self._info.rank} sending weights",
        )
        return RankSendResult(rank=self._info.rank, result=result, progress=tuple(progress))

    def stage(self, *, selector: Selector | None = None, engine_digests: EngineDigestPlan | None = None) -> StageResult:
        """Export and pack the current weights ahead of the next send (every rank at once, as for `send`); with a
        selector and a plan the source rank also predicts the engine digests then (`Sender.stage`)."""
        sender = self._sender
        if sender is None:
            raise RuntimeError(f"rank {self._info.rank}: stage before open()")
        if not sender.can_stage:
            raise ValueError(
                f"rank {self._info.rank}: a routed sync sends each rank's own shards at send time and packs nothing "
                "ahead; run it with sync.staged=false"
            )
        return self._loop.run(
            sender.stage(selector=selector, engine_digests=engine_digests),
            timeout_s=self._call_timeout_s,
            what=f"rank {self._info.rank} staging",
        )

    def predict(
        self, *, selector: Selector, engine_digests: EngineDigestPlan | None, settings: SenderSettings
    ) -> WeightDigests:
        """Export and hash the current weights without sending them (every rank at once, as for `send`;
        `Sender.predict`): through the open sender, or, before any open, a sender of `settings` without transport."""
        sender = self._sender
        if sender is None or not sender.can_predict:  # a routed sender hashes only what it sends
            sender = Sender(
                settings=settings, export=self._export_units, names=self.exported_names, is_source=self._is_source
            )
        return self._loop.run(
            sender.predict(selector=selector, engine_digests=engine_digests),
            timeout_s=settings.call_timeout_s,
            what=f"rank {self._info.rank} hashing its weights",
        )

    def close(self, *, timeout_s: float = 60.0) -> None:
        """Tear the transport down (idempotent)."""
        sender, self._sender = self._sender, None
        if sender is not None:
            self._loop.run(sender.close(), timeout_s=timeout_s, what=f"rank {self._info.rank} closing the transport")

    def shutdown(self) -> None:
        try:
            self.close()
        finally:
            self._loop.stop()

    # ---- LoRA (miles_sync.sync.lora) ----------------------------------------------------------------------------

    def attach_adapters(self, adapters: Any, *, flatten_min_bytes: int) -> None:
        """Sync these LoRA adapters (miles_sync.megatron.lora.LoraAdapters of this rank) instead of the base."""
        self._adapters = adapters
        self._adapter_flatten_min_bytes = flatten_min_bytes

    def adapter_payload(self, *, tp_sizes: Sequence[int]) -> AdapterPayload | None:
        """Gather the adapters into PEFT names and encode them for engines of `tp_sizes`: on the export source the
        payload (its tensors kept alive until `release_adapter`), None elsewhere. Every rank calls it at once."""
        from miles_sync.export.lora import gather_peft_adapter, peft_adapter_config
        from miles_sync.export.megatron import model_chunks
        from miles_sync.export.raw import create_converter

        if self._adapters is None:
            raise RuntimeError(f"rank {self._info.rank}: no LoRA adapters attached (attach_adapters)")
        converter = create_converter(self._hf_config.model_type, self._hf_config)
        named = gather_peft_adapter(model_chunks(self._model), self._adapters, converter=converter)
        if not named:
            return None
        payload, self._adapter_hold = encode_adapter(
            named,
            config_dict=peft_adapter_config(self._adapters.spec),
            tp_sizes=tp_sizes,
            flatten_min_bytes=self._adapter_flatten_min_bytes,
        )
        return payload

    def release_adapter(self) -> None:
        self._adapter_hold = None

    def _local_pieces(self) -> Iterator[LocalPiece]:
        """This rank's own shards as the HF slices it holds (no collective; views where the conversion allows)."""
        from miles_sync.export.megatron import iter_local_pieces
        from miles_sync.export.raw import create_converter

        converter = create_converter(self._hf_config.model_type, self._hf_config)
        for _, pieces in iter_local_pieces(self._model, converter=converter):
            yield from pieces


def _record(
    progress: list[BucketProgress], on_bucket: Callable[[BucketProgress], None] | None, event: BucketProgress
) -> None:
    progress.append(event)
    if on_bucket is not None:
        try:
            on_bucket(event)
        except Exception:  # progress must never fail a send
            pass
