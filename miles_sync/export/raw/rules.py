"""Name rules shared by the raw families: a rule matches the part of a canonical megatron name after its layer
prefix (`decoder.layers.{i}.`) and names the HF tensors it becomes, relative to `model.layers.{i}.`."""

from __future__ import annotations

from dataclasses import dataclass

from miles_sync.export.converter import Layout


@dataclass(frozen=True, kw_only=True)
class Rule:
    """`pattern` is matched in full; its named groups fill the `{...}` fields of `hf_names` and `unit`.

    `unit` is the atomic unit's key relative to the layer prefix; None makes the (single) HF tensor its own unit.
    """

    pattern: str
    hf_names: tuple[str, ...]
    layout: Layout = Layout.COPY
    unit: str | None = None


def copy_rule(pattern: str, hf_name: str) -> Rule:
    return Rule(pattern=pattern, hf_names=(hf_name,))


# Dense transformer layer of the Llama family. Alternatives in a pattern cover the Transformer Engine spec, which
# fuses the norms into the following linear (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`).
DENSE_LAYER_RULES: tuple[Rule, ...] = (
    copy_rule(r"input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight", "input_layernorm.weight"),
    Rule(
        pattern=r"self_attention\.linear_qkv\.weight",
        hf_names=("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        layout=Layout.QKV,
        unit="self_attn.qkv_proj",
    ),
    copy_rule(r"self_attention\.linear_proj\.weight", "self_attn.o_proj.weight"),
    copy_rule(r"pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight", "post_attention_layernorm.weight"),
    Rule(
        pattern=r"mlp\.linear_fc1\.weight",
        hf_names=("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        layout=Layout.GATE_UP,
        unit="mlp.gate_up_proj",
    ),
    copy_rule(r"mlp\.linear_fc2\.weight", "mlp.down_proj.weight"),
)

QKV_BIAS_RULE = Rule(
    pattern=r"self_attention\.linear_qkv\.bias",
    hf_names=("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    layout=Layout.QKV,
    unit="self_attn.qkv_proj",  # same unit as the weight: loaders fuse q/k/v weight and bias together
)

QK_NORM_RULES: tuple[Rule, ...] = (
    copy_rule(r"self_attention\.q_layernorm\.weight", "self_attn.q_norm.weight"),
    copy_rule(r"self_attention\.k_layernorm\.weight", "self_attn.k_norm.weight"),
)
