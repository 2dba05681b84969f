"""The sync controller as a plain class: engines, update-group membership, weight version, lease, stale engines.

It runs each sync as one session (miles_sync.sync.session) under the sync lease, and commits the version only when the
session completed on every engine and the lease was still held. After a failed sync the session has torn the
transport down; the controller plans a new membership (new group name, port from the OS) at the next sync. An
engine that may hold partial weights is held: left paused (never reset), reported with the reason, and resumed by
the first later sync that verifies on it. Held engines, and engines that joined (or restarted) since the last
successful sync, are stale until a sync succeeds on them: `serving_engines` leaves them out. An engine that stops
answering during a failed sync is held too (whatever restarts at its URL loads the checkpoint). `add_engine` and
`remove_engine` change the fleet between syncs (the update group is re-created at the next sync). With a `gate` (a
router in front of the engines) the router's worker list follows every verdict: held engines are withdrawn before
anything resumes, engines admitted once they serve the committed weights (miles_sync.sync.routing). `status()`
reads all of that state at once (`ControllerStatus`), which is what a Ray actor's caller asks for.

`mechanism_check=True` (opt-in) proves the update mechanism once, on the controller's first sync while the fleet is
at version 0 (no sync ever committed to it, usually version 0 -> 1): the session snapshots the engines' weights,
resets them to random values, syncs, and compares with the snapshot (miles_sync.sync.session), so a parameter the
sync never writes is named. It is meaningful only when the trainer's weights at that sync equal what the engines
loaded at start (e.g. a first sync straight from the checkpoint both loaded): otherwise the compare fails and
every engine stays paused, holding random weights, until a later sync verifies on it. Later syncs never run it; a
first sync of a fleet already past version 0 skips it with a warning in the report.

Async and bound to one event loop (its engine clients are); a Ray actor wraps it as an async actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from miles_sync.engine.client import CONTROL_ENDPOINTS, EngineClient
from miles_sync.sync.adapter import AdapterPayload
from miles_sync.sync.draft_canary import (
    CanaryMode,
    CanaryReading,
    CanarySettings,
    canary_requests,
    judge_reading,
    mean_reading,
)
from miles_sync.sync.draft_canary import next_baselines as next_canary_baselines
from miles_sync.sync.draft_guard import DraftDigests, draft_digests
from miles_sync.sync.engine_digests import read_direct_layouts
from miles_sync.sync.fleet_check import FleetCheck, check_fleet
from miles_sync.sync.lease import LeaseLostError, SyncLease
from miles_sync.sync.lora import adapter_name, run_lora_sync_session
from miles_sync.sync.pipeline import stage_group_names
from miles_sync.sync.report import BucketProgress, EngineResult, PhaseTimes, ProgressBar, SyncProgress, SyncReport
from miles_sync.sync.routing import RouteAction, RouteChange, TrafficGate, apply_gate, plan_routing
from miles_sync.sync.session import (
    EngineBaseline,
    SelectorInputs,
    SessionTimeouts,
    flush_mode_problem,
    run_sync_session,
)
from miles_sync.sync.weight_source import WeightSource
from miles_sync.transport.base import TransportSpec, transport_spec
from miles_sync.transport.membership import EngineEndpoint, GroupMembership, plan_membership
from miles_sync.weights.fp8 import Fp8Block
from miles_sync.wire.protocol import (
    DEFAULT_GROUP_NAME,
    DestroyWeightsUpdateGroupRequest,
    PauseMode,
    Selector,
    WeightsCheckerAction,
    WeightsCheckerRequest,
)
from miles_sync.wire.text import raise_if

__all__ = ["ControllerStatus", "GroupSettings", "SyncController", "SyncError"]


class SyncError(RuntimeError):
    """A sync failed; `report` says where, on which engines, and which engines are now stale."""

    def __init__(self, report: SyncReport) -> None:
        self.report = report
        super().__init__(report.summary())

    def __reduce__(self) -> tuple[Any, ...]:
        return (SyncError, (self.report,))


@dataclass(frozen=True, kw_only=True)
class GroupSettings:
    """Where and how the update group meets; the port always comes from the OS at creation. `master_address`
    None: on the source rank's own node (each pipeline stage's group on its stage source's node)."""

    name: str = DEFAULT_GROUP_NAME
    backend: str = "gloo"
    master_address: str | None = None


@dataclass(frozen=True, kw_only=True)
class ControllerStatus:
    """The controller's state at one moment (see the SyncController properties of the same names).

    `trainer_ranks`: what the source's `connect()` reported (its trainer ranks), empty for a source without one.
    """

    version: int
    weight_version: str
    engine_urls: tuple[str, ...]
    serving_engines: tuple[str, ...]
    stale_engines: tuple[str, ...]
    held_engines: dict[str, str]
    progress: SyncProgress | None
    membership: GroupMembership | None  # the first stage's (the only one without pipeline stages)
    trainer_ranks: tuple[Any, ...]
    memberships: tuple[GroupMembership, ...] = ()  # one per pipeline stage
    routed_engines: tuple[str, ...] = ()  # the router's worker list as the controller set it (empty: no router)
    route_changes: tuple[RouteChange, ...] = ()  # every change of it so far, oldest first


class SyncController:
    """Owns one engine fleet's sync state. Call `connect()` once, then `sync()` per training step."""

    def __init__(
        self,
        *,
        engine_urls: Sequence[str],
        source: WeightSource,
        transport: str,
        selector_inputs: SelectorInputs,
        pause_mode: PauseMode,
        verify: bool,
        timeouts: SessionTimeouts,
        staged: bool = False,
        mechanism_check: bool = False,
        group: GroupSettings = GroupSettings(),
        api_key: str | None = None,
        admin_api_key: str | None = None,
        lease: SyncLease | None = None,
        lease_wait_s: float = 30.0,
        show_progress: bool = True,
        quantization: Fp8Block | None = None,
        lora_name: str | None = None,
        draft_canary: CanarySettings | None = None,
        gate: TrafficGate | None = None,
        version_file: str | None = None,
    ) -> None:
        """`lora_name`: sync LoRA adapters under this engine adapter name (miles_sync.sync.lora: the source's
        `adapter_payload`, never the base); None: full syncs. `draft_canary`: the acceptance canary after every
        committed sync (miles_sync.sync.draft_canary); None: none. `gate`: the router in front of the engines,
        whose worker list follows every sync's verdict (miles_sync.sync.routing); None: no router. `version_file`:
        where every committed version is written (atomically), and read at connect, so that numbering continues
        after a controller restart even when every engine restarted too (they then report no version); None: the
        engines' answers alone."""
        self._spec = _checked_spec(
            engine_urls,
            source=source,
            transport=transport,
            staged=staged,
            lora_name=lora_name,
            lease_wait_s=lease_wait_s,
            pause_mode=PauseMode(pause_mode),
        )
        self._urls = [u.rstrip("/") for u in engine_urls]
        self._source = source
        self._transport = transport
        self._selector_inputs = selector_inputs
        self._quantization = quantization  # what the source sends: checked against each engine before the pause
        self._pause_mode = PauseMode(pause_mode)
        self._verify = verify
        self._staged = staged
        # Cleared by the first session: the check needs weights no sync has touched yet.
        self._is_mechanism_check_pending = mechanism_check
        self._timeouts = timeouts
        self._group = group
        self._api_key = api_key
        self._admin_api_key = admin_api_key
        # The lease outlives a stuck session by at most its TTL; a healthy one renews it every TTL / 3.
        self._lease = SyncLease(ttl_s=timeouts.sync_s) if lease is None else lease
        self._lease_wait_s = lease_wait_s
        self._show_progress = show_progress
        self._canary = CanarySettings() if draft_canary is None else draft_canary
        self._lora_name = lora_name
        self._gate = gate
        self._version_file = version_file
        self._start_empty()

    def _start_empty(self) -> None:
        """The state before `connect`: no engine clients or memories of them, version 0, no update group."""
        self._clients: dict[str, EngineClient] = {}
        self._tp_sizes: dict[str, int] = {}
        self._stale: set[str] = set()
        self._held: dict[str, str] = {}  # engines left paused because they may hold partial weights -> why
        # Each engine's checksum answer when the last sync verified on it: after a failed send, an engine that still
        # answers it received nothing that changed its weights, and may serve again.
        self._baselines: dict[str, EngineBaseline] = {}
        # Each engine's draft digests (miles_sync.sync.draft_guard), read at connect and after every verified sync:
        # a session that leaves the draft out fails on an engine whose draft no longer answers them.
        self._draft_baselines: dict[str, DraftDigests] = {}
        self._canary_baselines: dict[str, float] = {}  # each engine's last passing canary accept length
        self._version = 0  # last committed
        self._last_attempt = 0  # versions are never reused, not even those of failed syncs
        self._weight_version = ""
        self._progress: SyncProgress | None = None
        self._membership: GroupMembership | None = None
        self._is_open = False
        self._generation = 0
        # Group names are unique per controller and generation: a group that a dead source rank (or a dead earlier
        # controller) left on an engine can never collide with this controller's next one.
        self._group_token = uuid.uuid4().hex[:8]
        # The engines' side of these groups (one per pipeline stage) may exist until they are destroyed.
        self._group_names: tuple[str, ...] = ()
        self._trainer_ranks: tuple[Any, ...] = ()
        self._lora_served: dict[str, str] = {}  # engine URL -> the adapter name it serves (the last committed)
        self._routed: set[str] = set()  # engines the gate admitted and has not withdrawn since
        self._route_changes: list[RouteChange] = []

    # ---- state ----------------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def weight_version(self) -> str:
        """The version string every non-stale engine serves."""
        return self._weight_version

    @property
    def engine_urls(self) -> tuple[str, ...]:
        return tuple(self._urls)

    @property
    def stale_engines(self) -> tuple[str, ...]:
        return tuple(u for u in self._urls if u in self._stale)

    @property
    def serving_engines(self) -> tuple[str, ...]:
        """Engines that hold the committed weights and may take generation traffic."""
        return tuple(u for u in self._urls if u not in self._stale)

    @property
    def held_engines(self) -> dict[str, str]:
        """Engines left paused because they may hold partial weights -> the reason; a verified sync resumes them."""
        return {u: self._held[u] for u in self._urls if u in self._held}

    @property
    def progress(self) -> SyncProgress | None:
        """The running (or last) sync's acknowledged buckets so far; None before the first sync."""
        return self._progress

    @property
    def memberships(self) -> tuple[GroupMembership, ...]:
        """Every open update group: one per pipeline stage of the source, in stage order (empty when none is)."""
        if not self._is_open or self._membership is None:
            return ()
        stages = tuple(m for m in self._source.memberships if m is not None)
        return stages or (self._membership,)

    @property
    def membership(self) -> GroupMembership | None:
        """The current update group, None when none is open (colocated transport, or re-created at next sync)."""
        return self._membership if self._is_open else None

    @property
    def trainer_ranks(self) -> tuple[Any, ...]:
        """What the source's own `connect()` reported (e.g. RankInfo per trainer rank); empty without one."""
        return self._trainer_ranks

    def status(self) -> ControllerStatus:
        """All of the above at once: one call for a caller in another process."""
        return ControllerStatus(
            version=self.version,
            weight_version=self.weight_version,
            engine_urls=self.engine_urls,
            serving_engines=self.serving_engines,
            stale_engines=self.stale_engines,
            held_engines=self.held_engines,
            progress=self.progress,
            membership=self.membership,
            memberships=self.memberships,
            trainer_ranks=self.trainer_ranks,
            routed_engines=self.routed_engines,
            route_changes=tuple(self._route_changes),
        )

    @property
    def routed_engines(self) -> tuple[str, ...]:
        """The engines the router may send requests to (admitted, not withdrawn since); empty without a router."""
        return tuple(u for u in self._urls if u in self._routed)

    # ---- lifecycle ------------------------------------------------------------------------------------------

    async def connect(self) -> tuple[Any, ...]:
        """Connect the source first (a proxy for trainer actors finds its source rank there), then probe every
        engine (refusing one that lacks an endpoint the sync needs), read its TP size and version, and let the
        source refuse engines its transport cannot reach. Engines that disagree on the version are stale until the
        first sync. Returns what the source's `connect()` returned (`trainer_ranks`; empty by default)."""
        self._trainer_ranks = tuple(await self._source.connect())
        await asyncio.gather(*(self._connect_engine(url) for url in self._urls))
        # e.g. a colocated engine without a trainer rank on its node: refused now, not at the first sync
        self._source.check_engines([EngineEndpoint(url=u, tp_size=self._tp_sizes[u]) for u in self._urls])
        if self._verify:
            await self._read_draft_baselines(self._urls)
        await self._read_canary_baselines(self._urls)
        infos = await asyncio.gather(*(self._clients[u].model_info() for u in self._urls))
        versions = {u: info.weight_version for u, info in zip(self._urls, infos)}
        common = max(set(versions.values()), key=list(versions.values()).count)
        self._weight_version = common
        self._stale = {u for u, v in versions.items() if v != common}
        # A restarted controller continues the engines' numbering instead of reissuing versions they served.
        numeric = [int(v) for v in versions.values() if v.isdecimal()]
        persisted = 0 if self._version_file is None else read_committed_version(self._version_file)
        self._version = self._last_attempt = max([*numeric, persisted])
        warnings = await self._reconcile_routes(reason="connect", whole_fleet=True)
        if warnings:
            raise RuntimeError("; ".join(warnings))  # a router that cannot take the fleet fails the start
        return self._trainer_ranks

    async def _read_draft_baselines(self, urls: Sequence[str]) -> None:
        """The draft digests `urls` serve now, as their guard baselines (one checker call each with selector all;
        an engine without a draft answers none and is not guarded). A restarted engine loaded its frozen draft from
        the checkpoint, so what it serves at connect is the draft to keep."""
        request = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=Selector.ALL)
        answers = await asyncio.gather(
            *(self._clients[u].weights_checker(request, timeout_s=self._timeouts.control_s) for u in urls),
            return_exceptions=True,
        )
        for url, answer in zip(urls, answers):
            self._draft_baselines.pop(url, None)
            # An engine whose checker cannot answer now is not guarded until a verified sync records its draft;
            # its verification fails on the same checker first.
            digests = None if isinstance(answer, BaseException) else draft_digests(answer.ranks)
            if digests is not None:
                self._draft_baselines[url] = digests

    async def _read_canary_baselines(self, urls: Sequence[str]) -> None:
        """The canary's first baselines: each engine's accept length on the canary prompt now (none measured for
        an engine that answers none, e.g. without a draft; its later readings are then never judged)."""
        if not self._canary.is_enabled:
            return
        readings = await self._measure_canary(urls, baselines={})
        kept = {url: value for url, value in self._canary_baselines.items() if url not in urls}
        self._canary_baselines = next_canary_baselines(kept, readings)

    async def _measure_canary(self, urls: Sequence[str], *, baselines: dict[str, float]) -> list[CanaryReading]:
        """The canary's requests on every engine in `urls`, each engine's mean judged against `baselines`; an
        engine whose requests failed gets a reading without an accept length whose message says why."""
        requests = canary_requests(self._canary)

        async def measure(url: str) -> CanaryReading:
            client, timeout_s = self._clients[url], self._timeouts.control_s
            try:
                answers = await asyncio.gather(*(client.generate(r, timeout_s=timeout_s) for r in requests))
            except Exception as exc:
                why = f"{url}: draft canary request failed: {str(exc) or type(exc).__name__}"
                return CanaryReading(url=url, accept_length=None, baseline=baselines.get(url), message=why)
            return judge_reading(
                url,
                accept_length=mean_reading([a.meta_info.spec_accept_length for a in answers]),
                baseline=baselines.get(url),
                min_ratio=self._canary.min_ratio,
            )

        return list(await asyncio.gather(*(measure(u) for u in urls)))

    async def _run_canary(self, report: SyncReport) -> SyncReport:
        """The canary after a committed sync, on every engine the sync verified (module docstring of
        miles_sync.sync.draft_canary): readings and findings go into the report; in hold mode a flagged engine is
        paused again and held, its weights untouched."""
        urls = [e.url for e in report.engines if e.success]
        readings = await self._measure_canary(urls, baselines=self._canary_baselines)
        self._canary_baselines = next_canary_baselines(self._canary_baselines, readings)
        warnings = [r.message for r in readings if r.message]
        if self._canary.mode is CanaryMode.HOLD:
            for reading in (r for r in readings if r.flagged):
                try:
                    await self._clients[reading.url].pause_generation(
                        self._pause_mode, timeout_s=self._timeouts.control_s
                    )
                except Exception as exc:  # still unrouted: stale until a later sync's canary passes
                    warnings.append(f"{reading.url}: pausing it for the draft canary failed: {exc}")
                self._stale.add(reading.url)
                self._held[reading.url] = f"sync v{report.version}: {reading.message}"
        return replace(report, canary=tuple(readings), warnings=(*report.warnings, *warnings))

    async def _connect_engine(self, url: str) -> None:
        client = EngineClient(
            url, timeout_s=self._timeouts.control_s, api_key=self._api_key, admin_api_key=self._admin_api_key
        )
        try:
            info = await client.connect(required=(*CONTROL_ENDPOINTS, *self._spec.endpoints))
        except BaseException:
            await client.close()
            raise
        self._clients[url] = client
        self._tp_sizes[url] = info.tp_size

    async def replace_engine(self, old_url: str, new_url: str) -> None:
        """Swap a (dead or restarted) engine for the one at `new_url`. The new engine is stale until the next
        sync, and the group is re-created then, because its membership changed."""
        new_url = new_url.rstrip("/")
        if old_url not in self._urls:
            raise ValueError(f"engine {old_url} is not in this controller's fleet {self._urls}")
        if new_url in self._urls and new_url != old_url:
            raise ValueError(f"engine {new_url} is already in this controller's fleet")
        async with self._lease.hold(f"replace_engine {old_url}", timeout_s=self._lease_wait_s):
            await self._withdraw_or_raise(old_url, reason=f"replaced by {new_url}")
            old = self._clients.pop(old_url, None)
            if old is not None:
                await old.close()
            self._urls[self._urls.index(old_url)] = new_url
            self._stale.discard(old_url)
            self._held.pop(old_url, None)
            self._baselines.pop(old_url, None)
            self._draft_baselines.pop(old_url, None)
            self._tp_sizes.pop(old_url, None)
            await self._connect_engine(new_url)
            if self._verify:
                await self._read_draft_baselines([new_url])
            self._canary_baselines.pop(old_url, None)
            await self._read_canary_baselines([new_url])
            self._stale.add(new_url)
            await self._close_group()

    async def add_engine(self, url: str) -> None:
        """A new engine joins the fleet between syncs. It is stale, so it gets no routed traffic and is not in
        `serving_engines`, until a sync verifies on it; the next sync sends it the full weights at that sync's
        version, like every engine, and re-creates the update group (membership changed). Groups are never changed
        during a sync (the lease is held here): a rendezvous includes exactly the engines the session pauses.

        Decided: a joiner waits for the fleet's next sync rather than taking a catch-up copy of the committed
        version, because the trainer's weights may already have moved past what was committed (a training step
        since), and only one version may be served per fleet. It is paused here, before the router could list it,
        so that nothing it generates before that sync reaches a caller that asks the engine directly."""
        url = url.rstrip("/")
        if url in self._urls:
            raise ValueError(f"engine {url} is already in this controller's fleet")
        async with self._lease.hold(f"add_engine {url}", timeout_s=self._lease_wait_s):
            await self._connect_engine(url)
            try:
                self._source.check_engines([EngineEndpoint(url=url, tp_size=self._tp_sizes[url])])
                await self._clients[url].pause_generation(self._pause_mode, timeout_s=self._timeouts.control_s)
                if self._verify:
                    await self._read_draft_baselines([url])
                await self._read_canary_baselines([url])
            except BaseException:
                client = self._clients.pop(url)
                self._tp_sizes.pop(url, None)
                await client.close()
                raise
            self._urls.append(url)
            self._stale.add(url)
            self._held[url] = "joined: waits for a sync that verifies on it"
            await self._close_group()

    async def remove_engine(self, url: str) -> None:
        """Drain an engine out of the fleet between syncs: the router stops routing to it first (requests it holds
        finish on it), then it leaves the fleet and the update group is re-created at the next sync. The engine
        itself keeps running; stopping it is its owner's call."""
        url = url.rstrip("/")
        if url not in self._urls:
            raise ValueError(f"engine {url} is not in this controller's fleet {self._urls}")
        async with self._lease.hold(f"remove_engine {url}", timeout_s=self._lease_wait_s):
            await self._withdraw_or_raise(url, reason="removed from the fleet")
            self._urls.remove(url)
            client = self._clients.pop(url, None)
            if client is not None:
                await client.close()
            for state in (self._held, self._baselines, self._draft_baselines, self._canary_baselines, self._tp_sizes):
                state.pop(url, None)
            self._stale.discard(url)
            await self._close_group()

    async def close(self) -> None:
        await self._close_group()
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

    # ---- sync -----------------------------------------------------------------------------------------------

    async def check_engines(self, *, holder: str = "controller") -> FleetCheck:
        """Whether every engine already holds the trainer's current weights, without a sync and without writing to
        any engine (miles_sync.sync.fleet_check): the source hashes its weights, each engine's checker answers.
        Holds the lease (no sync runs meanwhile); bounded by the session timeout. Full-weight syncs only."""
        if len(self._clients) != len(self._urls):
            raise RuntimeError("SyncController.check_engines before connect()")
        if self._lora_name is not None:
            raise ValueError("check_engines compares full weights; a LoRA sync's engines serve the base checkpoint")
        if not self._source.can_predict:
            raise ValueError(f"{type(self._source).__name__} cannot hash its weights without sending them")
        async with self._lease.hold(holder, timeout_s=self._lease_wait_s):
            engines = [self._clients[u] for u in self._urls]
            return await asyncio.wait_for(
                check_fleet(
                    engines,
                    source=self._source,
                    inputs=self._selector_inputs,
                    timeout_s=self._timeouts.control_s,
                ),
                timeout=self._timeouts.sync_s,
            )

    async def sync(self, *, holder: str = "controller", raise_on_failure: bool = True) -> SyncReport:
        """One sync of every engine to a new version. Returns the report; raises SyncError (with the report)
        when it failed, unless `raise_on_failure` is False (the failed report is then returned); raises
        LeaseBusyError when another sync holds the lease past `lease_wait_s`."""
        if len(self._clients) != len(self._urls):
            raise RuntimeError("SyncController.sync before connect()")
        async with self._lease.hold(holder, timeout_s=self._lease_wait_s) as held:
            self._last_attempt = max(self._version, self._last_attempt) + 1
            version = str(self._last_attempt)
            report = None if self._lora_name is None else await self._sync_lora(version)
            if report is None:
                report = await self._open_group(version)
            if report is None:
                bar = ProgressBar(description=f"sync v{version}", is_enabled=self._show_progress)
                self._progress = SyncProgress(version=version, buckets=())

                def on_bucket(event: BucketProgress) -> None:
                    self._progress = replace(self._progress, buckets=(*self._progress.buckets, event))
                    bar.update(event)

                mechanism_check, skipped = self._take_mechanism_check(version)
                try:
                    report = await run_sync_session(
                        engines=[self._clients[u] for u in self._urls],
                        source=self._source,
                        version=version,
                        previous_version=self._weight_version,
                        selector_inputs=self._selector_inputs,
                        pause_mode=self._pause_mode,
                        verify=self._verify,
                        staged=self._staged,
                        timeouts=self._timeouts,
                        transport_name=self._transport,
                        on_bucket=on_bucket,
                        baselines=self._baselines,
                        held=tuple(self._held),
                        mechanism_check=mechanism_check,
                        quantization=self._quantization,
                        draft_baselines=self._draft_baselines,
                        before_resume=None if self._gate is None else self._withdraw_before_resume,
                    )
                finally:
                    bar.close()
                if skipped:
                    report = replace(report, warnings=(*report.warnings, skipped))
                if report.committed:
                    try:
                        held.check()
                    except LeaseLostError as exc:
                        report = replace(report, committed=False, error=f"not committed: {exc}")
            self._record(report)
            if report.committed and self._canary.is_enabled:
                report = await self._run_canary(report)
            if not report.committed:
                await self._destroy_engine_groups()  # the session already closed the source's side, if it could
                await self._hold_unreachable(report)
            routing = await self._reconcile_routes(reason=f"sync v{version}")
            if routing:
                report = replace(report, warnings=(*report.warnings, *routing))
        if not report.committed and raise_on_failure:
            raise SyncError(report)
        return report

    async def _sync_lora(self, version: str) -> SyncReport:
        """One LoRA sync (miles_sync.sync.lora): no update group, no session; the adapter goes to every engine."""

        async def payload() -> AdapterPayload:
            return await self._source.adapter_payload(tp_sizes=sorted(set(self._tp_sizes.values())))

        try:
            report = await run_lora_sync_session(
                engines=[self._clients[u] for u in self._urls],
                tp_sizes=dict(self._tp_sizes),
                payload=payload,
                name=self._lora_name,
                version=version,
                previous_version=self._weight_version,
                pause_mode=self._pause_mode,
                timeouts=self._timeouts,
                previous=dict(self._lora_served),
                held=tuple(self._held),
                verify=self._verify,
            )
        finally:
            with contextlib.suppress(Exception):  # the payload's tensors are no longer needed
                await asyncio.wait_for(self._source.release_adapter(), timeout=self._timeouts.control_s)
        if report.committed:
            self._lora_served = {url: adapter_name(self._lora_name, version) for url in self._urls}
        return report

    def _take_mechanism_check(self, version: str) -> tuple[bool, str]:
        """(run the mechanism check in this session, the warning when it is skipped). Only the first session of
        this controller may run it, and only while the fleet is at version 0: its weights are then still the ones
        the engines loaded at start, which the source is assumed to send back."""
        if not self._is_mechanism_check_pending:
            return False, ""
        self._is_mechanism_check_pending = False
        if self._version == 0:
            return True, ""
        return False, (
            f"mechanism check skipped: the fleet is at version {self._version}, not 0 (its weights are no longer "
            f"the ones it loaded at start), so sync v{version} ran without it"
        )

    async def _open_group(self, version: str) -> SyncReport | None:
        """(Re-)create the transport when none is open; a failure report when that fails, else None."""
        if self._is_open:
            return None
        start = time.perf_counter()
        try:
            endpoints = await self._endpoints()
        except ValueError as exc:
            return self._failed_before_session(
                version, error=f"transport set-up failed: {exc}", seconds=time.perf_counter() - start
            )
        membership = None
        if self._spec.needs_update_group:
            # A fresh name per generation: an engine that missed the last teardown still has the old group.
            name = f"{self._group.name}_{self._group_token}_{self._generation}"
            # A source with pipeline stages opens one group per stage under names derived from this one.
            self._group_names = stage_group_names(name, num_stages=self._source.num_stages)
            membership = plan_membership(
                engines=endpoints,
                group_name=name,
                backend=self._group.backend,
                master_address=self._group.master_address,
            )
            self._generation += 1
        try:
            self._membership = await asyncio.wait_for(
                self._source.open(engines=endpoints, membership=membership), timeout=self._timeouts.sync_s
            )
        except Exception as exc:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._source.close(), timeout=self._timeouts.control_s)
            await self._destroy_engine_groups()
            return self._failed_before_session(
                version,
                error=f"transport set-up failed: {str(exc) or type(exc).__name__}",
                seconds=time.perf_counter() - start,
            )
        self._is_open = True
        return None

    async def _endpoints(self) -> list[EngineEndpoint]:
        """The engines as the transport opens them: with each one's parameter layout where the transport sends the
        engines' own parameters (ValueError naming each engine whose layout is unknown)."""
        layouts = {}
        if self._spec.needs_engine_layouts:
            layouts = await read_direct_layouts([self._clients[u] for u in self._urls])
        return [EngineEndpoint(url=u, tp_size=self._tp_sizes[u], direct=layouts.get(u)) for u in self._urls]

    async def _close_group(self) -> None:
        self._is_open = False
        self._membership = None
        try:
            await asyncio.wait_for(self._source.close(), timeout=self._timeouts.sync_s)
        except Exception:
            await self._destroy_engine_groups()  # the source rank could not ask the engines itself
        else:
            self._group_names = ()  # the source's transports destroyed the engines' side

    async def _destroy_engine_groups(self) -> None:
        """Ask every engine to destroy its side of the current group. The source rank's transport does this when
        it closes, but a source rank that died (or whose close timed out) cannot: without this the engines would
        hold the group's sockets and threads for the rest of their life. An engine that has no such group, or is
        dead, refuses; that is the expected answer after a clean close and is ignored."""
        names, self._group_names = self._group_names, ()
        await asyncio.gather(
            *(
                c.destroy_weights_update_group(
                    DestroyWeightsUpdateGroupRequest(group_name=name), timeout_s=self._timeouts.control_s
                )
                for name in names
                for c in self._clients.values()
            ),
            return_exceptions=True,
        )

    async def _hold_unreachable(self, report: SyncReport) -> None:
        """After a failed sync, an engine that failed a step and no longer answers at all (it died) is held like
        one that may hold partial weights: whatever comes back at its URL (a restart loads the checkpoint, not the
        fleet's version) is stale until a sync verifies on it, and a router stops routing to it."""
        suspects = [e.url for e in report.engines if not e.success and e.url not in self._held]
        answers = await asyncio.gather(
            *(self._clients[u].server_info(timeout_s=self._timeouts.control_s) for u in suspects),
            return_exceptions=True,
        )
        for url, answer in zip(suspects, answers):
            if isinstance(answer, BaseException):
                self._stale.add(url)
                self._held[url] = f"sync v{report.version}: unreachable ({str(answer) or type(answer).__name__})"
                self._baselines.pop(url, None)

    async def _withdraw_before_resume(self, held: Sequence[str]) -> list[str]:
        """The session's hook between its verdict and its resume: every engine it leaves paused leaves the router
        first. Returns warnings; never raises."""
        reasons = {u: f"held before the resume of v{self._last_attempt}" for u in held}
        return await self._route(withdraw=[u for u in held if u in self._routed], admit=[], reasons=reasons)

    async def _reconcile_routes(self, *, reason: str, whole_fleet: bool = False) -> list[str]:
        """Bring the router's worker list to the serving engines (miles_sync.sync.routing.plan_routing);
        `whole_fleet`: assume nothing about what the router lists (at connect: a router may list engines this
        controller never admitted). Returns warnings; never raises."""
        if self._gate is None:
            return []
        serving = self.serving_engines
        plan = plan_routing(fleet=self._urls, routed=self._routed, serving=serving)
        withdraw, admit = plan.withdraw, plan.admit
        if whole_fleet:  # the gate's calls are idempotent: withdraw every non-serving engine, admit every serving one
            withdraw = plan_routing(fleet=self._urls, routed=self._urls, serving=serving).withdraw
            admit = plan_routing(fleet=self._urls, routed=(), serving=serving).admit
        reasons = {u: self._held.get(u, f"not serving the committed version ({reason})") for u in withdraw}
        serves = f"v{self._weight_version}" if self._weight_version.isdecimal() else "the weights it loaded"
        reasons |= {u: f"serving {serves} ({reason})" for u in admit}
        return await self._route(withdraw=withdraw, admit=admit, reasons=reasons)

    async def _withdraw_or_raise(self, url: str, *, reason: str) -> None:
        """Withdraw `url` before it leaves the fleet; raises when the router still lists it (an engine must never
        leave the controller's watch while routed)."""
        warnings = await self._route(withdraw=[url], admit=[], reasons={url: reason})
        if warnings:
            raise RuntimeError("; ".join(warnings))

    async def _route(self, *, withdraw: Sequence[str], admit: Sequence[str], reasons: dict[str, str]) -> list[str]:
        """Withdraw first (all at once), then admit; records each change that took. Never raises."""
        if self._gate is None:
            return []
        warnings = []
        for urls, action in ((withdraw, RouteAction.WITHDRAWN), (admit, RouteAction.ADMITTED)):
            results = await asyncio.gather(
                *(apply_gate(self._gate, u, action=action, timeout_s=self._timeouts.control_s) for u in urls)
            )
            for url, warning in zip(urls, results):
                if warning is not None:
                    warnings.append(warning)
                    continue
                if action is RouteAction.ADMITTED:
                    self._routed.add(url)
                else:
                    self._routed.discard(url)
                change = RouteChange(url=url, action=action, version=self._weight_version, reason=reasons[url])
                self._route_changes.append(change)
        return warnings

    def _record(self, report: SyncReport) -> None:
        for engine in report.engines:
            if engine.is_stale:
                self._stale.add(engine.url)
                self._held.setdefault(engine.url, f"sync v{report.version}: {engine.message}")
            elif engine.success:
                self._stale.discard(engine.url)
                self._held.pop(engine.url, None)
            if engine.success and engine.draft_digests is not None:
                self._draft_baselines[engine.url] = engine.draft_digests
            if engine.weights_digest is not None and report.selector is not None:
                self._baselines[engine.url] = EngineBaseline(selector=report.selector, digest=engine.weights_digest)
            elif engine.is_stale:
                self._baselines.pop(engine.url, None)  # its answer no longer describes a verified state
        if report.committed:
            self._version = int(report.version)
            self._weight_version = report.version
            if self._version_file is not None:
                write_committed_version(self._version_file, self._version)
        else:
            # The session tore the transport down on failure; the next sync re-creates it.
            self._is_open = False
            self._membership = None

    def _failed_before_session(self, version: str, *, error: str, seconds: float) -> SyncReport:
        return SyncReport(
            version=version,
            previous_version=self._weight_version,
            committed=False,
            selector=None,
            transport=self._transport,
            num_bytes=0,
            num_buckets=0,
            num_tensors=0,
            phases=PhaseTimes(),
            total_s=seconds,
            engines=tuple(
                EngineResult(url=u, success=False, is_stale=u in self._held, message=error) for u in self._urls
            ),
            error=error,
        )


