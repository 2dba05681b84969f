"""Where trainer ranks and rollout engines run: placement-group bundles planned as pure records, then created.

Two layouts:
- colocated: trainer rank i and the engine that serves on it share bundle i (one node, one GPU on GPU clusters),
  so the colocated transport can hand tensors over by CUDA IPC / shared memory. Engine j's first TP rank sits on
  bundle j * engine_tp_size; every bundle hosts one trainer rank and, in total, one engine TP rank.
- disaggregated: trainers and engines in two placement groups of their own, each packed onto as few nodes as fit;
  custom node resources (e.g. {"trainer_node": 1} vs {"rollout_node": 1}) pin each group to its pool of nodes.

`plan_placement` is pure and table-tested; `actors.placement.create_placement_groups` executes a plan on a
running Ray cluster and
hands out each actor's scheduling strategy. `plan_colocated_feeds` turns a colocated plan into the colocated
transport's feed assignment: engine j's TP rank r (bundle j * engine_tp_size + r) is fed by the trainer rank on its
bundle.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from miles_sync.config import PLACEMENT_STRATEGIES, MilesSyncConfig
from miles_sync.transport.base import transport_spec
from miles_sync.transport.feeds import Device, FeedPlan, plan_feeds
from miles_sync.wire.text import raise_if

__all__ = [
    "ActorSlot",
    "DEFAULT_ENGINE_RESOURCES",
    "DEFAULT_TRAINER_RESOURCES",
    "PlacementPlan",
    "Resources",
    "job_feed_plan",
    "job_placement",
]


class PlacementLayout(str, Enum):
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"


class ActorRole(str, Enum):
    TRAINER = "trainer"
    ENGINE = "engine"


@dataclass(frozen=True, kw_only=True)
class Resources:
    """What one actor asks for (or one bundle holds). `custom`: (resource name, amount) pairs, e.g. node pools."""

    num_cpus: float = 0.0
    num_gpus: float = 0.0
    custom: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        problems = [f"{name}={value} must be >= 0" for name, value in self._amounts().items() if value < 0]
        names = [name for name, _ in self.custom]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            problems.append(f"custom resources {repeated} are listed more than once")
        reserved = sorted({n for n in names if n in ("CPU", "GPU")})
        if reserved:
            problems.append(f"custom resources {reserved} must be given as num_cpus / num_gpus")
        raise_if(problems, what="invalid Resources")

    def __add__(self, other: Resources) -> Resources:
        custom = dict(self.custom)
        for name, amount in other.custom:
            custom[name] = custom.get(name, 0.0) + amount
        return Resources(
            num_cpus=self.num_cpus + other.num_cpus,
            num_gpus=self.num_gpus + other.num_gpus,
            custom=tuple(sorted(custom.items())),
        )

    @property
    def is_empty(self) -> bool:
        return not any(self._amounts().values())

    def as_bundle(self) -> dict[str, float]:
        """Ray's bundle dict ({"CPU": .., "GPU": .., name: ..}); zero amounts are left out."""
        bundle = {"CPU": self.num_cpus, "GPU": self.num_gpus, **dict(self.custom)}
        return {name: amount for name, amount in bundle.items() if amount > 0}

    def as_actor_options(self) -> dict[str, Any]:
        """Keyword arguments for `ActorClass.options(...)`."""
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "resources": dict(self.custom)}

    def _amounts(self) -> dict[str, float]:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, **{f"custom[{n}]": a for n, a in self.custom}}


@dataclass(frozen=True, kw_only=True)
class BundleGroup:
    """One placement group to create: a name (for logs), Ray's strategy and its bundles."""

    name: str
    strategy: str
    bundles: tuple[Resources, ...]


@dataclass(frozen=True, kw_only=True)
class ActorSlot:
    """Where one actor goes: group `group`, bundle `bundle`, asking for `resources` out of that bundle."""

    role: ActorRole
    index: int  # trainer rank or engine index
    group: int
    bundle: int
    resources: Resources


