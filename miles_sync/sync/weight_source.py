"""The trainer side of a sync as the session and controller see it: the `WeightSource` protocol and its results.

Implemented by `miles_sync.sync.sender.Sender` in the trainer's process, by `actors.remote_source` over trainer
actors, and by test doubles over a pipe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from miles_sync.sync.report import BucketProgress
from miles_sync.transport.base import EngineEndpoint, GroupMembership
from miles_sync.wire.protocol import Selector

__all__ = ["SendResult", "StageResult", "WeightSource"]


@dataclass(frozen=True, kw_only=True)
class SendResult:
    """What one `send` delivered. `checksums`: tensor name -> checksum of the bytes sent (empty on non-source
    ranks). Times: `export_s` pulling units from the export stream, `pack_s` packing and hashing, both overlapped
    with sending; `send_s` wall time of the whole send."""

    num_bytes: int
    num_buckets: int
    num_tensors: int
    checksums: dict[str, str]
    export_s: float
    pack_s: float
    send_s: float


@dataclass(frozen=True, kw_only=True)
class StageResult:
    """What one `stage` packed ahead of the pause: `num_bytes` is also the extra memory held until the send."""

    num_bytes: int
    num_buckets: int
    export_s: float
    pack_s: float
    stage_s: float


@runtime_checkable
class WeightSource(Protocol):
    """The trainer side as the session and controller see it: a local Sender, or a proxy for trainer actors in
    other processes.

    `open` (re)builds the transport to `engines` (in membership order) and, for transports with an update group,
    joins `membership` while the engines do; it returns the membership bound to its port (None without a group).
    `send` exports and sends the current weights once, calling `on_bucket` after each acknowledged bucket.
    `close` tears the transport down (idempotent). Any failure raises.

    Staged export (optional: `Sender` and the Ray proxy have it): `stage()` exports and packs every bucket of the
    current weights ahead of the session, while the engines still generate; the next `send` then only transfers
    them. It holds the whole packed model in memory until that send.
    """

    async def exported_names(self) -> tuple[str, ...]: ...

    async def open(
        self, *, engines: Sequence[EngineEndpoint], membership: GroupMembership | None
    ) -> GroupMembership | None: ...

    async def send(
        self, *, selector: Selector, on_bucket: Callable[[BucketProgress], None] | None = None
    ) -> SendResult: ...

    async def close(self) -> None: ...
