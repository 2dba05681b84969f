"""The shard-direct plan: every engine TP rank's own parameters as pieces of HF tensors, checked before any byte
moves, and what `build_param` writes equal to `engine_layout.rank_engine_tensors` (the per-rank model verified
engine-exact against real SGLang servers) for every rank, TP size, layout and family here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from miles_sync.weights.engine_layout import TPShape, rank_engine_tensors
from miles_sync.weights.layout import WeightLayout
from miles_sync.weights.shard_plan import (
    DirectLayout,
    build_param,
    coverage_problems,
    plan_direct,
)
from miles_sync.wire.bucket import TensorMeta

pytestmark = pytest.mark.unit

# GQA with 4 KV heads (replicated at TP=8), a vocab padded from 200 to 256, Qwen3's q/k norms; shapes the AITER
# layout covers (rows % 16, columns % 32).
CONFIG = {
    "hidden_size": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 200,
}
SHAPE = TPShape.from_config(CONFIG)


def layer(prefix: str, *, bias: bool = False) -> dict[str, tuple[int, ...]]:
    shapes = {
        f"{prefix}.input_layernorm.weight": (64,),
        f"{prefix}.self_attn.v_proj.weight": (64, 64),  # out of fusion order: q, k, v is the engine's
        f"{prefix}.self_attn.q_proj.weight": (128, 64),
        f"{prefix}.self_attn.k_proj.weight": (64, 64),
        f"{prefix}.self_attn.o_proj.weight": (64, 128),
        f"{prefix}.self_attn.q_norm.weight": (16,),
        f"{prefix}.self_attn.k_norm.weight": (16,),
        f"{prefix}.post_attention_layernorm.weight": (64,),
        f"{prefix}.mlp.gate_proj.weight": (128, 64),
        f"{prefix}.mlp.up_proj.weight": (128, 64),
        f"{prefix}.mlp.down_proj.weight": (64, 128),
    }
    if bias:  # Qwen2's q/k/v biases fuse into qkv_proj.bias
        shapes |= {f"{prefix}.self_attn.{p}_proj.bias": (128 if p == "q" else 64,) for p in "qkv"}
    return shapes


DENSE = {
    "model.embed_tokens.weight": (200, 64),
    **layer("model.layers.0", bias=True),
    **layer("model.layers.1"),
    "model.norm.weight": (64,),
    "lm_head.weight": (200, 64),
}


def moe_layer(prefix: str, *, num_experts: int) -> dict[str, tuple[int, ...]]:
    shapes = {k: v for k, v in layer(prefix).items() if ".mlp." not in k}
    shapes[f"{prefix}.mlp.gate.weight"] = (num_experts, 64)
    for e in range(num_experts):
        for proj, shape in (("gate", (32, 64)), ("up", (32, 64)), ("down", (64, 32))):
            shapes[f"{prefix}.mlp.experts.{e}.{proj}_proj.weight"] = shape
    return shapes


def tensors_of(shapes: dict[str, tuple[int, ...]], *, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=generator).to(torch.bfloat16) for n, s in shapes.items()}


def metas_of(tensors: dict[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(name=n, shape=tuple(t.shape), dtype=t.dtype) for n, t in tensors.items()]


def built(plan, tensors) -> list[dict[str, torch.Tensor]]:
    """Every rank's parameters as `build_param` writes them, each into a buffer of its own."""
    return [
        {
            param.name: build_param(
                param,
                tensors,
                out=torch.empty(param.num_bytes, dtype=torch.uint8),
                weight_layout=plan.layout.weight_layout,
            )
            for param in params
        }
        for params in plan.ranks
    ]


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
@pytest.mark.parametrize("weight_layout", [WeightLayout.NONE, WeightLayout.AITER])
def test_every_rank_gets_exactly_what_the_engine_stores(tp_size, weight_layout):
    tensors = tensors_of(DENSE)
    plan = plan_direct(
        metas_of(tensors), layout=DirectLayout(shape=SHAPE, tp_size=tp_size, weight_layout=weight_layout)
    )
    for tp_rank, rank in enumerate(built(plan, tensors)):
        expected = rank_engine_tensors(tensors, shape=SHAPE, tp_rank=tp_rank, tp_size=tp_size, layout=weight_layout)
        assert rank.keys() == expected.keys()
        for name, tensor in expected.items():
            assert rank[name].shape == tensor.shape and rank[name].dtype == tensor.dtype, name
            assert torch.equal(rank[name], tensor), (tp_rank, name)


def test_a_rank_receives_its_share_of_the_model():
    tensors = tensors_of(DENSE)
    model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    one, two = (
        tuple(sum(p.num_bytes for p in params) for params in plan.ranks)
        for plan in (plan_direct(metas_of(tensors), layout=DirectLayout(shape=SHAPE, tp_size=tp)) for tp in (1, 2))
    )
    # TP=1 pads the vocab from 200 to 256 rows in both embeddings; TP=2 halves everything but the norms.
    padding = 2 * 56 * 64 * 2
    assert one == (model_bytes + padding,)
    assert all(0.45 < n / model_bytes < 0.55 for n in two), two


