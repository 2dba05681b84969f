"""LoRA adapters on a megatron-core model's parallel linears, tensor-parallel like the layers they adapt.

Each adapted linear computes `W x + scale * B (A x)` (scale = alpha / rank, PEFT's). The adapters are split the way
the base layer is:

- column-parallel (`linear_qkv`, `linear_fc1`): A [r, in] whole on every TP rank, B [out/tp, r] the rank's output
  rows. `A x` is the same on every rank; its gradient is summed over the TP group (megatron's
  copy-to-region), so A's gradient is the full one on every rank;
- row-parallel (`linear_proj`, `linear_fc2`): A [r, in/tp] the rank's input columns, B [out, r] whole. The rank's
  partial `A x` is summed over the TP group (reduce-from-region) before B.

HF target names map onto megatron's fused modules: q/k/v -> linear_qkv, gate/up -> linear_fc1 (one A shared by the
fused parts, B covering all of them), o_proj -> linear_proj, down_proj -> linear_fc2; fused parts are adapted
together or not at all. Only decoder layers are adapted (not MTP layers); sequence parallelism is refused.

The adapters live in their own module (`LoraAdapters`), reached from the base layers by forward hooks, so the
base model's parameter names (its checkpoint import and full export) are unchanged. `apply_lora` freezes the base:
an optimizer over `adapters.parameters()` trains only the adapters.

Why not megatron-bridge's PEFT LoRA: on this stack (no Transformer Engine, CPU) it fails while wrapping the first
linear: `get_adapter_attributes_from_linear` takes Transformer Engine for present once its import succeeds and
tests `isinstance` against TE layer classes that the import stand-in cannot provide.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from miles_sync.wire.text import raise_if

__all__ = ["HF_TARGETS", "LoraAdapters", "LoraSpec", "apply_lora", "reduce_adapter_gradients"]

# megatron module leaf -> the HF modules it fuses (in megatron's fused order).
HF_TARGETS: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
COLUMN_MODULES = frozenset({"linear_qkv", "linear_fc1"})
ROW_MODULES = frozenset({"linear_proj", "linear_fc2"})


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """rank r, alpha, and the HF module names adapted (PEFT's target_modules)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    def __post_init__(self) -> None:
        problems = []
        if self.rank < 1:
            problems.append(f"rank={self.rank} must be at least 1")
        if not self.alpha > 0:
            problems.append(f"alpha={self.alpha} must be positive")
        known = {hf for parts in HF_TARGETS.values() for hf in parts}
        unknown = sorted(set(self.target_modules) - known)
        if unknown:
            problems.append(f"target_modules {unknown} are not adaptable here (known: {sorted(known)})")
        if not self.target_modules:
            problems.append("target_modules is empty")
        for module, parts in HF_TARGETS.items():
            chosen = [p for p in parts if p in self.target_modules]
            if chosen and len(chosen) != len(parts):
                problems.append(
                    f"target_modules {chosen} without {sorted(set(parts) - set(chosen))}: megatron fuses {list(parts)} "
                    f"into {module}, adapted as one"
                )
        raise_if(problems, what="invalid LoRA spec")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def megatron_modules(self) -> frozenset[str]:
        return frozenset(m for m, parts in HF_TARGETS.items() if parts[0] in self.target_modules)


class ParallelLoraAdapter(nn.Module):
    """The adapter of one megatron parallel linear on this TP rank (see the module docstring for the split).

    `a` is initialized from `generator` as PEFT does (Kaiming-uniform with a = sqrt(5)) over the FULL A, so every
    TP rank holds its slice of one A; `b` starts at zero, so a fresh adapter leaves the model unchanged.
    """

    def __init__(
        self,
        base: nn.Module,
        *,
        is_row_parallel: bool,
        rank: int,
        scale: float,
        tp_rank: int,
        tp_size: int,
        generator: torch.Generator,
    ) -> None:
        super().__init__()
        out_local, in_local = base.weight.shape
        in_full = in_local * tp_size if is_row_parallel else in_local
        bound = 1.0 / math.sqrt(in_full)  # kaiming_uniform_(a=sqrt(5)) on an [r, in] weight
        a_full = (torch.rand(rank, in_full, generator=generator) * 2 - 1) * bound
        if is_row_parallel:
            a_full = a_full[:, tp_rank * in_local : (tp_rank + 1) * in_local]
        dtype = base.weight.dtype
        self.lora_a = nn.Parameter(a_full.to(dtype).contiguous())
        self.lora_b = nn.Parameter(torch.zeros(out_local, rank, dtype=dtype))
        # The attributes megatron's own parallel parameters carry: which dimension is split across TP.
        split = self.lora_a if is_row_parallel else self.lora_b
        split.tensor_model_parallel = tp_size > 1
        split.partition_dim = 1 if is_row_parallel else 0
        self.is_row_parallel = is_row_parallel
        self.scale = scale

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        low = x.to(self.lora_a.dtype) @ self.lora_a.T
        if self.is_row_parallel:
            low = reduce_from_tensor_model_parallel_region(low)
        else:
            low = copy_to_tensor_model_parallel_region(low)
        return self.scale * (low @ self.lora_b.T)


class LoraAdapters(nn.Module):
    """Every adapter of one model stage; `paths[key]` is (chunk index, the adapted module's path in its chunk)."""

    def __init__(self, spec: LoraSpec) -> None:
        super().__init__()
        self.spec = spec
        self.adapters = nn.ModuleDict()
        self.paths: dict[str, tuple[int, str]] = {}

    def add(self, chunk: int, path: str, adapter: ParallelLoraAdapter) -> None:
        key = f"{chunk}__" + path.replace(".", "__")
        self.adapters[key] = adapter
        self.paths[key] = (chunk, path)

    def items(self) -> list[tuple[int, str, ParallelLoraAdapter]]:
        return [(*self.paths[key], adapter) for key, adapter in self.adapters.items()]


def apply_lora(chunks: Sequence[nn.Module], spec: LoraSpec, *, seed: int = 0) -> LoraAdapters:
    """Adapt the `spec` modules of every decoder layer of `chunks` (this rank's model chunks, wrappers removed) and
    freeze every base parameter. Adapters are created in module order from `seed`, the same on every TP rank, so
    replicated halves agree and split halves are slices of one tensor. Returns the adapters (train these)."""
    from megatron.core import parallel_state as ps

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    adapters = LoraAdapters(spec)
    for index, chunk in enumerate(chunks):
        if getattr(chunk.config, "sequence_parallel", False):
            raise ValueError("LoRA adapters are not implemented under sequence parallelism (MoE models under TP)")
        for param in chunk.parameters():
            param.requires_grad_(False)
        for path, module in chunk.named_modules():
            leaf = path.rsplit(".", 1)[-1]
            if not path.startswith("decoder.layers.") or leaf not in spec.megatron_modules:
                continue
            # One generator per module, seeded by its path: the same A whatever the layout (pp included).
            generator = torch.Generator().manual_seed(seed * 1_000_003 + _stable_hash(_layer_free(chunk, path)))
            adapter = ParallelLoraAdapter(
                module,
                is_row_parallel=leaf in ROW_MODULES,
                rank=spec.rank,
                scale=spec.scale,
                tp_rank=tp_rank,
                tp_size=tp_size,
                generator=generator,
            )
            adapter.to(module.weight.device)
            adapters.add(index, path, adapter)
            module.register_forward_hook(_add_delta(adapter))
    return adapters


def _add_delta(adapter: ParallelLoraAdapter):
    def hook(module: nn.Module, inputs: tuple, output):
        del module
        out, bias = output  # megatron's parallel linears return (output, bias)
        return out + adapter.delta(inputs[0]).to(out.dtype), bias

    return hook


def _layer_free(chunk: nn.Module, path: str) -> str:
    """`path` with the local layer index replaced by the global layer number (pipeline stages number theirs)."""
    parts = path.split(".")
    layer = chunk.decoder.layers[int(parts[2])]
    number = getattr(layer, "layer_number", int(parts[2]) + 1)
    return ".".join([*parts[:2], str(number), *parts[3:]])


def _stable_hash(text: str) -> int:
    # Python's hash() is salted per process; TP ranks must agree.
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "little")


def reduce_adapter_gradients(adapters: LoraAdapters) -> None:
    """Sum the adapters' gradients over the data-parallel group (each replica saw its share of the batch), as
    `schedule.reduce_gradients` does for the model's own parameters. Every rank calls it after the backward."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    grads = []
    for param in adapters.parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for grad, synced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(synced.view_as(grad))
