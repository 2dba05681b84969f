"""What one pipeline stage exports, as pure metadata: local parameters -> canonical names -> atomic units.

`collect_local_params` walks the model once (names, shapes, partition attributes; no tensor data).
`plan_units` is a pure function of those records, the parallel coords and a converter; the gather and
`export_metadata` both use it, so the metadata a planner sees is exactly the order the gather yields.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles_sync.export.converter import Converter, TensorMapping
from miles_sync.export.units import unit_slot
from miles_sync.wire.bucket import AtomicUnit, TensorMeta


@dataclass(frozen=True, kw_only=True)
class ParallelCoords:
    """This rank's coordinates in the megatron-core parallel grid (dense and expert grids)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    ep_rank: int
    ep_size: int
    etp_rank: int
    etp_size: int
    # Data-parallel coordinates: only the replica holding data-parallel rank 0 gathers for the source rank.
    dp_rank: int  # dense data-parallel rank, context parallel included
    edp_rank: int  # expert data-parallel rank

    @property
    def is_dense_participant(self) -> bool:
        return self.dp_rank == 0

    @property
    def is_expert_participant(self) -> bool:
        return self.edp_rank == 0

    @property
    def is_source(self) -> bool:
        """True on the one rank of the stage that materializes full tensors when exporting to a source."""
        return self.dp_rank == 0 and self.tp_rank == 0

    @classmethod
    def from_parallel_state(cls) -> ParallelCoords:
        from megatron.core import parallel_state as ps

        coords = cls(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            edp_rank=ps.get_expert_data_parallel_rank(),
        )
        # The dense source must also be the expert source, or experts would be collected on another rank.
        assert not coords.is_source or (coords.ep_rank == 0 and coords.etp_rank == 0 and coords.edp_rank == 0), coords
        return coords


@dataclass(frozen=True, kw_only=True)
class LocalParam:
    """One parameter of this rank's model chunk, before any tensor data moves.

    `canonical` is the TP=1/PP=1/EP=1 name; for an expert parameter it holds `{expert}` where the global expert id
    goes, and `local_expert` is its index among this rank's experts (the same index exists on every EP rank).
    `is_stage_copy` marks the embedding a later pipeline stage keeps for its MTP layers: megatron keeps it equal
    to the first stage's, so it is imported but never exported a second time.
    """

    chunk: int
    local_name: str
    canonical: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    partition_dim: int | None
    local_expert: int | None = None
    is_stage_copy: bool = False

    @property
    def is_expert(self) -> bool:
        return self.local_expert is not None


@dataclass(frozen=True, kw_only=True)
class ParamPlan:
    param: LocalParam
    mapping: TensorMapping
    owner_ep_rank: int | None  # EP rank that holds the parameter; None for dense parameters


@dataclass(frozen=True, kw_only=True)
class UnitPlan:
    meta: AtomicUnit
    params: tuple[ParamPlan, ...]
    owner_ep_rank: int | None


_LAYER = re.compile(r"(decoder|mtp)\.layers\.(\d+)\.(.+)")
_SEQUENTIAL_EXPERT = re.compile(r"(.*\.mlp\.experts)\.local_experts\.(\d+)\.(.+)")
_GROUPED_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(linear_fc[12])\.weight(\d+)")


def collect_local_params(chunks: Sequence[torch.nn.Module]) -> list[LocalParam]:
    """Parameter records of every model chunk (virtual pipeline stages in order), in model order."""
    records = []
    for chunk_index, chunk in enumerate(chunks):
        layer_numbers = {
            "decoder": _layer_numbers(getattr(getattr(chunk, "decoder", None), "layers", ())),
            "mtp": _layer_numbers(getattr(getattr(chunk, "mtp", None), "layers", ())),
        }
        for name, param in chunk.named_parameters():
            canonical, local_expert = _canonical_name(name, layer_numbers)
            is_sharded = bool(getattr(param, "tensor_model_parallel", False))
            records.append(
                LocalParam(
                    chunk=chunk_index,
                    local_name=name,
                    canonical=canonical,
                    shape=tuple(param.shape),
                    dtype=param.dtype,
                    partition_dim=int(param.partition_dim) if is_sharded else None,
                    local_expert=local_expert,
                    is_stage_copy=name.startswith("embedding.") and not getattr(chunk, "pre_process", True),
                )
            )
    return records


def plan_units(
    params: Sequence[LocalParam],
    *,
    converter: Converter,
    coords: ParallelCoords,
    dtype: torch.dtype | None = None,
) -> list[UnitPlan]:
    """Exported atomic units of this stage, in the order every rank of the stage iterates them. Pure.

    Expert parameters expand to one entry per EP rank (global id = ep_rank * num_local_experts + local index), so the
    stage exports every expert in global-id order although each rank holds only its own. Tensor dtypes are the
    parameters' (megatron keeps local-spec norms in fp32 under bf16) unless `dtype` is given.
    """
    num_local_experts = _num_local_experts(params)
    plans: list[ParamPlan] = []
    index = 0
    while index < len(params):
        param = params[index]
        if not param.is_expert:
            plans.append(_plan(param, converter=converter, coords=coords, owner=None, num_local_experts=0))
            index += 1
            continue
        # A run of expert parameters of one MoE layer: emit it once per owning EP rank.
        run_end = index
        prefix = _expert_block(param)
        while run_end < len(params) and params[run_end].is_expert and _expert_block(params[run_end]) == prefix:
            run_end += 1
        for owner in range(coords.ep_size):
            for p in params[index:run_end]:
                plans.append(
                    _plan(p, converter=converter, coords=coords, owner=owner, num_local_experts=num_local_experts)
                )
        index = run_end
    return _group_units([p for p in plans if p.mapping.is_exported and not p.param.is_stage_copy], dtype=dtype)


def plan_local_params(params: Sequence[LocalParam], *, converter: Converter, coords: ParallelCoords) -> list[ParamPlan]:
    """Mappings of this rank's own parameters (its experts only, aliases included): what import must fill. Pure."""
    num_local_experts = _num_local_experts(params)
    return [
        _plan(
            p,
            converter=converter,
            coords=coords,
            owner=coords.ep_rank if p.is_expert else None,
            num_local_experts=num_local_experts,
        )
        for p in params
    ]


def full_shape(param: LocalParam, *, coords: ParallelCoords) -> tuple[int, ...]:
    """Shape of the parameter with all its tensor-parallel shards put together."""
    if param.partition_dim is None:
        return param.shape
    size = coords.etp_size if param.is_expert else coords.tp_size
    shape = list(param.shape)
    shape[param.partition_dim] *= size
    return tuple(shape)


def _plan(
    param: LocalParam, *, converter: Converter, coords: ParallelCoords, owner: int | None, num_local_experts: int
) -> ParamPlan:
    name = param.canonical
    if owner is not None:
        name = name.format(expert=owner * num_local_experts + param.local_expert)
    mapping = converter.map_param(name, full_shape(param, coords=coords))
    return ParamPlan(param=param, mapping=mapping, owner_ep_rank=owner)


def _group_units(plans: list[ParamPlan], *, dtype: torch.dtype | None) -> list[UnitPlan]:
    grouped: dict[str, list[ParamPlan]] = {}
    for plan in plans:
        grouped.setdefault(plan.mapping.unit_key, []).append(plan)
    units = []
    for key, members in grouped.items():
        # Member order is the shared unit table's (export/units.py), the order bridge mode and HF sources use; the
        # sort is stable, so parameters the table does not order keep model order.
        members.sort(key=lambda m: unit_slot(m.mapping.hf_names[0])[1])
        owners = {m.owner_ep_rank for m in members}
        assert len(owners) == 1, (key, owners)
        metas = tuple(
            TensorMeta(name=name, shape=shape, dtype=m.param.dtype if dtype is None else dtype)
            for m in members
            for name, shape in zip(m.mapping.hf_names, m.mapping.hf_shapes, strict=True)
        )
        units.append(
            UnitPlan(meta=AtomicUnit(key=key, tensors=metas), params=tuple(members), owner_ep_rank=owners.pop())
        )
    return units


def _num_local_experts(params: Sequence[LocalParam]) -> int:
    # Every MoE layer holds the same number of local experts on every EP rank (megatron requires it).
    return 1 + max((p.local_expert for p in params if p.local_expert is not None), default=-1)


def _expert_block(param: LocalParam) -> str:
    return param.canonical.split("{expert}")[0]


def _layer_numbers(layers: Sequence[torch.nn.Module]) -> list[int]:
    # megatron numbers layers from 1; canonical names count from 0.
    return [int(layer.layer_number) - 1 for layer in layers]


def _canonical_name(name: str, layer_numbers: dict[str, list[int]]) -> tuple[str, int | None]:
    match = _LAYER.fullmatch(name)
    if match is None:
        return name, None
    block, local_index, rest = match[1], int(match[2]), match[3]
    # MTP layers number among themselves (from 1), decoder layers across all pipeline stages (from 1).
    global_index = layer_numbers[block][local_index]
    canonical = f"{block}.layers.{global_index}.{rest}"
    expert = _SEQUENTIAL_EXPERT.fullmatch(canonical)
    if expert is not None:
        return f"{expert[1]}.{{expert}}.{expert[3]}", int(expert[2])
    expert = _GROUPED_EXPERT.fullmatch(canonical)
    if expert is not None:
        return f"{expert[1]}.{{expert}}.{expert[2]}.weight", int(expert[3])
    return canonical, None
