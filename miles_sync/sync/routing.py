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
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

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