def read_committed_version(path: str) -> int:
    """The version a `version_file` holds; 0 when there is none yet. Raises ValueError for a file that is not one
    (never silently restarts the numbering)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return 0
    try:
        version = int(json.loads(text)["committed_version"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"version file {path} does not hold a committed version: {text[:200]!r}") from exc
    if version < 0:
        raise ValueError(f"version file {path} holds a negative version {version}")
    return version


def write_committed_version(path: str, version: int) -> None:
    """Replace `path`'s content with `version` atomically (a crash leaves the old file or the new, never half)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    scratch.write_text(json.dumps({"committed_version": version}) + "\n")
    os.replace(scratch, target)


def _checked_spec(
    engine_urls: Sequence[str],
    *,
    source: WeightSource,
    transport: str,
    staged: bool,
    lora_name: str | None,
    lease_wait_s: float,
    pause_mode: PauseMode,
) -> TransportSpec:
    """The transport's spec; ValueError naming every problem of the controller's arguments at once."""
    problems = []
    duplicates = sorted({u for u in engine_urls if list(engine_urls).count(u) > 1})
    if not engine_urls:
        problems.append("engine_urls is empty")
    if duplicates:
        problems.append(f"engine_urls repeat {duplicates}")
    if staged and not source.can_stage:
        problems.append(f"staged export needs a source that can stage; {type(source).__name__} cannot")
    if lora_name is not None and not source.syncs_adapters:
        problems.append(f"LoRA syncs need a source that answers adapters; {type(source).__name__} does not")
    if not lease_wait_s > 0:
        problems.append(f"lease_wait_s={lease_wait_s} must be positive")
    flush_problem = flush_mode_problem(source, pause_mode=pause_mode)
    if flush_problem is not None:
        problems.append(flush_problem)
    spec = None
    try:
        spec = transport_spec(transport)
    except ValueError as exc:
        problems.append(str(exc))
    raise_if(problems, what="invalid SyncController")
    return spec
