"""The record the export streams to senders (one atomic unit of full, HF-named tensors), and the one table of
which HF tensors form an atomic unit.

`UNIT_RULES` is the single source of the grouping: the raw converters (export/raw/table.py) key their mappings by
it, bridge mode (export/bridge.py) plans its units with it, and `units_from_hf_tensors` groups an HF state dict
with it. Loaders fuse a layer's q/k/v (weight and bias), its gate/up, and each expert (gate/up/down) only when all
parts arrive in one call, so those travel together; every other tensor is its own unit, keyed by its name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from miles_sync.weights.fp8 import (
    FP8_DTYPE,
    SCALE_DTYPE,
    Fp8Block,
    is_quantized_weight,
    quantize,
    scale_name,
    scale_shape,
)
from miles_sync.wire.bucket import AtomicUnit, TensorMeta


@dataclass(frozen=True, kw_only=True)
class UnitRule:
    """`pattern` is matched in full against an HF name; `unit` (a format string over its groups) names the unit;
    `order` maps the value of group `part` to the tensor's position inside the unit."""

    pattern: re.Pattern[str]
    unit: str
    order: Mapping[str, int]


UNIT_RULES: tuple[UnitRule, ...] = (
    UnitRule(
        pattern=re.compile(r"(?P<prefix>.+)\.self_attn\.(?P<part>[qkv]_proj\.(?:weight|bias))"),
        unit="{prefix}.self_attn.qkv_proj",
        # Weights before biases: the raw gather lists linear_qkv.weight before linear_qkv.bias.
        order={
            "q_proj.weight": 0,
            "k_proj.weight": 1,
            "v_proj.weight": 2,
            "q_proj.bias": 3,
            "k_proj.bias": 4,
            "v_proj.bias": 5,
        },
    ),
    # One routed expert (or the shared expert): gate, up and down together. Listed before the dense gate/up rule,
    # which would otherwise also match an expert's gate/up.
    UnitRule(
        pattern=re.compile(r"(?P<prefix>.+\.mlp\.(?:experts\.\d+|shared_expert))\.(?P<part>gate|up|down)_proj\.weight"),
        unit="{prefix}",
        order={"gate": 0, "up": 1, "down": 2},
    ),
    UnitRule(
        pattern=re.compile(r"(?P<prefix>.+)\.mlp\.(?P<part>gate|up)_proj\.weight"),
        unit="{prefix}.mlp.gate_up_proj",
        order={"gate": 0, "up": 1},
    ),
)


def unit_slot(hf_name: str) -> tuple[str, int]:
    """(unit key, position inside the unit) of one HF tensor; a tensor no rule groups is its own unit. Pure."""
    for rule in UNIT_RULES:
        match = rule.pattern.fullmatch(hf_name)
        if match is not None:
            fields = {k: v for k, v in match.groupdict().items() if k != "part"}
            return rule.unit.format(**fields), rule.order[match["part"]]
    return hf_name, 0


def group_hf_names(names: Iterable[str]) -> list[tuple[str, tuple[str, ...]]]:
    """(unit key, member names in unit order) for HF names, one entry per unit, in the order of each unit's first
    name in `names`; a repeated name counts once. Pure."""
    members: dict[str, dict[str, int]] = {}
    for name in names:
        key, position = unit_slot(name)
        members.setdefault(key, {}).setdefault(name, position)
    return [(key, tuple(sorted(group, key=group.__getitem__))) for key, group in members.items()]


@dataclass(frozen=True, kw_only=True)
class ExportedUnit:
    """One atomic unit as produced by `iter_hf_units`.

    `tensors` holds the full HF-named tensors in `meta.tensors` order on the stage's source rank (every rank when
    exporting with `source_rank_only=False`) and is None elsewhere. Shapes and dtypes always equal `meta`'s.
    The tensors may share storage with a temporary gather buffer: a consumer that keeps one past the next
    iteration step must not rely on it being a view of the model.
    """

    meta: AtomicUnit
    tensors: tuple[torch.Tensor, ...] | None

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs in unit order; raises on ranks that hold no tensors."""
        if self.tensors is None:
            raise ValueError(f"unit {self.meta.key!r} holds no tensors on this rank (not the export source)")
        return [(m.name, t) for m, t in zip(self.meta.tensors, self.tensors, strict=True)]


def units_from_hf_tensors(tensors: Mapping[str, torch.Tensor], names: Iterable[str]) -> list[ExportedUnit]:
    """Atomic units over whole HF-named tensors (the tensors themselves, no copies), grouped by `UNIT_RULES` as the
    converters emit them: a layer's q/k/v (weights and biases) together, its gate/up together, each expert's
    gate/up/down together, every other tensor alone; in the order of `names`, a unit at its first member. Only the
    tensors of `names` are units' members. For a source that holds an HF state dict rather than a Megatron model."""
    units = []
    for key, group in group_hf_names(names):
        metas = tuple(TensorMeta(name=n, shape=tuple(tensors[n].shape), dtype=tensors[n].dtype) for n in group)
        units.append(ExportedUnit(meta=AtomicUnit(key=key, tensors=metas), tensors=tuple(tensors[n] for n in group)))
    return units


def quantized_unit_meta(meta: AtomicUnit, spec: Fp8Block) -> AtomicUnit:
    """The unit as block-FP8 sends it: each quantized weight (`miles_sync.weights.fp8.is_quantized_weight`) in
    float8_e4m3fn, followed by its `weight_scale_inv`; every other tensor unchanged. The scales stay inside their
    weight's unit: a loader dequantizes (or repacks) a weight only with its scales in the same call. Pure."""
    tensors: list[TensorMeta] = []
    for t in meta.tensors:
        if not is_quantized_weight(t.name):
            tensors.append(t)
            continue
        tensors.append(TensorMeta(name=t.name, shape=t.shape, dtype=FP8_DTYPE))
        tensors.append(TensorMeta(name=scale_name(t.name), shape=scale_shape(t.shape, spec.block), dtype=SCALE_DTYPE))
    return AtomicUnit(key=meta.key, tensors=tuple(tensors))


def quantize_unit(unit: ExportedUnit, spec: Fp8Block) -> ExportedUnit:
    """`unit` in block-FP8 (`quantized_unit_meta`), its tensors quantized where it holds any (the source rank);
    a unit without a quantized weight is returned as it is. Deterministic: equal inputs give equal bytes."""
    if not any(is_quantized_weight(t.name) for t in unit.meta.tensors):
        return unit
    meta = quantized_unit_meta(unit.meta, spec)
    if unit.tensors is None:
        return ExportedUnit(meta=meta, tensors=None)
    tensors: list[torch.Tensor] = []
    for t, tensor in zip(unit.meta.tensors, unit.tensors, strict=True):
        if is_quantized_weight(t.name):
            tensors.extend(quantize(tensor, spec.block))
        else:
            tensors.append(tensor)
    return ExportedUnit(meta=meta, tensors=tuple(tensors))
