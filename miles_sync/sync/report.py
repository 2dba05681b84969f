"""What one sync did: typed per-sync report, per-engine results, per-bucket progress events and a progress bar.

Reports cross Ray and process boundaries and end up in logs and benchmark JSON, so they are plain frozen records
encoded with miles_sync.wire.codec (`encode_report` / `decode_report` round-trip exactly).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from miles_sync.sync.draft_canary import CanaryReading
from miles_sync.wire.codec import decode, encode
from miles_sync.wire.protocol import Selector

__all__ = ["BucketProgress", "EngineResult", "InIndexOrder", "ProgressBar", "SyncError", "SyncReport"]


@dataclass(frozen=True, kw_only=True)
class PhaseTimes:
    """Wall seconds per phase of one sync, in the order they run.

    `export_s` is the time the sender spent pulling units from the export stream (gather + convert). It overlaps
    `send_s`, the wall time from the first bucket packed to the last bucket acknowledged by every engine, because
    the next bucket is exported and packed while the previous one is in flight. `finalize_s` covers
    end_weight_update and update_weight_version on every engine.
    """

    stage_s: float = 0.0  # staged export only: export + pack before the pause, while engines still generate
    pause_s: float = 0.0
    export_s: float = 0.0
    send_s: float = 0.0
    finalize_s: float = 0.0
    verify_s: float = 0.0
    resume_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class EngineResult:
    """One engine's outcome of one sync.

    `is_stale`: the engine may hold partial weights (bytes may have reached it and the sync did not verify on it),
    so it is left paused and must not serve until a later full sync verifies on it; its weights are never touched
    to quarantine it. `weight_version` is the version it was tagged with, when known. `verification`: the check
    that passed on it (miles_sync.sync.verify: "exact": HF-named digests, tensor by tensor against the trainer;
    "engine-exact": engine-parameter digests, per TP rank, role and parameter against the trainer's prediction for
    the engine's layout; "replica": identical to the majority of the engines with its layout, where no layout
    model exists; "unverified": no check could run, e.g. a single engine without a layout model; "" when
    verification is off or did not pass). `num_verified_tensors`: the sent tensors that matched (exact,
    engine-exact) or the engine parameters compared (replica). `weights_digest`: one digest of its checksum answer
    for the session's roles once verified, the baseline that a later failed sync compares the engine against.
    """

    url: str
    success: bool
    is_stale: bool
    num_verified_tensors: int = 0
    weight_version: str | None = None
    message: str = ""
    verification: str = ""
    weights_digest: str | None = None
    # Its draft's digests per TP rank ({reported name: digest}) as the verification read them, None without a draft
    # answer or a verified session: the controller's draft-guard baseline (miles_sync.sync.draft_guard).
    draft_digests: tuple[dict[str, str], ...] | None = None
    # "draft unchanged" when the session left the draft out and its digests all stayed as they were (draft guard).
    draft_guard: str = ""
    # Wall seconds of the session's calls to this engine, by step ("pause", "flush", "begin", "end", "version",
    # "verify-checksum", "resume", ...; a step run twice adds up), so a slow phase names its call and engine. The
    # send's per-bucket posts are the transport's and count in `PhaseTimes.send_s`.
    call_s: dict[str, float] = field(default_factory=dict)
    # What the session did to its prefix (radix) cache: "flushed" (the session's /flush_cache while paused),
    # "flushed with the updates" (every update request flushed it while paused), "flushed after the resume" (an
    # in_place pause: a request-free moment came within the window), "not flushed: <why>" (in_place under load:
    # prefixes cached with the old weights may be reused), or "" (the session sent no weights to it).
    prefix_cache: str = ""


@dataclass(frozen=True, kw_only=True)
class SyncReport:
    """One sync session. `version` is the version attempted; it is the engines' new version iff `committed`."""

    version: str
    previous_version: str
    committed: bool
    selector: Selector | None  # None when the sync failed before the selector was decided
    transport: str
    num_bytes: int
    num_buckets: int
    num_tensors: int
    phases: PhaseTimes
    total_s: float
    engines: tuple[EngineResult, ...]
    error: str | None = None
    # The trainer's checksum of every tensor it sent (HF name -> hex digest), empty when nothing was sent.
    checksums: dict[str, str] = field(default_factory=dict)
    # The checks that passed, fleet-wide: "off", or the distinct per-engine `verification` values joined by "+"
    # (e.g. "engine-exact+exact"); `summary()` prints it.
    verification: str = "off"
    # Problems that did not fail the sync (e.g. an in_place pause whose cache flush after resume never succeeded,
    # a draft canary below its baseline).
    warnings: tuple[str, ...] = ()
    # The acceptance canary's reading per engine the sync verified (miles_sync.sync.draft_canary); empty when off.
    canary: tuple[CanaryReading, ...] = ()

    @property
    def canary_flagged(self) -> tuple[str, ...]:
        """The engines whose draft canary fell below its baseline's fraction at this sync."""
        return tuple(r.url for r in self.canary if r.flagged)

    @property
    def gb_per_s(self) -> float:
        """Payload bytes over send wall time (10^9 bytes per second); 0 when nothing was sent."""
        return self.num_bytes / self.phases.send_s / 1e9 if self.phases.send_s > 0 else 0.0

    @property
    def draft_guard(self) -> str:
        """ "draft unchanged" when the draft guard ran on every engine and passed (miles_sync.sync.draft_guard), else
        "" (no engine has a draft, the session selected the draft, or verification was off or failed)."""
        values = {e.draft_guard for e in self.engines}
        return values.pop() if len(values) == 1 else ""

    @property
    def stale_engines(self) -> tuple[str, ...]:
        return tuple(e.url for e in self.engines if e.is_stale)

    def summary(self) -> str:
        """One log line: outcome, version, volume, rate and the phase times."""
        p = self.phases
        outcome = f"committed (verification: {self.verification})" if self.committed else f"FAILED ({self.error})"
        selector = "-" if self.selector is None else self.selector.value
        return (
            f"sync v{self.version} {outcome}: {self.num_bytes / 2**20:.1f} MiB in {self.num_buckets} buckets "
            f"({self.num_tensors} tensors, selector {selector}, {self.transport}) {self.gb_per_s:.2f} GB/s; "
            f"pause {p.pause_s:.3f}s export {p.export_s:.3f}s send {p.send_s:.3f}s finalize {p.finalize_s:.3f}s "
            f"verify {p.verify_s:.3f}s resume {p.resume_s:.3f}s total {self.total_s:.3f}s"
        )


