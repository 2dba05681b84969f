"""Shard-direct routing without a gather, table-tested on what the export converters really hold: each trainer
rank's holdings are the HF slices its converter's `read_shard` reads to build that rank's Megatron shard. Matching TP
moves nothing between trainer ranks; trainer TP=2 into engine TP=1 moves exactly rank 1's shards; trainer TP=1
replicas into engine TP=2 move nothing; experts of another EP rank move whole; every engine slice is routed exactly
once, and a slice no rank holds is refused, named. And each rank converts its own shard, alone, into exactly the HF
slices it holds (`miles_sync.export.local_pieces`), bit for bit."""

from __future__ import annotations

import types

import pytest
import torch

from miles_sync.export.local_pieces import local_pieces, shard_reads
from miles_sync.export.raw import create_converter
from miles_sync.weights.engine_layout import TPShape
from miles_sync.weights.layout import WeightLayout
from miles_sync.weights.shard_plan import DirectLayout, assemble_param, build_param, plan_direct
from miles_sync.weights.shard_routes import (
    Build,
    Holding,
    ShardedParam,
    TrainerRank,
    converter_holdings,
    plan_routed,
    route_direct,
)
from miles_sync.wire.bucket import TensorMeta

pytestmark = pytest.mark.unit

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, PADDED_VOCAB = 64, 8, 4, 16, 128, 200, 256
CONFIG = dict(
    hidden_size=HIDDEN,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    intermediate_size=INTER,
    vocab_size=VOCAB,
    num_hidden_layers=2,
    tie_word_embeddings=False,
)
SHAPE = TPShape.from_config(CONFIG)
QKV_ROWS = KV_HEADS * (HEADS // KV_HEADS + 2) * HEAD_DIM


def dense_layer(i: int, *, arch: str) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(canonical Megatron name, full shape, partition dim) of one decoder layer."""
    prefix = f"decoder.layers.{i}."
    params = [
        (prefix + "input_layernorm.weight", (HIDDEN,), None),
        (prefix + "self_attention.linear_qkv.weight", (QKV_ROWS, HIDDEN), 0),
        (prefix + "self_attention.linear_proj.weight", (HIDDEN, HEADS * HEAD_DIM), 1),
        (prefix + "pre_mlp_layernorm.weight", (HIDDEN,), None),
    ]
    if arch == "qwen2":
        params.append((prefix + "self_attention.linear_qkv.bias", (QKV_ROWS,), 0))
    if arch == "qwen3":
        params += [(prefix + f"self_attention.{p}_layernorm.weight", (HEAD_DIM,), None) for p in "qk"]
    return params


def model_params(arch: str, *, num_experts: int = 0) -> list[tuple[str, tuple[int, ...], int | None]]:
    params = [("embedding.word_embeddings.weight", (PADDED_VOCAB, HIDDEN), 0)]
    for i in range(2):
        params += dense_layer(i, arch=arch)
        prefix = f"decoder.layers.{i}.mlp."
        if not num_experts:
            params += [
                (prefix + "linear_fc1.weight", (2 * INTER, HIDDEN), 0),
                (prefix + "linear_fc2.weight", (HIDDEN, INTER), 1),
            ]
            continue
        params.append((prefix + "router.weight", (num_experts, HIDDEN), None))
        for e in range(num_experts):
            params += [
                (prefix + f"experts.{e}.linear_fc1.weight", (2 * 32, HIDDEN), 0),
                (prefix + f"experts.{e}.linear_fc2.weight", (HIDDEN, 32), 1),
            ]
    return [
        *params,
        ("decoder.final_layernorm.weight", (HIDDEN,), None),
        ("output_layer.weight", (PADDED_VOCAB, HIDDEN), 0),
    ]


def sharded(arch: str, *, num_experts: int = 0) -> tuple[list[ShardedParam], dict[str, TensorMeta]]:
    """The stage's parameters as the routing sees them, and the HF tensors they export to (float32)."""
    config = types.SimpleNamespace(model_type=arch, **CONFIG, num_experts=num_experts or None, moe_intermediate_size=32)
    converter = create_converter(arch, config)
    params, metas = [], {}
    for name, shape, partition_dim in model_params(arch, num_experts=num_experts):
        mapping = converter.map_param(name, shape)

        def reads(rank, size, mapping=mapping, partition_dim=partition_dim):
            return shard_reads(converter, mapping, partition_dim=partition_dim, rank=rank, size=size)

        expert = int(name.split(".experts.")[1].split(".")[0]) if ".experts." in name else None
        hf_shapes = dict(zip(mapping.hf_names, mapping.hf_shapes))
        params.append(ShardedParam(reads=reads, expert=expert, num_experts=num_experts))
        metas.update({n: TensorMeta(name=n, shape=tuple(s), dtype=torch.float32) for n, s in hf_shapes.items()})
    return params, metas


def tp_ranks(tp: int, count: int = 2) -> list[TrainerRank]:
    return [TrainerRank(rank=r, tp_rank=r % tp, tp_size=tp) for r in range(count)]


def routes(arch, *, ranks, engine_tp, feeders, num_experts=0):
    params, metas = sharded(arch, num_experts=num_experts)
    shape = TPShape.from_config({**CONFIG, "num_experts": num_experts})
    plan = plan_direct(metas.values(), layout=DirectLayout(shape=shape, tp_size=engine_tp))
    table = route_direct(plan, converter_holdings(params, ranks=ranks), feeders=feeders)
    assert_every_slice_routed_once(plan, table)
    return metas, table


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


def moved_bytes(routes, metas: dict[str, TensorMeta]) -> dict[tuple[int, int], int]:
    """Bytes each (source, feeder) pair of distinct trainer ranks moves per sync under `routes`."""
    moved: dict[tuple[int, int], int] = {}
    for route in routes:
        if route.source != route.feeder:
            key = (route.source, route.feeder)
            moved[key] = moved.get(key, 0) + route.num_bytes(metas[route.hf_name])
    return moved


def tp_split_bytes(metas: dict[str, TensorMeta], *, half: int) -> int:
    """float32 bytes of half `half` of every TP-split HF tensor (Megatron's vocab blocks: 128 rows, then 72)."""
    total = 0
    for name, meta in metas.items():
        rows, cols = meta.shape[0], meta.numel // meta.shape[0]
        if any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            total += rows // 2 * cols * 4
        elif any(p in name for p in ("o_proj", "down_proj")):
            total += rows * (cols // 2) * 4
        elif "embed_tokens" in name or "lm_head" in name:
            total += (128 if half == 0 else VOCAB - 128) * cols * 4
    return total


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_matching_tp_moves_nothing_between_trainer_ranks(arch):
    _, table = routes(arch, ranks=tp_ranks(2), engine_tp=2, feeders={(0, 0): 0, (0, 1): 1})
    assert moved_bytes(table, {}) == {}
    assert all(r.source == r.feeder == r.tp_rank for r in table)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_trainer_tp2_into_engine_tp1_moves_exactly_the_other_ranks_shards(arch):
    metas, table = routes(arch, ranks=tp_ranks(2), engine_tp=1, feeders={(0, 0): 0})
    assert moved_bytes(table, metas) == {(1, 0): tp_split_bytes(metas, half=1)}
    # Layer 0's q rows: the first half from rank 0 itself, the second from rank 1, right after it in qkv_proj.
    q = [r for r in table if r.hf_name == "model.layers.0.self_attn.q_proj.weight"]
    assert [(r.start, r.end, r.offset, r.source) for r in q] == [(0, 64, 0, 0), (64, 128, 64, 1)]


def test_trainer_tp1_replicas_into_engine_tp2_move_nothing():
    _, table = routes("qwen3", ranks=tp_ranks(1), engine_tp=2, feeders={(0, 0): 0, (0, 1): 1})
    assert moved_bytes(table, {}) == {}


def test_experts_of_another_ep_rank_move_whole():
    ranks = [TrainerRank(rank=r, tp_rank=0, tp_size=1, ep_rank=r, ep_size=2) for r in range(2)]
    metas, table = routes("qwen3_moe", ranks=ranks, engine_tp=1, feeders={(0, 0): 0}, num_experts=4)
    expert_bytes = sum(m.num_bytes for n, m in metas.items() if ".experts.2." in n or ".experts.3." in n)
    assert moved_bytes(table, metas) == {(1, 0): expert_bytes}


def test_a_slice_no_trainer_rank_holds_is_refused_naming_it():
    params, metas = sharded("qwen3")
    plan = plan_direct(metas.values(), layout=DirectLayout(shape=SHAPE, tp_size=1))
    holdings = converter_holdings(params, ranks=[TrainerRank(rank=0, tp_rank=0, tp_size=2)])  # rank 1 missing
    with pytest.raises(ValueError) as info:
        route_direct(plan, holdings, feeders={(0, 0): 0})
    assert "model.layers.0.self_attn.q_proj.weight [64, 128) along dim 0: no trainer rank holds it" in str(info.value)
    assert "model.layers.0.mlp.down_proj.weight [64, 128) along dim 1: no trainer rank holds it" in str(info.value)
    assert "lm_head.weight [128, 200) along dim 0: no trainer rank holds it" in str(info.value)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "qwen3_moe"])
