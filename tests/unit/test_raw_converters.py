"""Raw converters without processes: shard merges (shards <-> HF, both directions), name tables, stage planning."""

from __future__ import annotations

import types

import pytest
import torch

from miles_sync.export import shard_merge
from miles_sync.export.converter import ShardMerge, TensorMapping
from miles_sync.export.raw import SUPPORTED_ARCHS, create_converter
from miles_sync.export.stage import LocalParam, ParallelCoords, collect_local_params, plan_local_params, plan_units
from miles_sync.export.units import ExportedUnit
from miles_sync.megatron.model_builder import padded_vocab_size, transformer_config_from_hf
from miles_sync.parity.cli import ParityResult, first_difference, split_mtp
from miles_sync.parity.harness import ParityCase
from miles_sync.wire.bucket import AtomicUnit, TensorMeta

ATTENTION = shard_merge.AttentionDims(num_query_groups=2, heads_per_group=2, head_dim=4)  # 4 q heads, 2 kv heads


def hf_config(**overrides):
    fields = dict(
        model_type="qwen2",
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=8,
        head_dim=4,
        vocab_size=10,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return types.SimpleNamespace(**fields)


def mapping(merge: ShardMerge, megatron_shape: tuple[int, ...], hf_names: tuple[str, ...], *, vocab_size: int = 10):
    shapes = shard_merge.hf_shapes(merge, megatron_shape, attention=ATTENTION, vocab_size=vocab_size)
    return TensorMapping(
        megatron_name="x",
        megatron_shape=megatron_shape,
        unit_key="u",
        merge=merge,
        hf_names=hf_names,
        hf_shapes=shapes,
    )


class RecordingReader:
    """A checkpoint in memory that records every slice asked for (what a rank actually reads)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.requests: list[tuple[str, int | None, int, int]] = []

    def __call__(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        self.requests.append((name, dim, start, stop))
        tensor = self.tensors[name]
        if dim is None:
            return tensor.clone()
        return tensor.narrow(dim, start, stop - start).clone()


def shards_of(m: TensorMapping, hf: dict[str, torch.Tensor], *, partition_dim: int | None, size: int):
    reader = RecordingReader(hf)
    shards = [
        shard_merge.read_shard(m.merge, m, reader, partition_dim=partition_dim, rank=r, size=size, attention=ATTENTION)
        for r in range(size)
    ]
    return shards, reader.requests


# ---------------------------------------------------------------------------------------------------------------
# Shard merges: known answers and round trips, for every merge and TP size.
# ---------------------------------------------------------------------------------------------------------------


def test_qkv_merge_splits_megatron_groups_into_q_k_v() -> None:
    # Megatron rows per query group g: [q heads of g (2 x 4 rows); k_g (4 rows); v_g (4 rows)].
    hidden = 3
    q = torch.arange(16 * hidden, dtype=torch.float32).reshape(16, hidden)
    k = 1000 + torch.arange(8 * hidden, dtype=torch.float32).reshape(8, hidden)
    v = 2000 + torch.arange(8 * hidden, dtype=torch.float32).reshape(8, hidden)
    fused = torch.cat([q[:8], k[:4], v[:4], q[8:], k[4:], v[4:]])
    merged = shard_merge.merge_shards(ShardMerge.QKV, [fused], partition_dim=0, attention=ATTENTION, vocab_size=0)
    assert all(torch.equal(a, b) for a, b in zip(merged, (q, k, v), strict=True))
    # TP=2 holds one group per rank: the shards are exactly the two halves of the fused tensor.
    halves = list(fused.chunk(2))
    merged = shard_merge.merge_shards(ShardMerge.QKV, halves, partition_dim=0, attention=ATTENTION, vocab_size=0)
    assert all(torch.equal(a, b) for a, b in zip(merged, (q, k, v), strict=True))


def test_gate_up_shards_hold_their_own_gate_and_up_halves() -> None:
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    shards = [torch.cat([gate[:4], up[:4]]), torch.cat([gate[4:], up[4:]])]
    merged = shard_merge.merge_shards(ShardMerge.GATE_UP, shards, partition_dim=0, attention=ATTENTION, vocab_size=0)
    assert torch.equal(merged[0], gate) and torch.equal(merged[1], up)


def test_vocab_padding_is_trimmed_on_export_and_zero_on_import() -> None:
    embed = torch.randn(10, 3)
    m = mapping(ShardMerge.VOCAB, (16, 3), ("embed",))
    shards, _ = shards_of(m, {"embed": embed}, partition_dim=0, size=2)
    assert [tuple(s.shape) for s in shards] == [(8, 3), (8, 3)]
    assert torch.equal(shards[1][2:], torch.zeros(6, 3))
    (merged,) = shard_merge.merge_shards(ShardMerge.VOCAB, shards, partition_dim=0, attention=ATTENTION, vocab_size=10)
    assert torch.equal(merged, embed)


CASES = [
    (ShardMerge.COPY, (8, 6), 0, ("w",)),
    (ShardMerge.COPY, (8, 6), 1, ("w",)),
    (ShardMerge.COPY, (8,), None, ("norm",)),
    (ShardMerge.QKV, (32, 6), 0, ("q", "k", "v")),
    (ShardMerge.QKV, (32,), 0, ("qb", "kb", "vb")),
    (ShardMerge.GATE_UP, (16, 6), 0, ("gate", "up")),
    (ShardMerge.VOCAB, (16, 6), 0, ("embed",)),
]


@pytest.mark.parametrize(
    "merge, megatron_shape, partition_dim, names, size",
    [(*case, size) for case in CASES for size in (1, 2) if case[2] is not None or size == 1],  # replicas: no split
)
def test_import_then_export_is_bit_exact(merge, megatron_shape, partition_dim, names, size) -> None:
    m = mapping(merge, megatron_shape, names)
    generator = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=generator) for n, s in zip(names, m.hf_shapes, strict=True)}
    shards, requests = shards_of(m, hf, partition_dim=partition_dim, size=size)
    local_shape = list(megatron_shape)
    if partition_dim is not None:
        local_shape[partition_dim] //= size
    assert all(tuple(s.shape) == tuple(local_shape) for s in shards)
    if size > 1:
        # Each rank read only slices: nothing whole, and every slice a 1/size part (vocab: clipped to the HF rows).
        assert all(dim is not None for _, dim, _, _ in requests)
    merged = shard_merge.merge_shards(merge, shards, partition_dim=partition_dim, attention=ATTENTION, vocab_size=10)
    assert all(torch.equal(merged[i], hf[n]) for i, n in enumerate(names))


# ---------------------------------------------------------------------------------------------------------------
# Name tables.
# ---------------------------------------------------------------------------------------------------------------

QWEN2_NAMES = [
    ("embedding.word_embeddings.weight", (16, 8), ("model.embed_tokens.weight",), "model.embed_tokens.weight"),
    ("decoder.layers.1.input_layernorm.weight", (8,), ("model.layers.1.input_layernorm.weight",), None),
    (
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
        (8,),
        ("model.layers.1.input_layernorm.weight",),
        None,
    ),
    (
        "decoder.layers.0.self_attention.linear_qkv.weight",
        (32, 8),
        (
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
        ),
        "model.layers.0.self_attn.qkv_proj",
    ),
    (
        "decoder.layers.0.self_attention.linear_qkv.bias",
        (32,),
        (
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.self_attn.k_proj.bias",
            "model.layers.0.self_attn.v_proj.bias",
        ),
        "model.layers.0.self_attn.qkv_proj",
    ),
    ("decoder.layers.0.self_attention.linear_proj.weight", (8, 16), ("model.layers.0.self_attn.o_proj.weight",), None),
    ("decoder.layers.0.pre_mlp_layernorm.weight", (8,), ("model.layers.0.post_attention_layernorm.weight",), None),
    (
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
        (8,),
        ("model.layers.0.post_attention_layernorm.weight",),
        None,
    ),
    (
        "decoder.layers.0.mlp.linear_fc1.weight",
        (32, 8),
        ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        "model.layers.0.mlp.gate_up_proj",
    ),
    ("decoder.layers.0.mlp.linear_fc2.weight", (8, 16), ("model.layers.0.mlp.down_proj.weight",), None),
    ("decoder.final_layernorm.weight", (8,), ("model.norm.weight",), None),
    ("output_layer.weight", (16, 8), ("lm_head.weight",), None),
    # MTP layer k of an L-layer model is HF layer L + k.
    ("mtp.layers.0.enorm.weight", (8,), ("model.layers.2.enorm.weight",), None),
    ("mtp.layers.0.hnorm.weight", (8,), ("model.layers.2.hnorm.weight",), None),
    ("mtp.layers.0.eh_proj.weight", (8, 16), ("model.layers.2.eh_proj.weight",), None),
    ("mtp.layers.1.final_layernorm.weight", (8,), ("model.layers.3.shared_head.norm.weight",), None),
    (
        "mtp.layers.1.transformer_layer.self_attention.linear_proj.weight",
        (8, 16),
        ("model.layers.3.self_attn.o_proj.weight",),
        None,
    ),
]


@pytest.mark.parametrize("name, shape, hf_names, unit", QWEN2_NAMES, ids=[n for n, *_ in QWEN2_NAMES])
def test_qwen2_names(name, shape, hf_names, unit) -> None:
    m = create_converter("qwen2", hf_config()).map_param(name, shape)
    assert m.hf_names == hf_names
    assert m.unit_key == (hf_names[0] if unit is None else unit)
    assert m.is_exported


def test_hf_shapes_follow_the_merge() -> None:
    converter = create_converter("qwen2", hf_config())
    assert converter.map_param("decoder.layers.0.self_attention.linear_qkv.weight", (32, 8)).hf_shapes == (
        (16, 8),
        (8, 8),
        (8, 8),
    )
    assert converter.map_param("embedding.word_embeddings.weight", (16, 8)).hf_shapes == ((10, 8),)
    assert converter.map_param("decoder.layers.0.mlp.linear_fc1.weight", (32, 8)).hf_shapes == ((16, 8), (16, 8))


def test_family_specific_tensors() -> None:
    qk_norm = "decoder.layers.0.self_attention.q_layernorm.weight"
    bias = "decoder.layers.0.self_attention.linear_qkv.bias"
    assert create_converter("qwen3", hf_config()).map_param(qk_norm, (4,)).hf_names == (
        "model.layers.0.self_attn.q_norm.weight",
    )
    for arch, name in (("llama", bias), ("llama", qk_norm), ("qwen2", qk_norm), ("qwen3", bias)):
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            create_converter(arch, hf_config()).map_param(name, (4,))


def test_moe_names() -> None:
    converter = create_converter("qwen3_moe", hf_config())
    router = converter.map_param("decoder.layers.1.mlp.router.weight", (4, 8))
    fc1 = converter.map_param("decoder.layers.1.mlp.experts.3.linear_fc1.weight", (8, 8))
    fc2 = converter.map_param("decoder.layers.1.mlp.experts.3.linear_fc2.weight", (8, 4))
    shared = converter.map_param("decoder.layers.1.mlp.shared_experts.gate_weight", (1, 8))
    assert router.hf_names == ("model.layers.1.mlp.gate.weight",)
    assert fc1.hf_names == (
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
    )
    assert fc2.hf_names == ("model.layers.1.mlp.experts.3.down_proj.weight",)
    assert fc1.unit_key == fc2.unit_key == "model.layers.1.mlp.experts.3"
    assert shared.hf_names == ("model.layers.1.mlp.shared_expert_gate.weight",)


def test_tied_output_layer_is_imported_from_the_embedding_and_never_exported() -> None:
    m = create_converter("qwen3", hf_config(tie_word_embeddings=True)).map_param("output_layer.weight", (16, 8))
    assert m.hf_names == ("model.embed_tokens.weight",) and not m.is_exported


def test_unsupported_arch_names_it_and_the_supported_list() -> None:
    with pytest.raises(ValueError) as info:
        create_converter("mixtral", hf_config())
    assert "'mixtral'" in str(info.value)
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHS)
    with pytest.raises(ValueError, match="'mixtral'"):
        ParityCase(arch="mixtral").validate(world_size=1)


# ---------------------------------------------------------------------------------------------------------------
# Stage planning: canonical names, expert renumbering, unit grouping.
# ---------------------------------------------------------------------------------------------------------------


def coords(**overrides) -> ParallelCoords:
    fields = dict(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, ep_rank=0, ep_size=1, etp_rank=0, etp_size=1, dp_rank=0, edp_rank=0
    )
    fields.update(overrides)
    return ParallelCoords(**fields)


def sharded(shape: tuple[int, ...], dim: int) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(shape))
    param.tensor_model_parallel, param.partition_dim = True, dim
    return param


def stage_model(*, first_layer_number: int, num_local_experts: int, grouped: bool) -> torch.nn.Module:
    """A module tree with megatron-core's local names: one MoE layer (global number given) and one MTP layer."""
    model = torch.nn.Module()
    model.pre_process = False
    model.decoder = torch.nn.Module()
    layer = torch.nn.Module()
    layer.layer_number = first_layer_number
    layer.input_layernorm = torch.nn.Module()
    layer.input_layernorm.weight = torch.nn.Parameter(torch.ones(8))
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = torch.nn.Module()
    if grouped:
        layer.mlp.experts.linear_fc1 = torch.nn.Module()
        for j in range(num_local_experts):
            layer.mlp.experts.linear_fc1.register_parameter(f"weight{j}", sharded((8, 8), 0))
    else:
        layer.mlp.experts.local_experts = torch.nn.ModuleList()
        for _ in range(num_local_experts):
            expert = torch.nn.Module()
            expert.linear_fc1 = torch.nn.Module()
            expert.linear_fc1.weight = sharded((8, 8), 0)
            expert.linear_fc2 = torch.nn.Module()
            expert.linear_fc2.weight = sharded((8, 4), 1)
            layer.mlp.experts.local_experts.append(expert)
    model.decoder.layers = torch.nn.ModuleList([layer])
    model.mtp = torch.nn.Module()
    mtp_layer = torch.nn.Module()
    mtp_layer.layer_number = 1
    mtp_layer.enorm = torch.nn.Module()
    mtp_layer.enorm.weight = torch.nn.Parameter(torch.ones(8))
    model.mtp.layers = torch.nn.ModuleList([mtp_layer])
    model.embedding = torch.nn.Module()
    model.embedding.word_embeddings = torch.nn.Module()
    model.embedding.word_embeddings.weight = sharded((16, 8), 0)
    return model


def test_canonical_names_use_global_layers_and_expert_placeholders() -> None:
    records = collect_local_params([stage_model(first_layer_number=2, num_local_experts=2, grouped=False)])
    by_local = {r.local_name: r for r in records}
    assert by_local["decoder.layers.0.input_layernorm.weight"].canonical == "decoder.layers.1.input_layernorm.weight"
    expert = by_local["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert expert.canonical == "decoder.layers.1.mlp.experts.{expert}.linear_fc2.weight"
    assert expert.local_expert == 1 and expert.partition_dim == 1
    assert by_local["mtp.layers.0.enorm.weight"].canonical == "mtp.layers.0.enorm.weight"
    assert by_local["embedding.word_embeddings.weight"].is_stage_copy  # this stage is not the first
    grouped = collect_local_params([stage_model(first_layer_number=2, num_local_experts=2, grouped=True)])
    assert [r.canonical for r in grouped if r.is_expert] == [
        "decoder.layers.1.mlp.experts.{expert}.linear_fc1.weight"
    ] * 2
    assert [r.local_expert for r in grouped if r.is_expert] == [0, 1]


def test_experts_expand_to_every_ep_rank_in_global_id_order() -> None:
    records = collect_local_params([stage_model(first_layer_number=1, num_local_experts=2, grouped=False)])
    converter = create_converter("qwen3_moe", hf_config(model_type="qwen3_moe", num_hidden_layers=1))
    units = plan_units(records, converter=converter, coords=coords(ep_rank=1, ep_size=2, etp_size=2))
    experts = [u for u in units if ".experts." in u.meta.key]
    assert [u.meta.key for u in experts] == [f"model.layers.0.mlp.experts.{e}" for e in range(4)]
    assert [u.owner_ep_rank for u in experts] == [0, 0, 1, 1]
    # ETP=2: fc1 [8, 8] shards (dim 0) make gate and up of 8 rows each; fc2 [8, 4] shards (dim 1) make down [8, 8].
    assert [(m.name.rsplit(".", 2)[-2], m.shape) for m in experts[2].meta.tensors] == [
        ("gate_proj", (8, 8)),
        ("up_proj", (8, 8)),
        ("down_proj", (8, 8)),
    ]
    keys = [u.meta.key for u in units]
    assert "model.embed_tokens.weight" not in keys  # a later stage's embedding copy is not exported twice
    assert keys[-1] == "model.layers.1.enorm.weight"
    # Import fills this rank's own experts (global ids 2 and 3) and the embedding copy too.
    local = plan_local_params(records, converter=converter, coords=coords(ep_rank=1, ep_size=2, etp_size=2))
    assert {p.mapping.megatron_name for p in local if p.param.is_expert} == {
        f"decoder.layers.0.mlp.experts.{e}.linear_fc{i}.weight" for e in (2, 3) for i in (1, 2)
    }
    assert "embedding.word_embeddings.weight" in {p.mapping.megatron_name for p in local}


def test_qkv_weight_and_bias_form_one_unit() -> None:
    records = [
        LocalParam(chunk=0, local_name=n, canonical=n, shape=s, dtype=torch.bfloat16, partition_dim=0)
        for n, s in (
            ("decoder.layers.0.self_attention.linear_qkv.weight", (16, 8)),
            ("decoder.layers.0.self_attention.linear_qkv.bias", (16,)),
        )
    ]
    (unit,) = plan_units(records, converter=create_converter("qwen2", hf_config()), coords=coords(tp_size=2))
    assert unit.meta.key == "model.layers.0.self_attn.qkv_proj"
    assert [m.name.split("self_attn.")[1] for m in unit.meta.tensors] == [
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "q_proj.bias",
        "k_proj.bias",
        "v_proj.bias",
    ]
    assert unit.meta.tensors[0] == TensorMeta(
        name="model.layers.0.self_attn.q_proj.weight", shape=(16, 8), dtype=torch.bfloat16
    )


# ---------------------------------------------------------------------------------------------------------------
# Builder checks, records and parity helpers.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "vocab, tp, padded", [(250, 1, 256), (256, 1, 256), (250, 2, 256), (257, 2, 512), (151936, 4, 152064)]
)
def test_padded_vocab_size(vocab, tp, padded) -> None:
    assert padded_vocab_size(vocab, tp_size=tp) == padded


def test_builder_names_every_unsupported_setting() -> None:
    config = hf_config(
        model_type="llama", hidden_act="gelu", attention_bias=True, rope_scaling={"rope_type": "yarn", "factor": 4.0}
    )
    with pytest.raises(ValueError) as info:
        transformer_config_from_hf(config)
    message = str(info.value)
    assert "hidden_act='gelu'" in message and "attention_bias=True" in message and "rope_scaling=" in message
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        transformer_config_from_hf(hf_config(model_type="gpt2"))


def test_exported_unit_named_pairs_and_absent_tensors() -> None:
    meta = AtomicUnit(key="k", tensors=(TensorMeta(name="a", shape=(2,), dtype=torch.float32),))
    tensor = torch.ones(2)
    assert ExportedUnit(meta=meta, tensors=(tensor,)).named() == [("a", tensor)]
    with pytest.raises(ValueError, match="'k'"):
        ExportedUnit(meta=meta, tensors=None).named()


def test_parity_summary_and_first_difference() -> None:
    ok = ParityResult(max_abs_logit_diff=1.5e-6, num_tensors=25, first_mismatch=None)
    assert ok.summary() == "max_abs_logit_diff=1.500e-06 tensors=25 OK"
    a = {"x": torch.zeros(2), "y": torch.ones(3)}
    assert first_difference(a, dict(a), what="t") is None
    assert first_difference(a, {"x": a["x"]}, what="t") == "y: missing after t"
    assert first_difference(a, {**a, "y": torch.ones(3, dtype=torch.float64)}, what="t").startswith("y: (3,)")
    failed = ParityResult(max_abs_logit_diff=0.0, num_tensors=2, first_mismatch="y: missing after t")
    assert failed.summary().endswith("FAIL y: missing after t") and not failed.is_ok
    main, mtp = split_mtp({"model.layers.1.a": 1, "model.layers.2.a": 2, "lm_head.weight": 3}, num_layers=2)
    assert set(main) == {"model.layers.1.a", "lm_head.weight"} and set(mtp) == {"model.layers.2.a"}


def test_parity_case_validation_names_each_problem() -> None:
    with pytest.raises(ValueError) as info:
        ParityCase(arch="qwen3", tp=2, pp=2, ep=2, num_layers=3).validate(world_size=4)
    message = str(info.value)
    assert "ep=2" in message and "num_layers=3" in message


def test_unit_keys_come_from_the_shared_unit_table() -> None:
    from miles_sync.export.raw.rules import Rule
    from miles_sync.export.raw.table import RuleConverter
    from miles_sync.export.units import unit_slot

    converter = create_converter("qwen3_moe", hf_config(model_type="qwen3_moe"))
    for name, shape in (
        ("decoder.layers.1.self_attention.linear_qkv.weight", (32, 8)),
        ("decoder.layers.1.mlp.experts.5.linear_fc1.weight", (8, 8)),
        ("decoder.layers.1.mlp.experts.5.linear_fc2.weight", (8, 4)),
        ("decoder.layers.1.mlp.shared_experts.linear_fc2.weight", (8, 4)),
        ("decoder.layers.1.mlp.router.weight", (4, 8)),
        ("mtp.layers.0.eh_proj.weight", (8, 16)),
    ):
        m = converter.map_param(name, shape)
        assert {unit_slot(n)[0] for n in m.hf_names} == {m.unit_key}

    class Straddling(RuleConverter):
        arch = "straddling"
        layer_rules = (Rule(pattern=r"fused\.weight", hf_names=("mlp.gate_proj.weight", "self_attn.q_proj.weight")),)

    with pytest.raises(ValueError, match="one parameter's tensors must fill one unit"):
        Straddling(hf_config()).map_param("decoder.layers.0.fused.weight", (8, 8))
