"""Several export sources in one sync: one per pipeline stage, one update group per source, one fixed order.

A model with pipeline stages has one export source per stage (each stage's tp 0 / dp 0 rank materializes that
stage's layers, `miles_sync.export.stage`). SGLang broadcasts every update group from its rank 0, so each source
owns a group of its own, and every engine rank joins every stage's group. Two rules keep that free of deadlocks
on engines that, like SGLang's scheduler, handle one weight-update request at a time (a rendezvous blocks it):

- groups are created one after another, stage 0 first, each completing on every engine before the next is asked
  for (`open`): an engine never blocks in stage B's rendezvous while another blocks in stage A's;
- every engine receives the stages' buckets in one global order, stage by stage (`send`): two engines never wait
  in two different stages' broadcasts.

Stages still export and pack concurrently: while stage 0 sends, every later stage that can pack ahead (`stage()`)
packs all its buckets, and sends them when its turn comes. That costs each later stage's packed bytes in memory on
its source rank until its turn (its share of the model, not the whole model); a stage that cannot pack ahead
exports while it sends, on its turn. `PipelineSource` is itself a `WeightSource`: the session's one begin and one
end per engine wrap all stages, every payload carries the session's selector, and the verification compares the
union of every stage's checksums with each engine's whole answer, so a tensor no stage sent is reported ("extra").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from miles_sync.sync.engine_digests import EngineDigestPlan, EngineLayout
from miles_sync.sync.report import BucketProgress
from miles_sync.sync.weight_source import SendResult, StageResult, WeightDigests, WeightSource
from miles_sync.transport.membership import EngineEndpoint, GroupMembership
from miles_sync.wire.protocol import Selector

__all__ = ["PipelineSource"]


def stage_group_name(group_name: str, *, stage: int, num_stages: int) -> str:
    """The update group of pipeline stage `stage`: the controller's name itself with one stage, else suffixed."""
    return group_name if num_stages == 1 else f"{group_name}_pp{stage}"


def stage_group_names(group_name: str, *, num_stages: int) -> tuple[str, ...]:
    return tuple(stage_group_name(group_name, stage=k, num_stages=num_stages) for k in range(num_stages))


