"""What a sync exports for a model: the HF tensors an HF `config.json` implies, grouped, with their bytes.

Pure arithmetic over the config dict; nothing is allocated. A `TensorGroup` is `count` tensors of one shape and one
role, so a 256-expert layer is three groups, not 768 records. Families (by `model_type`):

- dense: llama, mistral, qwen2, qwen3 (q/k/v/o, gate/up/down, two norms per layer; qwen2 q/k/v biases, qwen3
  q/k norms); `tie_word_embeddings` drops the LM head;
- qwen3_moe / qwen2_moe: the same attention, routed experts on the layers `decoder_sparse_step` and
  `mlp_only_layers` make sparse, a router (`mlp.gate`, not TP-sharded), qwen2_moe's shared expert and its gate;
- deepseek_v3 / deepseek_v2 / kimi_k2: MLA attention (q_a/q_b or q, kv_a_proj_with_mqa, kv_b, o and the two
  low-rank norms), dense MLP on the first `first_k_dense_replace` layers, then routed + shared experts with a
  router and, for `topk_method: noaux_tc`, its float32 `e_score_correction_bias`; `num_nextn_predict_layers` MTP
  layers as the published checkpoints hold them (a full decoder layer plus enorm, hnorm, eh_proj, shared_head norm
  and head, and the layer's own embed_tokens copy).

Bytes: bf16 (2 bytes an element) by default, or `fp8_block`: the decoder's linear weights (attention, MLP, experts,
an MTP layer's decoder block; not embeddings, the LM head, norms, biases, the router, eh_proj or the shared head)
as 1 byte an element plus one float32 `weight_scale_inv` tensor per weight with one scale per 128 x 128 block
(ragged edge blocks count as blocks), as DeepSeek-V3's checkpoint and miles_sync.weights.fp8 lay it out.
Parallel attributes per group: `is_tp_sharded` (split across trainer TP ranks, gathered to the stage source: every
linear weight incl. the vocab-parallel embedding and head; not norms, biases, the router), `is_expert` (split across
EP ranks), `layer` (decoder layer index for pipeline stage assignment; -1 before the first layer, `num_layers` and
beyond after it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__: list[str] = []  # nothing here is imported from outside miles_sync.sizing

DENSE_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
MOE_TYPES = frozenset({"qwen3_moe", "qwen2_moe"})
MLA_TYPES = frozenset({"deepseek_v3", "deepseek_v2", "kimi_k2"})
FP8_BLOCK = 128
_SCALE_BYTES = 4  # float32 weight_scale_inv


class ExportDtype(str, Enum):
    BF16 = "bf16"
    FP8_BLOCK = "fp8_block"


@dataclass(frozen=True, kw_only=True)
class TensorGroup:
    """`count` exported tensors named like `name` (one layer's, one expert's), each of `shape`."""

    name: str
    shape: tuple[int, ...]
    count: int = 1
    layer: int = -1
    is_tp_sharded: bool = False
    is_expert: bool = False
    is_quantizable: bool = False  # a decoder linear weight: fp8 in fp8_block exports
    itemsize: int = 2  # in bf16 exports (the router bias is float32)

    @property
    def numel(self) -> int:
        return math.prod(self.shape) * self.count

    def num_bytes(self, dtype: ExportDtype) -> int:
        """Bytes of the group's tensors, scales included for fp8_block."""
        if dtype is ExportDtype.FP8_BLOCK and self.is_quantizable:
            *lead, rows, cols = self.shape
            blocks = math.prod(lead) * math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)
            return self.numel + blocks * _SCALE_BYTES * self.count
        return self.numel * self.itemsize

    def num_tensors(self, dtype: ExportDtype) -> int:
        return self.count * (2 if dtype is ExportDtype.FP8_BLOCK and self.is_quantizable else 1)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A model's exported tensors. `num_layers` counts the main decoder layers (MTP layers come after them)."""

    model_type: str
    num_layers: int
    groups: tuple[TensorGroup, ...]

    @property
    def num_params(self) -> int:
        return sum(g.numel for g in self.groups)

    def num_bytes(self, dtype: ExportDtype) -> int:
        return sum(g.num_bytes(dtype) for g in self.groups)

    def num_tensors(self, dtype: ExportDtype) -> int:
        return sum(g.num_tensors(dtype) for g in self.groups)


