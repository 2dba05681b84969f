"""Bridge mode: export (and build) megatron-core models through megatron-bridge's AutoBridge.

The stream is the raw mode's (`ExportedUnit`s of `miles_sync.export.units`): the same atomic units under the same
keys, the same tensors in the same order inside each unit, tensors on the same source rank, so senders do not
care which mode produced it. Unit *order* follows megatron-bridge's conversion tasks (all ranks must walk them in
that order); consumers that plan buckets ahead use `metadata()`, which lists the units exactly as they are yielded.

- pure planning: `plan_units(metas)` groups HF-named tensors into atomic units by the shared table of
  export/units.py (`unit_slot`, re-exported here); `UnitAssembler` turns a stream of (name, tensor) pairs into
  complete units; `trim_vocab_padding`;
- construction: `load_bridge(hf_dir)` and `build_bridge_model(bridge)` (HF checkpoint dir -> this rank's
  megatron-core model, weights loaded by the bridge), on the local layer spec when Transformer Engine is absent;
  `bridge_for_config(hf_config)` for exporting a model built elsewhere (miles_sync's model builder);
- export: `BridgeExporter(bridge, model)` (`metadata()`, `iter_units()`), and `iter_hf_units` / `export_metadata`
  with the raw gather's call shape (`hf_config` in place of a converter).

megatron-bridge is imported lazily, after the CPU shims (megatron-core's, then the Transformer Engine import shim),
so importing this module is cheap and works without megatron-bridge installed (see launch/install_bridge.sh).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from miles_sync.export.megatron import is_export_source, model_chunks
from miles_sync.export.units import ExportedUnit, unit_slot
from miles_sync.wire.bucket import AtomicUnit, TensorMeta

# --------------------------------------------------------------------------------------------------------------
# Pure planning: which HF tensors travel together comes from the one grouping table, `UNIT_RULES` of
# export/units.py, which the raw converters use too; keys and member order are therefore the raw mode's.
# --------------------------------------------------------------------------------------------------------------


def plan_units(metas: Sequence[TensorMeta]) -> tuple[AtomicUnit, ...]:
    """Group tensors listed in arrival order into atomic units, in the order the units complete.

    A unit completes when its last member arrives, so a stream in this arrival order can hand each unit on as soon
    as it is whole, holding back only the units still missing a part. Raises ValueError on a repeated name.
    """
    members: dict[str, list[tuple[int, TensorMeta]]] = {}
    last_arrival: dict[str, int] = {}
    seen: set[str] = set()
    for index, meta in enumerate(metas):
        if meta.name in seen:
            raise ValueError(f"tensor {meta.name!r} is listed twice")
        seen.add(meta.name)
        key, position = unit_slot(meta.name)
        members.setdefault(key, []).append((position, meta))
        last_arrival[key] = index
    keys = sorted(members, key=last_arrival.__getitem__)
    return tuple(
        AtomicUnit(key=key, tensors=tuple(meta for _, meta in sorted(members[key], key=lambda pm: pm[0])))
        for key in keys
    )


class UnitAssembler:
    """Collects (name, tensor) pairs into the planned units; hands each unit on once all its tensors arrived.

    Only tensors of incomplete units are held, so memory stays bounded by the largest set of units in flight (one
    layer's q/k/v and gate/up for a dense model). Tensors must match the plan's shapes and dtypes.
    """

    def __init__(self, units: Sequence[AtomicUnit]) -> None:
        self._units = {u.key: u for u in units}
        self._slot = {m.name: (u.key, i) for u in units for i, m in enumerate(u.tensors)}
        self._pending: dict[str, dict[int, torch.Tensor]] = {}
        self._done: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> ExportedUnit | None:
        """Record one tensor; returns its unit when this tensor completes it, else None."""
        if name not in self._slot:
            raise ValueError(f"exported tensor {name!r} is not in the export plan")
        key, index = self._slot[name]
        unit = self._units[key]
        meta = unit.tensors[index]
        if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
            raise ValueError(
                f"exported tensor {name!r} has shape {tuple(tensor.shape)} dtype {tensor.dtype}; "
                f"the plan expects shape {meta.shape} dtype {meta.dtype}"
            )
        parts = self._pending.setdefault(key, {})
        if index in parts or key in self._done:
            raise ValueError(f"exported tensor {name!r} arrived twice")
        parts[index] = tensor
        if len(parts) < len(unit.tensors):
            return None
        del self._pending[key]
        self._done.add(key)
        return ExportedUnit(meta=unit, tensors=tuple(parts[i] for i in range(len(unit.tensors))))

    def planned_shape(self, name: str) -> tuple[int, ...]:
        if name not in self._slot:
            raise ValueError(f"exported tensor {name!r} is not in the export plan")
        key, index = self._slot[name]
        return self._units[key].tensors[index].shape

    def missing(self) -> list[str]:
        """Names of planned tensors that have not arrived, in plan order."""
        return [
            m.name
            for key, u in self._units.items()
            if key not in self._done
            for i, m in enumerate(u.tensors)
            if i not in self._pending.get(key, {})
        ]


# --------------------------------------------------------------------------------------------------------------
# Construction.
# --------------------------------------------------------------------------------------------------------------


def prepare_megatron_bridge() -> Any:
    """Apply the CPU shims (no-ops with CUDA) and import megatron-bridge; returns the `AutoBridge` class.

    Order matters: megatron-core's CPU shims and its TE-probing modules load before the Transformer Engine import
    shim, so megatron-core keeps its local code paths. Raises ImportError naming the install script when
    megatron-bridge is missing. Idempotent.
    """
    from miles_sync.megatron.cpu_shims import apply_cpu_shims
    from miles_sync.megatron.te_shim import install_transformer_engine_shim

    apply_cpu_shims()
    install_transformer_engine_shim()
    try:
        from megatron.bridge import AutoBridge
        from megatron.bridge.models.conversion import param_mapping
    except ModuleNotFoundError as e:
        raise ImportError(
            f"bridge mode cannot import megatron-bridge: {e.name} is missing. launch/install_bridge.sh installs "
            "megatron-bridge and the dependencies it needs on CPU; with CUDA it also needs Transformer Engine."
        ) from e
    _make_scatter_inputs_contiguous(param_mapping.MegatronParamMapping)
    return AutoBridge


def _make_scatter_inputs_contiguous(mapping_class: type) -> None:
    # The bridge scatters row-parallel splits (chunks along dim 1, non-contiguous views) when loading at TP>1. On
    # CUDA its `.to(device)` copies them; on CPU it is a no-op and gloo mis-sends non-contiguous tensors, which
    # corrupts o_proj/down_proj silently. Making the splits contiguous first is exact and a no-op otherwise.
    original = mapping_class.scatter_to_tp_ranks
    if getattr(original, "_miles_sync_contiguous", False):
        return

    def scatter_to_tp_ranks(self, splits, *args, **kwargs):
        if splits:
            splits = [s.contiguous() for s in splits]
        return original(self, splits, *args, **kwargs)

    scatter_to_tp_ranks._miles_sync_contiguous = True
    mapping_class.scatter_to_tp_ranks = scatter_to_tp_ranks


def load_bridge(hf_dir: str | os.PathLike[str]) -> Any:
    """`AutoBridge.from_hf_pretrained` on a local HF checkpoint directory (config.json + safetensors).

    Never reaches a hub: the directory must exist. The checkpoint's tensors are read lazily, when a model is built
    with `load_weights=True`.
    """
    path = Path(hf_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"hf_dir={str(hf_dir)!r} is not a local HF checkpoint directory (no config.json)")
    auto_bridge = prepare_megatron_bridge()
    return auto_bridge.from_hf_pretrained(str(path))


def bridge_for_config(hf_config: Any) -> Any:
    """A weightless `AutoBridge` for exporting any megatron-core model of `hf_config`'s architecture.

    megatron-bridge plans its conversion from the HF tensor names; without a checkpoint they come from the
    transformers model of `hf_config` built on the meta device (no memory, nothing downloaded). The caller's
    config is not mutated.
    """
    import copy

    auto_bridge = prepare_megatron_bridge()
    import transformers
    from megatron.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM

    config = copy.deepcopy(hf_config)
    with torch.device("meta"):
        meta_model = transformers.AutoModelForCausalLM.from_config(config)
    if not getattr(config, "architectures", None):
        # The bridge dispatches on the architecture class name, which configs built in code do not carry.
        config.architectures = [type(meta_model).__name__]
    pretrained = PreTrainedCausalLM(device="meta")
    pretrained.config = config
    pretrained.model = meta_model  # its state_dict() names and shapes the HF tensors; nothing runs it
    return auto_bridge(pretrained)


def build_bridge_model(
    bridge: Any, *, load_weights: bool = True, params_dtype: torch.dtype = torch.float32
) -> list[torch.nn.Module]:
    """HF checkpoint -> megatron-core model chunks for this rank, sharded as the initialized model-parallel state.

    The caller initializes torch.distributed (gloo on CPU) and megatron-core's model parallel state first: left to
    itself the bridge initializes NCCL. With `load_weights` the bridge loads the checkpoint's tensors, each rank
    keeping its shard; otherwise the weights are megatron-core's random initialization. Without Transformer Engine
    the layers use megatron-core's local spec and the fusions that need TE or Apex are off.
    """
    from megatron.core import parallel_state

    from miles_sync.megatron.te_shim import is_shim_installed

    if not parallel_state.model_parallel_is_initialized():
        raise ValueError("build_bridge_model needs megatron-core's model parallel state initialized first")
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    # The bridge turns initialization off when it loads weights, but megatron-core then leaves the weights without
    # their tensor-parallel attributes (`tensor_model_parallel`, `partition_dim`), which other code (the raw gather,
    # optimizers) reads. Initializing first costs one pass over the weights and keeps the model standard.
    provider.perform_initialization = True
    provider.tensor_model_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
    provider.pipeline_model_parallel_size = parallel_state.get_pipeline_model_parallel_world_size()
    provider.expert_model_parallel_size = parallel_state.get_expert_model_parallel_world_size()
    provider.params_dtype = params_dtype
    provider.pipeline_dtype = params_dtype
    provider.bf16 = params_dtype is torch.bfloat16
    provider.fp16 = params_dtype is torch.float16
    if is_shim_installed():
        _use_local_spec(provider)
    provider.finalize()
    return provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)


def _use_local_spec(provider: Any) -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if getattr(provider, "mtp_num_layers", None):
        raise ValueError(
            f"mtp_num_layers={provider.mtp_num_layers}: bridge mode builds MTP layers with Transformer Engine only; "
            "use raw mode for MTP models on CPU"
        )
    provider.transformer_layer_spec = get_gpt_layer_local_spec(
        num_experts=provider.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=provider.qk_layernorm,
        normalization=provider.normalization,
    )
    provider.moe_grouped_gemm = False
    # Each of these fuses through Transformer Engine, Apex or CUDA kernels; the local spec computes the same unfused.
    for flag in (
        "apply_rope_fusion",
        "persist_layer_norm",
        "gradient_accumulation_fusion",
        "masked_softmax_fusion",
        "bias_activation_fusion",
        "bias_dropout_fusion",
        "cross_entropy_loss_fusion",
    ):
        setattr(provider, flag, False)


# --------------------------------------------------------------------------------------------------------------
# Export.
# --------------------------------------------------------------------------------------------------------------


class BridgeExporter:
    """Exports one rank's model chunks as the raw mode's atomic-unit stream, through `bridge`'s conversion.

    The model may come from `build_bridge_model` or from miles_sync's own builder (vocabulary padded to a multiple
    of 128 * TP: the padding rows are dropped, as raw mode does). Construction is collective-free: it plans the
    units from the bridge's conversion tasks and the HF tensor shapes. Each pipeline stage yields the units whose
    parameters it holds.
    """

    def __init__(self, bridge: Any, model: Sequence[torch.nn.Module] | torch.nn.Module) -> None:
        self._bridge = bridge
        self._model = list(model) if isinstance(model, Sequence) else [model]
        self._tasks = bridge.get_conversion_tasks(self._model)
        first = model_chunks(self._model)[0]
        config = first.config
        # When the HF side lists lm_head.weight for a tied model, the bridge yields a copy of the embedding under that
        # name. Raw mode never exports it (engines tie it), so neither does this stream. Tied-ness is read as the
        # bridge reads it: the config's flag, else the model's.
        is_tied = getattr(
            config, "share_embeddings_and_output_weights", getattr(first, "share_embeddings_and_output_weights", False)
        )
        self._skip = {"lm_head.weight"} if is_tied else set()
        shapes = _hf_shapes(bridge)
        metas, local = [], set()
        for task in self._tasks:
            if task is None:
                continue
            # Parameters of other pipeline stages arrive by broadcast in the model's dtype.
            dtype = config.params_dtype if task.param_weight is None else task.param_weight.dtype
            for name in _hf_names(task.mapping.hf_param):
                if name in self._skip:
                    continue
                if name not in shapes:
                    raise ValueError(f"megatron-bridge exports {name!r}, which the HF model does not have")
                metas.append(TensorMeta(name=name, shape=shapes[name], dtype=dtype))
                if task.param_weight is not None:
                    local.add(name)
        self._all_units = plan_units(metas)
        # A unit belongs to the stage that holds all its parameters (units never span stages).
        self._stage_units = tuple(u for u in self._all_units if all(m.name in local for m in u.tensors))

    def metadata(self) -> list[AtomicUnit]:
        """This stage's units, in the order `iter_units()` yields them. Pure; no collectives."""
        return list(self._stage_units)

    def iter_units(self, *, source_rank_only: bool = True) -> Iterator[ExportedUnit]:
        """Yield this stage's units; tensors only on the stage's source rank unless `source_rank_only` is False.

        Collective: every rank of the model iterates to the end (the bridge gathers TP shards and broadcasts
        across pipeline stages tensor by tensor, on every rank). Yielded tensors are full, contiguous CPU tensors.
        """
        keep = (not source_rank_only) or is_export_source()
        owned = {u.key for u in self._stage_units}
        assembler = UnitAssembler(self._all_units)
        stream = self._bridge.export_hf_weights(
            self._model, cpu=True, show_progress=False, conversion_tasks=self._tasks
        )
        for name, tensor in stream:
            if name in self._skip:
                continue
            unit = assembler.add(name, trim_vocab_padding(name, tensor, assembler.planned_shape(name)))
            if unit is None or unit.meta.key not in owned:
                continue
            yield unit if keep else ExportedUnit(meta=unit.meta, tensors=None)
        missing = assembler.missing()
        if missing:
            raise RuntimeError(f"megatron-bridge export ended without {missing}")