class PipelineSource(WeightSource):
    """A WeightSource over one WeightSource per pipeline stage, in stage order (module docstring). It can stage
    when every stage can.

    A source that learns its stages only at `connect` (trainer actors: actors.remote_source) subclasses it, declares
    its capabilities itself, and hands them over with `use_stages`; the session's calls then run here and go down
    to the stages, never back up."""

    def __init__(self, stages: Sequence[WeightSource]) -> None:
        self._memberships: tuple[GroupMembership | None, ...] = ()
        self._is_staged = False
        self.use_stages(stages)
        self.can_stage = all(s.can_stage for s in self._stages)
        self.can_predict = all(s.can_predict for s in self._stages)
        # Each stage's requests load only its layers; each flushes as it loads, so every engine is flushed by the
        # first request it receives. Mixed stages would leave the session unsure: then it flushes itself.
        self.flushes_cache = all(s.flushes_cache for s in self._stages)

    def use_stages(self, stages: Sequence[WeightSource]) -> None:
        """Sync through these stage sources from now on (stage order; at least one)."""
        if not stages:
            raise ValueError("PipelineSource needs at least one stage source")
        self._stages = tuple(stages)
        self._memberships = ()
        self._is_staged = False

    @property
    def num_stages(self) -> int:
        return len(self._stages)

    @property
    def memberships(self) -> tuple[GroupMembership | None, ...]:
        """Each stage's bound update group after `open` (None entries without a group)."""
        return self._memberships

    async def exported_names(self) -> tuple[str, ...]:
        per_stage = await asyncio.gather(*(s.exported_names() for s in self._stages))
        owner: dict[str, int] = {}
        repeated = []
        for stage, names in enumerate(per_stage):
            for name in names:
                if name in owner:
                    repeated.append(f"{name} (stages {owner[name]} and {stage})")
                owner.setdefault(name, stage)
        if repeated:
            raise ValueError(f"pipeline stages export the same tensors, each must send its own: {', '.join(repeated)}")
        return tuple(owner)

    async def open(
        self, *, engines: Sequence[EngineEndpoint], membership: GroupMembership | None
    ) -> GroupMembership | None:
        """Open every stage in stage order; stage k's group is `stage_group_name(membership.group_name, k)`, with a
        port of its own. Returns stage 0's bound membership (all of them: `memberships`)."""
        self._is_staged = False
        self._memberships = ()
        bound = []
        for stage, source in enumerate(self._stages):
            planned = None
            if membership is not None:
                planned = dataclasses.replace(
                    membership,
                    group_name=stage_group_name(membership.group_name, stage=stage, num_stages=self.num_stages),
                    master_port=0,
                )
            try:
                bound.append(await source.open(engines=engines, membership=planned))
            except Exception as exc:
                if self.num_stages == 1:
                    raise
                raise RuntimeError(f"pipeline stage {stage}: {exc or type(exc).__name__}") from exc
        self._memberships = tuple(bound)
        return bound[0]

    async def stage(
        self, *, selector: Selector | None = None, engine_digests: EngineDigestPlan | None = None
    ) -> StageResult:
        """Every stage packs all its buckets now, concurrently; the next `send` only transfers them, in order. With
        a selector and a plan, each stage that can also predicts its engine digests now (`Sender.stage`)."""
        start = time.perf_counter()
        unable = [k for k, s in enumerate(self._stages) if not s.can_stage]
        if unable:
            raise RuntimeError(f"pipeline stages {unable} cannot pack ahead (their sources cannot stage)")
        results = await _all(
            enumerate(self._stages), "staging", lambda s: s.stage(selector=selector, engine_digests=engine_digests)
        )
        self._is_staged = True
        return StageResult(
            num_bytes=sum(r.num_bytes for r in results),
            num_buckets=sum(r.num_buckets for r in results),
            export_s=sum(r.export_s for r in results),
            pack_s=sum(r.pack_s for r in results),
            stage_s=time.perf_counter() - start,
            engine_layouts=min(r.engine_layouts for r in results),
            digest_s=sum(r.digest_s for r in results),
        )

    async def send(
        self,
        *,
        selector: Selector,
        on_bucket: Callable[[BucketProgress], None] | None = None,
        engine_digests: EngineDigestPlan | None = None,
    ) -> SendResult:
        """Every stage's buckets, stage 0's first; later stages pack ahead while earlier ones send (module
        docstring). The result sums the stages' and unites their checksums and engine digests."""
        start = time.perf_counter()
        is_staged, self._is_staged = self._is_staged, False
        packing: asyncio.Future | None = None
        if not is_staged and self.num_stages > 1:
            ahead = [(k, s) for k, s in enumerate(self._stages) if k > 0 and s.can_stage]
            if ahead:
                packing = asyncio.ensure_future(
                    _all(ahead, "packing ahead", lambda s: s.stage(selector=selector, engine_digests=engine_digests))
                )
        results: list[SendResult] = []
        try:
            for stage, source in enumerate(self._stages):
                if stage == 1 and packing is not None:
                    await packing  # a stage that failed to pack ahead fails the send before its turn
                relay = _Relay(on_bucket, results=results, start=start)
                try:
                    results.append(await source.send(selector=selector, on_bucket=relay, engine_digests=engine_digests))
                except Exception as exc:
                    if self.num_stages == 1:
                        raise
                    raise RuntimeError(f"pipeline stage {stage}: {exc or type(exc).__name__}") from exc
        finally:
            if packing is not None and not packing.done():
                packing.cancel()
                with contextlib.suppress(BaseException):
                    await packing
        return _combine(results, start=start)

    async def predict(self, *, selector: Selector, engine_digests: EngineDigestPlan | None = None) -> WeightDigests:
        """Every stage hashes its share at once (nothing is sent, so no order is needed); their checksums and
        engine digests united as a send's are."""
        start = time.perf_counter()
        results = await _all(
            enumerate(self._stages), "hashing", lambda s: s.predict(selector=selector, engine_digests=engine_digests)
        )
        checksums = {name: digest for r in results for name, digest in r.checksums.items()}
        return WeightDigests(
            checksums=checksums,
            engine_checksums=_unite_engine_checksums([r.engine_checksums for r in results]),
            predict_s=time.perf_counter() - start,
        )

    async def close(self) -> None:
        """Close every stage (concurrently); raises the first failure after all were asked."""
        await _all(enumerate(self._stages), "closing", lambda s: s.close())

    async def connect(self) -> tuple[Any, ...]:
        """Each stage's own `connect()` (e.g. trainer actors), concatenated in stage order."""
        answers = await asyncio.gather(*(s.connect() for s in self._stages))
        return tuple(item for answer in answers for item in answer)


