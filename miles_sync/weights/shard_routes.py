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

from miles_sync.weights.shard_plan import DirectPlan, matrix_shape
from miles_sync.wire.bucket import TensorMeta
from miles_sync.wire.text import raise_if

__all__: list[str] = []  # the routing's first consumer is its table test; the no-gather transport will import it


@dataclass(frozen=True, kw_only=True)
class TrainerRank:
    """One trainer rank of a pipeline stage: its global rank and its tensor- and expert-parallel coordinates."""

    rank: int
    tp_rank: int
    tp_size: int
    ep_rank: int = 0
    ep_size: int = 1


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


def moved_bytes(routes: Iterable[Route], metas: Mapping[str, TensorMeta]) -> dict[tuple[int, int], int]:
    """Bytes each (source, feeder) pair of distinct trainer ranks moves per sync under `routes`."""
    moved: dict[tuple[int, int], int] = defaultdict(int)
    for route in routes:
        if route.source != route.feeder:
            moved[(route.source, route.feeder)] += route.num_bytes(metas[route.hf_name])
    return dict(moved)
