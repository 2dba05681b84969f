"""LoRA sync: only the adapter travels, through SGLang's `/load_lora_adapter_from_tensors`; the base never does.

    payload = encode_adapter(named, config_dict=..., tp_sizes={1, 2}, ...)   # trainer's source (sync/adapter.py)
    report = await run_lora_sync_session(engines=..., payload=payload, name="policy", version="3", ...)

The flow of one LoRA sync, read from SGLang 0.5.23's source:

    pause (barrier) -> flush (unless in_place) -> [base/draft checksums] -> load the adapter as <name>-v<version>
    -> version -> [base/draft checksums again: unchanged] -> unload the previous version's adapter
    continue_generation on every engine that may serve, also on failure

- No begin/end session: SGLang's adapter load is its own scheduler request (tp_worker.load_lora_adapter_from_tensors)
  that never enters a weight-update session, carries no selector and is applied by the target's LoRA manager only;
  an /end_weight_update would run post-load processing on runners that received nothing (with the AITER layout
  the base, and the frozen draft, would be shuffled again: the frozen-draft bug of the README's seed-bug
  section). So a LoRA sync never calls begin/end and touches no base or draft byte.
- SGLang refuses to load a name that is already loaded ("already loaded"), so replacing an adapter in place is
  unload + load, and a failed load would leave no adapter at all. Each version is therefore loaded under its own
  name (`adapter_name`) and the previous one unloaded only after the new one committed: a corrupted transfer,
  refused by the engine, leaves the previous adapter serving and the engine in service.
- The engine verifies: `expected_checksums` (SHA-256 of each full tensor, which every TP rank receives whole and
  checks itself before slicing) makes the engine refuse a corrupted transfer.
- The version is committed only when every engine loaded the adapter and took the version.

The session runs in the frame every sync kind shares (miles_sync.sync.frame: fleet steps, phase clock, resume in
`finally`, the stale rule, the report), as an all-or-nothing session in which no step can leave partial weights.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence

from miles_sync.sync.adapter import AdapterPayload
from miles_sync.sync.fleet import Fleet
from miles_sync.sync.frame import FleetSteps, PhaseClock, SessionRun, SessionTimeouts, run_in_frame, session_report
from miles_sync.sync.report import SyncReport
from miles_sync.sync.verify import weights_digest
from miles_sync.sync.weight_source import SendResult, WeightSource
from miles_sync.wire.api import EngineAPI
from miles_sync.wire.protocol import (
    PauseMode,
    Selector,
    UnloadLoRAAdapterRequest,
    WeightsCheckerAction,
    WeightsCheckerRequest,
)

__all__ = ["adapter_name"]

LORA_TRANSPORT = "lora"  # the report's transport name


def adapter_name(name: str, version: str) -> str:
    """The engine adapter name of version `version` (what rollouts pass as `lora_path` once it is committed)."""
    return f"{name}-v{version}"


async def run_lora_sync_session(
    *,
    engines: Sequence[EngineAPI],
    tp_sizes: Mapping[str, int],
    payload: Callable[[], Awaitable[AdapterPayload]],
    name: str,
    version: str,
    previous_version: str,
    pause_mode: PauseMode,
    timeouts: SessionTimeouts,
    previous: Mapping[str, str] | None = None,
    held: Collection[str] = (),
    verify: bool = True,
) -> SyncReport:
    """One LoRA sync of every engine (module docstring), loading the adapter as `adapter_name(name, version)`.
    `payload()` exports and encodes the adapter (after the pause). `previous`: URL -> the adapter name an engine
    serves now, unloaded once the new one is in and the sync committed; `held`: URLs kept paused since an earlier
    failure, resumed only by a sync that completes on them. `verify`: besides the engine's own expected_checksums
    check, read every engine's checksums of its base and draft weights (weights checker, selector all) after the
    pause and after the load; any difference fails the sync and leaves that engine paused (stale). Never raises
    for a failed sync: see the report. A failed load leaves every engine serving its previous adapter (the new
    name is unloaded wherever it did load)."""
    previous = {} if previous is None else dict(previous)
    new_name = adapter_name(name, version)
    last_step = "base-after" if verify else "version"
    # All or nothing: unless every engine took the new adapter it is unloaded everywhere. No step of a LoRA sync
    # writes base or draft weights, so none leaves partial weights; an engine whose base changed anyway is marked.
    fleet = FleetSteps(
        engines, timeout_s=timeouts.control_s, last_step=last_step, held=held, partial_from=None, all_or_nothing=True
    )
    clock, run = PhaseClock(), SessionRun()
    flow = _LoraFlow(fleet, clock=clock, run=run, payload=payload, tp_sizes=tp_sizes, version=version)

    async def settle() -> None:
        # Committed: the previous adapters go. Failed: the new one goes wherever it loaded; the previous one serves.
        loaded = {url: new_name for url, state in fleet.state.items() if "load" in state.done}
        with clock.phase("finalize"):
            run.warnings += await _unload(fleet, previous if fleet.is_complete else loaded)

    await run_in_frame(
        fleet,
        flow=lambda: flow.run(pause_mode=pause_mode, name=new_name, verify=verify),
        run=run,
        clock=clock,
        sync_s=timeouts.sync_s,
        pause_mode=pause_mode,
        in_place_flush_s=timeouts.in_place_flush_s,
        settle=settle,
    )
    return session_report(
        fleet, run, clock, version=version, previous_version=previous_version, transport=LORA_TRANSPORT, is_checked=True
    )


async def sync_fleet_adapter(
    fleet: Fleet,
    *,
    source: WeightSource,
    name: str,
    version: str,
    previous_version: str,
    pause_mode: PauseMode,
    timeouts: SessionTimeouts,
    verify: bool,
) -> SyncReport:
    """One LoRA sync of `fleet` from `source`'s `adapter_payload` (run_lora_sync_session); once it committed, every
    engine's record names the adapter it now serves. The source's payload is released either way."""

    async def payload() -> AdapterPayload:
        return await source.adapter_payload(tp_sizes=sorted(set(fleet.tp_sizes.values())))

    try:
        report = await run_lora_sync_session(
            engines=[r.client for r in fleet.records],
            tp_sizes=fleet.tp_sizes,
            payload=payload,
            name=name,
            version=version,
            previous_version=previous_version,
            pause_mode=pause_mode,
            timeouts=timeouts,
            previous={r.url: r.lora_served for r in fleet.records if r.lora_served is not None},
            held=tuple(fleet.held),
            verify=verify,
        )
    finally:
        with contextlib.suppress(Exception):  # the payload's tensors are no longer needed
            await asyncio.wait_for(source.release_adapter(), timeout=timeouts.control_s)
    if report.committed:
        for record in fleet.records:
            record.lora_served = adapter_name(name, version)
    return report


class _LoraFlow:
    """The steps of one LoRA sync inside the frame (module docstring)."""

    def __init__(
        self,
        fleet: FleetSteps,
        *,
        clock: PhaseClock,
        run: SessionRun,
        payload: Callable[[], Awaitable[AdapterPayload]],
        tp_sizes: Mapping[str, int],
        version: str,
    ) -> None:
        self._fleet, self._clock, self._run = fleet, clock, run
        self._payload, self._tp_sizes, self._version = payload, tp_sizes, version

    async def run(self, *, pause_mode: PauseMode, name: str, verify: bool) -> None:
        fleet, clock, t = self._fleet, self._clock, self._fleet.timeout_s
        with clock.phase("pause"):
            await fleet.step("pause", lambda e: e.pause_generation(pause_mode, timeout_s=t))
            if pause_mode is not PauseMode.IN_PLACE:
                await fleet.flush_while_paused()
        before = await self._base_digests("base-before") if verify else {}
        with clock.phase("export"):
            sent = await self._payload()
        self._run.sent = SendResult(
            num_bytes=sent.num_bytes,
            num_buckets=1,
            num_tensors=sent.num_tensors,
            checksums=dict(sent.checksums),
            export_s=clock.seconds["export"],
            pack_s=0.0,
            send_s=0.0,
        )
        with clock.phase("send"):
            requests = {url: sent.request(name=name, tp_size=tp) for url, tp in self._tp_sizes.items()}
            await fleet.step("load", lambda e: e.load_lora_adapter_from_tensors(requests[e.url], timeout_s=t))
        for state in fleet.state.values():  # the engine's own expected_checksums check passed on each
            state.checks.append("engine-checksums")
            state.num_verified = sent.num_tensors
        with clock.phase("finalize"):
            await fleet.step("version", lambda e: e.update_weight_version(self._version, timeout_s=t))
        if verify:
            after = await self._base_digests("base-after")
            changed = [url for url in after if after[url] != before.get(url)]
            for url in changed:
                fleet.mark_stale(url, "its base or draft weights changed during a LoRA sync")
            if changed:
                raise RuntimeError(f"a LoRA sync changed the base or draft weights of {changed}")
            for state in fleet.state.values():
                state.checks.append("base-unchanged")

    async def _base_digests(self, what: str) -> dict[str, str]:
        """Every engine's base and draft checksums (weights checker, selector all), as one digest each."""
        request = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=Selector.ALL)
        with self._clock.phase("verify"):
            results = await self._fleet.step(
                what, lambda e: e.weights_checker(request, timeout_s=self._fleet.timeout_s)
            )
        return {e.url: weights_digest(r.ranks, selector=Selector.ALL) for e, r in zip(self._fleet.engines, results)}


async def _unload(fleet: FleetSteps, leaving: Mapping[str, str]) -> list[str]:
    """Unload `leaving` (URL -> adapter name) from those engines; a warning per failure, never raises."""
    engines = [e for e in fleet.engines if e.url in leaving]
    t = fleet.timeout_s
    results = await asyncio.gather(
        *(
            asyncio.wait_for(e.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=leaving[e.url]), timeout_s=t), t)
            for e in engines
        ),
        return_exceptions=True,
    )
    return [
        f"{e.url}: unloading {leaving[e.url]!r} failed: {r}"
        for e, r in zip(engines, results)
        if isinstance(r, BaseException)
    ]
