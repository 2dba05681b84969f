"""Qwen3-MoE: Qwen3 layers whose MLP may be a router plus experts (and a gated shared expert when configured).

Each routed expert is one atomic unit (gate, up, down; `UNIT_RULES` of export/units.py groups them). Canonical names
carry the *global* expert id; the gather renumbers expert-parallel local experts, and canonicalizes TEGroupedMLP's
`experts.linear_fc1.weight{j}` into SequentialMLP's `experts.{e}.linear_fc1.weight`, before names reach this table.
Shared experts follow the Qwen2-MoE names (`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`).
"""

from __future__ import annotations

from miles_sync.export.converter import ShardMerge
from miles_sync.export.raw.rules import DENSE_LAYER_RULES, QK_NORM_RULES, Rule, copy_rule
from miles_sync.export.raw.table import RuleConverter

MOE_RULES: tuple[Rule, ...] = (
    copy_rule(r"mlp\.router\.weight", "mlp.gate.weight"),
    Rule(
        pattern=r"mlp\.experts\.(?P<expert>\d+)\.linear_fc1\.weight",
        hf_names=("mlp.experts.{expert}.gate_proj.weight", "mlp.experts.{expert}.up_proj.weight"),
        merge=ShardMerge.GATE_UP,
    ),
    copy_rule(r"mlp\.experts\.(?P<expert>\d+)\.linear_fc2\.weight", "mlp.experts.{expert}.down_proj.weight"),
    Rule(
        pattern=r"mlp\.shared_experts\.linear_fc1\.weight",
        hf_names=("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        merge=ShardMerge.GATE_UP,
    ),
    copy_rule(r"mlp\.shared_experts\.linear_fc2\.weight", "mlp.shared_expert.down_proj.weight"),
    copy_rule(r"mlp\.shared_experts\.gate_weight", "mlp.shared_expert_gate.weight"),
)


class Qwen3MoeConverter(RuleConverter):
    arch = "qwen3_moe"
    layer_rules = (*DENSE_LAYER_RULES, *QK_NORM_RULES, *MOE_RULES)
