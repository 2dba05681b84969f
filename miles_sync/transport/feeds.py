"""The colocated feed assignment (`plan_feeds`): which trainer rank hands its own copy of each bucket to which engine
TP rank (the one on the same device: a CUDA IPC handle only opens on its own GPU), and which trainer rank posts each
engine's request; and the same records spread over the trainer ranks where no device ties them (`plan_spread_feeds`,
the p2p transport's). Pure records; the transports execute them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles_sync.transport.membership import EngineEndpoint
from miles_sync.wire.text import raise_if

__all__ = ["Device", "FeedPlan", "FeedRole", "feed_node_problems", "plan_feeds", "plan_spread_feeds"]


@dataclass(frozen=True, kw_only=True, order=True)
class Device:
    """One accelerator (or, on CPU clusters, one placement bundle): `node` is the node's address, or the name of
    the placement group when devices come from a placement plan (all of a bundle sits on one node); `index` is
    the device or bundle index there. Two processes on equal Devices can open each other's IPC handles."""

    node: str
    index: int


@dataclass(frozen=True, kw_only=True)
class EngineFeed:
    """Who serves one engine: `feeders[r]` is the trainer rank whose copy of each bucket engine TP rank r maps;
    `poster` gathers the engine's handles and posts its `update_weights_from_tensor` request."""

    feeders: tuple[int, ...]
    poster: int


@dataclass(frozen=True, kw_only=True)
class FeedPlan:
    """The colocated feed assignment of one fleet, engines in membership order (see `plan_feeds`)."""

    num_trainers: int
    engines: tuple[EngineFeed, ...]

    @classmethod
    def single_source(cls, *, tp_sizes: Sequence[int], rank: int = 0, num_trainers: int = 1) -> FeedPlan:
        """Every engine rank fed and posted by trainer rank `rank`: the layout of a caller that gave no devices
        (one copy of each bucket, every engine rank maps it; on GPU that only works where they share a device)."""
        return cls(
            num_trainers=num_trainers,
            engines=tuple(EngineFeed(feeders=(rank,) * tp, poster=rank) for tp in tp_sizes),
        )

    @property
    def feeding_ranks(self) -> tuple[int, ...]:
        """Trainer ranks that hold a copy of every bucket, ascending."""
        return tuple(sorted({r for e in self.engines for r in (*e.feeders, e.poster)}))

    def feeds_of(self, rank: int) -> tuple[tuple[int, int], ...]:
        """(engine index, TP rank) of every engine rank that `rank` feeds, in engine order."""
        return tuple((j, r) for j, e in enumerate(self.engines) for r, f in enumerate(e.feeders) if f == rank)

    def posted_by(self, rank: int) -> tuple[int, ...]:
        """Indices of the engines whose requests `rank` posts."""
        return tuple(j for j, e in enumerate(self.engines) if e.poster == rank)

    def check_engines(self, engines: Sequence[EngineEndpoint]) -> None:
        """Raise ValueError naming every engine whose TP size differs from the plan's (or a count mismatch)."""
        problems = []
        if len(engines) != len(self.engines):
            problems.append(f"the plan covers {len(self.engines)} engine(s), the fleet has {len(engines)}")
        problems.extend(
            f"engine {j} ({e.url}) runs {e.tp_size} TP rank(s), the plan feeds {len(f.feeders)}"
            for j, (e, f) in enumerate(zip(engines, self.engines))
            if e.tp_size != len(f.feeders)
        )
        raise_if(problems, what="the colocated feed plan does not match the engines")


@dataclass(frozen=True, kw_only=True)
class FeedRole:
    """One trainer rank's view of a FeedPlan: its own rank and the export source's (which packs every bucket).
    `every_rank`: every trainer rank is a member of the fan-out, not only the source and the feeders (a transport
    whose ranks send their own shards: miles_sync.transport.shard_routed)."""

    plan: FeedPlan
    rank: int
    source_rank: int
    every_rank: bool = False
    # The trainer ranks `every_rank` means: one pipeline stage's (a routed send runs stage by stage, each stage's
    # ranks among themselves: miles_sync.sync.pipeline); empty: every trainer rank of the plan.
    stage_ranks: tuple[int, ...] = ()

    @classmethod
    def single_source(cls, *, tp_sizes: Sequence[int]) -> FeedRole:
        """The source (rank 0) alone, feeding and posting every engine rank: the role without devices."""
        return cls(plan=FeedPlan.single_source(tp_sizes=tp_sizes), rank=0, source_rank=0)

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks of the fan-out group: the source and every feeding rank (every rank with `every_rank`),
        ascending."""
        if self.every_rank:
            return self.stage_ranks or tuple(range(self.plan.num_trainers))
        return tuple(sorted({self.source_rank, *self.plan.feeding_ranks}))

    @property
    def is_member(self) -> bool:
        return self.rank in self.members


def plan_feeds(*, trainer_devices: Sequence[Device], engine_devices: Sequence[Sequence[Device]]) -> FeedPlan:
    """Assign every engine TP rank the trainer rank on its own device (the lowest such rank), and every engine the
    feeder of its TP rank 0 as poster. Pure.

    `trainer_devices[i]`: trainer rank i's device; `engine_devices[j][r]`: engine j's TP rank r's. Raises
    ValueError naming every engine rank without a co-located trainer rank (and empty inputs), before any sync.
    """
    problems = []
    if not trainer_devices:
        problems.append("no trainer ranks")
    if not engine_devices:
        problems.append("no engines")
    problems.extend(f"engine {j} has no TP ranks" for j, ranks in enumerate(engine_devices) if not ranks)
    first_rank: dict[Device, int] = {}
    for rank, device in enumerate(trainer_devices):
        first_rank.setdefault(device, rank)
    orphans = [
        f"engine {j} TP rank {r} on {d}"
        for j, ranks in enumerate(engine_devices)
        for r, d in enumerate(ranks)
        if d not in first_rank
    ]
    if orphans:
        problems.append(
            "no trainer rank shares a device with " + ", ".join(orphans) + f" (trainer devices: {sorted(first_rank)})"
        )
    raise_if(problems, what="cannot plan colocated feeds")
    engines = []
    for ranks in engine_devices:
        feeders = tuple(first_rank[d] for d in ranks)
        engines.append(EngineFeed(feeders=feeders, poster=feeders[0]))
    return FeedPlan(num_trainers=len(trainer_devices), engines=tuple(engines))


def plan_spread_feeds(*, num_trainers: int, tp_sizes: Sequence[int], ranks: Sequence[int] | None = None) -> FeedPlan:
    """Which trainer rank builds and sends each engine rank's parameters when no device ties them: engine ranks in
    order, round robin over the trainer ranks `ranks` (default: all `num_trainers`; one pipeline stage's ranks where
    each stage feeds the engines its own layers), so the i-th of them feeds engine rank i where their TP equals the
    engine's, and replicas spread over them; each engine's request is posted by its rank 0's feeder. Pure. Raises
    ValueError for no trainers, ranks outside the trainer group, or no engines."""
    ranks = tuple(range(num_trainers)) if ranks is None else tuple(ranks)
    problems = [f"engine {j} has {tp} TP ranks" for j, tp in enumerate(tp_sizes) if tp < 1]
    if not tp_sizes:
        problems.append("no engines")
    if not ranks:
        problems.append("no trainer ranks")
    elif len(set(ranks)) != len(ranks) or not all(0 <= r < num_trainers for r in ranks):
        problems.append(f"ranks {list(ranks)} are not distinct ranks of a trainer group of {num_trainers}")
    raise_if(problems, what="cannot spread feeds")
    engines, next_rank = [], 0
    for tp in tp_sizes:
        feeders = tuple(ranks[(next_rank + r) % len(ranks)] for r in range(tp))
        next_rank += tp
        engines.append(EngineFeed(feeders=feeders, poster=feeders[0]))
    return FeedPlan(num_trainers=num_trainers, engines=tuple(engines))


def feed_node_problems(
    *,
    plan: FeedPlan,
    trainer_nodes: Sequence[str],
    engines: Sequence[EngineEndpoint],
    engine_nodes: Sequence[str],
) -> list[str]:
    """Every engine rank whose feeder, or engine whose poster, runs on another node than the engine. Pure.

    Colocated payloads are handles to memory (CPU shared memory, CUDA IPC) that open only on the node that holds
    it, so each engine must be fed from a trainer rank on its own node: the bucket reaches that node over the
    trainer's own group, never as a handle. `trainer_nodes[i]`: trainer rank i's node address; `engine_nodes[j]`:
    engine j's (the host of its URL). Each problem names the engine, its node and the nodes it has trainer ranks
    on, so a layout without a trainer rank on an engine's node is refused before any sync.
    """
    problems = []
    for j, (engine, feed, node) in enumerate(zip(engines, plan.engines, engine_nodes)):
        local = [r for r, n in enumerate(trainer_nodes) if n == node]
        strangers = sorted(
            {f"rank {r} on {trainer_nodes[r]}" for r in (*feed.feeders, feed.poster) if trainer_nodes[r] != node}
        )
        if strangers:
            where = f"trainer ranks {local} are on it" if local else "no trainer rank runs on it"
            problems.append(
                f"engine {j} ({engine.url}) on node {node} would be fed across nodes by {', '.join(strangers)} "
                f"({where})"
            )
    return problems
