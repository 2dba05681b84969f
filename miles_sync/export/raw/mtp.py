"""DeepSeek-V3-style MTP layers: names of the parts outside the MTP layer's transformer layer, and numbering.

MTP layer k of a model with L decoder layers is `model.layers.{L + k}.` in HF naming, the name the engines load:
`enorm`, `hnorm`, `eh_proj` ([hidden, 2 * hidden]; megatron concatenates [enorm(embedding); hnorm(hidden)], embedding
half first), the decoder layer under the family's names, and `shared_head.norm` (megatron's MTP `final_layernorm`).
Embedding and lm_head are the main model's and are not repeated.
"""

from __future__ import annotations

from miles_sync.export.raw.rules import Rule, copy_rule

MTP_RULES: tuple[Rule, ...] = (
    copy_rule(r"enorm\.weight", "enorm.weight"),
    copy_rule(r"hnorm\.weight", "hnorm.weight"),
    copy_rule(r"eh_proj\.weight", "eh_proj.weight"),
    copy_rule(r"final_layernorm\.weight", "shared_head.norm.weight"),
)


def hf_layer_index(*, num_layers: int, mtp_layer: int) -> int:
    """HF layer index of MTP layer `mtp_layer` (0-based) after `num_layers` decoder layers."""
    return num_layers + mtp_layer
