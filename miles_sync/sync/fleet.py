"""The controller's engines between syncs: one record per engine, and the fleet that owns them.

Each record holds what the controller remembers about one engine: its client and TP size, why it is held (left
paused because it may hold partial weights, or it died), whether it is behind (does not serve the committed
weights but is not paused: it disagreed on the version at connect, or replaced a dead engine), the checksum answer
and draft digests of its last verified sync, its canary baseline, the LoRA adapter it serves, and whether the
router lists it. Invariants the fleet keeps: a held engine is stale; an engine a sync verified is neither held nor
behind; an engine that leaves the fleet takes its whole record with it.

Not thread-safe; the controller mutates it only under its sync lease (or before its first sync, in `connect`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from miles_sync.engine.client import CONTROL_ENDPOINTS, EngineClient
from miles_sync.sync.draft_canary import CanarySettings, measure_canary, next_baselines
from miles_sync.sync.draft_guard import DraftDigests, read_draft_digests
from miles_sync.sync.report import SyncReport
from miles_sync.sync.session import EngineBaseline
from miles_sync.transport.membership import EngineEndpoint


@dataclass(kw_only=True, eq=False)
class EngineRecord:
    """One engine as the controller knows it (module docstring). `held`: why it is held, "" when it is not."""

    url: str
    client: EngineClient
    tp_size: int
    held: str = ""
    is_behind: bool = False
    baseline: EngineBaseline | None = None  # its checksum answer when the last sync verified on it
    draft_digests: DraftDigests | None = None  # its draft digests: the draft guard's baseline (None: not guarded)
    canary_baseline: float | None = None  # its last passing canary accept length
    lora_served: str | None = None  # the adapter name it serves (the last committed LoRA sync's)
    is_routed: bool = False  # the router admitted it and has not withdrawn it since

    @property
    def is_stale(self) -> bool:
        """It does not serve the committed weights: held, or behind."""
        return bool(self.held) or self.is_behind

    @property
    def endpoint(self) -> EngineEndpoint:
        return EngineEndpoint(url=self.url, tp_size=self.tp_size)


class Fleet:
    """The engines in fleet order, and a record for each one connected so far (all of them after `connect`)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self._urls = [u.rstrip("/") for u in urls]
        self._records: dict[str, EngineRecord] = {}

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(self._urls)

    @property
    def is_connected(self) -> bool:
        return all(u in self._records for u in self._urls)

    def __contains__(self, url: str) -> bool:
        return url in self._urls

    def __getitem__(self, url: str) -> EngineRecord:
        return self._records[url]

    @property
    def records(self) -> list[EngineRecord]:
        return [self._records[u] for u in self._urls if u in self._records]

    def records_of(self, urls: Sequence[str]) -> list[EngineRecord]:
        return [self._records[u] for u in urls]

    # ---- membership ----------------------------------------------------------------------------------------

    def attach(self, record: EngineRecord) -> None:
        """The record of an engine already in the fleet's URL list (at connect)."""
        assert record.url in self._urls, record.url
        self._records[record.url] = record

    def add(self, record: EngineRecord) -> None:
        """A new engine joins at the end of the fleet."""
        assert record.url not in self._urls, record.url
        self._urls.append(record.url)
        self._records[record.url] = record

    def replace(self, old_url: str, record: EngineRecord) -> EngineRecord | None:
        """`record` takes `old_url`'s place in fleet order; returns the old record (None if it never connected)."""
        self._urls[self._urls.index(old_url)] = record.url
        old = self._records.pop(old_url, None)
        self._records[record.url] = record
        return old

    def remove(self, url: str) -> EngineRecord | None:
        """`url` leaves the fleet with its whole record; returns it (None if it never connected)."""
        self._urls.remove(url)
        return self._records.pop(url, None)

    # ---- verdicts ------------------------------------------------------------------------------------------

    def hold(self, url: str, why: str) -> None:
        """Hold `url` (stale, left paused). An engine already held keeps its first reason: it names the sync that
        left it paused."""
        record = self._records[url]
        record.held = record.held or why

    def serve(self, url: str) -> None:
        """`url` serves the committed weights: a sync verified on it."""
        record = self._records[url]
        record.held, record.is_behind = "", False

    def record(self, report: SyncReport) -> None:
        """One sync's verdict on each engine: stale engines are held and lose their checksum baseline (their answer
        no longer describes a verified state); verified ones serve, with the digests the sync read from them."""
        for engine in report.engines:
            record = self._records[engine.url]
            if engine.is_stale:
                self.hold(engine.url, f"sync v{report.version}: {engine.message}")
            elif engine.success:
                self.serve(engine.url)
            if engine.success and engine.draft_digests is not None:
                record.draft_digests = engine.draft_digests
            if engine.weights_digest is not None and report.selector is not None:
                record.baseline = EngineBaseline(selector=report.selector, digest=engine.weights_digest)
            elif engine.is_stale:
                record.baseline = None

    def set_canary_baselines(self, baselines: dict[str, float]) -> None:
        for url, value in baselines.items():
            self._records[url].canary_baseline = value

    # ---- views, in fleet order ------------------------------------------------------------------------------

    @property
    def serving(self) -> tuple[str, ...]:
        return tuple(r.url for r in self.records if not r.is_stale)

    @property
    def stale(self) -> tuple[str, ...]:
        return tuple(r.url for r in self.records if r.is_stale)

    @property
    def held(self) -> dict[str, str]:
        return {r.url: r.held for r in self.records if r.held}

    @property
    def routed(self) -> tuple[str, ...]:
        return tuple(r.url for r in self.records if r.is_routed)

    @property
    def tp_sizes(self) -> dict[str, int]:
        return {r.url: r.tp_size for r in self.records}

    @property
    def baselines(self) -> dict[str, EngineBaseline]:
        return {r.url: r.baseline for r in self.records if r.baseline is not None}

    @property
    def draft_baselines(self) -> dict[str, DraftDigests]:
        return {r.url: r.draft_digests for r in self.records if r.draft_digests is not None}

    @property
    def canary_baselines(self) -> dict[str, float]:
        return {r.url: r.canary_baseline for r in self.records if r.canary_baseline is not None}


