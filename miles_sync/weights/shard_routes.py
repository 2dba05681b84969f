"""Shard-direct routing without a gather: which trainer rank sends which slice of which HF tensor to the trainer rank
that feeds each engine rank, so that a slice moves between trainer ranks only when its feeder does not hold it.

The engine side is a `DirectPlan` (miles_sync.weights.shard_plan: every engine rank's parameters as pieces of HF
tensors). The trainer side is what each rank of one pipeline stage holds of each HF tensor after a local conversion
of its own Megatron shards (`megatron_holdings`, megatron-core's split): q/k/v rows of its query groups, its block of
gate/up rows, of o_proj/down_proj columns and of the (Megatron-padded) vocabulary, the whole of every replicated
tensor, and the whole of the experts its EP rank owns. `route_direct` cuts every engine piece where holders' slices
begin and end and gives each cut one source: the engine rank's own feeder when it holds it (nothing moves between
trainer ranks), else the lowest rank that does. A slice no trainer rank holds is a planning error, named, before
anything moves. Pure.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from miles_sync.weights.engine_layout import ShardKind, shard_kind
from miles_sync.weights.shard_plan import DirectPlan, matrix_shape
from miles_sync.wire.bucket import TensorMeta
from miles_sync.wire.text import raise_if

__all__: list[str] = []  # the routing's first consumer is its table test; the no-gather transport will import it

_EXPERT = re.compile(r".*\.mlp\.experts\.(\d+)\.")


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
    """Rows (`dim` 0) or columns (`dim` 1) [start, end) of an HF tensor, seen as a matrix, held by trainer `rank`."""

    rank: int
    dim: int
    start: int
    end: int


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


def megatron_holdings(
    metas: Iterable[TensorMeta], *, ranks: Sequence[TrainerRank], vocab_divisor: int = 128
) -> dict[str, tuple[Holding, ...]]:
    """What each rank of one stage holds of each HF tensor (`metas`: the stage's export) after converting its own
    shards, by megatron-core's split: column-parallel rows and row-parallel columns in TP-rank blocks, the vocabulary
    padded to a multiple of `vocab_divisor * tp_size` (megatron's `make_vocab_size_divisible_by`) then split in
    blocks (padding rows held by nobody), every other dense tensor whole on every rank, an expert whole on the ranks
    of the EP rank that owns it (a block's experts split evenly over the EP ranks, in order; expert TP 1)."""
    metas = list(metas)
    num_experts: dict[str, int] = defaultdict(int)  # MoE block -> experts in it
    for meta in metas:
        expert = _EXPERT.match(meta.name)
        if expert is not None:
            block = meta.name[: expert.start(1)]
            num_experts[block] = max(num_experts[block], int(expert.group(1)) + 1)
    holdings: dict[str, tuple[Holding, ...]] = {}
    for meta in metas:
        rows, cols = matrix_shape(meta.shape)
        expert = _EXPERT.match(meta.name)
        held = []
        for r in ranks:
            if expert is None:
                held.append(_dense_holding(meta.name, rows, cols, r, vocab_divisor=vocab_divisor))
                continue
            per_rank = num_experts[meta.name[: expert.start(1)]] // r.ep_size
            if int(expert.group(1)) // per_rank == r.ep_rank:
                held.append(Holding(rank=r.rank, dim=0, start=0, end=rows))
        holdings[meta.name] = tuple(h for h in held if h.end > h.start)
    return holdings


def _dense_holding(name: str, rows: int, cols: int, r: TrainerRank, *, vocab_divisor: int) -> Holding:
    kind = shard_kind(name)
    t, n = r.tp_rank, r.tp_size
    if kind is ShardKind.ROW:
        size = cols // n
        return Holding(rank=r.rank, dim=1, start=t * size, end=(t + 1) * size)
    if kind is ShardKind.VOCAB:
        multiple = vocab_divisor * n
        size = -(-rows // multiple) * multiple // n
        return Holding(rank=r.rank, dim=0, start=min(t * size, rows), end=min((t + 1) * size, rows))
    if kind in (ShardKind.QUERY, ShardKind.KEY_VALUE, ShardKind.COLUMN):
        size = rows // n
        return Holding(rank=r.rank, dim=0, start=t * size, end=(t + 1) * size)
    return Holding(rank=r.rank, dim=0, start=0, end=rows)


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
                # Held along the engine's split dim: both sides split an HF tensor by the same kind rule.
                along = [h for h in holdings.get(piece.hf_name, ()) if h.end > h.start and h.dim == piece.dim]
                edges = {piece.start, piece.end, *(x for h in along for x in (h.start, h.end))}
                cuts = sorted(c for c in edges if piece.start <= c <= piece.end)
                for start, end in zip(cuts, cuts[1:]):
                    owners = [h.rank for h in along if h.start <= start and end <= h.end]
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
