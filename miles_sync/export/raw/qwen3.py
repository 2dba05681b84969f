"""Qwen3: Llama layers plus per-head RMSNorm on queries and keys (megatron `qk_layernorm`)."""

from __future__ import annotations

from miles_sync.export.raw.rules import DENSE_LAYER_RULES, QK_NORM_RULES
from miles_sync.export.raw.table import RuleConverter


class Qwen3Converter(RuleConverter):
    arch = "qwen3"
    layer_rules = (*DENSE_LAYER_RULES, *QK_NORM_RULES)