async def hold_unreachable(fleet: Fleet, report: SyncReport, *, timeout_s: float) -> None:
    """After a failed sync, an engine that failed a step and no longer answers at all (it died) is held like one
    that may hold partial weights: whatever comes back at its URL (a restart loads the checkpoint, not the fleet's
    version) is stale until a sync verifies on it, and a router stops routing to it. Never raises."""
    suspects = [fleet[e.url] for e in report.engines if not e.success and not fleet[e.url].held]
    answers = await asyncio.gather(
        *(r.client.server_info(timeout_s=timeout_s) for r in suspects), return_exceptions=True
    )
    for record, answer in zip(suspects, answers):
        if isinstance(answer, BaseException):
            fleet.hold(record.url, f"sync v{report.version}: unreachable ({str(answer) or type(answer).__name__})")
            record.baseline = None


class EngineConnector:
    """Makes the record of an engine that enters the fleet: its client (with the fleet's API keys), probed for
    every endpoint a sync needs, and the guards' first baselines read from what it serves."""

    def __init__(
        self,
        *,
        timeout_s: float,
        endpoints: Sequence[str],
        api_key: str | None,
        admin_api_key: str | None,
        guards_draft: bool,
        canary: CanarySettings,
    ) -> None:
        self._timeout_s = timeout_s
        self._required = (*CONTROL_ENDPOINTS, *endpoints)
        self._api_key = api_key
        self._admin_api_key = admin_api_key
        self._guards_draft = guards_draft
        self._canary = canary

    async def connect(self, url: str) -> EngineRecord:
        """The engine at `url`, probed (raises naming a missing endpoint; the client is closed then)."""
        client = EngineClient(url, timeout_s=self._timeout_s, api_key=self._api_key, admin_api_key=self._admin_api_key)
        try:
            info = await client.connect(required=self._required)
        except BaseException:
            await client.close()
            raise
        return EngineRecord(url=url, client=client, tp_size=info.tp_size)

    async def connect_all(self, urls: Sequence[str]) -> list[EngineRecord]:
        """Every engine at once, in `urls` order. When any fails, the clients of those that connected are closed
        again; the error is the failed engine's own, or with several one that names each (the first one's is the
        cause)."""
        results = await asyncio.gather(*(self.connect(u) for u in urls), return_exceptions=True)
        failed = [(u, r) for u, r in zip(urls, results) if isinstance(r, BaseException)]
        if not failed:
            return list(results)  # type: ignore[arg-type]  # no exception among them
        await asyncio.gather(*(r.client.close() for r in results if isinstance(r, EngineRecord)))
        if len(failed) == 1:
            raise failed[0][1]  # its own error (an EngineError names the engine and the endpoint)
        named = "; ".join(f"{url}: {exc}" for url, exc in failed)
        raise RuntimeError(f"{len(failed)} of {len(urls)} engine(s) could not be connected: {named}") from failed[0][1]

    async def read_baselines(self, records: Sequence[EngineRecord]) -> None:
        """What the guards compare later syncs with, read from what `records` serve now: draft digests (when drafts
        are guarded: with verification) and canary accept lengths (with the canary). A restarted engine loaded its
        frozen draft from the checkpoint, so what it serves when it enters is the draft to keep. Never raises."""
        if self._guards_draft:
            digests = await read_draft_digests([r.client for r in records], timeout_s=self._timeout_s)
            for record, digest in zip(records, digests):
                record.draft_digests = digest
        if self._canary.is_enabled:
            engines = {r.url: r.client for r in records}
            readings = await measure_canary(engines, self._canary, baselines={}, timeout_s=self._timeout_s)
            baselines = next_baselines({}, readings)
            for record in records:
                record.canary_baseline = baselines.get(record.url)
