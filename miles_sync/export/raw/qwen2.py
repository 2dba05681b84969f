"""Qwen2: Llama layers plus q/k/v projection biases (megatron `add_qkv_bias`)."""

from __future__ import annotations

from miles_sync.export.raw.rules import DENSE_LAYER_RULES, QKV_BIAS_RULE
from miles_sync.export.raw.table import RuleConverter


class Qwen2Converter(RuleConverter):
    arch = "qwen2"
    layer_rules = (*DENSE_LAYER_RULES, QKV_BIAS_RULE)
