"""The controller's view of trainer actors: each call runs on the model a rank attached (`__ray_call__`).

Bucket progress flows one way: the source rank pushes each acknowledged bucket to the controller actor as it
happens (`_ProgressPush`, fire and forget), and the send's result carries the full list, so an event whose push
was lost or late still arrives once. Nothing polls a rank, so trainer actors need no second concurrency slot.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from miles_sync.sync.adapter import AdapterPayload
from miles_sync.sync.attach import DEFAULT_ATTACHMENT, attached_source
from miles_sync.sync.engine_digests import EngineDigestPlan
from miles_sync.sync.pipeline import PipelineSource
from miles_sync.sync.rank_plan import colocated_node_problems, stage_members
from miles_sync.sync.report import BucketProgress, InIndexOrder
from miles_sync.sync.sender import SenderSettings
from miles_sync.sync.source import ModelSource, RankInfo, RankSendResult
from miles_sync.sync.weight_source import SendResult, StageResult, WeightDigests, WeightSource
from miles_sync.transport.base import transport_spec
from miles_sync.transport.membership import EngineEndpoint, GroupMembership
from miles_sync.wire.protocol import Selector
from miles_sync.wire.text import raise_if

__all__ = ["RemoteTrainerSource", "StageSource", "plan_stages"]

# Extra seconds the controller waits for a rank beyond the rank's own deadline, so the rank's precise error (not a
# bare controller-side timeout) is what gets reported.
_RANK_DEADLINE_MARGIN_S = 10.0

# Sends in this (controller) process that take pushed progress, by token. Entries live for one send.
_RECEIVERS: dict[str, Callable[[BucketProgress], None]] = {}


def _deliver_progress(actor: object, token: str, event: BucketProgress) -> None:
    """Runs inside the controller actor (through `__ray_call__`): hands one pushed event to its send, if running."""
    del actor
    receive = _RECEIVERS.get(token)
    if receive is not None:
        receive(event)


@dataclass(frozen=True)
class _ProgressPush:
    """The source rank's `on_bucket`: pushes each acknowledged bucket to the controller actor. Picklable; never
    blocks (fire and forget). ModelSource.send already keeps a failing `on_bucket` from failing the send."""

    controller: Any
    token: str

    def __call__(self, event: BucketProgress) -> None:
        self.controller.__ray_call__.remote(_deliver_progress, self.token, event)


def _current_actor() -> Any | None:
    try:
        return ray.get_runtime_context().current_actor
    except Exception:  # not inside an actor (a driver using this class directly): progress arrives with the result
        return None


def _on_rank(actor: object, name: str, method: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """Runs inside a trainer actor (through `__ray_call__`): `method`, a ModelSource method (passed by reference,
    not by name), on the model attached there."""
    del actor  # the model is found by name, so any actor class works
    return method(attached_source(name), **kwargs)


class RemoteTrainerSource(PipelineSource):
    """The WeightSource (miles_sync.sync.weight_source) over trainer actors whose processes attached a model.

    Async, for the controller actor's event loop. `connect()` first: it reads every rank's RankInfo and groups the
    ranks by pipeline stage, each stage with exactly one export source rank; from then on it is the
    `PipelineSource` over one `StageSource` per stage (one update group per stage, opened and sent in stage order:
    miles_sync.sync.pipeline), whose calls go down to the ranks through Ray. With one stage that is exactly one
    source and one group. Every call has a deadline.
    """

    can_stage = True
    can_predict = True
    syncs_adapters = True

    def __init__(
        self,
        *,
        trainers: Sequence[Any],
        settings: SenderSettings,
        attachment: str = DEFAULT_ATTACHMENT,
        control_timeout_s: float,
    ) -> None:
        if not trainers:
            raise ValueError("RemoteTrainerSource needs at least one trainer actor")
        if not control_timeout_s > 0:
            raise ValueError(f"control_timeout_s={control_timeout_s} must be positive")
        self._trainers = tuple(trainers)
        self.flushes_cache = settings.flush_cache  # every rank builds its requests from these settings
        self._calls = _RankCalls(attachment=attachment, settings=settings, control_timeout_s=control_timeout_s)
        self._ranks: tuple[RankInfo, ...] = ()
        # Until connect() plans the stages: one stage that refuses use (num_stages is 1, as a group name needs).
        self.use_stages([_Unconnected()])

    @property
    def ranks(self) -> tuple[RankInfo, ...]:
        return self._ranks

    async def connect(self) -> tuple[RankInfo, ...]:
        infos = await self._calls.on_all(self._trainers, ModelSource.describe, timeout_s=self._calls.control_timeout_s)
        self.use_stages(plan_stages(self._trainers, infos, calls=self._calls))
        self._ranks = tuple(infos)
        return self._ranks

    async def adapter_payload(self, *, tp_sizes: Sequence[int]) -> AdapterPayload:
        """The LoRA adapter for engines of `tp_sizes` (miles_sync.sync.lora): every rank gathers, the export source
        answers the payload."""
        results = await self._calls.on_all(
            self._trainers, ModelSource.adapter_payload, timeout_s=self._calls.rank_timeout_s, tp_sizes=list(tp_sizes)
        )
        payloads = [r for r in results if r is not None]
        if len(payloads) != 1:
            raise RuntimeError(f"expected the adapter from exactly one trainer rank, got {len(payloads)}")
        return payloads[0]

    async def release_adapter(self) -> None:
        await self._calls.on_all(self._trainers, ModelSource.release_adapter, timeout_s=self._calls.control_timeout_s)

    def check_engines(self, engines: Sequence[EngineEndpoint]) -> None:
        """Raise ValueError, naming each engine and node, when the colocated transport would feed an engine from a
        trainer rank on another node (`transport.feeds.feed_node_problems`); a no-op for other transports. The
        controller calls it once it knows the engines (at connect), and every `open` does."""
        if not transport_spec(self._calls.settings.transport).places_colocated():
            return
        raise_if(
            colocated_node_problems(self._ranks, engines),
            what="the colocated transport cannot feed every engine on its own node",
        )

    async def open(
        self, *, engines: Sequence[EngineEndpoint], membership: GroupMembership | None
    ) -> GroupMembership | None:
        self.check_engines(engines)
        return await super().open(engines=engines, membership=membership)

    async def close(self) -> None:
        if not self._ranks:  # never connected: every rank may still hold a transport of an earlier owner
            await self._calls.on_all(self._trainers, ModelSource.close, timeout_s=self._calls.rank_timeout_s)
            return
        await super().close()


class _Unconnected(WeightSource):
    """RemoteTrainerSource's stage before connect(): every call is refused, naming the step that is missing."""

    async def exported_names(self) -> tuple[str, ...]:
        raise RuntimeError("RemoteTrainerSource used before connect()")

    async def open(
        self, *, engines: Sequence[EngineEndpoint], membership: GroupMembership | None
    ) -> GroupMembership | None:
        raise RuntimeError("RemoteTrainerSource used before connect()")

    async def send(
        self,
        *,
        selector: Selector,
        on_bucket: Callable[[BucketProgress], None] | None = None,
        engine_digests: EngineDigestPlan | None = None,
    ) -> SendResult:
        raise RuntimeError("RemoteTrainerSource used before connect()")

    async def close(self) -> None:
        return None


