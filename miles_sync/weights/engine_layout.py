"""How a tensor-parallel SGLang-style engine stores HF weights: which slice each TP rank keeps, how slices fuse
into the engine's own parameters, and what its weights checker therefore hashes. Pure functions over tensors.

The rules are SGLang's parallel layers (`sglang/srt/layers/linear.py`, `vocab_parallel_embedding.py`):

- column-parallel (q/k/v, gate/up; weight and bias): each rank keeps a contiguous block of output rows. Attention
  heads and the MLP intermediate size must divide by the TP size. Key/value heads divide by it too, or, when the
  TP size is at least their count, one KV head is replicated on `tp_size // num_kv_heads` consecutive ranks (rank r
  keeps head `r // replicas`); a KV head count that neither divides nor is divided by the TP size is refused.
- row-parallel (o_proj, down_proj): each rank keeps a block of input columns; a bias is kept whole.
- vocab-parallel (embed_tokens, lm_head): the vocabulary is padded to a multiple of 64, then split in contiguous
  row blocks; padding rows are zero.
- everything else (norms, the MTP head's enorm/hnorm/eh_proj, an MoE router `mlp.gate`) is replicated.
- MoE experts (`mlp.experts.<e>.*`, SGLang's FusedMoE with expert parallelism off: every rank holds every
  expert): each expert's gate and up projections are column-parallel over `moe_intermediate_size` and its down
  projection row-parallel, like a dense MLP's (FusedMoE's `_load_w13` narrows the loaded weight's rows by TP rank,
  `_load_w2` its columns). Only the digest prediction models that split (`tp_problems(split_experts=True)`);
  the reference engine and the direct-load plans keep MoE models at tp_size 1, and refuse larger sizes by name.

Fusion: a rank's `self_attn.qkv_proj` is cat(q, k, v slices) along dim 0 and `mlp.gate_up_proj` cat(gate, up
slices) (`miles_sync.weights.checksum.sglang_parameter_names`); an MoE block's experts stack into FusedMoE's
`experts.w13_weight` [E, 2I/tp, H] (the rank's gate rows then its up rows, per expert) and `experts.w2_weight`
[E, H, I/tp].
Post-processing (a `WeightLayout`) then applies to each fused linear weight whose shape and dtype it covers; on the
3-D expert weights it applies per expert on the last two dims, as SGLang's AITER MoE path shuffles w13/w2 after
loading (`UnquantizedFusedMoEMethod.process_weights_after_loading`). The checker hashes these physical rank tensors
with SGLang's CPU `tensor_hash`, so `rank_engine_digests` predicts a faithful engine's answer from the HF tensors sent.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from miles_sync.weights.checksum import (
    TensorHash,
    sglang_digest,
    sglang_fused_tensor,
    sglang_parameter_names,
    sglang_reported_name,
)
from miles_sync.weights.layout import WeightLayout, layout_spec

__all__ = ["ShardKind", "TPShape", "copy_shard", "is_linear_weight", "shard_kind", "shard_tensor", "tp_problems"]

VOCAB_PADDING = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE


class ShardKind(enum.Enum):
    REPLICATED = "replicated"
    QUERY = "query"  # column-parallel over attention heads
    KEY_VALUE = "key_value"  # column-parallel over KV heads, replicated when they are fewer than the ranks
    COLUMN = "column"  # column-parallel over the MLP intermediate size
    ROW = "row"  # row-parallel: input columns split, bias whole
    VOCAB = "vocab"  # vocab-parallel rows, padded


_MODULE_KINDS = (
    ("self_attn.q_proj", ShardKind.QUERY),
    ("self_attn.k_proj", ShardKind.KEY_VALUE),
    ("self_attn.v_proj", ShardKind.KEY_VALUE),
    ("mlp.gate_proj", ShardKind.COLUMN),
    ("mlp.up_proj", ShardKind.COLUMN),
    ("self_attn.o_proj", ShardKind.ROW),
    ("mlp.down_proj", ShardKind.ROW),
    ("embed_tokens", ShardKind.VOCAB),
    ("lm_head", ShardKind.VOCAB),
)
# One expert's projection in an MoE block (`...mlp.experts.<e>.<proj>.weight`) and how FusedMoE splits it.
_EXPERT_PROJECTION = re.compile(r"(?:^|\.)mlp\.experts\.\d+\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_KINDS = {"gate_proj": ShardKind.COLUMN, "up_proj": ShardKind.COLUMN, "down_proj": ShardKind.ROW}
# Engine parameters that are linear weights, the tensors a post-processing layout may transform.
_LINEAR_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "eh_proj", "lm_head")
# FusedMoE's stacked expert weights (leaf names of `...mlp.experts`); the router `mlp.gate` is not among them.
_EXPERT_WEIGHTS = ("w13_weight", "w2_weight")


@dataclass(frozen=True, kw_only=True)
class TPShape:
    """The dimensions of one decoder family that decide its TP split (read from an HF config)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_experts: int = 0  # routed experts per MoE block (config `num_experts`); 0: a dense model
    moe_intermediate_size: int = 0  # each expert's intermediate size (config `moe_intermediate_size`); 0: dense

    @classmethod
    def from_config(cls, config: Any) -> TPShape:
        """From a transformers config object or its config.json mapping."""

        def get(key: str, default: Any = None) -> Any:
            value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
            if value is None:
                raise ValueError(f"config has no {key!r}: cannot derive the engine's tensor-parallel layout")
            return int(value)

        hidden, heads = get("hidden_size"), get("num_attention_heads")
        head_dim = (config.get("head_dim") if isinstance(config, Mapping) else getattr(config, "head_dim", None)) or (
            hidden // heads
        )

        def optional(key: str) -> int:
            value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
            return int(value or 0)

        num_experts = optional("num_experts")
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads", heads),
            head_dim=int(head_dim),
            intermediate_size=get("intermediate_size"),
            vocab_size=get("vocab_size"),
            num_experts=num_experts,
            moe_intermediate_size=optional("moe_intermediate_size") if num_experts else 0,
        )

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_PADDING) * VOCAB_PADDING

    def kv_heads_per_rank(self, tp_size: int) -> int:
        return max(1, self.num_key_value_heads // tp_size)

    def kv_replicas(self, tp_size: int) -> int:
        return max(1, tp_size // self.num_key_value_heads)


def tp_problems(shape: TPShape, tp_size: int, *, split_experts: bool = False) -> list[str]:
    """What SGLang refuses at start-up for this shape at `tp_size`, each naming the dimension (empty: it runs), and
    what the caller does not model: MoE experts split across TP ranks, unless `split_experts` (the digest
    prediction of SGLang's FusedMoE models it; the reference engine and the direct-load plans do not)."""
    if tp_size < 1:
        return [f"tp_size={tp_size} must be at least 1"]
    problems = []
    if shape.num_attention_heads % tp_size:
        problems.append(f"num_attention_heads={shape.num_attention_heads} is not divisible by tp_size={tp_size}")
    kv = shape.num_key_value_heads
    if (tp_size >= kv and tp_size % kv) or (tp_size < kv and kv % tp_size):
        problems.append(
            f"num_key_value_heads={kv} neither divides nor is divisible by tp_size={tp_size} (KV heads are split "
            f"across ranks, or replicated when there are fewer of them than ranks)"
        )
    if shape.intermediate_size % tp_size:
        problems.append(f"intermediate_size={shape.intermediate_size} is not divisible by tp_size={tp_size}")
    if shape.num_experts and tp_size > 1 and split_experts and shape.moe_intermediate_size % tp_size:
        problems.append(
            f"moe_intermediate_size={shape.moe_intermediate_size} is not divisible by tp_size={tp_size} (each "
            f"expert's gate/up rows and down columns are split across the ranks)"
        )
    if shape.num_experts and tp_size > 1 and not split_experts:
        problems.append(
            f"num_experts={shape.num_experts}: splitting MoE experts across TP ranks is not modeled (an MoE model "
            f"runs at tp_size=1 here, not tp_size={tp_size})"
        )
    if shape.padded_vocab_size % tp_size:
        problems.append(
            f"vocab_size={shape.vocab_size} padded to {shape.padded_vocab_size} is not divisible by tp_size={tp_size}"
        )
    return problems


def is_expert_projection(hf_name: str) -> bool:
    """Whether `hf_name` is one expert's gate, up or down projection in an MoE block (a part of FusedMoE's stacks)."""
    return _EXPERT_PROJECTION.search(hf_name) is not None


def shard_kind(hf_name: str) -> ShardKind:
    """How the engine splits the HF tensor `hf_name` across TP ranks."""
    expert = _EXPERT_PROJECTION.search(hf_name)
    if expert is not None:
        return _EXPERT_KINDS[expert["proj"]]
    module = hf_name.rsplit(".", 1)[0]
    for suffix, kind in _MODULE_KINDS:
        if module == suffix or module.endswith("." + suffix):
            if kind is ShardKind.ROW and hf_name.endswith(".bias"):
                return ShardKind.REPLICATED
            return kind
    return ShardKind.REPLICATED


def is_linear_weight(engine_name: str) -> bool:
    """Whether `engine_name` (HF or fused) is the weight of a linear layer."""
    module, _, leaf = engine_name.rpartition(".")
    if leaf in _EXPERT_WEIGHTS:
        return module == "experts" or module.endswith(".experts")
    return leaf == "weight" and module.rsplit(".", 1)[-1] in _LINEAR_MODULES


def shard_rows(hf_name: str, num_rows: int, *, shape: TPShape, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of the dim-0 rows of `hf_name` rank `tp_rank` keeps (column/vocab kinds; all rows otherwise)."""
    kind = shard_kind(hf_name)
    if kind is ShardKind.QUERY or kind is ShardKind.COLUMN:
        size = num_rows // tp_size
        return tp_rank * size, (tp_rank + 1) * size
    if kind is ShardKind.KEY_VALUE:
        size = shape.kv_heads_per_rank(tp_size) * shape.head_dim
        block = tp_rank // shape.kv_replicas(tp_size)
        return block * size, (block + 1) * size
    if kind is ShardKind.VOCAB:
        size = shape.padded_vocab_size // tp_size
        return tp_rank * size, (tp_rank + 1) * size
    return 0, num_rows


def shard_tensor(hf_name: str, tensor: torch.Tensor, *, shape: TPShape, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The slice of one full HF tensor that rank `tp_rank` of `tp_size` keeps (a view where it can be one; vocab
    shards are padded with zero rows)."""
    kind = shard_kind(hf_name)
    if kind is ShardKind.REPLICATED:
        return tensor
    if kind is ShardKind.ROW:
        size = tensor.shape[-1] // tp_size
        return tensor[..., tp_rank * size : (tp_rank + 1) * size]
    start, end = shard_rows(hf_name, tensor.shape[0], shape=shape, tp_rank=tp_rank, tp_size=tp_size)
    if kind is not ShardKind.VOCAB:
        return tensor[start:end]
    local = tensor.new_empty((end - start, *tensor.shape[1:]))
    _write_vocab_rows(local, tensor, start)
    return local


def copy_shard(
    destination: torch.Tensor, hf_name: str, tensor: torch.Tensor, *, shape: TPShape, tp_rank: int, tp_size: int
) -> None:
    """Write `shard_tensor(...)` into `destination` (its shape) in one pass: a vocab shard's rows go straight in and
    its padding rows are zeroed, as SGLang's vocab-parallel loader does, with no intermediate copy. Raises
    ValueError, before writing, when the shard's shape is not the destination's."""
    if shard_kind(hf_name) is not ShardKind.VOCAB:
        shard = shard_tensor(hf_name, tensor, shape=shape, tp_rank=tp_rank, tp_size=tp_size)
        _check_shard_shape(hf_name, tuple(shard.shape), destination)
        destination.copy_(shard)
        return
    start, end = shard_rows(hf_name, tensor.shape[0], shape=shape, tp_rank=tp_rank, tp_size=tp_size)
    _check_shard_shape(hf_name, (end - start, *tensor.shape[1:]), destination)
    _write_vocab_rows(destination, tensor, start)


def _write_vocab_rows(destination: torch.Tensor, tensor: torch.Tensor, start: int) -> None:
    """A vocab shard from row `start`: the rows `tensor` has, then zero rows for the padding past its end."""
    real = max(0, min(start + destination.shape[0], tensor.shape[0]) - start)
    destination[:real].copy_(tensor[start : start + real])
    destination[real:].zero_()


def _check_shard_shape(hf_name: str, shard_shape: tuple[int, ...], destination: torch.Tensor) -> None:
    if shard_shape != tuple(destination.shape):
        raise ValueError(f"{hf_name}: shard {shard_shape} does not fit its region {tuple(destination.shape)}")


def rank_engine_tensors(
    hf_tensors: Mapping[str, torch.Tensor],
    *,
    shape: TPShape,
    tp_rank: int,
    tp_size: int,
    layout: WeightLayout = WeightLayout.NONE,
) -> dict[str, torch.Tensor]:
    """{engine parameter name: the physical tensor rank `tp_rank` stores} for one runner's full HF tensors."""
    spec = layout_spec(layout)
    result = {}
    num_experts = shape.num_experts or None
    for engine_name, parts in sglang_parameter_names(hf_tensors, num_experts=num_experts).items():
        shards = [shard_tensor(p, hf_tensors[p], shape=shape, tp_rank=tp_rank, tp_size=tp_size) for p in parts]
        tensor = sglang_fused_tensor(engine_name, shards).contiguous()
        if is_linear_weight(engine_name) and spec.applies_to(tuple(tensor.shape), tensor.dtype):
            tensor = spec.apply(tensor)
        result[engine_name] = tensor
    return result


def rank_engine_digests(
    roles: Iterable[tuple[str, Mapping[str, torch.Tensor]]],
    *,
    shape: TPShape,
    tp_size: int,
    layout: WeightLayout = WeightLayout.NONE,
    tensor_hash: TensorHash = TensorHash.SHA256,
) -> tuple[dict[str, str], ...]:
    """Per TP rank, the checksums a faithful engine's checker answers for these runners: (role name, full HF
    tensors) pairs, target first; draft-role names get their role as prefix, as SGLang merges them. `tensor_hash`:
    the server's (SGLang's CPU SHA-256 or its GPU Triton hash)."""
    roles = list(roles)
    per_rank = []
    for tp_rank in range(tp_size):
        checksums = {}
        for role_name, tensors in roles:
            engine = rank_engine_tensors(tensors, shape=shape, tp_rank=tp_rank, tp_size=tp_size, layout=layout)
            for name, tensor in engine.items():
                checksums[sglang_reported_name(role_name, name)] = sglang_digest(tensor, tensor_hash)
        per_rank.append(checksums)
    return tuple(per_rank)
