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

`mechanism_check=True` (opt-in) proves the update mechanism once, on the first sync (miles_sync.sync.full_sync).

Async and bound to one event loop (its engine clients are); a Ray actor wraps it as an async actor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from miles_sync.sync.draft_canary import CanarySettings, run_canary
from miles_sync.sync.fleet import EngineConnector, Fleet, hold_unreachable
from miles_sync.sync.fleet_check import FleetCheck, check_fleet
from miles_sync.sync.full_sync import FullSync
from miles_sync.sync.lease import LeaseLostError, SyncLease
from miles_sync.sync.lora import sync_fleet_adapter
from miles_sync.sync.report import SyncError, SyncProgress, SyncReport
from miles_sync.sync.routing import RouteChange, RouteKeeper, TrafficGate
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.sync.update_group import GroupSettings, UpdateGroup
from miles_sync.sync.version_file import read_committed_version, write_committed_version
from miles_sync.sync.weight_source import WeightSource, source_problems
from miles_sync.transport.base import TransportSpec, transport_spec
from miles_sync.transport.membership import GroupMembership
from miles_sync.weights.fp8 import Fp8Block
from miles_sync.wire.protocol import PauseMode
from miles_sync.wire.text import raise_if

__all__ = ["ControllerStatus", "SyncController"]