@pytest.mark.parametrize("size", [1, 2])
def test_each_rank_converts_its_own_shard_into_exactly_the_hf_slices_it_holds(arch, size):
    """A rank's shard (what the converter reads for it from the full HF tensors, the inverse of the gather's merge)
    becomes, on that rank alone, pieces equal to those very slices of the HF tensors, bit for bit."""
    num_experts = 4 if arch == "qwen3_moe" else 0
    config = types.SimpleNamespace(model_type=arch, **CONFIG, num_experts=num_experts or None, moe_intermediate_size=32)
    converter = create_converter(arch, config)
    generator = torch.Generator().manual_seed(0)
    for name, shape, partition_dim in model_params(arch, num_experts=num_experts):
        mapping = converter.map_param(name, shape)
        full = {n: torch.randn(s, generator=generator) for n, s in zip(mapping.hf_names, mapping.hf_shapes)}

        def read(hf_name, dim, start, stop, full=full):
            tensor = full[hf_name]
            return tensor if dim is None else tensor.narrow(dim, start, stop - start)

        for rank in range(size):
            shard = converter.read_shard(
                mapping, read, partition_dim=partition_dim, rank=rank, size=size, dtype=torch.float32
            )
            pieces = local_pieces(converter, mapping, shard, partition_dim=partition_dim, rank=rank, size=size)
            for p in pieces:
                expected = full[p.hf_name] if p.dim is None else full[p.hf_name].narrow(p.dim, p.start, p.end - p.start)
                assert torch.equal(p.tensor, expected), (name, rank, p.hf_name)
            assert [(p.hf_name, p.dim, p.start, p.end) for p in pieces] == shard_reads(
                converter, mapping, partition_dim=partition_dim, rank=rank, size=size
            )


# ---- the routed send's schedule (plan_routed), replayed here without a group -------------------------------------


def converted_ranks(arch: str, ranks: list[TrainerRank], *, num_experts: int = 0):
    """Random full HF tensors of a model, and each trainer rank's own pieces of them: its shards as its converter
    reads them, converted back on that rank alone (what `iter_local_pieces` yields in a trainer)."""
    config = types.SimpleNamespace(model_type=arch, **CONFIG, num_experts=num_experts or None, moe_intermediate_size=32)
    converter = create_converter(arch, config)
    generator = torch.Generator().manual_seed(1)
    full, pieces = {}, {r.rank: [] for r in ranks}
    for name, shape, partition_dim in model_params(arch, num_experts=num_experts):
        mapping = converter.map_param(name, shape)
        tensors = {n: torch.randn(s, generator=generator) for n, s in zip(mapping.hf_names, mapping.hf_shapes)}
        full.update(tensors)
        expert = int(name.split(".experts.")[1].split(".")[0]) if ".experts." in name else None

        def read(hf_name, dim, start, stop, tensors=tensors):
            return tensors[hf_name] if dim is None else tensors[hf_name].narrow(dim, start, stop - start)

        for r in ranks:
            if expert is not None and expert // (num_experts // r.ep_size) != r.ep_rank:
                continue
            rank, size = (0, 1) if expert is not None else (r.tp_rank, r.tp_size)
            shard = converter.read_shard(
                mapping, read, partition_dim=partition_dim, rank=rank, size=size, dtype=torch.float32
            )
            pieces[r.rank] += local_pieces(converter, mapping, shard, partition_dim=partition_dim, rank=rank, size=size)
    return full, pieces


def replay(schedule, plans, pieces):
    """Every build of `schedule` assembled bucket by bucket from the routes' source pieces: {build: {param: tensor}}."""
    built = {b: {} for b in schedule.builds}
    for bucket in schedule.buckets:
        for b in schedule.builds:
            params = {p.name: p for p in plans[b.layout].ranks[b.tp_rank]}
            for name in bucket.names:
                routes = [
                    r
                    for r in bucket.routes
                    if (r.layout, r.tp_rank, r.feeder, r.param) == (b.layout, b.tp_rank, b.feeder, name)
                ]
                writes = []
                for r in routes:
                    piece = next(p for p in pieces[r.source] if p.covers(r))
                    writes.append((r.dim, r.offset, piece.read(r)))
                out = torch.empty(params[name].num_bytes, dtype=torch.uint8)
                built[b][name] = assemble_param(params[name], writes, out=out, weight_layout=WeightLayout.AITER).clone()
    return built


