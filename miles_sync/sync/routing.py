"""Routing follows the sync's verdict: which engines a router in front of the fleet may send requests to.

With a router (miles_sync.engine.router) the traffic users send goes wherever the router's worker list says, not
to the controller's `serving_engines`. So the controller keeps that list equal to the engines that serve the
fleet's committed weights:

- an engine a session leaves paused (held: it may hold partial weights, or it died) is withdrawn from the router
  BEFORE the session resumes anything (`run_sync_session(before_resume=...)`), so no request is routed to it from
  the moment the sync's verdict is known;
- an engine that serves the committed weights and is not routed is admitted AFTER the session resumed it: at
  connect (the engines that agree on the version), after the first sync that verifies on a held engine, and after
  the first sync that verifies on a joiner (`SyncController.add_engine`); a joiner is never routed before that;
- a removed engine (`remove_engine`) is withdrawn first, then dropped from the fleet.

Requests that reached an engine while a sync paused it, and that the sync then held, wait on that engine (as
without a router) until a later verified sync resumes it or the client's timeout; the router sends it no new ones.
A gate call that fails is a warning in the sync's report, and the next sync reconciles again: a failed withdraw
leaves the engine paused (it serves nothing), a failed admit leaves a serving engine without routed traffic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from miles_sync.sync.fleet import Fleet
from miles_sync.wire.codec import WireEnum

__all__ = ["TrafficGate"]


class TrafficGate(Protocol):
    """A router's worker list as the controller changes it (miles_sync.engine.router.RouterClient). Both calls
    return once the router shows the change, and are idempotent."""

    async def admit(self, url: str) -> None: ...

    async def withdraw(self, url: str) -> None: ...


class RouteAction(WireEnum):
    ADMITTED = "admitted"
    WITHDRAWN = "withdrawn"


@dataclass(frozen=True, kw_only=True)
class RouteChange:
    """One change of the router's worker list, for the run report."""

    url: str
    action: RouteAction
    version: str  # the fleet's committed version when it happened
    reason: str


@dataclass(frozen=True, kw_only=True)
class RoutingPlan:
    withdraw: tuple[str, ...]
    admit: tuple[str, ...]


def plan_routing(*, fleet: Collection[str], routed: Collection[str], serving: Collection[str]) -> RoutingPlan:
    """What brings the routed set to the serving engines of the fleet: withdraw every routed engine that does not
    serve (or left the fleet), admit every serving engine that is not routed; in fleet order. Pure."""
    order = list(fleet) + sorted(set(routed) - set(fleet))
    return RoutingPlan(
        withdraw=tuple(u for u in order if u in routed and (u not in serving or u not in fleet)),
        admit=tuple(u for u in fleet if u in serving and u not in routed),
    )


async def apply_gate(gate: TrafficGate, url: str, *, action: RouteAction, timeout_s: float) -> str | None:
    """One gate call within `timeout_s`; the warning when it failed, else None. Never raises."""
    call = gate.admit if action is RouteAction.ADMITTED else gate.withdraw
    try:
        await asyncio.wait_for(call(url), timeout=timeout_s)
    except Exception as exc:
        verb = "admitting" if action is RouteAction.ADMITTED else "withdrawing"
        return f"router: {verb} {url} failed: {str(exc) or type(exc).__name__ + f' within {timeout_s} s'}"
    return None


class RouteKeeper:
    """Keeps a router's worker list equal to the fleet's serving engines (module docstring) and records every change
    that took (`changes`, oldest first). Withdraws before it admits. Without a gate every call does nothing."""

    def __init__(self, gate: TrafficGate | None, *, timeout_s: float) -> None:
        self._gate = gate
        self._timeout_s = timeout_s
        self.changes: list[RouteChange] = []

    async def reconcile(self, fleet: Fleet, *, version: str, reason: str, whole_fleet: bool = False) -> list[str]:
        """Bring the router to the fleet's serving engines; `version`: the committed one. `whole_fleet`: assume
        nothing about what the router lists (at connect: a router may list engines this controller never
        admitted). Returns warnings; never raises."""
        if self._gate is None:
            return []
        urls, serving = fleet.urls, fleet.serving
        plan = plan_routing(fleet=urls, routed=fleet.routed, serving=serving)
        withdraw, admit = plan.withdraw, plan.admit
        if whole_fleet:  # the gate's calls are idempotent: withdraw every non-serving engine, admit every serving one
            withdraw = plan_routing(fleet=urls, routed=urls, serving=serving).withdraw
            admit = plan_routing(fleet=urls, routed=(), serving=serving).admit
        held = fleet.held
        reasons = {u: held.get(u, f"not serving the committed version ({reason})") for u in withdraw}
        serves = f"v{version}" if version.isdecimal() else "the weights it loaded"
        reasons |= {u: f"serving {serves} ({reason})" for u in admit}
        return await self._apply(fleet, withdraw=withdraw, admit=admit, reasons=reasons, version=version)

    async def withdraw_routed(self, fleet: Fleet, urls: Sequence[str], *, version: str, reason: str) -> list[str]:
        """Withdraw those of `urls` the router lists (the session's hook before its resume). Never raises."""
        routed = [u for u in urls if fleet[u].is_routed]
        return await self._apply(
            fleet, withdraw=routed, admit=(), reasons=dict.fromkeys(routed, reason), version=version
        )

    async def withdraw_or_raise(self, fleet: Fleet, url: str, *, version: str, reason: str) -> None:
        """Withdraw `url` before it leaves the fleet; raises when the router still lists it (an engine must never
        leave the controller's watch while routed)."""
        warnings = await self._apply(fleet, withdraw=[url], admit=(), reasons={url: reason}, version=version)
        if warnings:
            raise RuntimeError("; ".join(warnings))

    async def _apply(
        self,
        fleet: Fleet,
        *,
        withdraw: Sequence[str],
        admit: Sequence[str],
        reasons: Mapping[str, str],
        version: str,
    ) -> list[str]:
        if self._gate is None:
            return []
        warnings = []
        for urls, action in ((withdraw, RouteAction.WITHDRAWN), (admit, RouteAction.ADMITTED)):
            results = await asyncio.gather(
                *(apply_gate(self._gate, u, action=action, timeout_s=self._timeout_s) for u in urls)
            )
            for url, warning in zip(urls, results):
                if warning is not None:
                    warnings.append(warning)
                    continue
                fleet[url].is_routed = action is RouteAction.ADMITTED
                self.changes.append(RouteChange(url=url, action=action, version=version, reason=reasons[url]))
        return warnings