def test_stacked_experts_are_built_as_fusedmoe_stores_them():
    shapes = {"model.embed_tokens.weight": (200, 64), **moe_layer("model.layers.0", num_experts=4)}
    tensors = tensors_of(shapes)
    shape = dataclasses.replace(SHAPE, num_experts=4)
    for weight_layout in (WeightLayout.NONE, WeightLayout.AITER):
        plan = plan_direct(metas_of(tensors), layout=DirectLayout(shape=shape, tp_size=1, weight_layout=weight_layout))
        (rank,) = built(plan, tensors)
        expected = rank_engine_tensors(tensors, shape=shape, tp_rank=0, tp_size=1, layout=weight_layout)
        assert rank["model.layers.0.mlp.experts.w13_weight"].shape == (4, 64, 64)
        assert rank.keys() == expected.keys()
        assert all(torch.equal(rank[n], expected[n]) for n in expected)


def test_mtp_layers_are_left_to_the_draft():
    shapes = {**DENSE, **layer("model.layers.2")}  # layer 2 is an MTP head's: the target has 2 layers
    plan = plan_direct(metas_of(tensors_of(shapes)), layout=DirectLayout(shape=SHAPE, tp_size=2, num_target_layers=2))
    names = {p.name for p in plan.ranks[0]}
    assert "model.layers.1.self_attn.qkv_proj.weight" in names
    assert not any(n.startswith("model.layers.2.") for n in names)


def test_a_group_sent_in_part_is_refused_before_anything_moves():
    shapes = {k: v for k, v in DENSE.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    shapes = {k: v for k, v in shapes.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError) as info:
        plan_direct(metas_of(tensors_of(shapes)), layout=DirectLayout(shape=SHAPE, tp_size=2))
    message = str(info.value)
    for name in ("self_attn.q_proj.weight", "self_attn.v_proj.weight", "mlp.gate_proj.weight"):
        assert f"model.layers.1.{name}: exported without the rest of its fused group" in message


def test_a_model_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="num_attention_heads=8 is not divisible by tp_size=3"):
        plan_direct(metas_of(tensors_of(DENSE)), layout=DirectLayout(shape=SHAPE, tp_size=3))


def test_a_slice_fed_to_nobody_or_to_two_ranks_is_a_planning_error():
    metas = metas_of(tensors_of(DENSE))
    plan = plan_direct(metas, layout=DirectLayout(shape=SHAPE, tp_size=2))
    assert coverage_problems(plan, metas) == []
    rank0, rank1 = (list(params) for params in plan.ranks)
    down = next(i for i, p in enumerate(rank1) if p.name == "model.layers.0.mlp.down_proj.weight")
    qkv = next(i for i, p in enumerate(rank1) if p.name == "model.layers.0.self_attn.qkv_proj.weight")
    # Rank 1 takes rank 0's columns of down_proj (its own go to nobody) and its k rows start one row early.
    rank1[down] = dataclasses.replace(rank1[down], pieces=rank0[down].pieces)
    k = rank1[qkv].pieces[1]
    pieces = list(rank1[qkv].pieces)
    pieces[1] = dataclasses.replace(k, start=k.start - 1, end=k.end - 1)
    rank1[qkv] = dataclasses.replace(rank1[qkv], pieces=tuple(pieces))
    broken = dataclasses.replace(plan, ranks=(tuple(rank0), tuple(rank1)))
    problems = coverage_problems(broken, metas)
    assert (
        "model.layers.0.mlp.down_proj.weight: [0, 64) is received by 2 rank(s); the engine's split keeps it on 1"
        in problems
    )
    assert (
        "model.layers.0.mlp.down_proj.weight: [64, 128) is received by 0 rank(s); the engine's split keeps it on 1"
        in problems
    )
    assert (
        "model.layers.0.self_attn.k_proj.weight: [31, 32) is received by 2 rank(s); the engine's split keeps it on 1"
        in problems
    )
    assert (
        "model.layers.0.self_attn.k_proj.weight: [63, 64) is received by 0 rank(s); the engine's split keeps it on 1"
        in problems
    )


def test_replicated_kv_heads_are_received_by_each_replica():
    metas = metas_of(tensors_of(DENSE))
    plan = plan_direct(metas, layout=DirectLayout(shape=SHAPE, tp_size=8))  # 4 KV heads on 8 ranks: 2 replicas
    k_rows = [
        next(p for p in params if p.name == "model.layers.0.self_attn.qkv_proj.weight").pieces[1]
        for params in plan.ranks
    ]
    assert [(p.start, p.end) for p in k_rows] == [
        (0, 16),
        (0, 16),
        (16, 32),
        (16, 32),
        (32, 48),
        (32, 48),
        (48, 64),
        (48, 64),
    ]
    assert coverage_problems(plan, metas) == []
