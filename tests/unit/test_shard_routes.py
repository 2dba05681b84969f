"""Shard-direct routing without a gather, table-tested: which trainer rank sends which slice to the trainer rank
feeding each engine rank. Matching TP moves nothing between trainer ranks; trainer TP=2 into engine TP=1 moves
exactly rank 1's shards; trainer TP=1 (two data-parallel replicas) into engine TP=2 moves nothing; experts of another
EP rank move whole; every engine slice is routed exactly once and a slice nobody holds is refused, named."""

from __future__ import annotations

import dataclasses

import pytest
from test_shard_plan import DENSE, SHAPE, moe_layer, tensors_of

from miles_sync.weights.shard_plan import DirectLayout, plan_direct
from miles_sync.weights.shard_routes import TrainerRank, megatron_holdings, moved_bytes, route_direct
from miles_sync.wire.bucket import TensorMeta

pytestmark = pytest.mark.unit


def metas_of(shapes) -> dict[str, TensorMeta]:
    return {n: TensorMeta(name=n, shape=tuple(t.shape), dtype=t.dtype) for n, t in tensors_of(shapes).items()}


def sharded_bytes(metas, rank_of_block: int, tp: int) -> int:
    """Bytes of trainer TP rank `rank_of_block`'s block of every TP-split tensor (replicated ones excluded)."""
    total = 0
    for name, meta in metas.items():
        rows = meta.shape[0]
        cols = meta.numel // rows
        if any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            total += rows // tp * cols * 2
        elif any(p in name for p in ("o_proj", "down_proj")) and name.endswith("weight"):
            total += rows * (cols // tp) * 2
        elif "embed_tokens" in name or "lm_head" in name:
            total += (rows - 128) * cols * 2 if rank_of_block == 1 else 128 * cols * 2  # 256 rows / 2, 200 real
    return total


def routes(metas, *, trainer_tp, engine_tp, feeders, ranks=None, shape=SHAPE):
    plan = plan_direct(metas.values(), layout=DirectLayout(shape=shape, tp_size=engine_tp))
    ranks = ranks or [TrainerRank(rank=r, tp_rank=r % trainer_tp, tp_size=trainer_tp) for r in range(2)]
    return plan, route_direct(plan, megatron_holdings(metas.values(), ranks=ranks), feeders=feeders)


def assert_every_slice_routed_once(plan, table):
    """The routes tile each engine piece exactly: no part unrouted, none routed twice."""
    for tp_rank, params in enumerate(plan.ranks):
        for param in params:
            for piece in param.pieces:
                cuts = sorted(
                    (r.start, r.end)
                    for r in table
                    if (r.tp_rank, r.param, r.hf_name) == (tp_rank, param.name, piece.hf_name)
                )
                position = piece.start
                for start, end in cuts:
                    assert start == position, (param.name, piece, cuts)
                    position = end
                assert position == piece.end, (param.name, piece, cuts)


def test_matching_tp_moves_nothing_between_trainer_ranks():
    metas = metas_of(DENSE)
    plan, table = routes(metas, trainer_tp=2, engine_tp=2, feeders={(0, 0): 0, (0, 1): 1})
    assert_every_slice_routed_once(plan, table)
    assert moved_bytes(table, metas) == {}
    assert all(r.source == r.feeder == r.tp_rank for r in table)


def test_trainer_tp2_into_engine_tp1_moves_exactly_the_other_ranks_shards():
    metas = metas_of(DENSE)
    plan, table = routes(metas, trainer_tp=2, engine_tp=1, feeders={(0, 0): 0})
    assert_every_slice_routed_once(plan, table)
    assert moved_bytes(table, metas) == {(1, 0): sharded_bytes(metas, 1, 2)}
    # q rows of layer 0: the first half local, the second from rank 1, written after it in the fused qkv_proj
    q = [r for r in table if r.hf_name == "model.layers.0.self_attn.q_proj.weight"]
    assert [(r.start, r.end, r.offset, r.source) for r in q] == [(0, 64, 0, 0), (64, 128, 64, 1)]


def test_trainer_tp1_replicas_into_engine_tp2_move_nothing():
    metas = metas_of(DENSE)
    plan, table = routes(metas, trainer_tp=1, engine_tp=2, feeders={(0, 0): 0, (0, 1): 1})
    assert_every_slice_routed_once(plan, table)
    assert moved_bytes(table, metas) == {}


def test_experts_of_another_ep_rank_move_whole():
    shapes = {"model.embed_tokens.weight": (200, 64), **moe_layer("model.layers.0", num_experts=4)}
    metas = metas_of(shapes)
    shape = dataclasses.replace(SHAPE, num_experts=4)
    ranks = [TrainerRank(rank=r, tp_rank=0, tp_size=1, ep_rank=r, ep_size=2) for r in range(2)]
    plan, table = routes(metas, trainer_tp=1, engine_tp=1, feeders={(0, 0): 0}, ranks=ranks, shape=shape)
    assert_every_slice_routed_once(plan, table)
    expert_bytes = sum(m.num_bytes for n, m in metas.items() if ".experts.2." in n or ".experts.3." in n)
    assert moved_bytes(table, metas) == {(1, 0): expert_bytes}


def test_a_slice_no_trainer_rank_holds_is_refused_naming_it():
    metas = metas_of(DENSE)
    plan = plan_direct(metas.values(), layout=DirectLayout(shape=SHAPE, tp_size=1))
    ranks = [TrainerRank(rank=0, tp_rank=0, tp_size=2)]  # rank 1 (the other TP half) is missing
    with pytest.raises(ValueError) as info:
        route_direct(plan, megatron_holdings(metas.values(), ranks=ranks), feeders={(0, 0): 0})
    assert "model.layers.0.self_attn.q_proj.weight [64, 128) along dim 0: no trainer rank holds it" in str(info.value)
    assert "model.layers.0.mlp.down_proj.weight [64, 128) along dim 1: no trainer rank holds it" in str(info.value)
