"""Shard-direct planning: which slices of which HF tensors make each engine TP rank's own parameters.

SGLang's `load_format: "direct"` copies each named tensor of a rank's payload into the engine parameter of that
name, on that rank, with no weight loader in between (`_model_load_weights_direct`: the shape must match) and no
post-processing after it. So a direct payload must carry exactly what the engine stores: its fused names
(`qkv_proj`, `gate_up_proj`, stacked experts), this rank's shard of each (vocab padding included) and, where the
engine post-processes a weight (a `WeightLayout`), the bytes already in that layout.

`plan_direct` computes, once per engine layout and export, every rank's parameters as pieces of HF tensors (rows or
columns [start, end) written at an offset of the parameter), and refuses a plan with a problem before any byte
moves: a parameter the engine does not have (a fused group sent in part), a slice of an HF tensor that no rank
receives or that more ranks receive than the engine's split keeps, a parameter whose pieces do not tile it.
`build_param` executes one parameter of the plan into a buffer. The rules are `engine_layout`'s; a test checks that
what `build_param` writes equals `engine_layout.rank_engine_tensors`, the digest model verified against real
servers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from miles_sync.weights.checksum import sglang_fused_tensor, sglang_parameter_names
from miles_sync.weights.engine_layout import (
    ShardKind,
    TPShape,
    is_expert_projection,
    is_linear_weight,
    shard_kind,
    shard_rows,
    tp_problems,
)
from miles_sync.weights.layout import WeightLayout, layout_spec
from miles_sync.wire.bucket import TensorMeta
from miles_sync.wire.text import raise_if

__all__ = ["DirectLayout", "DirectPlan", "assemble_param", "build_param", "is_target_layer", "plan_direct"]

_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
# HF tensors that only exist in the engine as part of a fused parameter.
_FUSED_KINDS = (ShardKind.QUERY, ShardKind.KEY_VALUE, ShardKind.COLUMN)


def is_target_layer(name: str, *, num_target_layers: int | None) -> bool:
    """Whether the target runner holds HF tensor `name`: decoder layers at or past `num_target_layers` belong to an
    MTP head, which the target skips (None: it holds every name)."""
    if num_target_layers is None:
        return True
    match = _LAYER_INDEX.match(name)
    return match is None or int(match.group(1)) < num_target_layers


@dataclass(frozen=True, kw_only=True)
class DirectLayout:
    """What decides an engine's target parameters: its model's TP dimensions, its TP size, the layout it
    post-processes linear weights into, and how many decoder layers its target holds."""

    shape: TPShape
    tp_size: int
    weight_layout: WeightLayout = WeightLayout.NONE
    num_target_layers: int | None = None


@dataclass(frozen=True, kw_only=True)
class Piece:
    """Rows (`dim` 0) or columns (`dim` 1) [start, end) of HF tensor `hf_name`, seen as a matrix (`_matrix`),
    written from `offset` on along the same dim of the engine parameter's matrix."""

    hf_name: str
    dim: int
    start: int
    end: int
    offset: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, kw_only=True)
