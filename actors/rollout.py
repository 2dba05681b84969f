"""Rollout actors: one `miles_sync.engine.rollout.RolloutWorker` per engine, wrapped with `ray.remote` here.

Each actor launches its engine server as a subprocess on its own node and talks to it over HTTP; the controller
and trainers are given the servers' URLs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from actors.placement import PlacedGroups
from miles_sync.engine.kinds import EngineSpec
from miles_sync.engine.rollout import RolloutWorker
from miles_sync.job.placement import Resources

__all__ = ["DEFAULT_ENGINE_RESOURCES", "EngineGroup", "create_engines"]

DEFAULT_ENGINE_RESOURCES = Resources(num_cpus=0.01)


@dataclass(frozen=True, kw_only=True)
class EngineGroup:
    """The rollout actors, in engine order, and the URL each engine served at start."""

    actors: tuple[Any, ...]
    urls: tuple[str, ...]

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
    host: str = "127.0.0.1",
    http_timeout_s: float = 60.0,
    timeout_s: float = 300.0,
) -> EngineGroup:
    """Start one rollout actor per spec and its server; returns once every server is healthy (or raises, after
    stopping them all)."""
    remote_class = ray.remote(RolloutWorker)
    actors = [
        remote_class.options(
            **(resources.as_actor_options() if placement is None else placement.engine_options(i))
        ).remote(spec=spec, log_dir=str(log_dir), host=host, http_timeout_s=http_timeout_s, startup_timeout_s=timeout_s)
        for i, spec in enumerate(specs)
    ]
    group = EngineGroup(actors=tuple(actors), urls=())
    try:
        urls = ray.get([a.start.remote() for a in actors], timeout=timeout_s)
    except BaseException:
        group.shutdown()
        raise
    return EngineGroup(actors=tuple(actors), urls=tuple(urls))