@dataclass(frozen=True, kw_only=True)
class ControllerStatus:
    """The controller's state at one moment: the SyncController properties of the same names."""

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
    """Owns one engine fleet's sync state. Call `connect()` once, then `sync()` per training step.

    `lora_name`: sync LoRA adapters under this engine adapter name (miles_sync.sync.lora: the source's
    `adapter_payload`, never the base); None: full syncs. `draft_canary`: the acceptance canary after every
    committed sync (miles_sync.sync.draft_canary); None: none. `gate`: the router in front of the engines, whose
    worker list follows every sync's verdict (miles_sync.sync.routing); None: no router. `version_file`: where every
    committed version is written (atomically), and read at connect, so that numbering continues after a controller
    restart even when every engine restarted too (they then report no version); None: the engines' answers alone.
    From a job's config: `miles_sync.embedding.controller_from_config`. Raises TypeError for a source that does not
    subclass WeightSource, ValueError naming every other problem."""

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
        group: GroupSettings | None = None,
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
        self._spec = _checked_spec(
            engine_urls,
            source=source,
            transport=transport,
            staged=staged,
            lora_name=lora_name,
            lease_wait_s=lease_wait_s,
            pause_mode=PauseMode(pause_mode),
        )
        self._fleet = Fleet(engine_urls)
        self._source = source
        self._selector_inputs = selector_inputs
        self._pause_mode = PauseMode(pause_mode)
        self._verify = verify
        self._timeouts = timeouts
        # The lease outlives a stuck session by at most its TTL; a healthy one renews it every TTL / 3.
        self._lease = SyncLease(ttl_s=timeouts.sync_s) if lease is None else lease
        self._lease_wait_s = lease_wait_s
        self._canary = CanarySettings() if draft_canary is None else draft_canary
        self._lora_name = lora_name
        self._version_file = version_file
        self._version = 0  # last committed
        self._last_attempt = 0  # versions are never reused, not even those of failed syncs
        self._weight_version = ""
        self._routes = RouteKeeper(gate, timeout_s=timeouts.control_s)
        self._connector = EngineConnector(
            timeout_s=timeouts.control_s,
            endpoints=self._spec.endpoints,
            api_key=api_key,
            admin_api_key=admin_api_key,
            guards_draft=verify,
            canary=self._canary,
        )
        self._group = UpdateGroup(
            source=source,
            spec=self._spec,
            settings=GroupSettings() if group is None else group,
            open_s=timeouts.sync_s,
            control_s=timeouts.control_s,
        )
        self._full = FullSync(
            source=source,
            group=self._group,
            routes=self._routes,
            transport=transport,
            selector_inputs=selector_inputs,
            pause_mode=self._pause_mode,
            verify=verify,
            staged=staged,
            timeouts=timeouts,
            quantization=quantization,
            mechanism_check=mechanism_check,
            show_progress=show_progress,
        )
        self._trainer_ranks: tuple[Any, ...] = ()
        self._is_closed = False

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
        return self._fleet.urls

    @property
    def stale_engines(self) -> tuple[str, ...]:
        return self._fleet.stale

    @property
    def serving_engines(self) -> tuple[str, ...]:
        """Engines that hold the committed weights and may take generation traffic (none before `connect`)."""
        return self._fleet.serving

    @property
    def held_engines(self) -> dict[str, str]:
        """Engines left paused because they may hold partial weights -> the reason; a verified sync resumes them."""
        return self._fleet.held

    @property
    def routed_engines(self) -> tuple[str, ...]:
        """The engines the router may send requests to (admitted, not withdrawn since); empty without a router."""
        return self._fleet.routed

    @property
    def progress(self) -> SyncProgress | None:
        """The running (or last) sync's acknowledged buckets so far; None before the first sync."""
        return self._full.progress

    @property
    def memberships(self) -> tuple[GroupMembership, ...]:
        """Every open update group: one per pipeline stage of the source, in stage order (empty when none is)."""
        return self._group.memberships

    @property
    def membership(self) -> GroupMembership | None:
        """The current update group, None when none is open (colocated transport, or re-created at next sync)."""
        return self._group.membership

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
            route_changes=tuple(self._routes.changes),
        )

    # ---- lifecycle ------------------------------------------------------------------------------------------

    async def connect(self) -> tuple[Any, ...]:
        """Connect the source first (a proxy for trainer actors finds its source rank there), then probe every
        engine (refusing one that lacks an endpoint the sync needs), read its TP size and version, and let the
        source refuse engines its transport cannot reach. Engines that disagree on the version are stale until the
        first sync. Returns what the source's `connect()` returned (`trainer_ranks`; empty by default)."""
        self._trainer_ranks = tuple(await self._source.connect())
        for record in await self._connector.connect_all(self._fleet.urls):
            self._fleet.attach(record)
        records = self._fleet.records
        # e.g. a colocated engine without a trainer rank on its node: refused now, not at the first sync
        self._source.check_engines([r.endpoint for r in records])
        await self._connector.read_baselines(records)
        infos = await asyncio.gather(*(r.client.model_info() for r in records))
        versions = [info.weight_version for info in infos]
        self._weight_version = max(set(versions), key=versions.count)
        for record, version in zip(records, versions):
            record.is_behind = version != self._weight_version
        # A restarted controller continues the engines' numbering instead of reissuing versions they served.
        numeric = [int(v) for v in versions if v.isdecimal()]
        persisted = 0 if self._version_file is None else read_committed_version(self._version_file)
        self._version = self._last_attempt = max([*numeric, persisted])
        warnings = await self._routes.reconcile(
            self._fleet, version=self._weight_version, reason="connect", whole_fleet=True
        )
        if warnings:
            raise RuntimeError("; ".join(warnings))  # a router that cannot take the fleet fails the start
        return self._trainer_ranks

    async def _run_canary(self, report: SyncReport) -> SyncReport:
        """The canary after a committed sync on every engine it verified (miles_sync.sync.draft_canary)."""
        verified = self._fleet.records_of([e.url for e in report.engines if e.success])
        outcome = await run_canary(
            {r.url: r.client for r in verified},
            self._canary,
            baselines=self._fleet.canary_baselines,
            version=report.version,
            pause_mode=self._pause_mode,
            timeout_s=self._timeouts.control_s,
        )
        self._fleet.set_canary_baselines(outcome.baselines)
        for url, why in outcome.held.items():
            self._fleet.hold(url, why)
        return replace(report, canary=outcome.readings, warnings=(*report.warnings, *outcome.warnings))

    async def replace_engine(self, old_url: str, new_url: str) -> None:
        """Swap a (dead or restarted) engine for the one at `new_url`. The new engine is stale until the next
        sync, and the group is re-created then, because its membership changed."""
        new_url = new_url.rstrip("/")
        if old_url not in self._fleet:
            raise ValueError(f"engine {old_url} is not in this controller's fleet {list(self._fleet.urls)}")
        if new_url in self._fleet and new_url != old_url:
            raise ValueError(f"engine {new_url} is already in this controller's fleet")
        async with self._lease.hold(f"replace_engine {old_url}", timeout_s=self._lease_wait_s):
            await self._routes.withdraw_or_raise(
                self._fleet, old_url, version=self._weight_version, reason=f"replaced by {new_url}"
            )
            record = await self._connector.connect(new_url)
            record.is_behind = True
            old = self._fleet.replace(old_url, record)
            if old is not None:
                await old.client.close()
            await self._connector.read_baselines([record])
            await self._group.close(self._fleet)

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
        if url in self._fleet:
            raise ValueError(f"engine {url} is already in this controller's fleet")
        async with self._lease.hold(f"add_engine {url}", timeout_s=self._lease_wait_s):
            record = await self._connector.connect(url)
            try:
                self._source.check_engines([record.endpoint])
                await record.client.pause_generation(self._pause_mode, timeout_s=self._timeouts.control_s)
                await self._connector.read_baselines([record])
            except BaseException:
                await record.client.close()
                raise
            record.held = "joined: waits for a sync that verifies on it"
            self._fleet.add(record)
            await self._group.close(self._fleet)

    async def remove_engine(self, url: str) -> None:
        """Drain an engine out of the fleet between syncs: the router stops routing to it first (requests it holds
        finish on it), then it leaves the fleet and the update group is re-created at the next sync. The engine
        itself keeps running; stopping it is its owner's call."""
        url = url.rstrip("/")
        if url not in self._fleet:
            raise ValueError(f"engine {url} is not in this controller's fleet {list(self._fleet.urls)}")
        async with self._lease.hold(f"remove_engine {url}", timeout_s=self._lease_wait_s):
            await self._routes.withdraw_or_raise(
                self._fleet, url, version=self._weight_version, reason="removed from the fleet"
            )
            record = self._fleet.remove(url)
            if record is not None:
                await record.client.close()
            await self._group.close(self._fleet)

    def _check_connected(self, call: str) -> None:
        if self._is_closed or not self._fleet.is_connected:
            raise RuntimeError(f"SyncController.{call} before connect() (or after close())")

    async def close(self) -> None:
        await self._group.close(self._fleet)
        self._is_closed = True  # the records stay: status() still describes the fleet as it was left
        await asyncio.gather(*(r.client.close() for r in self._fleet.records))

    # ---- sync -----------------------------------------------------------------------------------------------

    async def check_engines(self, *, holder: str = "controller") -> FleetCheck:
        """Whether every engine already holds the trainer's current weights, without a sync and without writing to
        any engine (miles_sync.sync.fleet_check): the source hashes its weights, each engine's checker answers.
        Holds the lease (no sync runs meanwhile); bounded by the session timeout. Full-weight syncs only."""
        self._check_connected("check_engines")
        if self._lora_name is not None:
            raise ValueError("check_engines compares full weights; a LoRA sync's engines serve the base checkpoint")
        if not self._source.can_predict:
            raise ValueError(f"{type(self._source).__name__} cannot hash its weights without sending them")
        async with self._lease.hold(holder, timeout_s=self._lease_wait_s):
            return await asyncio.wait_for(
                check_fleet(
                    [r.client for r in self._fleet.records],
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
        self._check_connected("sync")
        async with self._lease.hold(holder, timeout_s=self._lease_wait_s) as held:
            self._last_attempt = max(self._version, self._last_attempt) + 1
            version = str(self._last_attempt)
            if self._lora_name is not None:
                report = await sync_fleet_adapter(
                    self._fleet,
                    source=self._source,
                    name=self._lora_name,
                    version=version,
                    previous_version=self._weight_version,
                    pause_mode=self._pause_mode,
                    timeouts=self._timeouts,
                    verify=self._verify,
                )
            else:
                report = await self._full.run(
                    self._fleet,
                    version=version,
                    previous_version=self._weight_version,
                    committed_version=self._version,
                )
                if report.committed:
                    try:
                        held.check()
                    except LeaseLostError as exc:
                        report = replace(report, committed=False, error=f"not committed: {exc}")
            self._record(report)
            if report.committed and self._canary.is_enabled:
                report = await self._run_canary(report)
            if not report.committed:  # the session already closed the source's side, if it could
                await self._group.destroy_engine_groups(self._fleet)
                await hold_unreachable(self._fleet, report, timeout_s=self._timeouts.control_s)
            routing = await self._routes.reconcile(self._fleet, version=self._weight_version, reason=f"sync v{version}")
            if routing:
                report = replace(report, warnings=(*report.warnings, *routing))
        if not report.committed and raise_on_failure:
            raise SyncError(report)
        return report

    def _record(self, report: SyncReport) -> None:
        self._fleet.record(report)
        if report.committed:
            self._version = int(report.version)
            self._weight_version = report.version
            if self._version_file is not None:
                write_committed_version(self._version_file, self._version)
        else:
            self._group.forget()  # the session tore the transport down on failure; the next sync re-creates it


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
    """The transport's spec; ValueError naming every problem of the controller's arguments at once (TypeError for a
    source that does not subclass WeightSource)."""
    problems = source_problems(source, staged=staged, lora_name=lora_name, pause_mode=pause_mode)
    duplicates = sorted({u for u in engine_urls if list(engine_urls).count(u) > 1})
    if not engine_urls:
        problems.append("engine_urls is empty")
    if duplicates:
        problems.append(f"engine_urls repeat {duplicates}")
    if not lease_wait_s > 0:
        problems.append(f"lease_wait_s={lease_wait_s} must be positive")
    spec = None
    try:
        spec = transport_spec(transport)
    except ValueError as exc:
        problems.append(str(exc))
    raise_if(problems, what="invalid SyncController")
    return spec