class _Relay:
    """A stage's `on_bucket`: numbers its buckets after the earlier stages' and counts their bytes."""

    def __init__(
        self, on_bucket: Callable[[BucketProgress], None] | None, *, results: Sequence[SendResult], start: float
    ) -> None:
        self._on_bucket = on_bucket
        self._offset = sum(r.num_buckets for r in results)
        self._bytes = sum(r.num_bytes for r in results)
        self._start = start

    def __call__(self, event: BucketProgress) -> None:
        if self._on_bucket is not None:
            self._on_bucket(
                dataclasses.replace(
                    event,
                    index=self._offset + event.index,
                    total_bytes=self._bytes + event.total_bytes,
                    elapsed_s=time.perf_counter() - self._start,
                )
            )


def _combine(results: Sequence[SendResult], *, start: float) -> SendResult:
    if len(results) == 1:
        return results[0]
    checksums: dict[str, str] = {}
    for result in results:
        checksums.update(result.checksums)
    engine_checksums = _unite_engine_checksums([r.engine_checksums for r in results])
    return SendResult(
        num_bytes=sum(r.num_bytes for r in results),
        num_buckets=sum(r.num_buckets for r in results),
        num_tensors=sum(r.num_tensors for r in results),
        checksums=checksums,
        export_s=sum(r.export_s for r in results),
        pack_s=sum(r.pack_s for r in results),
        send_s=time.perf_counter() - start,
        engine_checksums=engine_checksums,
        quantize_s=sum(r.quantize_s for r in results),
        names=tuple(n for r in results for n in r.names),
    )


def _unite_engine_checksums(
    per_stage: Sequence[Mapping[EngineLayout, tuple[dict[str, str], ...]]],
) -> dict[EngineLayout, tuple[dict[str, str], ...]]:
    """A layout is predicted only when every stage predicted its share; each TP rank's digests are the union."""
    layouts = set.intersection(*(set(stage) for stage in per_stage))
    return {
        layout: tuple(
            {name: digest for stage in per_stage for name, digest in stage[layout][tp_rank].items()}
            for tp_rank in range(len(per_stage[0][layout]))
        )
        for layout in layouts
    }


async def _all(stages: Iterable[tuple[int, WeightSource]], what: str, call: Callable[[WeightSource], Any]) -> list[Any]:
    """`call` on every (stage number, source) concurrently; after all answered, raises RuntimeError naming each
    failed stage."""
    stages = list(stages)
    results = await asyncio.gather(*(call(s) for _, s in stages), return_exceptions=True)
    failures = [
        f"stage {k}: {r or type(r).__name__}" for (k, _), r in zip(stages, results) if isinstance(r, BaseException)
    ]
    if failures:
        raise RuntimeError(
            f"{what} failed on {len(failures)} of {len(results)} pipeline stage(s): " + "; ".join(failures)
        )
    return list(results)
