"""The trainer side of a sync as the session and controller see it: the `WeightSource` protocol and its results.

Implemented by `miles_sync.sync.sender.Sender` in the trainer's process, by `actors.remote_source` over trainer
actors, and by test doubles over a pipe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from miles_sync.sync.adapter import AdapterPayload
from miles_sync.sync.engine_digests import EngineDigestPlan, EngineLayout
from miles_sync.sync.report import BucketProgress
from miles_sync.transport.membership import EngineEndpoint, GroupMembership
from miles_sync.wire.protocol import PauseMode, Selector

__all__ = ["SendResult", "StageResult", "WeightSource"]


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
    # The HF tensors sent where `checksums` does not name them all: a routed send (miles_sync.sync.routed) hashes
    # HF tensors only where a TP=1 engine's parameters are built whole.
    names: tuple[str, ...] = ()

    def sent_names(self) -> tuple[str, ...]:
        """Every HF tensor this send delivered (the engine-exact check maps engine parameters back to them)."""
        return tuple(dict.fromkeys((*self.checksums, *self.names)))


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


@dataclass(frozen=True, kw_only=True)
class WeightDigests:
    """What the current weights hash to, computed without sending them (`WeightSource.predict`): `checksums` the
    HF checksums a send would report, `engine_checksums` per layout of the plan the per-rank engine digests (as
    `SendResult`'s), `predict_s` the export, pack and hash time."""

    checksums: dict[str, str]
    engine_checksums: dict[EngineLayout, tuple[dict[str, str], ...]] = field(default_factory=dict)
    predict_s: float = 0.0


class WeightSource(Protocol):
    """The trainer side as the session and controller see it: a local Sender, a pipeline of stage sources, or a proxy
    for trainer actors in other processes. Every member the controller, session and pipeline call is declared here;
    a source subclasses this Protocol and inherits the defaults of the members it does not need, so nothing probes
    a source for a method.

    Required: `exported_names`; `open` (re)builds the transport to `engines` (in membership order) and, for
    transports with an update group, joins `membership` while the engines do, returning the membership bound to
    its port (None without a group); `send` exports and sends the current weights once, calling `on_bucket` after
    each acknowledged bucket, and given an `engine_digests` plan also predicts the engine-parameter digests of
    every layout it can (`SendResult.engine_checksums`; a layout it leaves out is verified by replica agreement);
    `close` tears the transport down (idempotent). Any failure raises.

    Optional, with defaults: `can_stage` / `stage` (staged export: pack every bucket ahead of the session while the
    engines still generate; the next `send` only transfers them; with a selector and a plan it also predicts the
    engine digests then); `connect` (reach the trainer ranks once, before the first sync; returns what the caller
    reports as its trainer ranks); `check_engines` (refuse engines the transport cannot reach, at connect);
    `num_stages` / `memberships` (pipeline stages: one update group each); `syncs_adapters` / `adapter_payload` /
    `release_adapter` (LoRA syncs, miles_sync.sync.lora); `can_predict` / `predict` (export and hash the current
    weights without sending: what the engines should already hold, for the controller's `check_engines`).
    """

    # Whether `stage` packs ahead; the default `stage` refuses.
    can_stage: bool = False
    # Whether `adapter_payload` answers a LoRA adapter; the default refuses.
    syncs_adapters: bool = False
    # Whether `predict` hashes the current weights without sending them; the default refuses.
    can_predict: bool = False
    # Whether every update request of a send asks the engine to flush its prefix cache as it loads
    # (SenderSettings.flush_cache): the session then sends no /flush_cache of its own (miles_sync.sync.session).
    flushes_cache: bool = False

    @property
    def num_stages(self) -> int:
        """Export sources, one per pipeline stage, each with an update group of its own."""
        return 1

    @property
    def memberships(self) -> tuple[GroupMembership | None, ...]:
        """Each stage's bound update group after `open`; empty for a source of one stage."""
        return ()

    async def connect(self) -> tuple[Any, ...]:
        return ()

    def check_engines(self, engines: Sequence[EngineEndpoint]) -> None:
        return None

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

    async def stage(
        self, *, selector: Selector | None = None, engine_digests: EngineDigestPlan | None = None
    ) -> StageResult:
        raise NotImplementedError(f"{type(self).__name__} cannot pack ahead (can_stage is False)")

    async def close(self) -> None: ...

    async def predict(self, *, selector: Selector, engine_digests: EngineDigestPlan | None = None) -> WeightDigests:
        """Export, pack and hash the current weights with `selector` as a send would (every rank takes part), and
        send nothing; with a plan, also the plan's engine digests. Drops anything staged."""
        raise NotImplementedError(f"{type(self).__name__} cannot hash its weights without sending (can_predict)")

    async def adapter_payload(self, *, tp_sizes: Sequence[int]) -> AdapterPayload:
        raise NotImplementedError(f"{type(self).__name__} syncs no LoRA adapters (syncs_adapters is False)")

    async def release_adapter(self) -> None:
        return None


def source_problems(source: WeightSource, *, staged: bool, lora_name: str | None, pause_mode: PauseMode) -> list[str]:
    """What `source` cannot serve of a controller's configuration (empty: nothing). Raises TypeError for a source that
    does not subclass WeightSource: the controller calls members a duck-typed source may lack, and it would fail
    later, inside a sync, with an AttributeError. Pure."""
    name = type(source).__name__
    if WeightSource not in type(source).__mro__:
        raise TypeError(
            f"invalid SyncController: the source {name} does not subclass miles_sync.api.WeightSource (subclass it: "
            "it declares every member the controller calls, with defaults for the optional ones)"
        )
    problems = []
    if staged and not source.can_stage:
        problems.append(f"staged export needs a source that can stage; {name} cannot")
    if lora_name is not None and not source.syncs_adapters:
        problems.append(f"LoRA syncs need a source that answers adapters; {name} does not")
    flush_problem = flush_mode_problem(source, pause_mode=pause_mode)
    return problems if flush_problem is None else [*problems, flush_problem]


def flush_mode_problem(source: WeightSource, *, pause_mode: PauseMode) -> str | None:
    """Why `source` cannot serve `pause_mode`, or None: a source that flushes the prefix cache with every update
    cannot serve in_place, whose running requests make SGLang refuse that flush (and fail the update). Pure."""
    if source.flushes_cache and pause_mode is PauseMode.IN_PLACE:
        return (
            "pause_mode=in_place keeps requests running, and SGLang refuses the prefix-cache flush the source "
            "sends with every update then (SenderSettings.flush_cache must be false for in_place)"
        )
    return None
