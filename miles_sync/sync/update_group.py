"""The transport a controller's syncs go over, and the update groups it meets the engines in.

A controller opens it before a sync when none is open and keeps it open across syncs. It is torn down when the
fleet's membership changes (an engine joined, left or was replaced) and after a failed sync (the session closed the
source's side), and re-created at the next sync under a fresh group name: an engine that missed a teardown still
has the old group, and a name is never reused, not even by a restarted controller (a random token per controller).
The port always comes from the OS at creation.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, replace

from miles_sync.sync.engine_digests import read_direct_layouts
from miles_sync.sync.fleet import Fleet
from miles_sync.sync.pipeline import stage_group_names
from miles_sync.sync.weight_source import WeightSource
from miles_sync.transport.base import TransportSpec
from miles_sync.transport.membership import EngineEndpoint, GroupMembership, plan_membership
from miles_sync.wire.protocol import DEFAULT_GROUP_NAME, DestroyWeightsUpdateGroupRequest


@dataclass(frozen=True, kw_only=True)
class GroupSettings:
    """Where and how the update group meets; the port always comes from the OS at creation. `master_address`
    None: on the source rank's own node (each pipeline stage's group on its stage source's node)."""

    name: str = DEFAULT_GROUP_NAME
    backend: str = "gloo"
    master_address: str | None = None


class UpdateGroup:
    """The source's transport to a fleet (module docstring). Every call is bounded: `open_s` for opening and
    closing the source's side, `control_s` for each engine call."""

    def __init__(
        self,
        *,
        source: WeightSource,
        spec: TransportSpec,
        settings: GroupSettings,
        open_s: float,
        control_s: float,
    ) -> None:
        self._source = source
        self._spec = spec
        self._settings = settings
        self._open_s = open_s
        self._control_s = control_s
        self._membership: GroupMembership | None = None
        self._is_open = False
        self._generation = 0
        self._token = uuid.uuid4().hex[:8]
        # The engines' side of these groups (one per pipeline stage) may exist until they are destroyed.
        self._names: tuple[str, ...] = ()

    @property
    def is_open(self) -> bool:
        return self._is_open

    @property
    def membership(self) -> GroupMembership | None:
        """The current update group (the first stage's), None when none is open or the transport has none."""
        return self._membership if self._is_open else None

    @property
    def memberships(self) -> tuple[GroupMembership, ...]:
        """Every open update group: one per pipeline stage of the source, in stage order (empty when none is)."""
        if self.membership is None:
            return ()
        stages = tuple(m for m in self._source.memberships if m is not None)
        return stages or (self._membership,)

    async def open(self, fleet: Fleet) -> str:
        """(Re-)create the transport to every engine of `fleet` unless it is open; "" when it is, else why not
        (everything it opened is torn down again)."""
        if self._is_open:
            return ""
        try:
            endpoints = await self._endpoints(fleet)
        except ValueError as exc:
            return f"transport set-up failed: {exc}"
        membership = None
        if self._spec.opens_update_group():
            name = f"{self._settings.name}_{self._token}_{self._generation}"
            # A source with pipeline stages opens one group per stage under names derived from this one.
            self._names = stage_group_names(name, num_stages=self._source.num_stages)
            membership = plan_membership(
                engines=endpoints,
                group_name=name,
                backend=self._settings.backend,
                master_address=self._settings.master_address,
            )
            self._generation += 1
        try:
            self._membership = await asyncio.wait_for(
                self._source.open(engines=endpoints, membership=membership), timeout=self._open_s
            )
        except Exception as exc:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._source.close(), timeout=self._control_s)
            await self.destroy_engine_groups(fleet)
            return f"transport set-up failed: {str(exc) or type(exc).__name__}"
        self._is_open = True
        return ""

    def forget(self) -> None:
        """A failed session tore the transport down: the next sync opens a new one."""
        self._is_open = False
        self._membership = None

    async def close(self, fleet: Fleet) -> None:
        """Close the source's side; when that fails, ask the fleet's engines to destroy theirs."""
        self.forget()
        try:
            await asyncio.wait_for(self._source.close(), timeout=self._open_s)
        except Exception:
            await self.destroy_engine_groups(fleet)  # the source rank could not ask the engines itself
        else:
            self._names = ()  # the source's transports destroyed the engines' side

    async def destroy_engine_groups(self, fleet: Fleet) -> None:
        """Ask every engine to destroy its side of the current groups. The source rank's transport does this when
        it closes, but a source rank that died (or whose close timed out) cannot: without this the engines would
        hold the group's sockets and threads for the rest of their life. An engine that has no such group, or is
        dead, refuses; that is the expected answer after a clean close and is ignored."""
        names, self._names = self._names, ()
        await asyncio.gather(
            *(
                engine.destroy_weights_update_group(
                    DestroyWeightsUpdateGroupRequest(group_name=name), timeout_s=self._control_s
                )
                for name in names
                for engine in (r.client for r in fleet.records)
            ),
            return_exceptions=True,
        )

    async def _endpoints(self, fleet: Fleet) -> list[EngineEndpoint]:
        """The engines as the transport opens them: with each one's parameter layout where the transport sends the
        engines' own parameters (ValueError naming each engine whose layout is unknown)."""
        records = fleet.records
        if not self._spec.sends_engine_parameters():
            return [r.endpoint for r in records]
        layouts = await read_direct_layouts([r.client for r in records])
        return [replace(r.endpoint, direct=layouts.get(r.url)) for r in records]
