"""Name rules shared by the raw families: a rule matches the part of a canonical megatron name after its layer
prefix (`decoder.layers.{i}.`) and names the HF tensors it becomes, relative to `model.layers.{i}.`.

Rules say nothing about atomic units: which HF tensors travel together comes from the one grouping table,
`UNIT_RULES` of export/units.py, which bridge mode and HF-state-dict sources use too."""

from __future__ import annotations

from dataclasses import dataclass

from miles_sync.export.converter import ShardMerge


@dataclass(frozen=True, kw_only=True)
class Rule:
    """`pattern` is matched in full; its named groups fill the `{...}` fields of `hf_names`."""

    pattern: str
    hf_names: tuple[str, ...]
    merge: ShardMerge = ShardMerge.COPY


def copy_rule(pattern: str, hf_name: str) -> Rule:
    return Rule(pattern=pattern, hf_names=(hf_name,))


# Dense transformer layer of the Llama family. Alternatives in a pattern cover the Transformer Engine spec, which
# fuses the norms into the following linear (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`).
DENSE_LAYER_RULES: tuple[Rule, ...] = (
    copy_rule(r"input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight", "input_layernorm.weight"),
    Rule(
        pattern=r"self_attention\.linear_qkv\.weight",
        hf_names=("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        merge=ShardMerge.QKV,
    ),
    copy_rule(r"self_attention\.linear_proj\.weight", "self_attn.o_proj.weight"),
    copy_rule(r"pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight", "post_attention_layernorm.weight"),
    Rule(
        pattern=r"mlp\.linear_fc1\.weight",
        hf_names=("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        merge=ShardMerge.GATE_UP,
    ),
    copy_rule(r"mlp\.linear_fc2\.weight", "mlp.down_proj.weight"),
)

QKV_BIAS_RULE = Rule(
    pattern=r"self_attention\.linear_qkv\.bias",
    hf_names=("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    merge=ShardMerge.QKV,  # the same unit as the weight (export/units.py): loaders fuse q/k/v weight and bias together
)

QK_NORM_RULES: tuple[Rule, ...] = (
    copy_rule(r"self_attention\.q_layernorm\.weight", "self_attn.q_norm.weight"),
    copy_rule(r"self_attention\.k_layernorm\.weight", "self_attn.k_norm.weight"),
)
