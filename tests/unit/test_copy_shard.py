"""copy_shard writes exactly what shard_tensor slices, for every TP split kind, in place; a shard that does not fit
its region is refused before a byte is written."""

from __future__ import annotations

import pytest
import torch

from miles_sync.weights.engine_layout import ShardKind, TPShape, copy_shard, shard_kind, shard_tensor

# vocab 100 pads to 128 (SGLang pads to 64): rank 1 of 2 holds 36 real rows and 28 zero rows
SHAPE = TPShape(
    hidden_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=2, intermediate_size=12, vocab_size=100
)
NAMES = {
    "model.embed_tokens.weight": (100, 8),
    "lm_head.weight": (100, 8),
    "model.layers.0.self_attn.q_proj.weight": (8, 8),
    "model.layers.0.self_attn.k_proj.weight": (4, 8),
    "model.layers.0.self_attn.o_proj.weight": (8, 8),
    "model.layers.0.mlp.gate_proj.weight": (12, 8),
    "model.layers.0.mlp.down_proj.weight": (8, 12),
    "model.layers.0.input_layernorm.weight": (8,),
}


def test_the_names_cover_every_split_kind() -> None:
    assert {shard_kind(name) for name in NAMES} == set(ShardKind)


@pytest.mark.parametrize("tp_rank", [0, 1])
@pytest.mark.parametrize("name", sorted(NAMES))
def test_copy_shard_writes_the_shard_in_place(name: str, tp_rank: int) -> None:
    generator = torch.Generator().manual_seed(7)
    full = torch.randn(NAMES[name], generator=generator).to(torch.bfloat16)
    expected = shard_tensor(name, full, shape=SHAPE, tp_rank=tp_rank, tp_size=2)
    region = torch.full(expected.shape, float("nan"), dtype=torch.bfloat16)  # stale bytes everywhere
    copy_shard(region, name, full, shape=SHAPE, tp_rank=tp_rank, tp_size=2)
    assert torch.equal(region.view(torch.int16), expected.contiguous().view(torch.int16))


def test_vocab_padding_rows_are_zeroed() -> None:
    full = torch.ones(100, 8)
    region = torch.full((64, 8), 5.0)
    copy_shard(region, "lm_head.weight", full, shape=SHAPE, tp_rank=1, tp_size=2)
    assert torch.equal(region[:36], torch.ones(36, 8))
    assert torch.equal(region[36:], torch.zeros(28, 8))


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight"])
def test_a_shard_that_does_not_fit_is_refused_before_writing(name: str) -> None:
    full = torch.ones(NAMES[name])
    region = torch.full((3, 8), 5.0)
    with pytest.raises(ValueError, match=f"{name}: shard .* does not fit its region \\(3, 8\\)"):
        copy_shard(region, name, full, shape=SHAPE, tp_rank=0, tp_size=2)
    assert torch.equal(region, torch.full((3, 8), 5.0))