@dataclass(frozen=True, kw_only=True)
class PlacementPlan:
    layout: PlacementLayout
    groups: tuple[BundleGroup, ...]
    trainers: tuple[ActorSlot, ...]
    engines: tuple[ActorSlot, ...]
    engine_tp_size: int = 1  # an engine's TP ranks sit on consecutive bundles from its slot's bundle on

    def slots(self) -> tuple[ActorSlot, ...]:
        return self.trainers + self.engines


def plan_placement(
    *,
    layout: PlacementLayout | str,
    num_trainers: int,
    num_engines: int,
    trainer: Resources,
    engine: Resources,
    engine_tp_size: int = 1,
    strategy: str = "PACK",
    engine_strategy: str | None = None,
) -> PlacementPlan:
    """Bundles and slots for `num_trainers` trainer ranks and `num_engines` engines. Pure.

    `strategy`: Ray's strategy for the trainers' group (colocated: the one shared group); `engine_strategy` for the
    engines' group of a disaggregated plan (None: `strategy`), e.g. PACK trainers onto one node and STRICT_SPREAD
    engines one per node.

    `trainer` / `engine` are what one actor asks for; a colocated bundle holds one trainer's resources plus, on
    the bundles where an engine's first TP rank sits, that engine's. Raises ValueError naming every bad value
    (non-positive counts, an unknown strategy, empty resources, or a colocated layout whose engine TP ranks do
    not cover the trainer ranks one to one).
    """
    problems = []
    try:
        layout = PlacementLayout(layout)
    except ValueError:
        problems.append(f"layout={layout!r} is not one of {[m.value for m in PlacementLayout]}")
    counts = {"num_trainers": num_trainers, "num_engines": num_engines, "engine_tp_size": engine_tp_size}
    problems.extend(f"{name}={value} must be at least 1" for name, value in counts.items() if value < 1)
    if engine_strategy is None:
        engine_strategy = strategy
    for name, value in (("strategy", strategy), ("engine_strategy", engine_strategy)):
        if value not in PLACEMENT_STRATEGIES:
            problems.append(f"{name}={value!r} is not one of {list(PLACEMENT_STRATEGIES)}")
    # Ray refuses empty bundles; a zero-resource actor could also land anywhere, defeating the plan.
    for name, resources in (("trainer", trainer), ("engine", engine)):
        if resources.is_empty:
            problems.append(f"{name} resources are empty; give each actor a (fractional) CPU or GPU share")
    if not problems and layout is PlacementLayout.COLOCATED and num_engines * engine_tp_size != num_trainers:
        problems.append(
            f"colocated layout needs num_engines * engine_tp_size == num_trainers (one engine TP rank per trainer "
            f"bundle), got {num_engines} * {engine_tp_size} != {num_trainers}"
        )
    raise_if(problems, what="cannot plan placement")
    if layout is PlacementLayout.COLOCATED:
        return _colocated(num_trainers, num_engines, trainer, engine, engine_tp_size, strategy)
    return _disaggregated(num_trainers, num_engines, trainer, engine, strategy, engine_strategy)


def _colocated(
    num_trainers: int, num_engines: int, trainer: Resources, engine: Resources, engine_tp_size: int, strategy: str
) -> PlacementPlan:
    engine_bundle = {j: j * engine_tp_size for j in range(num_engines)}
    bundles = tuple(trainer + engine if i in engine_bundle.values() else trainer for i in range(num_trainers))
    return PlacementPlan(
        layout=PlacementLayout.COLOCATED,
        groups=(BundleGroup(name="colocated", strategy=strategy, bundles=bundles),),
        trainers=tuple(
            ActorSlot(role=ActorRole.TRAINER, index=i, group=0, bundle=i, resources=trainer)
            for i in range(num_trainers)
        ),
        engines=tuple(
            ActorSlot(role=ActorRole.ENGINE, index=j, group=0, bundle=b, resources=engine)
            for j, b in engine_bundle.items()
        ),
        engine_tp_size=engine_tp_size,
    )


