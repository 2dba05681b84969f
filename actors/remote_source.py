"""The controller's view of trainer actors: each call runs on the model a rank attached (`__ray_call__`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import ray

from miles_sync.sync.attach import DEFAULT_ATTACHMENT, attached_source
from miles_sync.sync.report import BucketProgress
from miles_sync.sync.sender import SenderSettings
from miles_sync.sync.source import RankInfo, RankSendResult
from miles_sync.sync.weight_source import SendResult, StageResult
from miles_sync.transport.base import EngineEndpoint, GroupMembership
from miles_sync.wire.protocol import Selector

__all__ = ["RemoteTrainerSource"]

# Extra seconds the controller waits for a rank beyond the rank's own deadline, so the rank's precise error (not a
# bare controller-side timeout) is what gets reported.
_RANK_DEADLINE_MARGIN_S = 10.0
_PROGRESS_POLL_S = 0.2


def _on_rank(actor: object, name: str, method: str, kwargs: dict[str, Any]) -> Any:
    """Runs inside a trainer actor (through `__ray_call__`): one ModelSource call on the model attached there."""
    del actor  # the model is found by name, so any actor class works
    return getattr(attached_source(name), method)(**kwargs)


class RemoteTrainerSource:
    """The WeightSource (miles_sync.sync.weight_source) over trainer actors whose processes attached a model.

    Async, for the controller actor's event loop. `connect()` first: it reads every rank's RankInfo and finds
    the export source (one pipeline stage: exactly one source rank). Every call has a deadline.
    """

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
        self._settings = settings
        self._attachment = attachment
        self._control_timeout_s = control_timeout_s
        self._ranks: tuple[RankInfo, ...] = ()
        self._source_index: int | None = None

    @property
    def ranks(self) -> tuple[RankInfo, ...]:
        return self._ranks

    async def connect(self) -> tuple[RankInfo, ...]:
        infos = await self._on_all("describe", timeout_s=self._control_timeout_s)
        sources = [i for i, info in enumerate(infos) if info.is_source]
        if len(sources) != 1:
            raise ValueError(
                f"trainer ranks {[infos[i].rank for i in sources]} are export sources; the update group has one "
                f"source rank, so the model must have exactly one pipeline stage (pp=1)"
            )
        self._ranks, self._source_index = tuple(infos), sources[0]
        return self._ranks

    async def exported_names(self) -> tuple[str, ...]:
        return await self._call(self._source(), "exported_names", timeout_s=self._control_timeout_s)

    async def open(
        self, *, engines: Sequence[EngineEndpoint], membership: GroupMembership | None
    ) -> GroupMembership | None:
        results = await self._on_all(
            "open",
            timeout_s=self._settings.call_timeout_s + _RANK_DEADLINE_MARGIN_S,
            engines=tuple(engines),
            membership=membership,
            settings=self._settings,
        )
        return results[self._source_index]

    async def send(
        self, *, selector: Selector, on_bucket: Callable[[BucketProgress], None] | None = None
    ) -> SendResult:
        # Every rank exports at once (the gather's collectives pair up); only the source's result carries bytes.
        sending = asyncio.ensure_future(
            self._on_all("send", timeout_s=self._settings.call_timeout_s + _RANK_DEADLINE_MARGIN_S, selector=selector)
        )
        num_seen = 0
        if on_bucket is not None:
            num_seen = await self._forward_progress(sending, on_bucket)
        results: list[RankSendResult] = await sending
        sent = results[self._source_index]
        if on_bucket is not None:
            for event in sent.progress[num_seen:]:  # acknowledged after the last poll
                on_bucket(event)
        return sent.result

    async def stage(self) -> StageResult:
        results = await self._on_all("stage", timeout_s=self._settings.call_timeout_s + _RANK_DEADLINE_MARGIN_S)
        return results[self._source_index]

    async def _forward_progress(self, sending: asyncio.Future, on_bucket: Callable[[BucketProgress], None]) -> int:
        """Poll the source rank for acknowledged buckets while `sending` runs and pass them on; returns how many.

        Best effort: buckets are acknowledged in the source's process, and an actor that runs one call at a time
        answers the poll only after the send (the rest then arrive with the send's result)."""
        num_seen = 0
        while not sending.done():
            await asyncio.wait({sending}, timeout=_PROGRESS_POLL_S)
            if sending.done():
                break
            try:
                events = await self._call(self._source(), "progress", timeout_s=self._control_timeout_s, start=num_seen)
            except Exception:  # progress must never fail a sync; the send's own outcome decides
                continue
            for event in events:
                on_bucket(event)
            num_seen += len(events)
        return num_seen

    async def close(self) -> None:
        await self._on_all("close", timeout_s=self._settings.call_timeout_s + _RANK_DEADLINE_MARGIN_S)

    def _source(self) -> Any:
        if self._source_index is None:
            raise RuntimeError("RemoteTrainerSource used before connect()")
        return self._trainers[self._source_index]

    async def _on_all(self, method: str, *, timeout_s: float, **kwargs: Any) -> list[Any]:
        """`method` on every rank concurrently; raises RuntimeError naming each failed rank after all answered."""
        results = await asyncio.gather(
            *(self._call(t, method, timeout_s=timeout_s, **kwargs) for t in self._trainers), return_exceptions=True
        )
        failures = [f"trainer {i}: {r}" for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failures:
            shown = "; ".join(failures)
            raise RuntimeError(f"{method} failed on {len(failures)} of {len(results)} trainer rank(s): {shown}")
        return list(results)

    async def _call(self, trainer: Any, method: str, *, timeout_s: float, **kwargs: Any) -> Any:
        ref = trainer.__ray_call__.remote(_on_rank, self._attachment, method, kwargs)
        try:
            return await asyncio.wait_for(ref, timeout=timeout_s)
        except asyncio.TimeoutError:
            ray.cancel(ref)
            raise TimeoutError(f"{method} got no answer within {timeout_s} s") from None
        except ray.exceptions.RayTaskError as exc:
            # The rank's own exception, without Ray's remote traceback around it.
            raise _cause(exc) from None


def _cause(exc: Exception) -> Exception:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc
