"""Shard-direct routing without a gather: which trainer rank sends which slice of which HF tensor to the trainer rank
that feeds each engine rank, so that a slice moves between trainer ranks only when its feeder does not hold it.

The engine side is a `DirectPlan` (miles_sync.weights.shard_plan: every engine rank's parameters as pieces of HF
tensors). The trainer side is what each rank of one pipeline stage holds of each HF tensor after converting its own
Megatron shards (`converter_holdings`): exactly the HF slices the export converter reads to build that shard (its
`read_shard`, the inverse of the gather's merge), so the routing follows the converter's own split rules (q/k/v rows
of the rank's query groups, its blocks of gate/up rows, of o_proj/down_proj columns and of the Megatron-padded
vocabulary, a column-parallel MTP eh_proj, every replicated tensor whole) and the whole of the experts its EP rank
owns. `route_direct` cuts every engine piece where holders' slices begin and end and gives each cut one source: the
engine rank's own feeder when it holds it (nothing moves between trainer ranks), else the lowest rank that does. A
slice no trainer rank holds is a planning error, named, before anything moves. Pure.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from miles_sync.weights.shard_plan import DirectPlan, matrix_shape
from miles_sync.wire.bucket import TensorMeta
from miles_sync.wire.text import raise_if

__all__ = ["Build", "Holding", "LocalPiece", "Route", "RoutedSchedule", "plan_routed"]


@dataclass(frozen=True, kw_only=True)
class TrainerRank:
    """One trainer rank of a pipeline stage: its global rank and its tensor- and expert-parallel coordinates."""

    rank: int
    tp_rank: int
    tp_size: int
    ep_rank: int = 0
    ep_size: int = 1


@dataclass(frozen=True, kw_only=True)
class LocalPiece:
    """Rows/columns [start, end) along `dim` of HF tensor `hf_name` (`dim` None: all of it), and their values: what
    one trainer rank holds of it after converting its own shard (miles_sync.export.local_pieces)."""

    hf_name: str
    dim: int | None
    start: int
    end: int
    tensor: torch.Tensor

    def covers(self, route: Route) -> bool:
        """Whether this piece holds the slice `route` reads."""
        if self.hf_name != route.hf_name:
            return False
        return self.dim is None or (self.dim == route.dim and self.start <= route.start and route.end <= self.end)

    def read(self, route: Route) -> torch.Tensor:
        """The slice `route` reads, as a view of this piece seen as a matrix (`matrix_shape`); `covers` must hold."""
        matrix = self.tensor.reshape(matrix_shape(tuple(self.tensor.shape)))
        begin = route.start - (0 if self.dim is None else self.start)
        return matrix.narrow(route.dim, begin, route.end - route.start)


@dataclass(frozen=True, kw_only=True)
class Holding:
    """Rows (`dim` 0) or columns (`dim` 1) [start, end) of an HF tensor, seen as a matrix, held by trainer `rank`;
    `dim` None: the whole tensor (start, end unused)."""

    rank: int
    dim: int | None
    start: int = 0
    end: int = 0


@dataclass(frozen=True, kw_only=True)
class Route:
    """One cut of an engine piece: trainer rank `source` sends rows/columns [start, end) of `hf_name` to trainer
    rank `feeder`, which writes them at `offset` of parameter `param` of engine rank `tp_rank` (layout `layout`)."""

    layout: int
    tp_rank: int
    param: str
    hf_name: str
    dim: int
    start: int
    end: int
    offset: int
    source: int
    feeder: int

    def num_bytes(self, meta: TensorMeta) -> int:
        rows, cols = matrix_shape(meta.shape)
        per_line = cols if self.dim == 0 else rows
        return (self.end - self.start) * per_line * meta.dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class ShardedParam:
    """One Megatron parameter of a stage: `reads(rank, size)`, the HF slices (name, dim or None for all of it,
    start, stop) the export converter reads to build TP rank `rank`'s shard of `size`
    (miles_sync.export.local_pieces.shard_reads), and, for an expert, its global id and the block's expert count
    (EP-owned, expert TP 1)."""

    reads: Callable[[int, int], Sequence[tuple[str, int | None, int, int]]]
    expert: int | None = None
    num_experts: int = 0


def converter_holdings(
    params: Iterable[ShardedParam], *, ranks: Sequence[TrainerRank]
) -> dict[str, tuple[Holding, ...]]:
    """What each rank of one stage holds of each HF tensor after converting its own shards: the HF slices its
    converter reads to build that shard (a dense parameter on every TP rank; an expert whole on the ranks of the EP
    rank that owns it, experts split evenly over EP ranks in order)."""
    holdings: dict[str, list[Holding]] = defaultdict(list)
    for param in params:
        for r in ranks:
            if param.expert is not None and param.expert // (param.num_experts // r.ep_size) != r.ep_rank:
                continue
            tp_rank, tp_size = (0, 1) if param.expert is not None else (r.tp_rank, r.tp_size)
            for name, dim, start, stop in param.reads(tp_rank, tp_size):
                holdings[name].append(Holding(rank=r.rank, dim=dim, start=start, end=stop))
    return {name: tuple(h for h in held if h.dim is None or h.end > h.start) for name, held in holdings.items()}


def route_direct(
    plan: DirectPlan,
    holdings: Mapping[str, Sequence[Holding]],
    *,
    feeders: Mapping[tuple[int, int], int],
    layout: int = 0,
) -> tuple[Route, ...]:
    """Every cut of every engine piece of `plan` (engine layout index `layout`) with its source trainer rank;
    `feeders[(layout, tp_rank)]` is the trainer rank that feeds engine rank `tp_rank`. Raises ValueError naming each
    slice no trainer rank holds, before anything moves."""
    routes, problems = [], []
    for tp_rank, params in enumerate(plan.ranks):
        feeder = feeders[(layout, tp_rank)]
        for param in params:
            for piece in param.pieces:
                if piece.length == 0:
                    continue
                # Held whole, or along the engine's split dim (a TP split of either side cuts the same dim).
                held = holdings.get(piece.hf_name, ())
                along = [h for h in held if h.dim == piece.dim and h.end > h.start]
                whole = [h.rank for h in held if h.dim is None]
                edges = {piece.start, piece.end, *(x for h in along for x in (h.start, h.end))}
                cuts = sorted(c for c in edges if piece.start <= c <= piece.end)
                for start, end in zip(cuts, cuts[1:]):
                    owners = whole + [h.rank for h in along if h.start <= start and end <= h.end]
                    if not owners:
                        problems.append(
                            f"{piece.hf_name} [{start}, {end}) along dim {piece.dim}: no trainer rank holds it "
                            f"(engine rank {tp_rank}, {param.name})"
                        )
                        continue
                    source = feeder if feeder in owners else min(owners)
                    routes.append(
                        Route(
                            layout=layout,
                            tp_rank=tp_rank,
                            param=param.name,
                            hf_name=piece.hf_name,
                            dim=piece.dim,
                            start=start,
                            end=end,
                            offset=piece.offset + start - piece.start,
                            source=source,
                            feeder=feeder,
                        )
                    )
    raise_if(problems, what="the shard-direct routes are refused")
    return tuple(routes)


@dataclass(frozen=True, kw_only=True)
class Build:
    """One buffer a trainer rank builds per bucket: engine rank `tp_rank` of engine layout `layout`, built on trainer
    rank `feeder` (every engine of that layout whose rank `tp_rank` it feeds maps the same buffer)."""

    layout: int
    tp_rank: int
    feeder: int


@dataclass(frozen=True, kw_only=True)
class RoutedBucket:
    """One bucket of a routed send: the engine parameters it completes (`names`, plan order) and every route that
    writes them, build by build (in `RoutedSchedule.builds` order), parameter by parameter, piece by piece."""

    names: tuple[str, ...]
    routes: tuple[Route, ...]

    @property
    def hf_names(self) -> tuple[str, ...]:
        """The HF tensors this bucket's parameters are made of, in order."""
        return tuple(dict.fromkeys(r.hf_name for r in self.routes))

    def sends(self, rank: int) -> tuple[Route, ...]:
        """The routes trainer rank `rank` sends to another rank, in order (the order its receiver expects)."""
        return tuple(r for r in self.routes if r.source == rank != r.feeder)

    def receives(self, rank: int) -> tuple[Route, ...]:
        """The routes trainer rank `rank` receives from another rank, in order."""
        return tuple(r for r in self.routes if r.feeder == rank != r.source)


@dataclass(frozen=True, kw_only=True)
class RoutedSchedule:
    """A routed send, planned once per layout and export and replayed every sync: the builds and the buckets."""

    builds: tuple[Build, ...]
    buckets: tuple[RoutedBucket, ...]


def plan_routed(
    plans: Sequence[DirectPlan],
    holdings: Mapping[str, Sequence[Holding]],
    *,
    builds: Sequence[Build],
    bucket_bytes: int,
) -> RoutedSchedule:
    """The routed send of `builds` (each feeder's (layout, engine rank) buffers; `plans[layout]` that layout's direct
    plan) from the trainer ranks' `holdings`: every engine parameter in plan order, cut into buckets whose largest
    build stays within `bucket_bytes` (a parameter larger than that travels alone), each with the routes of its
    parameters (`route_direct`: a slice moves between trainer ranks only when its feeder does not hold it). Raises
    ValueError, before anything moves, naming every slice no trainer rank holds or a build no plan has. Pure."""
    raise_if(
        [f"{b}: no such engine rank in its layout's plan" for b in builds if not 0 <= b.tp_rank < _num_ranks(plans, b)],
        what="the routed send is refused",
    )
    routed: dict[tuple[int, int], tuple[Route, ...]] = {}
    for layout, feeder in dict.fromkeys((b.layout, b.feeder) for b in builds):
        feeders = {(layout, r): feeder for r in range(len(plans[layout].ranks))}
        routed[(layout, feeder)] = route_direct(plans[layout], holdings, feeders=feeders, layout=layout)
    by_param: dict[tuple[Build, str], list[Route]] = defaultdict(list)
    for b in builds:
        for route in routed[(b.layout, b.feeder)]:
            if route.tp_rank == b.tp_rank:
                by_param[(b, route.param)].append(route)
    sizes = {
        (b, p.name): p.num_bytes for b in builds for p in plans[b.layout].ranks[b.tp_rank]
    }  # the bytes of each parameter in each build
    names = list(dict.fromkeys(p.name for b in builds for p in plans[b.layout].ranks[b.tp_rank]))
    groups: list[list[str]] = []
    filled = dict.fromkeys(builds, 0)
    for name in names:
        grows = {b: filled[b] + sizes.get((b, name), 0) for b in builds}
        if not groups or (any(filled.values()) and max(grows.values()) > bucket_bytes):
            groups.append([])
            grows = {b: sizes.get((b, name), 0) for b in builds}
        groups[-1].append(name)
        filled = grows
    buckets = tuple(
        RoutedBucket(names=tuple(group), routes=tuple(r for b in builds for n in group for r in by_param[(b, n)]))
        for group in groups
    )
    return RoutedSchedule(builds=tuple(builds), buckets=buckets)


def _num_ranks(plans: Sequence[DirectPlan], build: Build) -> int:
    return len(plans[build.layout].ranks) if 0 <= build.layout < len(plans) else 0
