"""Rollout actors: one `miles_sync.engine.rollout.RolloutWorker` per engine, wrapped with `ray.remote` here.

Each actor launches its engine server as a subprocess on its own node, bound to that node's address (actors.node),
and talks to it over HTTP; the controller and trainers are given the servers' URLs, which name those addresses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from actors.node import NodeAddress, adopt_node_address, node_address_of
from actors.placement import PlacedGroups
from miles_sync.engine.kinds import EngineSpec
from miles_sync.engine.rollout import RolloutWorker
from miles_sync.job.placement import DEFAULT_ENGINE_RESOURCES, Resources

__all__ = ["DEFAULT_ENGINE_RESOURCES", "EngineGroup", "NodeRolloutWorker", "create_engines"]


class NodeRolloutWorker(RolloutWorker):
    """A RolloutWorker whose server binds its node's address (actors.node); the server process inherits the adopted
    address, so its update groups and TP rank processes bind there too. `bind_host`: `cluster.bind_host`."""

    def __init__(self, *, bind_host: str | None = None, **kwargs: Any) -> None:
        self.node_address = adopt_node_address(bind_host)
        super().__init__(host=self.node_address.bind_host, **kwargs)


@dataclass(frozen=True, kw_only=True)
class EngineGroup:
    """The rollout actors, in engine order, the URL each engine served at start, and each engine's node."""

    actors: tuple[Any, ...]
    urls: tuple[str, ...]
    nodes: tuple[NodeAddress, ...] = ()

    def shutdown(self, *, timeout_s: float = 60.0) -> None:
        """Stop every server, then end the actors. Best effort, never raises."""
        try:
            ray.get([a.stop.remote() for a in self.actors], timeout=timeout_s)
        except Exception:  # a dead actor's server died with it
            pass
        for actor in self.actors:
            ray.kill(actor)


def create_engines(
    *,
    specs: Sequence[EngineSpec],
    log_dir: str | Path,
    placement: PlacedGroups | None = None,
    resources: Resources = DEFAULT_ENGINE_RESOURCES,
    bind_host: str | None = None,
    http_timeout_s: float = 60.0,
    timeout_s: float = 300.0,
) -> EngineGroup:
    """Start one rollout actor per spec and its server, bound to its node's address (or `bind_host`, the explicit
    `cluster.bind_host`); returns once every server is healthy (or raises, after stopping them all)."""
    remote_class = ray.remote(NodeRolloutWorker)
    actors = [
        remote_class.options(
            **(resources.as_actor_options() if placement is None else placement.engine_options(i))
        ).remote(
            spec=spec,
            log_dir=str(log_dir),
            bind_host=bind_host,
            http_timeout_s=http_timeout_s,
            startup_timeout_s=timeout_s,
        )
        for i, spec in enumerate(specs)
    ]
    group = EngineGroup(actors=tuple(actors), urls=())
    try:
        urls = ray.get([a.start.remote() for a in actors], timeout=timeout_s)
        nodes = [node_address_of(a, timeout_s=timeout_s) for a in actors]
    except BaseException:
        group.shutdown()
        raise
    return EngineGroup(actors=tuple(actors), urls=tuple(urls), nodes=tuple(nodes))
