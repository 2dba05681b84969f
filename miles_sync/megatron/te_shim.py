"""CPU-only import stand-in for Transformer Engine, so that megatron-bridge imports on machines without CUDA.

megatron-bridge 0.3.x imports `transformer_engine.pytorch` unconditionally (its LoRA module subclasses `te.Linear`
at import time), although the weight conversion we use never touches it. Transformer Engine itself cannot be
installed without CUDA. This module registers a placeholder package under that name and nothing more:

- it is applied only when CUDA is absent and no real Transformer Engine is importable;
- it is applied after megatron-core's modules that probe for Transformer Engine are imported, so megatron-core
  keeps choosing its local (non-TE) code paths;
- nothing in it computes: the few names megatron-bridge needs at import time are placeholder classes whose
  construction, calls and attributes raise `TransformerEngineUnavailableError`; every other name is missing
  (AttributeError, so `from transformer_engine.pytorch import X` raises ImportError as without the package).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types

import torch

# The only names megatron-bridge 0.3.x dereferences while its modules import: `peft/lora_layers.py` subclasses
# `te.Linear` and annotates a return type with `te.ops.Sequential`.
PLACEHOLDER_NAMES: dict[str, tuple[str, ...]] = {
    "transformer_engine.pytorch": ("Linear",),
    "transformer_engine.pytorch.ops": ("Sequential",),
}

# megatron-core modules that decide HAVE_TE at import time; importing them before the shim keeps them TE-free.
MEGATRON_CORE_PROBES: tuple[str, ...] = (
    "megatron.core",
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer.transformer_config",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.mlp",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
    "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs",
    "megatron.core.transformer.heterogeneous.linear_replacements",
    "megatron.core.extensions.transformer_engine",
    "megatron.core.fp8_utils",
    "megatron.core.optimizer",
    # Reached through megatron-bridge's model registry (vision and Mamba families).
    "megatron.core.models.multimodal.llava_model",
    "megatron.core.models.vision.clip_vit_model",
    "megatron.core.models.mamba.mamba_layer_specs",
    "megatron.core.ssm.mamba_block",
    "megatron.core.post_training.modelopt.gpt.model_specs",
)

_SHIM_MARKER = "__miles_sync_cpu_shim__"


class TransformerEngineUnavailableError(RuntimeError):
    """Raised by any use of the CPU placeholder for Transformer Engine."""


def _unavailable(what: str) -> TransformerEngineUnavailableError:
    return TransformerEngineUnavailableError(
        f"{what} needs NVIDIA Transformer Engine, which is not installed; on this CPU machine "
        "miles_sync.megatron.te_shim only lets megatron-bridge import. Use the local layer spec, "
        "or install Transformer Engine on a CUDA machine."
    )


class _PlaceholderMeta(type):
    """Class attributes of a placeholder raise; isinstance/issubclass and subclassing still work."""

    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise _unavailable(f"transformer_engine placeholder {cls.__qualname__}.{name}")


def _make_placeholder(module_name: str, name: str) -> type:
    def __init__(self, *args, **kwargs):
        raise _unavailable(f"{module_name}.{name}")

    return _PlaceholderMeta(name, (), {"__init__": __init__, "__module__": module_name, _SHIM_MARKER: True})


def _make_module(module_name: str, names: tuple[str, ...]) -> types.ModuleType:
    module = types.ModuleType(module_name, "CPU placeholder for Transformer Engine (miles_sync.megatron.te_shim)")
    # A spec without a loader keeps importlib.util.find_spec() working on the registered module.
    module.__spec__ = importlib.machinery.ModuleSpec(module_name, loader=None, is_package=True)
    module.__path__ = []
    setattr(module, _SHIM_MARKER, True)
    for name in names:
        setattr(module, name, _make_placeholder(module_name, name))

    def __getattr__(name: str):
        # AttributeError (not our error) so hasattr() is False and `from ... import name` is an ImportError.
        raise AttributeError(f"{module_name}.{name} is not provided by the CPU Transformer Engine placeholder")

    module.__getattr__ = __getattr__
    return module


def is_shim_installed() -> bool:
    module = sys.modules.get("transformer_engine")
    return module is not None and getattr(module, _SHIM_MARKER, False) is True


def is_shim_needed() -> bool:
    """True when CUDA is absent and no real Transformer Engine can be imported."""
    if torch.cuda.is_available():
        return False
    if is_shim_installed():
        return False
    return importlib.util.find_spec("transformer_engine") is None


def install_transformer_engine_shim() -> bool:
    """Register the placeholder package if needed; return whether it is (now) installed. Idempotent.

    Imports megatron-core's TE-probing modules first (see MEGATRON_CORE_PROBES) so they record that Transformer
    Engine is absent. Safe to call on GPU machines: it does nothing there.
    """
    if is_shim_installed():
        return True
    if not is_shim_needed():
        return False
    for probe in MEGATRON_CORE_PROBES:
        importlib.import_module(probe)
    modules = {"transformer_engine": _make_module("transformer_engine", ())}
    for module_name, names in PLACEHOLDER_NAMES.items():
        modules[module_name] = _make_module(module_name, names)
    for module_name, module in modules.items():
        parent, _, child = module_name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    sys.modules.update(modules)
    return True