class DirectParam:
    """One engine parameter on one rank: its name, local shape and dtype, its pieces, and whether the engine's
    layout transforms it after fusion (then its bytes are sent transformed). Rows no piece writes are zero (the
    vocab padding of a vocab-parallel shard)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]
    is_post_processed: bool
    # The parameter as the matrix its pieces are written into: its parts' rows one after another by their columns
    # (stacked experts are viewed as [experts, rows, columns] only afterwards, as `sglang_fused_tensor` does).
    matrix: tuple[int, int]

    @property
    def num_bytes(self) -> int:
        return self.meta.num_bytes

    @property
    def meta(self) -> TensorMeta:
        return TensorMeta(name=self.name, shape=self.shape, dtype=self.dtype)

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.hf_name for p in self.pieces))


@dataclass(frozen=True, kw_only=True)
class DirectPlan:
    """Every TP rank's target parameters for one engine layout (`ranks[r]`, in engine-name order). Replayed every
    sync; recomputed only when the layout or the export changes."""

    layout: DirectLayout
    ranks: tuple[tuple[DirectParam, ...], ...]

    def parts(self) -> dict[str, tuple[str, ...]]:
        """{engine parameter name: the HF names it is built from}, the same on every rank."""
        return {p.name: p.parts for p in self.ranks[0]}


def plan_direct(metas: Iterable[TensorMeta], *, layout: DirectLayout) -> DirectPlan:
    """The direct plan of the HF tensors `metas` (the export's, every name once) for engines of `layout`. Names the
    target does not hold (MTP layers) are left out. Pure.

    Raises ValueError naming every problem, before anything is sent: the model does not split at the TP size, a
    fused group is exported in part (the engine has no parameter of that name: a direct load of it would fail on
    the server), fused parts disagree on dtype, or the plan's pieces do not cover each HF tensor exactly as often
    as the engine's split keeps it, or do not tile a parameter."""
    shape, tp_size = layout.shape, layout.tp_size
    raise_if(tp_problems(shape, tp_size), what=f"no direct plan at tp_size={tp_size}")
    by_name = {m.name: m for m in metas if is_target_layer(m.name, num_target_layers=layout.num_target_layers)}
    groups = sglang_parameter_names(by_name, num_experts=shape.num_experts or None)
    problems = []
    for name, parts in sorted(groups.items()):
        if parts == (name,) and (_plan_kind(name) in _FUSED_KINDS or is_expert_projection(name)):
            problems.append(
                f"{name}: exported without the rest of its fused group, so the engine has no parameter of that name"
            )
        dtypes = {by_name[p].dtype for p in parts}
        if len(dtypes) > 1:
            problems.append(f"{name}: its parts {list(parts)} have different dtypes {sorted(map(str, dtypes))}")
    raise_if(problems, what="the direct plan is refused")
    spec = layout_spec(layout.weight_layout)
    ranks = []
    for tp_rank in range(tp_size):
        params = []
        for name, parts in sorted(groups.items()):
            pieces, local_shapes, offset = [], [], 0
            for part in parts:
                piece, local = _piece(by_name[part], shape=shape, tp_rank=tp_rank, tp_size=tp_size, offset=offset)
                pieces.append(piece)
                local_shapes.append(local)
                offset += matrix_shape(local)[0] if piece.dim == 0 else 0
            dtype = by_name[parts[0]].dtype
            meta_parts = [torch.empty(s, dtype=dtype, device="meta") for s in local_shapes]
            param_shape = tuple(sglang_fused_tensor(name, meta_parts).shape)
            params.append(
                DirectParam(
                    name=name,
                    shape=param_shape,
                    dtype=dtype,
                    pieces=tuple(pieces),
                    is_post_processed=is_linear_weight(name) and spec.applies_to(param_shape, dtype),
                    matrix=(sum(matrix_shape(s)[0] for s in local_shapes), matrix_shape(local_shapes[0])[1]),
                )
            )
        ranks.append(tuple(params))
    plan = DirectPlan(layout=layout, ranks=tuple(ranks))
    raise_if(coverage_problems(plan, by_name.values()), what="the direct plan is refused")
    return plan


def _plan_kind(hf_name: str) -> ShardKind:
    """`shard_kind`, except for MoE experts: a direct plan keeps MoE models at tp_size 1 (`tp_problems` refuses
    more), where every expert is loaded whole into its stack."""
    return ShardKind.REPLICATED if is_expert_projection(hf_name) else shard_kind(hf_name)


def _piece(
    meta: TensorMeta, *, shape: TPShape, tp_rank: int, tp_size: int, offset: int
) -> tuple[Piece, tuple[int, ...]]:
    """The piece rank `tp_rank` keeps of one HF tensor and the shape of its local shard (padding included)."""
    rows, cols = matrix_shape(meta.shape)
    kind = _plan_kind(meta.name)
    if kind is ShardKind.ROW:
        size = meta.shape[-1] // tp_size
        piece = Piece(hf_name=meta.name, dim=1, start=tp_rank * size, end=(tp_rank + 1) * size, offset=0)
        return piece, (*meta.shape[:-1], size)
    start, end = shard_rows(meta.name, rows, shape=shape, tp_rank=tp_rank, tp_size=tp_size)
    # A vocab shard past the real rows keeps only padding: its piece is empty.
    piece = Piece(hf_name=meta.name, dim=0, start=min(start, rows), end=min(end, rows), offset=offset)
    return piece, ((end - start, *meta.shape[1:]) if meta.shape else ())


def coverage_problems(plan: DirectPlan, metas: Iterable[TensorMeta]) -> list[str]:
    """Every way `plan` fails its contract, empty when it holds: each HF tensor's rows (columns, for row-parallel
    weights) are received by exactly as many ranks as the engine's split keeps them on (every rank for replicated
    tensors, `kv_replicas` ranks for KV heads, one otherwise), and each parameter is tiled by its pieces, without
    overlap, along the dim they split, leaving at most trailing zero rows (vocab padding). Pure."""
    layout = plan.layout
    problems = []
    received: dict[str, list[tuple[int, int]]] = {}
    for params in plan.ranks:
        for param in params:
            received_dims = {p.dim for p in param.pieces}
            if len(received_dims) != 1:
                problems.append(f"{param.name}: pieces along different dims {sorted(received_dims)}")
                continue
            problems.extend(_tiling_problems(param))
            for p in param.pieces:
                received.setdefault(p.hf_name, []).append((p.start, p.end))
    for meta in metas:
        if meta.name not in received:
            if is_target_layer(meta.name, num_target_layers=layout.num_target_layers):
                problems.append(f"{meta.name}: no rank receives any of it")
            continue
        kind = _plan_kind(meta.name)
        rows, cols = matrix_shape(meta.shape)
        length = cols if kind is ShardKind.ROW else rows
        expected = {
            ShardKind.REPLICATED: layout.tp_size,
            ShardKind.KEY_VALUE: layout.shape.kv_replicas(layout.tp_size),
        }.get(kind, 1)
        for start, end, count in _multiplicities(received.pop(meta.name), length):
            if count != expected:
                problems.append(
                    f"{meta.name}: [{start}, {end}) is received by {count} rank(s); the engine's split keeps it on "
                    f"{expected}"
                )
    problems.extend(f"{name}: not an exported tensor" for name in sorted(received))
    return problems


def _tiling_problems(param: DirectParam) -> list[str]:
    rows, cols = param.matrix
    dim = param.pieces[0].dim
    length = cols if dim == 1 else rows
    spans = sorted((p.offset, p.offset + p.length) for p in param.pieces)
    problems = []
    position = 0
    for start, end in spans:
        if start != position:
            problems.append(f"{param.name}: its pieces leave [{position}, {start}) unwritten or overlap there")
        position = max(position, end)
    if position > length:
        problems.append(f"{param.name}: its pieces reach {position}, past its {length}")
    elif position < length and not (dim == 0 and _plan_kind(param.pieces[-1].hf_name) is ShardKind.VOCAB):
        problems.append(f"{param.name}: its pieces leave [{position}, {length}) unwritten")
    return problems


def _multiplicities(spans: Sequence[tuple[int, int]], length: int) -> list[tuple[int, int, int]]:
    """[start, end) ranges of [0, length) with the number of `spans` covering each, in order (a sweep)."""
    events: dict[int, int] = {0: 0, length: 0}
    for start, end in spans:
        if end > start:
            events[start] = events.get(start, 0) + 1
            events[end] = events.get(end, 0) - 1
    result, count = [], 0
    points = sorted(events)
    for start, end in zip(points, points[1:]):
        count += events[start]
        if start < length:
            result.append((start, min(end, length), count))
    return result


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """A tensor seen as a matrix: its first dim by the rest (a scalar is 1 x 1, a vector a column)."""
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:])


def build_param(
    param: DirectParam, tensors: Mapping[str, torch.Tensor], *, out: torch.Tensor, weight_layout: WeightLayout
) -> torch.Tensor:
    """Write `param` from the full HF `tensors` of its parts into `out` (a uint8 region of at least
    `param.num_bytes`) and return it there, as an engine post-processing into `weight_layout` stores it: pieces at
    their offsets, padding zeroed, the layout applied where it post-processes."""

    def writes() -> Iterable[tuple[int, int, torch.Tensor]]:
        for p in param.pieces:
            if p.length:
                source = tensors[p.hf_name]
                matrix = source.reshape(matrix_shape(tuple(source.shape)))
                yield p.dim, p.offset, matrix.narrow(p.dim, p.start, p.length)

    return assemble_param(param, writes(), out=out, weight_layout=weight_layout)


def assemble_param(
    param: DirectParam,
    writes: Iterable[tuple[int, int, torch.Tensor]],
    *,
    out: torch.Tensor,
    weight_layout: WeightLayout,
    before_layout: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Write `param` into `out` (a uint8 region of at least `param.num_bytes`) from `writes`, each (dim, offset,
    slice): the slice, a matrix of HF rows (dim 0) or columns (dim 1), goes at `offset` along that dim of the
    parameter's matrix; the writes must tile what the plan's pieces cover. Padding rows are zeroed and the layout
    applied where it post-processes (`before_layout(matrix)` sees the parameter's matrix just before); returns the
    parameter there."""
    rows, cols = param.matrix
    dest = out[: param.num_bytes].view(param.dtype).view(rows, cols)
    written = sum(p.length for p in param.pieces) if param.pieces[0].dim == 0 else rows
    if written < rows:
        dest[written:].zero_()
    for dim, offset, piece in writes:
        dest.narrow(dim, offset, piece.shape[dim]).copy_(piece)
    if before_layout is not None:
        before_layout(dest)
    result = dest.view(param.shape)
    if param.is_post_processed:
        result.copy_(layout_spec(weight_layout).apply(result))
    return result
