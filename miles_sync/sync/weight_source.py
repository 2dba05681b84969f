"""The trainer side of a sync as the session and controller see it: the `WeightSource` protocol and its results.

Implemented by `miles_sync.sync.sender.Sender` in the trainer's process, by `actors.remote_source` over trainer
actors, and by test doubles over a pipe.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from miles_sync.sync.engine_digests import EngineDigestPlan, EngineLayout
from miles_sync.sync.report import BucketProgress
from miles_sync.transport.base import EngineEndpoint, GroupMembership
from miles_sync.wire.protocol import Selector

__all__ = [
    "SendResult",
    "StageResult",
    "WeightSource",
    "accepts_engine_digests",
    "send_with_digests",
    "stage_with_digests",
    "stages_engine_digests",
]


@dataclass(frozen=True, kw_only=True)
class SendResult:
    """What one `send` delivered. `checksums`: tensor name -> checksum of the bytes sent (empty on non-source
    ranks). Times: `export_s` pulling units from the export stream, `pack_s` packing and hashing, both overlapped
    with sending; `send_s` wall time of the whole send. `engine_checksums`: per layout of the send's
    `EngineDigestPlan`, the digests each TP rank of an engine with that layout should answer
    (miles_sync.sync.engine_digests); a layout the source could not predict is absent."""

    num_bytes: int
    num_buckets: int
    num_tensors: int
    checksums: dict[str, str]
    export_s: float
    pack_s: float
    send_s: float
    engine_checksums: dict[EngineLayout, tuple[dict[str, str], ...]] = field(default_factory=dict)
    quantize_s: float = 0.0  # block-FP8 quantization on the source, overlapped with sending (0 without it)


@dataclass(frozen=True, kw_only=True)
class StageResult:
    """What one `stage` packed ahead of the pause: `num_bytes` is also the extra memory held until the send.
    `engine_layouts`: how many layouts' engine digests it also predicted (`digest_s` seconds), so the next send
    with the same selector and plan returns them without hashing inside the pause."""

    num_bytes: int
    num_buckets: int
    export_s: float
    pack_s: float
    stage_s: float
    engine_layouts: int = 0
    digest_s: float = 0.0


@runtime_checkable
class WeightSource(Protocol):
    """The trainer side as the session and controller see it: a local Sender, or a proxy for trainer actors in
    other processes.

    `open` (re)builds the transport to `engines` (in membership order) and, for transports with an update group,
    joins `membership` while the engines do; it returns the membership bound to its port (None without a group).
    `send` exports and sends the current weights once, calling `on_bucket` after each acknowledged bucket; given an
    `engine_digests` plan, it also predicts the engine-parameter digests of every layout in it
    (`SendResult.engine_checksums`). A source without that parameter is still a WeightSource: its engines are
    verified by replica agreement instead (`accepts_engine_digests`).
    `close` tears the transport down (idempotent). Any failure raises.

    Staged export (optional: `Sender` and the Ray proxy have it): `stage()` exports and packs every bucket of the
    current weights ahead of the session, while the engines still generate; the next `send` then only transfers
    them. It holds the whole packed model in memory until that send. A `stage(selector=..., engine_digests=...)`
    (`stages_engine_digests`) also predicts the plan's engine digests then, and the next send with the same
    selector and plan returns those instead of hashing again.
    """

    async def exported_names(self) -> tuple[str, ...]: ...

    async def open(
        self, *, engines: Sequence[EngineEndpoint], membership: GroupMembership | None
    ) -> GroupMembership | None: ...

    async def send(
        self,
        *,
        selector: Selector,
        on_bucket: Callable[[BucketProgress], None] | None = None,
        engine_digests: EngineDigestPlan | None = None,
    ) -> SendResult: ...

    async def close(self) -> None: ...


def accepts_engine_digests(source: WeightSource) -> bool:
    """Whether `source.send` takes an `engine_digests` plan (sources written before it do not)."""
    return _takes_engine_digests(getattr(source, "send", None))


def stages_engine_digests(source: WeightSource) -> bool:
    """Whether `source.stage` takes a selector and an `engine_digests` plan (predicts the digests ahead)."""
    return _takes_engine_digests(getattr(source, "stage", None))


async def send_with_digests(
    source: WeightSource,
    *,
    selector: Selector,
    on_bucket: Callable[[BucketProgress], None] | None,
    plan: EngineDigestPlan | None,
) -> SendResult:
    """`source.send`, with the engine-digest plan where it takes one. A source written before engine digests (a
    pipeline's own WeightSource) takes none: the engines it would have predicted fall back to the replica check."""
    if plan and accepts_engine_digests(source):
        return await source.send(selector=selector, on_bucket=on_bucket, engine_digests=plan)
    return await source.send(selector=selector, on_bucket=on_bucket)


async def stage_with_digests(
    source: WeightSource, *, selector: Selector | None, plan: EngineDigestPlan | None
) -> StageResult:
    """`source.stage()` (the source must have one), with the selector and engine-digest plan where it takes them:
    it then predicts the engine digests at stage time, out of the pause."""
    if plan and stages_engine_digests(source):
        return await source.stage(selector=selector, engine_digests=plan)
    return await source.stage()


def _takes_engine_digests(method: Callable[..., object] | None) -> bool:
    if method is None:
        return False
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):  # no signature to read: do not pass what it may not take
        return False
    return "engine_digests" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