@pytest.mark.parametrize(
    ("arch", "trainer_tp", "engine_tps", "num_experts"),
    [
        ("qwen3", 2, (1, 1), 0),  # each TP=1 engine fed by its own rank: the other half moves
        ("qwen3", 2, (2,), 0),  # matching TP: nothing moves
        ("qwen2", 1, (2,), 0),  # replicas into TP=2: nothing moves
        ("llama", 2, (1, 2), 0),  # mixed engine TPs in one fleet
        ("qwen3", 2, (4,), 0),  # engine TP=4 from trainer TP=2, ranks fed alternately: halves move
        ("qwen3_moe", 1, (1, 1), 4),  # EP=2: experts of the other rank move whole
    ],
)
def test_a_routed_schedule_replayed_builds_every_engine_rank_bit_exact(arch, trainer_tp, engine_tps, num_experts):
    if num_experts:
        ranks = [TrainerRank(rank=r, tp_rank=0, tp_size=1, ep_rank=r, ep_size=2) for r in range(2)]
    else:
        ranks = tp_ranks(trainer_tp)
    full, pieces = converted_ranks(arch, ranks, num_experts=num_experts)
    metas = {n: TensorMeta(name=n, shape=tuple(t.shape), dtype=t.dtype) for n, t in full.items()}
    shape = TPShape.from_config({**CONFIG, "num_experts": num_experts})
    layouts = list(
        dict.fromkeys(DirectLayout(shape=shape, tp_size=tp, weight_layout=WeightLayout.AITER) for tp in engine_tps)
    )
    plans = [plan_direct(metas.values(), layout=layout) for layout in layouts]
    # Engine j's TP rank t is fed by trainer rank (j + t) % 2, as a colocated plan puts ranks on devices.
    builds = [
        Build(
            layout=layouts.index(DirectLayout(shape=shape, tp_size=tp, weight_layout=WeightLayout.AITER)),
            tp_rank=t,
            feeder=(j + t) % 2,
        )
        for j, tp in enumerate(engine_tps)
        for t in range(tp)
    ]
    holdings = {}
    for rank, rank_pieces in pieces.items():
        for p in rank_pieces:
            holdings.setdefault(p.hf_name, []).append(Holding(rank=rank, dim=p.dim, start=p.start, end=p.end))
    cap = 40_000
    schedule = plan_routed(plans, holdings, builds=builds, bucket_bytes=cap)

    names = [n for bucket in schedule.buckets for n in bucket.names]
    assert sorted(names) == sorted({p.name for p in plans[0].ranks[0]}) and len(names) == len(set(names))
    assert len(schedule.buckets) > 1
    for bucket in schedule.buckets:
        sizes = [sum(p.num_bytes for p in plans[b.layout].ranks[b.tp_rank] if p.name in bucket.names) for b in builds]
        assert max(sizes) <= cap or len(bucket.names) == 1, (bucket.names, sizes)
        for rank in (0, 1):  # what one rank sends to another is exactly what that one receives from it, in order
            assert [r for r in bucket.sends(rank)] == [r for r in bucket.receives(1 - rank)]

    built = replay(schedule, plans, pieces)
    for b in builds:
        for param in plans[b.layout].ranks[b.tp_rank]:
            expected = build_param(
                param, full, out=torch.empty(param.num_bytes, dtype=torch.uint8), weight_layout=WeightLayout.AITER
            )
            assert torch.equal(built[b][param.name], expected), (b, param.name)

    moved = moved_bytes((r for b in schedule.buckets for r in b.routes), metas)
    if (trainer_tp, engine_tps) in ((2, (2,)), (1, (2,))):
        assert moved == {}
    else:
        assert moved and all(a != b for a, b in moved)


def test_a_routed_build_of_an_engine_rank_the_plan_lacks_is_refused():
    params, metas = sharded("qwen3")
    plan = plan_direct(metas.values(), layout=DirectLayout(shape=SHAPE, tp_size=1))
    holdings = converter_holdings(params, ranks=tp_ranks(2))
    with pytest.raises(ValueError, match=r"tp_rank=1, feeder=0\): no such engine rank"):
        plan_routed([plan], holdings, builds=[Build(layout=0, tp_rank=1, feeder=0)], bucket_bytes=1 << 20)