VOCAB_TENSORS: frozenset[str] = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


def trim_vocab_padding(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Drop megatron's vocabulary padding rows from an embedding or output layer; contiguous result. Pure.

    megatron-bridge exports what the model holds; a model built with a padded vocabulary (multiple of 128 * TP)
    carries rows the HF checkpoint does not have.
    """
    if (
        name in VOCAB_TENSORS
        and tensor.dim() == len(shape)
        and tensor.shape[0] > shape[0]
        and tuple(tensor.shape[1:]) == tuple(shape[1:])
    ):
        tensor = tensor[: shape[0]]
    return tensor.contiguous()


def export_metadata(model: Sequence[torch.nn.Module] | torch.nn.Module, *, hf_config: Any) -> list[AtomicUnit]:
    """Bridge-mode counterpart of the raw `export_metadata`: this stage's units in stream order."""
    return BridgeExporter(bridge_for_config(hf_config), model).metadata()


def iter_hf_units(
    model: Sequence[torch.nn.Module] | torch.nn.Module, *, hf_config: Any, source_rank_only: bool = True
) -> Iterator[ExportedUnit]:
    """Bridge-mode counterpart of the raw `iter_hf_units`: the same units, converted by megatron-bridge.

    Builds a weightless bridge for `hf_config` on each call; hold a `BridgeExporter` to export repeatedly.
    """
    return BridgeExporter(bridge_for_config(hf_config), model).iter_units(source_rank_only=source_rank_only)


def _hf_names(hf_param: str | dict[str, str]) -> tuple[str, ...]:
    return (hf_param,) if isinstance(hf_param, str) else tuple(hf_param.values())


def _hf_shapes(bridge: Any) -> dict[str, tuple[int, ...]]:
    from megatron.bridge.models.hf_pretrained.state import SafeTensorsStateSource

    source = bridge.hf_pretrained.state.source
    if not isinstance(source, SafeTensorsStateSource):
        return {name: tuple(source[name].shape) for name in source.get_all_keys()}
    # Headers only: safetensors reads no tensor data for get_shape().
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(source.path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes
