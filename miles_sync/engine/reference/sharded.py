"""One tensor-parallel rank's runner: storage is the engine's own fused parameters on this rank, the tensors
SGLang's weights checker hashes (`...self_attn.qkv_proj.weight` = cat(q, k, v slices), `...mlp.gate_up_proj.weight`
= cat(gate, up slices), every other tensor under its HF name). Each TP rank is its own process, as in SGLang; the
models computing with these weights are `parallel_models.py`, the split rules `miles_sync.weights.engine_layout`.

A load receives FULL HF tensors and copies this rank's slice into its region of the fused parameter (SGLang's
weight loaders). Compute views follow `runner.Runner`: an unshuffled fused weight's q/k/v parameters are views of
its rows (a load is live at once); a shuffled one keeps its own compute buffers, decoded with the layout's `undo`
at each finalize. A direct load (`load_direct`) names these engine parameters with this rank's local shapes and
writes the physical bytes as they are, as SGLang's `_model_load_weights_direct` does.
"""

from __future__ import annotations

import os
import threading
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from miles_sync.engine.reference.models import (
    mtp_prefix,
    num_mtp_layers,
    read_config,
    read_safetensors,
)
from miles_sync.engine.reference.parallel_models import ShardedCausalLM, ShardedMTPHead
from miles_sync.engine.reference.runner import (
    DRAFT_KINDS,
    direct_load_problems,
    direct_source,
    dtype_str,
    populate,
)
from miles_sync.engine.reference.runner_api import StoredRunner
from miles_sync.weights.checksum import sglang_parameter_names
from miles_sync.weights.engine_layout import (
    TPShape,
    copy_shard,
    is_linear_weight,
    tp_problems,
)
from miles_sync.weights.layout import WeightLayout, layout_spec
from miles_sync.wire.bucket import TensorMeta
from miles_sync.wire.protocol import Role
from miles_sync.wire.text import raise_if

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine


# ---- runner -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, eq=False)
class _Part:
    """One HF tensor's share of an engine parameter: dim-0 rows [start, end) of it, and its compute parameter."""

    hf_name: str
    engine_name: str
    start: int
    end: int
    param: nn.Parameter
    is_whole: bool  # the engine parameter holds this tensor alone


class ShardedRunner(StoredRunner):
    """One served model of one role on one TP rank, with the engine's fused parameters as its storage.

    A `StoredRunner` as `runner.Runner` is; names in `load`/`finalize`/`owned_names`/`expected` are
    FULL HF names, names in `stored_tensors`/`shuffled_names`/`overwrite` are engine names. All writes happen under
    `weights_lock`, which the caller holds during every forward step.
    """

    holds_shards = True  # the engine's own fused parameters, this rank's shard
    quantization = None  # block FP8 is served at TP=1 only

    def __init__(
        self,
        *,
        role: Role,
        model: ShardedCausalLM | ShardedMTPHead,
        layout: WeightLayout = WeightLayout.NONE,
        weights_lock: threading.RLock | None = None,
    ) -> None:
        self.role = Role(role)
        self.model = model.eval().requires_grad_(False)
        self.layout = WeightLayout(layout)
        self._layout_spec = layout_spec(self.layout)
        self.weights_lock = threading.RLock() if weights_lock is None else weights_lock
        self.tp_rank, self.tp_size = model.tp_rank, model.tp_size
        self.shape = model.shape
        params = model.hf_parameters()
        self._full = model.full_parameter_metas()
        assert self._full.keys() == params.keys(), "sharded and unsharded models disagree on names"
        self._stored: dict[str, torch.Tensor] = {}
        self._parts: dict[str, tuple[_Part, ...]] = {}
        shuffled = set()
        for engine_name, hf_names in sorted(sglang_parameter_names(params).items()):
            parts = tuple(_parts(engine_name, [(name, params[name]) for name in hf_names]))
            stored = parts[0].param.detach() if len(parts) == 1 else torch.cat([p.param.detach() for p in parts])
            if is_linear_weight(engine_name) and self._layout_spec.applies_to(tuple(stored.shape), stored.dtype):
                shuffled.add(engine_name)
                # A shuffled weight needs its own physical buffer (a fused one has it already).
                stored = stored.clone() if len(parts) == 1 else stored
            elif len(parts) > 1:
                for part in parts:  # the compute view IS the fused storage: a load is live at once
                    part.param.data = stored[part.start : part.end]
            self._stored[engine_name] = stored
            self._parts[engine_name] = parts
        self._part_of = {part.hf_name: part for parts in self._parts.values() for part in parts}
        self._shuffled = frozenset(shuffled)
        self._linear = frozenset(name for name in self._stored if is_linear_weight(name))
        self._engine_metas = {
            name: TensorMeta(name=name, shape=tuple(t.shape), dtype=t.dtype) for name, t in self._stored.items()
        }
        self._loaded: set[str] = set()
        self._direct: set[str] = set()  # HF names whose bytes a direct load wrote in this session
        self._epoch = 0

    # ---- what this runner owns ------------------------------------------------------------------------------

    @property
    def is_mtp(self) -> bool:
        return isinstance(self.model, ShardedMTPHead)

    @property
    def weights_epoch(self) -> int:
        """Increases on every load and finalize: anything computed from the weights at an older epoch is stale."""
        return self._epoch

    def owned_names(self) -> frozenset[str]:
        """FULL HF names this runner loads; every other name in a payload is skipped by `load`."""
        return frozenset(self._full)

    def expected(self, name: str) -> TensorMeta:
        """The FULL HF shape and dtype of `name`, what a trainer sends (every rank receives the whole tensor)."""
        meta = self._full.get(name)
        if meta is None:
            raise ValueError(f"{self.role} runner does not own tensor {name!r}")
        return meta

    def shuffled_names(self) -> frozenset[str]:
        """Engine names stored in the runner's layout after finalize (empty with WeightLayout.NONE)."""
        return self._shuffled

    # ---- loading ------------------------------------------------------------------------------------------------

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy this rank's slice of each owned FULL HF tensor into its region of the engine parameter; return the
        loaded names in order.

        Names not owned are skipped. Every shape and dtype is checked against the full HF meta before any byte is
        written: on a mismatch this raises ValueError naming each offending tensor, and storage is untouched.
        """
        owned = [(name, tensor) for name, tensor in named if name in self._full]
        problems = []
        for name, tensor in owned:
            meta = self._full[name]
            if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
                problems.append(
                    f"{name}: expected shape {meta.shape} dtype {dtype_str(meta.dtype)}, "
                    f"got shape {tuple(tensor.shape)} dtype {dtype_str(tensor.dtype)}"
                )
        raise_if(problems, what=f"{self.role} runner rejected the payload")
        with self.weights_lock:
            for name, tensor in owned:
                region = self._region(self._part_of[name])
                copy_shard(region, name, tensor, shape=self.shape, tp_rank=self.tp_rank, tp_size=self.tp_size)
            self._loaded.update(name for name, _ in owned)
            self._direct.difference_update(name for name, _ in owned)
            self._epoch += 1
        return [name for name, _ in owned]

    def engine_parameters(self) -> Mapping[str, TensorMeta]:
        """The engine's parameters on this rank (SGLang's names, local shapes and dtypes)."""
        return self._engine_metas

    def direct_problems(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
        """What SGLang's direct loader dies on for `named` (engine names, this rank's local tensors)."""
        return direct_load_problems(self._engine_metas, named)

    def load_direct(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
        """SGLang's `_model_load_weights_direct` on this rank: copy each (engine name, local tensor) into that
        parameter as PHYSICAL bytes (cast as `copy_` casts), then refresh the compute view of the shuffled ones
        written (an unshuffled parameter's compute view is its storage). Recorded as loaded direct: no finalize
        transforms them. Returns the engine names in order; ValueError before any write on a `direct_problems`."""
        named = list(named)
        raise_if(self.direct_problems(named), what=f"{self.role} runner cannot load direct")
        sources = [(name, direct_source(tensor, self._engine_metas[name])) for name, tensor in named]
        parts = {part.hf_name for name, _ in named for part in self._parts[name]}
        with self.weights_lock:
            for name, source in sources:
                self._stored[name].copy_(source)
            for name in sorted({name for name, _ in named} & self._shuffled):
                self._refresh_compute_view(name)
            self._direct.update(parts)
            self._loaded.difference_update(parts)
            self._epoch += 1
        return [name for name, _ in named]

    def loaded_in_session(self) -> frozenset[str]:
        """HF names loaded (logical bytes, to finalize) since the last `reset_session`."""
        return frozenset(self._loaded)

    def loaded_direct_in_session(self) -> frozenset[str]:
        """HF names whose engine parameters a direct load wrote (physical bytes) since the last `reset_session`."""
        return frozenset(self._direct)

    def reset_session(self) -> None:
        with self.weights_lock:
            self._loaded.clear()
            self._direct.clear()

    def partially_loaded(self) -> list[str]:
        """Sorted engine names of which some, but not all, fused HF parts were loaded this session: finalizing one
        transforms the stale rows with the fresh ones, as SGLang's post-processing would."""
        return sorted(
            name
            for name, parts in self._parts.items()
            if 0 < sum(part.hf_name in self._loaded for part in parts) < len(parts)
        )

    # ---- post-load processing ---------------------------------------------------------------------------------

    def finalize(self, names: Iterable[str]) -> None:
        """Post-load hook: apply the layout once to each engine parameter holding any of the HF `names`, then
        rebuild the compute view of every shuffled parameter.

        Not idempotent with the AITER layout (see `runner.Runner.finalize`). Unknown names raise ValueError before
        anything changes.
        """
        names = list(dict.fromkeys(names))
        unknown = [name for name in names if name not in self._part_of]
        if unknown:
            raise ValueError(f"{self.role} runner cannot finalize tensors it does not own: {', '.join(unknown)}")
        engine_names = dict.fromkeys(self._part_of[name].engine_name for name in names)
        with self.weights_lock:
            for name in engine_names:
                if name in self._shuffled:
                    stored = self._stored[name]
                    stored.copy_(self._layout_spec.apply(stored))
            # The kernel's view of the physical bytes: decoded from every shuffled weight, stale or not.
            for name in self._shuffled:
                self._refresh_compute_view(name)
            self._epoch += 1

    def _refresh_compute_view(self, name: str) -> None:
        """Decode the compute parameters of the shuffled engine weight `name` from its physical bytes."""
        logical = self._layout_spec.undo(self._stored[name])
        for part in self._parts[name]:
            part.param.data.copy_(logical if part.is_whole else logical[part.start : part.end])

    def finalize_all(self) -> None:
        """Finalize every linear engine weight, as SGLang does per runner (and at start-up), but those a direct
        load wrote in this session: their bytes are physical already."""
        self.finalize(
            part.hf_name
            for name in sorted(self._linear)
            for part in self._parts[name]
            if part.hf_name not in self._direct
        )

    def overwrite(self, named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Copy `named` ((engine name, local tensor) pairs or a mapping) into storage as PHYSICAL bytes (no layout
        applied), then refresh the compute view; not recorded as loaded. ValueError before anything is written for
        an unknown name or a shape/dtype that is not the stored one."""
        named = list(named.items() if isinstance(named, Mapping) else named)
        problems = []
        for name, tensor in named:
            stored = self._stored.get(name)
            if stored is None:
                problems.append(f"{name}: not an engine parameter of this runner")
            elif tuple(tensor.shape) != tuple(stored.shape) or tensor.dtype != stored.dtype:
                problems.append(f"{name}: expected shape {tuple(stored.shape)} dtype {dtype_str(stored.dtype)}")
        raise_if(problems, what=f"{self.role} runner cannot overwrite")
        with self.weights_lock:
            for name, tensor in named:
                self._stored[name].copy_(tensor)
            self.finalize([])

    # ---- reading the weights ------------------------------------------------------------------------------------

    def stored_tensors(self) -> Mapping[str, torch.Tensor]:
        """Read-only {engine name: this rank's physical tensor} (hold `weights_lock` for a consistent read)."""
        return types.MappingProxyType(self._stored)

    def _region(self, part: _Part) -> torch.Tensor:
        stored = self._stored[part.engine_name]
        return stored if part.is_whole else stored[part.start : part.end]

    def __repr__(self) -> str:
        kind = "mtp" if self.is_mtp else type(self.model).__name__
        return (
            f"ShardedRunner(role={self.role.value}, model={kind}, layout={self.layout.value}, "
            f"tp={self.tp_rank}/{self.tp_size}, tensors={len(self._stored)})"
        )


def _parts(engine_name: str, named: list[tuple[str, nn.Parameter]]) -> list[_Part]:
    """The parts of one engine parameter, concatenated along dim 0 in the given order."""
    parts, row = [], 0
    for name, param in named:
        rows = param.shape[0] if param.dim() else 0
        is_whole = len(named) == 1
        parts.append(
            _Part(hf_name=name, engine_name=engine_name, start=row, end=row + rows, param=param, is_whole=is_whole)
        )
        row += rows
    return parts


# ---- loading a checkpoint ---------------------------------------------------------------------------------------


def load_sharded_runners(
    model_path: str | os.PathLike,
    *,
    draft_kind: str = "none",
    draft_path: str | os.PathLike | None = None,
    layout: WeightLayout = WeightLayout.NONE,
    tp_rank: int,
    tp_size: int,
    group: Any = None,
) -> tuple[ShardedRunner, ShardedRunner | None]:
    """This rank's target runner and, for draft_kind mtp (from the target checkpoint) or standalone (from
    `draft_path`), its draft runner, as `runner.load_runners`; all share one weights lock.

    Raises ValueError before building anything for an unknown kind, a missing/unneeded draft path, or a model that
    does not split at `tp_size` (naming the model and each dimension).
    """
    kind = str(getattr(draft_kind, "value", draft_kind))
    if kind not in DRAFT_KINDS:
        raise ValueError(f"draft_kind {kind!r} is not one of {', '.join(DRAFT_KINDS)}")
    if (kind == "standalone") != (draft_path is not None):
        raise ValueError(
            f"draft_path={None if draft_path is None else str(draft_path)!r} with draft_kind {kind!r}: a draft "
            f"path is required for 'standalone' and not accepted otherwise"
        )
    config = read_config(model_path)
    # The MTP head has the target's attention and MLP dimensions: the target's problems cover it.
    models = [(f"target model {str(model_path)!r}", config)]
    if kind == "standalone":
        models.append((f"standalone draft model {str(draft_path)!r}", read_config(draft_path)))
    problems = [f"{what}: {p}" for what, cfg in models for p in tp_problems(TPShape.from_config(cfg), tp_size)]
    raise_if(problems, what=f"cannot shard at tp_size={tp_size}")
    tensors = read_safetensors(model_path)
    if kind == "mtp" and num_mtp_layers(config) < 1 and not any(n.startswith(mtp_prefix(config)) for n in tensors):
        raise ValueError(
            f"checkpoint {str(model_path)!r} has no MTP layer: config num_nextn_predict_layers is 0 and no tensor "
            f"is named {mtp_prefix(config)}*"
        )
    tp = {"tp_rank": tp_rank, "tp_size": tp_size, "group": group}
    lock = threading.RLock()
    target = ShardedRunner(role=Role.TARGET, model=ShardedCausalLM(config, **tp), layout=layout, weights_lock=lock)
    populate(target, tensors, source=str(model_path))
    if kind == "mtp":
        draft = ShardedRunner(role=Role.DRAFT, model=ShardedMTPHead(config, **tp), layout=layout, weights_lock=lock)
        return target, populate(draft, tensors, source=str(model_path))
    if kind == "standalone":
        draft_config = models[1][1]
        model = ShardedCausalLM(draft_config, **tp)
        draft = ShardedRunner(role=Role.DRAFT, model=model, layout=layout, weights_lock=lock)
        return target, populate(draft, read_safetensors(draft_path), source=str(draft_path))
    return target, None