def plan_stages(trainers: Sequence[Any], infos: Sequence[RankInfo], *, calls: _RankCalls) -> list[StageSource]:
    """One StageSource per pipeline stage, in stage order (`rank_plan.stage_members`: raises ValueError when the
    ranks do not form a pipeline)."""
    return [
        StageSource(
            stage=planned.stage,
            trainers=[trainers[i] for i in planned.members],
            source_index=planned.source_index,
            calls=calls,
        )
        for planned in stage_members(infos)
    ]


class _RankCalls:
    """How the controller calls a method of the ModelSource attached on a trainer actor, with deadlines."""

    def __init__(self, *, attachment: str, settings: SenderSettings, control_timeout_s: float) -> None:
        self.attachment = attachment
        self.settings = settings
        self.control_timeout_s = control_timeout_s

    @property
    def rank_timeout_s(self) -> float:
        """A whole open, stage, send or close on a rank, plus the margin for the rank's own error to arrive."""
        return self.settings.call_timeout_s + _RANK_DEADLINE_MARGIN_S

    async def on_all(
        self, trainers: Sequence[Any], method: Callable[..., Any], *, timeout_s: float, **kwargs: Any
    ) -> list[Any]:
        """`method` on every rank concurrently; raises RuntimeError naming each failed rank after all answered."""
        results = await asyncio.gather(
            *(self.call(t, method, timeout_s=timeout_s, **kwargs) for t in trainers), return_exceptions=True
        )
        failures = [f"trainer {i}: {r}" for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failures:
            shown = "; ".join(failures)
            raise RuntimeError(
                f"{method.__name__} failed on {len(failures)} of {len(results)} trainer rank(s): {shown}"
            )
        return list(results)

    async def call(self, trainer: Any, method: Callable[..., Any], *, timeout_s: float, **kwargs: Any) -> Any:
        ref = trainer.__ray_call__.remote(_on_rank, self.attachment, method, kwargs)
        try:
            return await asyncio.wait_for(ref, timeout=timeout_s)
        except asyncio.TimeoutError:
            ray.cancel(ref)
            raise TimeoutError(f"{method.__name__} got no answer within {timeout_s} s") from None
        except ray.exceptions.RayTaskError as exc:
            # The rank's own exception, without Ray's remote traceback around it.
            raise _cause(exc) from None


class StageSource(WeightSource):
    """The WeightSource over the trainer ranks of one pipeline stage: every call goes to all of them (the
    export's collectives pair up within the stage), and the stage's source rank's answer is the result."""

    can_predict = True

    def __init__(self, *, stage: int, trainers: Sequence[Any], source_index: int, calls: _RankCalls) -> None:
        self.index = stage  # its pipeline stage
        # A transport with only a routed form (p2p) sends every rank's own shards at send time and packs nothing
        # ahead, so a later stage waits for its turn instead (miles_sync.sync.pipeline).
        self.can_stage = transport_spec(calls.settings.transport).can_pack_ahead()
        self.flushes_cache = calls.settings.flush_cache
        self._trainers = tuple(trainers)
        self._source_index = source_index
        self._calls = calls

    async def exported_names(self) -> tuple[str, ...]:
        source = self._trainers[self._source_index]
        return await self._calls.call(source, ModelSource.exported_names, timeout_s=self._calls.control_timeout_s)

    async def open(
        self, *, engines: Sequence[EngineEndpoint], membership: GroupMembership | None
    ) -> GroupMembership | None:
        results = await self._calls.on_all(
            self._trainers,
            ModelSource.open,
            timeout_s=self._calls.rank_timeout_s,
            engines=tuple(engines),
            membership=membership,
            settings=self._calls.settings,
        )
        return results[self._source_index]

    async def send(
        self,
        *,
        selector: Selector,
        on_bucket: Callable[[BucketProgress], None] | None = None,
        engine_digests: EngineDigestPlan | None = None,
    ) -> SendResult:
        # Every rank of the stage exports at once (the gather's collectives pair up); only the source's result
        # carries bytes (and the engine digests, which only the source rank computes). Pushed events can reach
        # this (async) actor out of order and come again in the result: InIndexOrder passes each on once, in order.
        receive = InIndexOrder(on_bucket if on_bucket is not None else lambda event: None)
        token = uuid.uuid4().hex
        controller = None if on_bucket is None else _current_actor()
        push = None if controller is None else _ProgressPush(controller=controller, token=token)
        _RECEIVERS[token] = receive
        try:
            results: list[RankSendResult] = await self._calls.on_all(
                self._trainers,
                ModelSource.send,
                timeout_s=self._calls.rank_timeout_s,
                selector=selector,
                on_bucket=push,
                engine_digests=engine_digests,
            )
            sent = results[self._source_index]
            for event in sent.progress:  # whatever no push delivered (yet)
                receive(event)
        finally:
            _RECEIVERS.pop(token, None)
        return sent.result

    async def stage(
        self, *, selector: Selector | None = None, engine_digests: EngineDigestPlan | None = None
    ) -> StageResult:
        # Every rank packs (the export's collectives pair up); only the source rank predicts engine digests.
        results = await self._calls.on_all(
            self._trainers,
            ModelSource.stage,
            timeout_s=self._calls.rank_timeout_s,
            selector=selector,
            engine_digests=engine_digests,
        )
        return results[self._source_index]

    async def predict(self, *, selector: Selector, engine_digests: EngineDigestPlan | None = None) -> WeightDigests:
        # Every rank exports (the gather's collectives pair up); only the source rank hashes.
        results = await self._calls.on_all(
            self._trainers,
            ModelSource.predict,
            timeout_s=self._calls.rank_timeout_s,
            selector=selector,
            engine_digests=engine_digests,
            settings=self._calls.settings,
        )
        return results[self._source_index]

    async def close(self) -> None:
        await self._calls.on_all(self._trainers, ModelSource.close, timeout_s=self._calls.rank_timeout_s)


def _cause(exc: Exception) -> Exception:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc
