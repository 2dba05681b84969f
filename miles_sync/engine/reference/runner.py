"""Runners: one served model each (the target, or a draft), with the weight storage a weight update writes into.

Storage model, mirroring an engine whose kernels read a physical layout:

- `stored_tensors()` are the physical bytes. Every linear weight that the runner's layout applies to (its
  `LayoutSpec.applies_to` in `miles_sync.weights.layout.LAYOUTS`; with `WeightLayout.AITER`, those that
  `can_shuffle`) is kept in that layout after `finalize` (a "shuffled" weight); everything else is stored in the
  logical HF layout.
- The module's parameters are the compute view. For a shuffled weight the forward reads the layout's `undo` of
  the stored bytes, decoded once per `finalize`, as a kernel reading that layout would; for every other tensor the
  parameter IS the stored tensor, so a load is live immediately.
- MoE experts are stored as SGLang's FusedMoE stores them: per block one `w13` [E, 2I, H] and one `w2` [E, H, I]
  buffer (`models.stack_expert_weights`), each expert's HF-named tensor a view of its slice, so a load by HF name
  writes the expert's slice. A shuffled expert weight keeps its own physical buffer like any other; shuffling each
  expert's gate and up rows apart equals AITER's per-expert shuffle of w13 when the expert width is a multiple of 16.
- `finalize(names)` is the post-load hook: it applies the layout to the named linear weights in place and rebuilds
  the compute view. It is not idempotent: finalizing bytes that were already shuffled corrupts the model with no
  error. That is the behaviour of the real hook; guarding against it is the engine's finalize policy, not the
  runner's.

- Block FP8 (a checkpoint whose config.json declares a block-FP8 `quantization_config`): every linear weight an FP8
  checkpoint quantizes (`miles_sync.weights.fp8.is_quantized_weight`) is stored as float8_e4m3fn codes plus its
  float32 `<name>_scale_inv` (both owned names, loaded by name like any other), and the forward reads their
  dequantization (after undoing the layout, for a shuffled FP8 weight). The compute view of an unshuffled FP8
  weight is rebuilt by the load that writes its codes or scales; of a shuffled one by finalize.

- A direct load (`load_direct`, SGLang's `load_format: "direct"`) names the ENGINE's parameters, as a TP=1
  SGLang runner has them (`qkv_proj`, `gate_up_proj`, stacked experts): each fused tensor's bytes are the bytes of
  its HF parts one after another, so they are split back into the HF-named storage. The bytes are physical:
  written as they are, never finalized.

All writes (load, finalize) happen under `weights_lock`, which the scheduler holds during every forward step.
"""

from __future__ import annotations

import math
import os
import threading
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from miles_sync.engine.reference.models import (
    MOE_MODEL_TYPES,
    CausalLM,
    ExpertStorage,
    MTPHead,
    mtp_prefix,
    num_mtp_layers,
    read_config,
    read_safetensors,
)
from miles_sync.engine.reference.runner_api import StoredRunner
from miles_sync.weights.checksum import sglang_fused_tensor, sglang_parameter_names
from miles_sync.weights.fp8 import (
    FP8_DTYPE,
    SCALE_DTYPE,
    Fp8Block,
    block_from_config,
    dequantize,
    is_quantized_weight,
    scale_name,
    scale_shape,
    weight_name,
)
from miles_sync.weights.layout import WeightLayout, layout_spec
from miles_sync.wire.bucket import TensorMeta
from miles_sync.wire.protocol import Role
from miles_sync.wire.text import raise_if, shorten

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine

DRAFT_KINDS = ("none", "mtp", "standalone", "ngram")
_NUM_MISSING_SHOWN = 5  # how many missing checkpoint tensors an error message lists


class Runner(StoredRunner):
    """A served model of one role with HF-named weight storage.

    `model` is a `CausalLM` (target or standalone draft) or an `MTPHead` (MTP draft; it owns only its
    `model.layers.N.*` names and reads the target's embedding and lm_head, which the target runner owns).
    """

    holds_shards = False  # HF-named storage, whole tensors

    def __init__(
        self,
        *,
        role: Role,
        model: CausalLM | MTPHead,
        layout: WeightLayout = WeightLayout.NONE,
        weights_lock: threading.RLock | None = None,
        quantization: Fp8Block | None = None,
    ) -> None:
        self.role = Role(role)
        self.model = model.eval().requires_grad_(False)
        self.layout = WeightLayout(layout)
        self._layout_spec = layout_spec(self.layout)
        self.weights_lock = threading.RLock() if weights_lock is None else weights_lock
        self._expert_stacks = tuple(model.stack_expert_weights())
        self._params = model.hf_parameters()
        self._linear_names = model.linear_weight_names()
        self.quantization = quantization
        self._quantized = frozenset(
            name for name in self._params if quantization is not None and is_quantized_weight(name)
        )
        self._shuffled = frozenset(
            name
            for name in self._linear_names
            if self._layout_spec.applies_to(self._params[name].shape, self._stored_dtype(name))
        )
        # A shuffled or FP8 weight needs its own physical buffer; every other stored tensor is the parameter itself.
        self._stored = {}
        for name, p in self._params.items():
            if name in self._quantized:
                self._stored[name] = torch.zeros(p.shape, dtype=FP8_DTYPE)
                self._stored[scale_name(name)] = torch.ones(scale_shape(p.shape, quantization.block), dtype=SCALE_DTYPE)
            else:
                self._stored[name] = p.detach().clone() if name in self._shuffled else p.detach()
        # The engine's parameters a direct load names: {engine name: HF parts}, as the checker's engine names.
        self._engine_parts = sglang_parameter_names(self._stored)
        self._engine_metas = {
            name: _fused_meta(name, [self._stored[p] for p in parts]) for name, parts in self._engine_parts.items()
        }
        self._loaded: set[str] = set()
        self._direct: set[str] = set()
        self._epoch = 0

    def _stored_dtype(self, name: str) -> torch.dtype:
        return FP8_DTYPE if name in self._quantized else self._params[name].dtype

    def _compute_view(self, name: str) -> torch.Tensor:
        """What the forward reads for a shuffled or FP8 weight: the layout undone, then dequantized."""
        stored = self._stored[name]
        logical = self._layout_spec.undo(stored) if name in self._shuffled else stored
        if name not in self._quantized:
            return logical
        block = self.quantization.block
        return dequantize(logical, self._stored[scale_name(name)], block, dtype=self._params[name].dtype)

    # ---- what this runner owns ------------------------------------------------------------------------------

    @property
    def is_mtp(self) -> bool:
        return isinstance(self.model, MTPHead)

    @property
    def weights_epoch(self) -> int:
        """Increases on every load and finalize: anything computed from the weights at an older epoch is stale."""
        return self._epoch

    def owned_names(self) -> frozenset[str]:
        """HF names this runner loads; every other name in a payload is skipped by `load`."""
        return frozenset(self._stored)

    def linear_weight_names(self) -> frozenset[str]:
        """Owned names of linear weights, the tensors the finalize hook may transform."""
        return self._linear_names

    def shuffled_names(self) -> frozenset[str]:
        """Owned names stored in the runner's layout after finalize (empty with WeightLayout.NONE)."""
        return self._shuffled

    def expert_stacks(self) -> tuple[ExpertStorage, ...]:
        """The stacked expert buffers of every MoE block (empty for a dense model); live, read under the lock."""
        return self._expert_stacks

    def expected(self, name: str) -> TensorMeta:
        stored = self._stored.get(name)
        if stored is None:
            raise ValueError(f"{self.role} runner does not own tensor {name!r}")
        return TensorMeta(name=name, shape=tuple(stored.shape), dtype=stored.dtype)

    # ---- loading ------------------------------------------------------------------------------------------------

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy the owned tensors of `named` (logical HF layout) into storage; return their names in order.

        Names this runner does not own are skipped. Every shape and dtype is checked before any byte is written:
        on a mismatch this raises ValueError naming each offending tensor with expected and received meta, and
        storage is untouched. Loaded names are recorded as fresh for this session.
        """
        owned = [(name, tensor) for name, tensor in named if name in self._stored]
        problems = []
        for name, tensor in owned:
            stored = self._stored[name]
            if tuple(tensor.shape) != tuple(stored.shape) or tensor.dtype != stored.dtype:
                problems.append(
                    f"{name}: expected shape {tuple(stored.shape)} dtype {dtype_str(stored.dtype)}, "
                    f"got shape {tuple(tensor.shape)} dtype {dtype_str(tensor.dtype)}"
                )
        raise_if(problems, what=f"{self.role} runner rejected the payload")
        with self.weights_lock:
            for name, tensor in owned:
                self._stored[name].copy_(tensor)
            self._loaded.update(name for name, _ in owned)
            self._direct.difference_update(name for name, _ in owned)
            self._refresh_fp8({name for name, _ in owned})
            self._epoch += 1
        return [name for name, _ in owned]

    def engine_parameters(self) -> Mapping[str, TensorMeta]:
        """The engine's parameters on this rank (SGLang's names, local shapes and dtypes)."""
        return self._engine_metas

    def direct_problems(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
        """What SGLang's direct loader dies on for `named` (engine names, local tensors); empty when it loads."""
        return direct_load_problems(self._engine_metas, named)

    def load_direct(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
        """SGLang's `_model_load_weights_direct`: copy each (engine name, tensor) into that engine parameter (its HF
        parts here) as PHYSICAL bytes, cast to the stored dtype as `copy_` casts, then refresh the compute view of
        the tensors written. Recorded as loaded direct in the session: no finalize transforms them. Returns the
        engine names in order; ValueError before anything is written when `direct_problems` finds any."""
        named = list(named)
        raise_if(self.direct_problems(named), what=f"{self.role} runner cannot load direct")
        pieces = []
        for name, tensor in named:
            meta = self._engine_metas[name]
            flat = direct_source(tensor, meta).reshape(-1)
            offset = 0
            for part in self._engine_parts[name]:
                stored = self._stored[part]
                pieces.append((part, flat[offset : offset + stored.numel()].view(stored.shape)))
                offset += stored.numel()
        written = {part for part, _ in pieces}
        with self.weights_lock:  # one critical section: no forward sees new bytes under an old compute view
            for part, piece in pieces:
                self._stored[part].copy_(piece)
            self._refresh_fp8(written)
            for part in sorted({weight_name(n) or n for n in written} & self._shuffled):
                self._params[part].data.copy_(self._compute_view(part))
            self._direct.update(written)
            self._loaded.difference_update(written)
            self._epoch += 1
        return [name for name, _ in named]

    def _refresh_fp8(self, names: set[str]) -> None:
        """Rebuild the compute view of the unshuffled FP8 weights whose codes or scales are among `names` (a
        shuffled one is rebuilt by finalize, once its bytes are in the layout)."""
        weights = {weight_name(n) or n for n in names} & (self._quantized - self._shuffled)
        for name in sorted(weights):
            self._params[name].data.copy_(self._compute_view(name))

    def loaded_in_session(self) -> frozenset[str]:
        """Names loaded since the last `reset_session` (the fresh bytes a strict finalize may transform)."""
        return frozenset(self._loaded)

    def loaded_direct_in_session(self) -> frozenset[str]:
        """Names a direct load wrote (physical bytes) since the last `reset_session`; no finalize transforms them."""
        return frozenset(self._direct)

    def reset_session(self) -> None:
        with self.weights_lock:
            self._loaded.clear()
            self._direct.clear()

    def partially_loaded(self) -> list[str]:
        """Fused parameters only partly loaded in this session: none, this runner stores every HF tensor apart."""
        return []

    # ---- post-load processing ---------------------------------------------------------------------------------

    def finalize(self, names: Iterable[str]) -> None:
        """Post-load hook over `names`: apply the layout to each named linear weight, then rebuild the compute view.

        Not idempotent with the AITER layout: each call shuffles the stored bytes of the named weights again,
        whether or not they are fresh. Names that are not linear weights (or cannot be shuffled) are left as they
        are. Unknown names raise ValueError before anything changes.
        """
        names = list(dict.fromkeys(names))
        unknown = [name for name in names if name not in self._stored]
        if unknown:
            raise ValueError(f"{self.role} runner cannot finalize tensors it does not own: {', '.join(unknown)}")
        with self.weights_lock:
            for name in names:
                if name in self._shuffled:
                    stored = self._stored[name]
                    stored.copy_(self._layout_spec.apply(stored))
            # The kernel's view of the physical bytes: decoded from every shuffled weight, stale or not.
            for name in self._shuffled:
                self._params[name].data.copy_(self._compute_view(name))
            self._epoch += 1

    def overwrite(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy `named` into storage as PHYSICAL bytes (no layout applied), then refresh the compute view.

        What a test hook writing straight into an engine's parameters does (weights_checker reset_tensors): the
        names are not recorded as loaded in the session, so no finalize transforms them. Owned names with matching
        shape and dtype only (ValueError before anything is written otherwise).
        """
        named = list(named)
        problems = []
        for name, tensor in named:
            stored = self._stored.get(name)
            if stored is None:
                problems.append(f"{name}: not owned")
            elif tuple(tensor.shape) != tuple(stored.shape) or tensor.dtype != stored.dtype:
                problems.append(f"{name}: expected shape {tuple(stored.shape)} dtype {dtype_str(stored.dtype)}")
        raise_if(problems, what=f"{self.role} runner cannot overwrite")
        with self.weights_lock:  # one critical section: no forward sees new bytes under an old compute view
            for name, tensor in named:
                self._stored[name].copy_(tensor)
            self._refresh_fp8({name for name, _ in named})
            self.finalize([])  # no transform: only the compute view of the shuffled weights, and a new epoch

    def finalize_all(self) -> None:
        """Finalize every linear weight this runner owns, as SGLang does per runner (and at start-up), but those a
        direct load wrote in this session: their bytes are physical already."""
        self.finalize(sorted(self._linear_names - self._direct))

    # ---- reading the weights ------------------------------------------------------------------------------------

    def stored_tensors(self) -> Mapping[str, torch.Tensor]:
        """Read-only view of the physical bytes, name -> live tensor (hold `weights_lock` for a consistent read)."""
        return types.MappingProxyType(self._stored)

    def logical_tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors with the layout undone (copies for shuffled weights): what a trainer would hash.

        Valid between sessions; between a load and its finalize a shuffled weight's stored bytes are still logical.
        """
        with self.weights_lock:
            return {
                name: (self._layout_spec.undo(stored) if name in self._shuffled else stored)
                for name, stored in self._stored.items()
            }

    def __repr__(self) -> str:
        kind = "mtp" if self.is_mtp else type(self.model).__name__
        return f"Runner(role={self.role.value}, model={kind}, layout={self.layout.value}, tensors={len(self._stored)})"


def _fused_meta(engine_name: str, parts: list[torch.Tensor]) -> TensorMeta:
    fused = sglang_fused_tensor(engine_name, [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in parts])
    return TensorMeta(name=engine_name, shape=tuple(fused.shape), dtype=parts[0].dtype)


def direct_load_problems(parameters: Mapping[str, TensorMeta], named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """Why SGLang's `_model_load_weights_direct` would raise on `named` given a runner's `parameters` (engine name
    -> local meta), in its words: `params_dict[name]` raises KeyError for a name the runner has no parameter for,
    `default_weight_loader` asserts the shape unless both sides hold one element. The dtype is never a problem:
    `copy_` casts silently (measured on SGLang 0.5.23: bfloat16 and float64 into float32 parameters load)."""
    problems = []
    for name, tensor in named:
        meta = parameters.get(name)
        if meta is None:
            problems.append(f"KeyError: {name!r}")
        elif tuple(tensor.shape) != meta.shape and not (tensor.numel() == 1 and math.prod(meta.shape) == 1):
            problems.append(
                f"AssertionError: {name}: Attempted to load weight ({torch.Size(tensor.shape)}) into parameter "
                f"({torch.Size(meta.shape)})"
            )
    return problems


def direct_source(tensor: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """What `default_weight_loader` writes into a parameter of `meta`: a one-element tensor fills a one-element
    parameter whatever the shapes (SGLang's scalar broadcast), any other tensor as it is; cast to the parameter's
    dtype as `copy_` casts. Contiguous."""
    if tensor.numel() == 1 and math.prod(meta.shape) == 1:
        tensor = tensor.reshape(meta.shape)
    return tensor.to(meta.dtype).contiguous()


def dtype_str(dtype: torch.dtype) -> str:
    """A dtype as error messages show it ("bfloat16"); any dtype, unlike the wire's name table."""
    return str(dtype).removeprefix("torch.")


def populate(runner, tensors: Mapping[str, torch.Tensor], *, source: str):
    """Fill a fresh runner (a `Runner`, or a TP rank's `sharded.ShardedRunner`) from full checkpoint tensors, then
    finalize it once (start-up post-processing); returns it."""
    missing = sorted(runner.owned_names() - tensors.keys())
    if missing:
        raise ValueError(
            f"checkpoint {source!r} lacks {len(missing)} tensor(s) of the {runner.role} runner: "
            f"{shorten(missing, limit=_NUM_MISSING_SHOWN)}"
        )
    runner.load(tensors.items())
    runner.reset_session()
    runner.finalize_all()
    return runner


def load_target_runner(
    path: str | os.PathLike, *, layout: WeightLayout = WeightLayout.NONE, weights_lock: threading.RLock | None = None
) -> Runner:
    """The target runner of a checkpoint directory; MTP names (`model.layers.N.*`) in it are ignored."""
    config = read_config(path)
    runner = _runner(Role.TARGET, CausalLM(config), config, layout=layout, weights_lock=weights_lock)
    return populate(runner, read_safetensors(path), source=str(path))


def load_mtp_runner(path: str | os.PathLike, *, target: Runner, layout: WeightLayout = WeightLayout.NONE) -> Runner:
    """The MTP draft runner from the TARGET checkpoint at `path`; it shares the target's weights lock."""
    config = read_config(path)
    tensors = read_safetensors(path)
    prefix = mtp_prefix(config)
    if num_mtp_layers(config) < 1 and not any(name.startswith(prefix) for name in tensors):
        raise ValueError(
            f"checkpoint {str(path)!r} has no MTP layer: config num_nextn_predict_layers is 0 and no tensor is "
            f"named {prefix}*"
        )
    runner = _runner(Role.DRAFT, MTPHead(config), config, layout=layout, weights_lock=target.weights_lock)
    return populate(runner, tensors, source=str(path))


def load_standalone_runner(
    path: str | os.PathLike, *, layout: WeightLayout = WeightLayout.NONE, weights_lock: threading.RLock | None = None
) -> Runner:
    """A standalone draft model (its own embedding, layers and lm_head under the usual HF names)."""
    config = read_config(path)
    runner = _runner(Role.DRAFT, CausalLM(config), config, layout=layout, weights_lock=weights_lock)
    return populate(runner, read_safetensors(path), source=str(path))


def _runner(
    role: Role, model: torch.nn.Module, config: Any, *, layout: WeightLayout, weights_lock: threading.RLock | None
) -> Runner:
    """A runner of `model`, serving in the quantization its checkpoint's config declares (block FP8 or none)."""
    return Runner(
        role=role, model=model, layout=layout, weights_lock=weights_lock, quantization=block_from_config(config)
    )


def load_runners(
    model_path: str | os.PathLike,
    *,
    draft_kind: str = "none",
    draft_path: str | os.PathLike | None = None,
    layout: WeightLayout = WeightLayout.NONE,
) -> tuple[Runner, Runner | None]:
    """The target runner and, for draft_kind mtp or standalone, its draft runner (ngram and none have none).

    All runners share one weights lock. Raises ValueError for an unknown kind or a missing/unneeded draft path.
    """
    kind = str(getattr(draft_kind, "value", draft_kind))
    if kind not in DRAFT_KINDS:
        raise ValueError(f"draft_kind {kind!r} is not one of {', '.join(DRAFT_KINDS)}")
    if (kind == "standalone") != (draft_path is not None):
        raise ValueError(
            f"draft_path={None if draft_path is None else str(draft_path)!r} with draft_kind {kind!r}: a draft "
            f"path is required for 'standalone' and not accepted otherwise"
        )
    if kind == "standalone" and read_config(model_path).model_type in MOE_MODEL_TYPES:
        raise ValueError(
            f"draft_kind 'standalone' with the {read_config(model_path).model_type} target {str(model_path)!r}: an "
            f"MoE target is served with draft_kind 'mtp' (its checkpoint's MTP layer), 'ngram' or 'none'"
        )
    target = load_target_runner(model_path, layout=layout)
    if kind == "mtp":
        return target, load_mtp_runner(model_path, target=target, layout=layout)
    if kind == "standalone":
        return target, load_standalone_runner(draft_path, layout=layout, weights_lock=target.weights_lock)
    return target, None