def encode_report(report: SyncReport) -> dict[str, Any]:
    """JSON-safe dict (the derived `gb_per_s` is included for readers of the JSON and ignored on decode)."""
    return {**encode(report), "gb_per_s": report.gb_per_s}


def decode_report(data: dict[str, Any] | str) -> SyncReport:
    """Inverse of `encode_report`; accepts the dict or its JSON text. Raises ValueError naming bad fields."""
    obj = json.loads(data) if isinstance(data, str) else dict(data)
    obj.pop("gb_per_s", None)
    return decode(SyncReport, obj)


@dataclass(frozen=True, kw_only=True)
class BucketProgress:
    """Sent by the sender after each bucket is acknowledged by every engine."""

    index: int  # 0-based, in send order
    num_bytes: int
    num_tensors: int
    total_bytes: int  # cumulative, including this bucket
    elapsed_s: float  # since the first bucket started


@dataclass(frozen=True, kw_only=True)
class SyncProgress:
    """A sync's buckets acknowledged so far, for a driver that shows progress while the sync runs elsewhere."""

    version: str
    buckets: tuple[BucketProgress, ...]


class InIndexOrder:
    """Passes bucket events on once each, in index order, whatever order they arrive in.

    A rank numbers its buckets 0, 1, 2, ... and reports each as it is acknowledged, but a report that crosses a
    process boundary (a fire-and-forget push into an async actor) can overtake an earlier one, and the rank's
    result repeats every event at the end. An event ahead of its predecessors waits here until they came; a
    repeat is dropped."""

    def __init__(self, on_bucket: Callable[[BucketProgress], None]) -> None:
        self._on_bucket = on_bucket
        self._waiting: dict[int, BucketProgress] = {}
        self.next_index = 0

    def __call__(self, event: BucketProgress) -> None:
        if event.index < self.next_index:
            return
        self._waiting[event.index] = event
        while self.next_index in self._waiting:
            self._on_bucket(self._waiting.pop(self.next_index))
            self.next_index += 1


class ProgressBar:
    """A per-bucket tqdm bar on the driver. The bucket count is not known in advance (the plan is streamed)."""

    def __init__(self, *, description: str, is_enabled: bool = True, file: IO[str] | None = None) -> None:
        self._bar = None
        self.num_updates = 0
        if is_enabled:
            from tqdm import tqdm  # imported lazily: only drivers that show progress need it

            # Redrawn on every bucket: a bucket is large, so this costs nothing next to sending it.
            self._bar = tqdm(desc=description, unit="bucket", leave=False, dynamic_ncols=True, file=file, mininterval=0)

    def update(self, progress: BucketProgress) -> None:
        self.num_updates += 1
        if self._bar is None:
            return
        rate = progress.total_bytes / progress.elapsed_s / 1e9 if progress.elapsed_s > 0 else 0.0
        self._bar.set_postfix_str(f"{progress.total_bytes / 2**20:.1f} MiB, {rate:.2f} GB/s", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class SyncError(RuntimeError):
    """A sync failed; `report` says where, on which engines, and which engines are now stale."""

    def __init__(self, report: SyncReport) -> None:
        self.report = report
        super().__init__(report.summary())

    def __reduce__(self) -> tuple[Any, ...]:
        return (SyncError, (self.report,))


class _HeldEngine(Protocol):
    url: str
    held: str


def failed_report(
    *,
    version: str,
    previous_version: str,
    transport: str,
    engines: Sequence[_HeldEngine],
    error: str,
    total_s: float,
) -> SyncReport:
    """The report of a sync that failed before its session started (nothing reached any engine): every engine
    failed with `error`, stale only where it was already held."""
    return SyncReport(
        version=version,
        previous_version=previous_version,
        committed=False,
        selector=None,
        transport=transport,
        num_bytes=0,
        num_buckets=0,
        num_tensors=0,
        phases=PhaseTimes(),
        total_s=total_s,
        engines=tuple(EngineResult(url=e.url, success=False, is_stale=bool(e.held), message=error) for e in engines),
        error=error,
    )
