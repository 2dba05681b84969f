"""Test-side hooks inside trainer actors: act at a precise point of a sync from the test, with no hook in the product.

    wrap_calls(trainers.actors, GATHERED_UNIT, refuse)   # refuse(index) runs before each unit the gather builds
    try: ... finally: unwrap_calls(trainers.actors, GATHERED_UNIT)

`wrap_calls` replaces a module attribute in each actor's process (through `__ray_call__`) by a function that runs
`action(index)` (index: that process's calls since it was wrapped, from 0) and then the original; an exception
`action` raises is what the caller of the original sees. The targets name the points the drills need:

- GATHERED_UNIT: miles_sync.export.megatron builds one ExportedUnit per unit the gather export yields, on every
  rank of the stage, after that unit's collectives: a routed sync never builds one; an action raising on every rank
  at the same index fails the export without leaving a peer inside a collective;
- P2P_TRANSFER: miles_sync.transport.p2p sends each bucket's parameters of one engine over its channel through
  send_params, on the feeder's channel thread, once the engine's tickets are out.

`action` runs in the actor, so it travels by value: define it inside the test function (Ray pickles a nested
function by value; this module's functions, and the test module's, cannot be imported in an actor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ray

GATHERED_UNIT = ("miles_sync.export.megatron", "ExportedUnit")
P2P_TRANSFER = ("miles_sync.transport.p2p", "send_params")
_TIMEOUT_S = 60.0


def wrap_calls(actors: Sequence[Any], target: tuple[str, str], action: Callable[[int], None]) -> None:
    """Wrap `target` (module, attribute) in every actor's process with `action` (module docstring). Wrapping again
    replaces the earlier action."""
    module_name, name = target

    def arm(actor: object) -> None:
        import importlib
        import itertools

        module = importlib.import_module(module_name)
        original = getattr(module, name)
        original = getattr(original, "__wrapped__", original)
        count = itertools.count()

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            action(next(count))
            return original(*args, **kwargs)

        wrapped.__wrapped__ = original
        setattr(module, name, wrapped)

    ray.get([a.__ray_call__.remote(arm) for a in actors], timeout=_TIMEOUT_S)


def unwrap_calls(actors: Sequence[Any], target: tuple[str, str]) -> None:
    """Put `target` back as it was in every (living) actor's process."""
    module_name, name = target

    def disarm(actor: object) -> None:
        import importlib

        module = importlib.import_module(module_name)
        current = getattr(module, name)
        setattr(module, name, getattr(current, "__wrapped__", current))

    ray.get([a.__ray_call__.remote(disarm) for a in actors], timeout=_TIMEOUT_S)


def refuse_gather(actors: Sequence[Any]) -> None:
    """Make the gather export fail on every trainer rank of `actors` (undone by `unwrap_calls(actors, GATHERED_UNIT)`):
    a routed sync, which sends each rank's own shards, must never enter it."""

    def refuse(index: int) -> None:  # nested: Ray pickles it by value into the trainer processes
        raise AssertionError(f"unit {index} went through the gather export: a routed sync gathers nothing")

    wrap_calls(actors, GATHERED_UNIT, refuse)
