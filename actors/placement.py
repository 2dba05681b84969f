"""Placement groups on a running Ray cluster: executes a `miles_sync.job.placement.PlacementPlan`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.util import placement_group

from miles_sync.job.placement import ActorSlot, PlacementPlan

__all__ = ["PlacedGroups", "create_placement_groups"]


class PlacedGroups:
    """The placement groups of a plan, created and ready (see `create_placement_groups`). `remove()` in finally."""

    def __init__(self, plan: PlacementPlan, groups: Sequence[Any] = ()) -> None:
        self.plan = plan
        self.groups = tuple(groups)  # ray.util.placement_group.PlacementGroup, in plan order

    def actor_options(self, slot: ActorSlot) -> dict[str, Any]:
        """`ActorClass.options(...)` keyword arguments that put an actor in `slot`'s bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.groups[slot.group],
            placement_group_bundle_index=slot.bundle,
            # Tasks the actor starts are not squeezed into the bundle the actor already fills.
            placement_group_capture_child_tasks=False,
        )
        return {**slot.resources.as_actor_options(), "scheduling_strategy": strategy}

    def trainer_options(self, rank: int) -> dict[str, Any]:
        return self.actor_options(self.plan.trainers[rank])

    def engine_options(self, index: int) -> dict[str, Any]:
        return self.actor_options(self.plan.engines[index])

    def remove(self) -> None:
        """Remove every group (their actors die with them). Idempotent."""
        from ray.util import remove_placement_group

        groups, self.groups = self.groups, ()
        for group in groups:
            remove_placement_group(group)


def create_placement_groups(plan: PlacementPlan, *, timeout_s: float, name_prefix: str | None = None) -> PlacedGroups:
    """Create the plan's placement groups and wait until all are placed. Raises TimeoutError naming the groups
    that could not be placed within `timeout_s` (the cluster lacks the resources); nothing is left behind then."""

    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s} must be positive")
    placed = PlacedGroups(plan=plan)
    created = []
    try:
        for group in plan.groups:
            name = "" if name_prefix is None else f"{name_prefix}-{group.name}"
            created.append(placement_group([b.as_bundle() for b in group.bundles], strategy=group.strategy, name=name))
        placed.groups = tuple(created)
        refs = [g.ready() for g in created]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            waiting = [
                f"{group.name} {[b.as_bundle() for b in group.bundles]}"
                for group, ref in zip(plan.groups, refs)
                if ref in pending
            ]
            raise TimeoutError(
                f"placement groups not placed within {timeout_s} s (the cluster lacks the resources?): "
                + "; ".join(waiting)
            )
    except BaseException:
        placed.remove()
        raise
    return placed
