"""The gather: a megatron-core model's stage -> a stream of atomic units of full, HF-named tensors.

Every rank of a pipeline stage calls `iter_hf_units` and iterates it to the end in the same order; collectives
run inside the iteration, one parameter at a time, so no rank ever holds more than one unit's full tensors.
Tensor-parallel shards meet on TP rank 0 (experts: expert-TP rank 0 of the owning EP rank), are converted there,
and experts owned by another EP rank travel point-to-point to the stage's source rank. Only the data-parallel
replica that contains the source does any of this; other replicas just walk the metadata.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from miles_sync.env import read_environment
from miles_sync.export.converter import Converter
from miles_sync.export.local_pieces import LocalPiece, local_pieces
from miles_sync.export.stage import (
    ParallelCoords,
    ParamPlan,
    UnitPlan,
    collect_local_params,
    plan_units,
)
from miles_sync.export.units import ExportedUnit
from miles_sync.wire.bucket import AtomicUnit


def model_chunks(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The GPTModel chunks of `model` (a model, or megatron's list of virtual-pipeline chunks), wrappers removed."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    unwrapped = []
    for chunk in chunks:
        # DDP and Float16Module wrap the model as `.module`.
        while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
            chunk = chunk.module
        unwrapped.append(chunk)
    return unwrapped


def export_metadata(
    model: torch.nn.Module | Sequence[torch.nn.Module], *, converter: Converter, dtype: torch.dtype | None = None
) -> list[AtomicUnit]:
    """The units `iter_hf_units` (same `dtype`) will yield on this stage, in order, without moving tensor data."""
    coords = ParallelCoords.from_parallel_state()
    params = collect_local_params(model_chunks(model))
    return [u.meta for u in plan_units(params, converter=converter, coords=coords, dtype=dtype)]


def is_export_source() -> bool:
    """Whether this rank receives full tensors from `iter_hf_units(..., source_rank_only=True)`."""
    return ParallelCoords.from_parallel_state().is_source


def iter_hf_units(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    converter: Converter,
    source_rank_only: bool = True,
    dtype: torch.dtype | None = None,
    timeout_s: float | None = None,
) -> Iterator[ExportedUnit]:
    """Yield this stage's atomic units of full HF-named tensors.

    With `source_rank_only` the tensors appear on the stage's source rank (TP rank 0 of data-parallel rank 0;
    see `is_export_source`) and are None elsewhere; otherwise every rank of the stage receives them (each
    data-parallel replica gathers within its own groups). Every rank of the stage must iterate to the end in
    lockstep; each collective waits at most `timeout_s` (default: MILES_SYNC_COLLECTIVE_TIMEOUT_S).
    `dtype` casts every exported tensor (None keeps each parameter's dtype; see `export_metadata`).
    Does not mutate the model. Yielded tensors may be views of parameters (TP=1): copy before the next step of
    training if they must outlive it.
    """
    chunks = model_chunks(model)
    coords = ParallelCoords.from_parallel_state()
    plans = plan_units(collect_local_params(chunks), converter=converter, coords=coords, dtype=dtype)
    timeout = timedelta(seconds=read_environment().collective_timeout_s if timeout_s is None else timeout_s)
    params = {(i, name): p for i, chunk in enumerate(chunks) for name, p in chunk.named_parameters()}
    gather_class = _GatherToSource if source_rank_only else _GatherEverywhere
    gather = gather_class(params=params, converter=converter, coords=coords, dtype=dtype, timeout=timeout)
    with torch.no_grad():
        for plan in plans:
            yield ExportedUnit(meta=plan.meta, tensors=gather.unit(plan))


def iter_local_pieces(
    model: torch.nn.Module | Sequence[torch.nn.Module], *, converter: Converter
) -> Iterator[tuple[AtomicUnit, list[LocalPiece]]]:
    """This rank's own share of every unit of its stage, with no collective: each parameter's local Megatron shard
    converted into the HF slices it holds (miles_sync.export.local_pieces), in unit order. A dense parameter's
    pieces come from its TP coordinates, an expert's from its expert-TP coordinates on the EP rank that owns it;
    other EP ranks yield no pieces for that unit. Views of the parameters where the conversion makes them."""
    chunks = model_chunks(model)
    coords = ParallelCoords.from_parallel_state()
    plans = plan_units(collect_local_params(chunks), converter=converter, coords=coords, dtype=None)
    params = {(i, name): p for i, chunk in enumerate(chunks) for name, p in chunk.named_parameters()}
    with torch.no_grad():
        for plan in plans:
            if plan.owner_ep_rank is not None and plan.owner_ep_rank != coords.ep_rank:
                yield plan.meta, []
                continue
            rank, size = (
                (coords.tp_rank, coords.tp_size) if plan.owner_ep_rank is None else (coords.etp_rank, coords.etp_size)
            )
            pieces = []
            for member in plan.params:
                local = params[(member.param.chunk, member.param.local_name)].detach()
                pieces += local_pieces(
                    converter, member.mapping, local, partition_dim=member.param.partition_dim, rank=rank, size=size
                )
            yield plan.meta, pieces


class _Groups:
    """The process groups of one rank's stage, with the global rank of each group's members."""

    def __init__(self) -> None:
        from megatron.core import parallel_state as ps

        self.tp = ps.get_tensor_model_parallel_group()
        self.etp = ps.get_expert_tensor_parallel_group()
        self.ep = ps.get_expert_model_parallel_group()

    @staticmethod
    def global_rank(group: dist.ProcessGroup, group_rank: int) -> int:
        return dist.get_global_rank(group, group_rank)


class _Gather:
    """Shared by both modes: walk a unit's parameters, collect each one's TP shards, convert them to HF tensors."""

    def __init__(
        self,
        *,
        params: dict[tuple[int, str], torch.nn.Parameter],
        converter: Converter,
        coords: ParallelCoords,
        dtype: torch.dtype | None,
        timeout: timedelta,
    ) -> None:
        self._params = params
        self._converter = converter
        self._coords = coords
        self._dtype = dtype
        self._timeout = timeout
        self._groups = _Groups()

    def unit(self, plan: UnitPlan) -> tuple[torch.Tensor, ...] | None:
        raise NotImplementedError

    def _shards(self, local: torch.Tensor, *, group: dist.ProcessGroup, group_rank: int) -> list[torch.Tensor] | None:
        """Every TP shard of one sharded parameter in group-rank order, on the ranks that receive them."""
        raise NotImplementedError

    def _convert(
        self, members: Sequence[ParamPlan], *, group: dist.ProcessGroup, group_rank: int
    ) -> tuple[torch.Tensor, ...] | None:
        hf: list[torch.Tensor] = []
        is_receiver = True
        size = dist.get_world_size(group)
        for member in members:
            local = self._params[(member.param.chunk, member.param.local_name)].detach()
            if member.param.partition_dim is None or size == 1:
                shards = [local]
            else:
                # gloo mis-sends non-contiguous tensors: every buffer handed to a collective is contiguous.
                shards = self._shards(local.contiguous(), group=group, group_rank=group_rank)
            if shards is None:
                is_receiver = False
                continue  # keep walking: the unit's remaining collectives need this rank too
            tensors = self._converter.to_hf(member.mapping, shards, partition_dim=member.param.partition_dim)
            hf.extend(t if self._dtype is None else t.to(self._dtype) for t in tensors)
        return tuple(hf) if is_receiver else None

    def _device(self) -> torch.device:
        return next(iter(self._params.values())).device


class _GatherToSource(_Gather):
    """Shards meet on group rank 0 (`dist.gather`); experts of other EP ranks reach EP rank 0 by send/recv."""

    def unit(self, plan: UnitPlan) -> tuple[torch.Tensor, ...] | None:
        coords = self._coords
        if plan.owner_ep_rank is None:
            if not coords.is_dense_participant:
                return None
            tensors = self._convert(plan.params, group=self._groups.tp, group_rank=coords.tp_rank)
            # Replicated parameters need no collective, so every TP rank converted them; only rank 0 reports.
            return tensors if coords.tp_rank == 0 else None
        if not coords.is_expert_participant:
            return None
        owner = plan.owner_ep_rank
        tensors = None
        if coords.ep_rank == owner:
            tensors = self._convert(plan.params, group=self._groups.etp, group_rank=coords.etp_rank)
        if coords.etp_rank != 0:
            return None
        if owner == 0:
            return tensors
        # Expert-TP rank 0 of the owner holds the unit; move it to EP rank 0 (the source's EP coordinate).
        ep = self._groups.ep
        if coords.ep_rank == owner:
            works = [dist.isend(t.contiguous(), dst=_Groups.global_rank(ep, 0), group=ep) for t in tensors]
            _wait(works, self._timeout)
            return None
        if coords.ep_rank == 0:
            received = tuple(_empty_like_meta(plan, self._device()))
            works = [dist.irecv(t, src=_Groups.global_rank(ep, owner), group=ep) for t in received]
            _wait(works, self._timeout)
            return received
        return None

    def _shards(self, local: torch.Tensor, *, group: dist.ProcessGroup, group_rank: int) -> list[torch.Tensor] | None:
        shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))] if group_rank == 0 else None
        work = dist.gather(local, shards, dst=_Groups.global_rank(group, 0), group=group, async_op=True)
        _wait([work], self._timeout)
        return shards


class _GatherEverywhere(_Gather):
    """Every rank of the stage ends with the full tensors: all-gather shards, broadcast experts within EP."""

    def unit(self, plan: UnitPlan) -> tuple[torch.Tensor, ...] | None:
        coords = self._coords
        if plan.owner_ep_rank is None:
            return self._convert(plan.params, group=self._groups.tp, group_rank=coords.tp_rank)
        tensors = None
        if coords.ep_rank == plan.owner_ep_rank:
            tensors = self._convert(plan.params, group=self._groups.etp, group_rank=coords.etp_rank)
        if coords.ep_size == 1:
            return tensors
        ep = self._groups.ep
        if tensors is None:
            buffers = tuple(_empty_like_meta(plan, self._device()))
        else:
            buffers = tuple(t.contiguous() for t in tensors)
        src = _Groups.global_rank(ep, plan.owner_ep_rank)
        _wait([dist.broadcast(t, src=src, group=ep, async_op=True) for t in buffers], self._timeout)
        return buffers

    def _shards(self, local: torch.Tensor, *, group: dist.ProcessGroup, group_rank: int) -> list[torch.Tensor] | None:
        shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        _wait([dist.all_gather(shards, local, group=group, async_op=True)], self._timeout)
        return shards


def _empty_like_meta(plan: UnitPlan, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(m.shape, dtype=m.dtype, device=device) for m in plan.meta.tensors]


def _wait(works: Sequence[dist.Work], timeout: timedelta) -> None:
    for work in works:
        work.wait(timeout=timeout)