def model_shape(config: Mapping[str, Any]) -> ModelShape:
    """The exported tensors of an HF config dict. Raises ValueError naming an unsupported `model_type` or a
    missing key."""
    model_type = config.get("model_type")
    if model_type in DENSE_TYPES or model_type in MOE_TYPES:
        return _gqa_model(config, model_type)
    if model_type in MLA_TYPES:
        return _mla_model(config, model_type)
    known = sorted(DENSE_TYPES | MOE_TYPES | MLA_TYPES)
    raise ValueError(f"model_type {model_type!r} is not supported by the sizing model (known: {', '.join(known)})")


def _get(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ValueError(f"config key {key!r} is missing (model_type {config.get('model_type')!r})")
    return config[key]


def _linear(name: str, rows: int, cols: int, *, layer: int, count: int = 1, expert: bool = False) -> TensorGroup:
    return TensorGroup(
        name=name,
        shape=(rows, cols),
        count=count,
        layer=layer,
        is_tp_sharded=True,
        is_expert=expert,
        is_quantizable=True,
    )


def _norm(name: str, size: int, *, layer: int) -> TensorGroup:
    return TensorGroup(name=name, shape=(size,), layer=layer)


def _mlp(prefix: str, hidden: int, inter: int, *, layer: int, count: int = 1, expert: bool = False) -> list:
    return [
        _linear(f"{prefix}.gate_proj.weight", inter, hidden, layer=layer, count=count, expert=expert),
        _linear(f"{prefix}.up_proj.weight", inter, hidden, layer=layer, count=count, expert=expert),
        _linear(f"{prefix}.down_proj.weight", hidden, inter, layer=layer, count=count, expert=expert),
    ]


def _ends(config: Mapping[str, Any], *, hidden: int, num_layers: int) -> tuple[list, list]:
    """Embedding (before the first layer) and final norm + LM head (after the last)."""
    vocab = _get(config, "vocab_size")
    embed = TensorGroup(name="model.embed_tokens.weight", shape=(vocab, hidden), layer=-1, is_tp_sharded=True)
    tail = [_norm("model.norm.weight", hidden, layer=num_layers)]
    if not config.get("tie_word_embeddings", False):
        tail.append(TensorGroup(name="lm_head.weight", shape=(vocab, hidden), layer=num_layers, is_tp_sharded=True))
    return [embed], tail


def _gqa_model(config: Mapping[str, Any], model_type: str) -> ModelShape:
    hidden = _get(config, "hidden_size")
    num_layers = _get(config, "num_hidden_layers")
    heads = _get(config, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    has_bias = model_type in ("qwen2", "qwen2_moe") or bool(config.get("attention_bias", False))
    has_qk_norm = model_type in ("qwen3", "qwen3_moe")
    num_experts = (config.get("num_experts") or 0) if model_type in MOE_TYPES else 0
    sparse_step = config.get("decoder_sparse_step") or 1
    mlp_only = set(config.get("mlp_only_layers") or ())
    head, tail = _ends(config, hidden=hidden, num_layers=num_layers)
    groups = list(head)
    for i in range(num_layers):
        p = f"model.layers.{i}"
        groups += [
            _norm(f"{p}.input_layernorm.weight", hidden, layer=i),
            _norm(f"{p}.post_attention_layernorm.weight", hidden, layer=i),
            _linear(f"{p}.self_attn.q_proj.weight", heads * head_dim, hidden, layer=i),
            _linear(f"{p}.self_attn.k_proj.weight", kv_heads * head_dim, hidden, layer=i),
            _linear(f"{p}.self_attn.v_proj.weight", kv_heads * head_dim, hidden, layer=i),
            _linear(f"{p}.self_attn.o_proj.weight", hidden, heads * head_dim, layer=i),
        ]
        if has_bias:
            for proj, size in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                groups.append(_norm(f"{p}.self_attn.{proj}_proj.bias", size * head_dim, layer=i))
        if has_qk_norm:
            groups += [_norm(f"{p}.self_attn.q_norm.weight", head_dim, layer=i)]
            groups += [_norm(f"{p}.self_attn.k_norm.weight", head_dim, layer=i)]
        is_sparse = num_experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0
        if not is_sparse:
            groups += _mlp(f"{p}.mlp", hidden, _get(config, "intermediate_size"), layer=i)
            continue
        groups.append(TensorGroup(name=f"{p}.mlp.gate.weight", shape=(num_experts, hidden), layer=i))
        inter = _get(config, "moe_intermediate_size")
        groups += _mlp(f"{p}.mlp.experts.*", hidden, inter, layer=i, count=num_experts, expert=True)
        shared = config.get("shared_expert_intermediate_size") or 0
        if shared:
            groups += _mlp(f"{p}.mlp.shared_expert", hidden, shared, layer=i)
            groups.append(TensorGroup(name=f"{p}.mlp.shared_expert_gate.weight", shape=(1, hidden), layer=i))
    return ModelShape(model_type=model_type, num_layers=num_layers, groups=tuple(groups + tail))


def _mla_layer(config: Mapping[str, Any], i: int, *, hidden: int) -> list:
    p = f"model.layers.{i}"
    heads = _get(config, "num_attention_heads")
    nope, rope = _get(config, "qk_nope_head_dim"), _get(config, "qk_rope_head_dim")
    v_dim, kv_rank = _get(config, "v_head_dim"), _get(config, "kv_lora_rank")
    q_rank = config.get("q_lora_rank")
    groups = [
        _norm(f"{p}.input_layernorm.weight", hidden, layer=i),
        _norm(f"{p}.post_attention_layernorm.weight", hidden, layer=i),
    ]
    if q_rank:
        groups += [
            _linear(f"{p}.self_attn.q_a_proj.weight", q_rank, hidden, layer=i),
            _norm(f"{p}.self_attn.q_a_layernorm.weight", q_rank, layer=i),
            _linear(f"{p}.self_attn.q_b_proj.weight", heads * (nope + rope), q_rank, layer=i),
        ]
    else:
        groups.append(_linear(f"{p}.self_attn.q_proj.weight", heads * (nope + rope), hidden, layer=i))
    groups += [
        _linear(f"{p}.self_attn.kv_a_proj_with_mqa.weight", kv_rank + rope, hidden, layer=i),
        _norm(f"{p}.self_attn.kv_a_layernorm.weight", kv_rank, layer=i),
        _linear(f"{p}.self_attn.kv_b_proj.weight", heads * (nope + v_dim), kv_rank, layer=i),
        _linear(f"{p}.self_attn.o_proj.weight", hidden, heads * v_dim, layer=i),
    ]
    first_dense = config.get("first_k_dense_replace") or 0
    freq = config.get("moe_layer_freq") or 1
    experts = config.get("n_routed_experts") or 0
    if experts == 0 or i < first_dense or i % freq != 0:
        return groups + _mlp(f"{p}.mlp", hidden, _get(config, "intermediate_size"), layer=i)
    inter = _get(config, "moe_intermediate_size")
    groups.append(TensorGroup(name=f"{p}.mlp.gate.weight", shape=(experts, hidden), layer=i))
    if config.get("topk_method") == "noaux_tc":
        groups.append(TensorGroup(name=f"{p}.mlp.gate.e_score_correction_bias", shape=(experts,), layer=i, itemsize=4))
    groups += _mlp(f"{p}.mlp.experts.*", hidden, inter, layer=i, count=experts, expert=True)
    shared = config.get("n_shared_experts") or 0
    if shared:
        groups += _mlp(f"{p}.mlp.shared_experts", hidden, inter * shared, layer=i)
    return groups


def _mla_model(config: Mapping[str, Any], model_type: str) -> ModelShape:
    hidden = _get(config, "hidden_size")
    num_layers = _get(config, "num_hidden_layers")
    vocab = _get(config, "vocab_size")
    head, tail = _ends(config, hidden=hidden, num_layers=num_layers)
    groups = list(head)
    for i in range(num_layers):
        groups += _mla_layer(config, i, hidden=hidden)
    for i in range(num_layers, num_layers + (config.get("num_nextn_predict_layers") or 0)):
        p = f"model.layers.{i}"
        groups += _mla_layer(config, i, hidden=hidden)
        groups += [
            _norm(f"{p}.enorm.weight", hidden, layer=i),
            _norm(f"{p}.hnorm.weight", hidden, layer=i),
            TensorGroup(name=f"{p}.eh_proj.weight", shape=(hidden, 2 * hidden), layer=i, is_tp_sharded=True),
            _norm(f"{p}.shared_head.norm.weight", hidden, layer=i),
            TensorGroup(name=f"{p}.shared_head.head.weight", shape=(vocab, hidden), layer=i, is_tp_sharded=True),
            TensorGroup(name=f"{p}.embed_tokens.weight", shape=(vocab, hidden), layer=i, is_tp_sharded=True),
        ]
    return ModelShape(model_type=model_type, num_layers=num_layers, groups=tuple(groups + tail))