def plan_colocated_feeds(plan: PlacementPlan) -> FeedPlan:
    """The colocated transport's feed assignment for `plan`: each engine TP rank fed by the trainer rank on its
    bundle (`transport.feeds.plan_feeds` over bundle devices). Pure. Raises ValueError for a disaggregated plan
    (no engine rank shares a device with a trainer rank, so the colocated transport cannot run on it)."""
    if plan.layout is not PlacementLayout.COLOCATED:
        raise ValueError(
            f"the colocated transport needs the colocated placement layout, got {plan.layout.value!r}: engine ranks "
            f"map trainer memory on their own device"
        )

    def device(slot: ActorSlot, offset: int = 0) -> Device:
        return Device(node=plan.groups[slot.group].name, index=slot.bundle + offset)

    return plan_feeds(
        trainer_devices=[device(t) for t in plan.trainers],
        engine_devices=[[device(e, r) for r in range(plan.engine_tp_size)] for e in plan.engines],
    )


def _disaggregated(
    num_trainers: int, num_engines: int, trainer: Resources, engine: Resources, strategy: str, engine_strategy: str
) -> PlacementPlan:
    return PlacementPlan(
        layout=PlacementLayout.DISAGGREGATED,
        groups=(
            BundleGroup(name="trainers", strategy=strategy, bundles=(trainer,) * num_trainers),
            BundleGroup(name="engines", strategy=engine_strategy, bundles=(engine,) * num_engines),
        ),
        trainers=tuple(
            ActorSlot(role=ActorRole.TRAINER, index=i, group=0, bundle=i, resources=trainer)
            for i in range(num_trainers)
        ),
        engines=tuple(
            ActorSlot(role=ActorRole.ENGINE, index=j, group=1, bundle=j, resources=engine) for j in range(num_engines)
        ),
    )


# What one trainer rank or one engine needs of a bundle by default (they run on the CPU here; GPU clusters place
# by their custom node resources, `cluster.*_node_resource`).
DEFAULT_TRAINER_RESOURCES = Resources(num_cpus=0.01)
DEFAULT_ENGINE_RESOURCES = Resources(num_cpus=0.01)


def job_placement(config: MilesSyncConfig) -> PlacementPlan | None:
    """The main job's placement: with a transport that feeds engines from every trainer rank (colocated: memory
    mapped across processes on one device) each trainer rank shares a bundle with an engine rank, otherwise
    trainers and engines get bundles of their own. None when the engines are running servers (`engines.urls`):
    only the trainers are placed, by Ray."""
    if config.engines.urls:
        return None
    cluster = config.cluster
    is_colocated = transport_spec(config.sync.transport).places_colocated()
    return plan_placement(
        layout=PlacementLayout.COLOCATED if is_colocated else PlacementLayout.DISAGGREGATED,
        num_trainers=config.trainer.world_size,
        num_engines=config.engines.count,
        trainer=_on_nodes(DEFAULT_TRAINER_RESOURCES, cluster.trainer_node_resource),
        engine=_on_nodes(DEFAULT_ENGINE_RESOURCES, cluster.engine_node_resource),
        engine_tp_size=config.engines.tp,
        strategy=cluster.trainer_strategy,
        engine_strategy=cluster.engine_strategy,
    )


def job_feed_plan(config: MilesSyncConfig, plan: PlacementPlan | None) -> FeedPlan | None:
    """Colocated transport on placed engines: each engine rank is fed by the trainer rank on its bundle. Running
    servers have no placement: the export source feeds them all; with pipeline stages each stage's source feeds
    every engine rank itself (a feed plan spans the whole trainer group, and the stages open one after another)."""
    if plan is None or not transport_spec(config.sync.transport).places_colocated() or config.trainer.pp > 1:
        return None
    return plan_colocated_feeds(plan)


def _on_nodes(resources: Resources, node_resource: str | None) -> Resources:
    """`resources` plus one unit of the custom node resource that marks the nodes this role may run on."""
    return resources if node_resource is None else resources + Resources(custom=((node_resource, 1.0),))
