"""Llama: the dense layer rules as they are (no biases, no q/k norm)."""

from __future__ import annotations

from miles_sync.export.raw.rules import DENSE_LAYER_RULES
from miles_sync.export.raw.table import RuleConverter


class LlamaConverter(RuleConverter):
    arch = "llama"
    layer_rules = DENSE_LAYER_RULES
