"""Export of LoRA adapters: every adapter of a megatron model, gathered across TP and PP into PEFT names and shapes.

    named = gather_peft_adapter(chunks, adapters, converter=converter)   # every rank calls; the source gets them
    config = peft_adapter_config(adapters.spec)                         # PEFT's adapter_config.json dict

PEFT names: `base_model.model.<HF module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. A fused megatron
module becomes its HF parts: linear_qkv's B rows are split into q/k/v exactly as its weight is (the raw converter's
QKV merge, megatron's per-query-group interleave undone) and each part gets the one shared A; linear_fc1 likewise
into gate/up. The base is never part of it.

Collectives: shards meet on TP rank 0 of each stage (gloo gathers, contiguous tensors), then the stages' results
meet on the export source (pipeline rank 0 of TP rank 0) through an object gather over the pipeline group. Every
rank of the model calls `gather_peft_adapter` with the same adapters in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from miles_sync.export.converter import Converter
from miles_sync.export.stage import collect_local_params
from miles_sync.megatron.lora import HF_TARGETS, LoraAdapters, LoraSpec

__all__ = ["gather_peft_adapter", "peft_adapter_config"]

PEFT_PREFIX = "base_model.model."


def peft_adapter_config(spec: LoraSpec) -> dict:
    """The adapter_config.json PEFT writes for this adapter (the fields SGLang and PEFT read)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": sorted(spec.target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def peft_names(hf_weight_name: str) -> tuple[str, str]:
    """(lora_A name, lora_B name) of the HF weight `model.layers.0.self_attn.q_proj.weight`."""
    module = hf_weight_name.removesuffix(".weight")
    return f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"


def gather_peft_adapter(
    chunks: Sequence[torch.nn.Module], adapters: LoraAdapters, *, converter: Converter
) -> dict[str, torch.Tensor]:
    """Every adapter tensor of the model in PEFT names, on the export source; {} on every other rank."""
    from megatron.core import parallel_state as ps

    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    canonical = {(p.chunk, p.local_name): p.canonical for p in collect_local_params(chunks)}
    stage: dict[str, torch.Tensor] = {}
    for chunk, path, adapter in adapters.items():
        leaf = path.rsplit(".", 1)[-1]
        name = canonical[(chunk, f"{path}.weight")]
        split = adapter.lora_a if adapter.is_row_parallel else adapter.lora_b
        shards = _gather(split.detach(), group=tp_group, tp_rank=tp_rank, tp_size=tp_size)
        if shards is None:
            continue
        full_shape = list(split.shape)
        full_shape[1 if adapter.is_row_parallel else 0] *= tp_size
        mapping = converter.map_param(name, tuple(full_shape))
        merged = converter.to_hf(mapping, shards, partition_dim=1 if adapter.is_row_parallel else 0)
        assert len(merged) == len(mapping.hf_names) == len(HF_TARGETS[leaf]), (name, mapping.hf_names)
        for hf_name, part in zip(mapping.hf_names, merged, strict=True):
            a_name, b_name = peft_names(hf_name)
            if adapter.is_row_parallel:
                stage[a_name], stage[b_name] = part.contiguous(), adapter.lora_b.detach().clone()
            else:
                stage[a_name], stage[b_name] = adapter.lora_a.detach().clone(), part.contiguous()
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return stage if tp_rank == 0 and ps.get_data_parallel_rank() == 0 else {}
    stages: list = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, stage, group=ps.get_pipeline_model_parallel_group())
    if tp_rank != 0 or ps.get_data_parallel_rank() != 0 or ps.get_pipeline_model_parallel_rank() != 0:
        return {}
    return {name: tensor for part in stages for name, tensor in part.items()}


def _gather(local: torch.Tensor, *, group, tp_rank: int, tp_size: int) -> list[torch.Tensor] | None:
    """Every TP rank's shard on TP rank 0 (None elsewhere); gloo needs contiguous tensors."""
    if tp_size == 1:
        return [local.clone()]
    local = local.contiguous()
    shards = [torch.empty_like(local) for _ in range(tp_size)] if tp_rank == 0 else None
    dist.gather(local, shards, dst=dist.get_global_rank(group, 0), group=group)
    return shards
