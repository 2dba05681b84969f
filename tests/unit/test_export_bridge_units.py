"""Pure planning of bridge mode: HF names -> atomic units, streaming assembly, vocabulary trimming.

The unit keys and member order must equal the raw converters' (senders must not care which mode produced a
stream), so the table is also checked against every raw family's own mapping.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from miles_sync.export.bridge import UnitAssembler, plan_units, trim_vocab_padding, unit_slot
from miles_sync.wire.bucket import AtomicUnit, TensorMeta

L = "model.layers.3"


@pytest.mark.parametrize(
    ("name", "slot"),
    [
        (f"{L}.self_attn.q_proj.weight", (f"{L}.self_attn.qkv_proj", 0)),
        (f"{L}.self_attn.k_proj.weight", (f"{L}.self_attn.qkv_proj", 1)),
        (f"{L}.self_attn.v_proj.weight", (f"{L}.self_attn.qkv_proj", 2)),
        (f"{L}.self_attn.q_proj.bias", (f"{L}.self_attn.qkv_proj", 3)),
        (f"{L}.self_attn.k_proj.bias", (f"{L}.self_attn.qkv_proj", 4)),
        (f"{L}.self_attn.v_proj.bias", (f"{L}.self_attn.qkv_proj", 5)),
        (f"{L}.self_attn.o_proj.weight", (f"{L}.self_attn.o_proj.weight", 0)),
        (f"{L}.self_attn.q_norm.weight", (f"{L}.self_attn.q_norm.weight", 0)),
        (f"{L}.mlp.gate_proj.weight", (f"{L}.mlp.gate_up_proj", 0)),
        (f"{L}.mlp.up_proj.weight", (f"{L}.mlp.gate_up_proj", 1)),
        (f"{L}.mlp.down_proj.weight", (f"{L}.mlp.down_proj.weight", 0)),
        (f"{L}.mlp.experts.12.gate_proj.weight", (f"{L}.mlp.experts.12", 0)),
        (f"{L}.mlp.experts.12.up_proj.weight", (f"{L}.mlp.experts.12", 1)),
        (f"{L}.mlp.experts.12.down_proj.weight", (f"{L}.mlp.experts.12", 2)),
        (f"{L}.mlp.shared_expert.gate_proj.weight", (f"{L}.mlp.shared_expert", 0)),
        (f"{L}.mlp.shared_expert.down_proj.weight", (f"{L}.mlp.shared_expert", 2)),
        (f"{L}.mlp.shared_expert_gate.weight", (f"{L}.mlp.shared_expert_gate.weight", 0)),
        (f"{L}.mlp.gate.weight", (f"{L}.mlp.gate.weight", 0)),  # the router is its own unit
        ("model.layers.2.eh_proj.weight", ("model.layers.2.eh_proj.weight", 0)),
        ("model.embed_tokens.weight", ("model.embed_tokens.weight", 0)),
        ("lm_head.weight", ("lm_head.weight", 0)),
    ],
)
def test_unit_slot_table(name, slot):
    assert unit_slot(name) == slot


def _meta(name: str, shape=(2, 2), dtype=torch.float32) -> TensorMeta:
    return TensorMeta(name=name, shape=shape, dtype=dtype)


def test_plan_orders_members_and_units_by_completion():
    # Bias arrives after the o_proj: the q/k/v unit completes last, with weights before biases.
    arrival = [
        _meta(f"{L}.self_attn.k_proj.weight"),
        _meta(f"{L}.self_attn.q_proj.weight"),
        _meta(f"{L}.self_attn.v_proj.weight"),
        _meta(f"{L}.self_attn.o_proj.weight"),
        _meta(f"{L}.self_attn.v_proj.bias"),
        _meta(f"{L}.self_attn.q_proj.bias"),
        _meta(f"{L}.self_attn.k_proj.bias"),
    ]
    units = plan_units(arrival)
    assert [u.key for u in units] == [f"{L}.self_attn.o_proj.weight", f"{L}.self_attn.qkv_proj"]
    assert [m.name.split(".")[-2:] for m in units[1].tensors] == [
        ["q_proj", "weight"],
        ["k_proj", "weight"],
        ["v_proj", "weight"],
        ["q_proj", "bias"],
        ["k_proj", "bias"],
        ["v_proj", "bias"],
    ]


def test_plan_rejects_a_repeated_name():
    with pytest.raises(ValueError, match="listed twice"):
        plan_units([_meta("model.norm.weight"), _meta("model.norm.weight")])


def _assembler():
    names = [f"{L}.mlp.up_proj.weight", f"{L}.mlp.gate_proj.weight", "model.norm.weight"]
    units = plan_units([_meta(n) for n in names])
    return UnitAssembler(units), units


def test_assembler_hands_on_complete_units_in_member_order():
    assembler, units = _assembler()
    up, gate, norm = torch.ones(2, 2), torch.zeros(2, 2), torch.full((2, 2), 3.0)
    assert assembler.add(f"{L}.mlp.up_proj.weight", up) is None
    assert assembler.missing() == [f"{L}.mlp.gate_proj.weight", "model.norm.weight"]
    unit = assembler.add(f"{L}.mlp.gate_proj.weight", gate)
    assert unit.meta == units[0]
    assert unit.tensors[0] is gate and unit.tensors[1] is up
    assert assembler.add("model.norm.weight", norm).named() == [("model.norm.weight", norm)]
    assert assembler.missing() == []


@pytest.mark.parametrize(
    ("name", "tensor", "match"),
    [
        ("model.layers.0.mlp.down_proj.weight", torch.zeros(2, 2), "not in the export plan"),
        ("model.norm.weight", torch.zeros(3, 2), "shape"),
        ("model.norm.weight", torch.zeros(2, 2, dtype=torch.bfloat16), "dtype"),
    ],
)
def test_assembler_rejects_what_the_plan_does_not_expect(name, tensor, match):
    assembler, _ = _assembler()
    with pytest.raises(ValueError, match=match):
        assembler.add(name, tensor)


def test_assembler_rejects_a_tensor_arriving_twice():
    assembler, _ = _assembler()
    assembler.add("model.norm.weight", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="twice"):
        assembler.add("model.norm.weight", torch.zeros(2, 2))


def test_trim_vocab_padding_drops_only_padding_rows_of_vocab_tensors():
    padded = torch.arange(12.0).reshape(6, 2)
    trimmed = trim_vocab_padding("model.embed_tokens.weight", padded, (5, 2))
    assert torch.equal(trimmed, padded[:5]) and trimmed.is_contiguous()
    assert trim_vocab_padding("lm_head.weight", padded, (6, 2)).shape == (6, 2)
    # Any other tensor keeps its shape (and then fails the plan's shape check, never silently truncated).
    assert trim_vocab_padding("model.norm.weight", padded, (5, 2)).shape == (6, 2)
    assert trim_vocab_padding("model.embed_tokens.weight", padded, (5, 3)).shape == (6, 2)


def _raw_units(arch: str, names: list[str]) -> list[AtomicUnit]:
    """Units the raw converter of `arch` forms for canonical megatron names in model order."""
    from miles_sync.export.raw import create_converter

    config = SimpleNamespace(
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        head_dim=16,
        vocab_size=250,
        num_hidden_layers=1,
        tie_word_embeddings=False,
    )
    converter = create_converter(arch, config)
    members: dict[str, list[str]] = {}
    shapes = {"linear_qkv.weight": (128, 64), "linear_qkv.bias": (128,), "linear_fc1.weight": (256, 64)}
    for name in names:
        shape = next((v for k, v in shapes.items() if name.endswith(k)), (64, 64))
        mapping = converter.map_param(name, shape)
        members.setdefault(mapping.unit_key, []).extend(mapping.hf_names)
    return [AtomicUnit(key=k, tensors=tuple(_meta(n) for n in v)) for k, v in members.items()]


_ATTENTION = ["input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight"]
_QKV_BIAS = ["self_attention.linear_qkv.bias"]
_QK_NORM = ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
_MLP = ["pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
_MOE = [
    "pre_mlp_layernorm.weight",
    "mlp.router.weight",
    "mlp.experts.0.linear_fc1.weight",
    "mlp.experts.0.linear_fc2.weight",
    "mlp.experts.1.linear_fc1.weight",
    "mlp.experts.1.linear_fc2.weight",
    "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_experts.gate_weight",
]


@pytest.mark.parametrize(
    ("arch", "layer_params"),
    [
        ("llama", _ATTENTION + _MLP),
        ("qwen2", _ATTENTION + _QKV_BIAS + _MLP),
        ("qwen3", _ATTENTION + _QK_NORM + _MLP),
        ("qwen3_moe", _ATTENTION + _QK_NORM + _MOE),
    ],
)
def test_units_equal_the_raw_converters_for_any_arrival_order(arch, layer_params):
    names = [
        "embedding.word_embeddings.weight",
        *(f"decoder.layers.0.{p}" for p in layer_params),
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    ]
    raw = _raw_units(arch, names)
    hf_names = [m.name for u in raw for m in u.tensors]
    # The bridge emits in its own order; reversed arrival still yields the raw units, member order included.
    bridge = plan_units([_meta(n) for n in reversed(hf_names)])
    assert sorted(bridge, key=lambda u: u.key) == sorted(raw, key=lambda u: u.key)


# ---- one grouping table: raw, bridge and HF-state-dict grouping agree ------------------------------------------

_NUM_EXPERTS = 4


def _qwen3_moe_records():
    """LocalParam records of a 2-layer Qwen3-MoE stage (4 experts, a shared expert, one MTP layer), TP=PP=EP=1."""
    from miles_sync.export.stage import LocalParam

    shapes = {
        "linear_qkv.weight": (128, 64),
        "experts.{expert}.linear_fc1.weight": (64, 64),
        "experts.{expert}.linear_fc2.weight": (64, 32),
        "shared_experts.linear_fc1.weight": (64, 64),
        "shared_experts.linear_fc2.weight": (64, 32),
        "shared_experts.gate_weight": (1, 64),
        "router.weight": (_NUM_EXPERTS, 64),
        "eh_proj.weight": (64, 128),
        "word_embeddings.weight": (256, 64),
        "output_layer.weight": (256, 64),
    }

    def record(name: str, local_expert: int | None = None) -> LocalParam:
        shape = next((v for k, v in shapes.items() if name.endswith(k)), (64,))
        return LocalParam(
            chunk=0,
            local_name=name,
            canonical=name,
            shape=shape,
            dtype=torch.float32,
            partition_dim=None,
            local_expert=local_expert,
        )

    def layer(prefix: str) -> list[LocalParam]:
        params = [record(f"{prefix}.{p}") for p in [*_ATTENTION, *_QK_NORM, *_MOE[:2]]]
        for e in range(_NUM_EXPERTS):
            params += [record(f"{prefix}.mlp.experts.{{expert}}.linear_fc{i}.weight", local_expert=e) for i in (1, 2)]
        return params + [record(f"{prefix}.{p}") for p in _MOE[6:]]

    return [
        record("embedding.word_embeddings.weight"),
        *layer("decoder.layers.0"),
        *layer("decoder.layers.1"),
        record("decoder.final_layernorm.weight"),
        record("output_layer.weight"),
        *(record(f"mtp.layers.0.{p}") for p in ("enorm.weight", "hnorm.weight", "eh_proj.weight")),
        *(record(f"mtp.layers.0.transformer_layer.{p}") for p in [*_ATTENTION, *_QK_NORM, *_MLP]),
        record("mtp.layers.0.final_layernorm.weight"),
    ]


def test_raw_bridge_and_hf_grouping_agree_and_group_experts_per_expert():
    import random

    from miles_sync.export.raw import create_converter
    from miles_sync.export.stage import ParallelCoords
    from miles_sync.export.stage import plan_units as raw_plan_units
    from miles_sync.export.units import units_from_hf_tensors

    config = SimpleNamespace(
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        head_dim=16,
        vocab_size=250,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    )
    grid = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, ep_rank=0, ep_size=1, etp_rank=0, etp_size=1)
    coords = ParallelCoords(**grid, dp_rank=0, edp_rank=0)
    raw_units = [
        u.meta
        for u in raw_plan_units(_qwen3_moe_records(), converter=create_converter("qwen3_moe", config), coords=coords)
    ]
    metas = {m.name: m for u in raw_units for m in u.tensors}
    names = list(metas)
    random.Random(0).shuffle(names)  # bridge and HF sources list tensors in an order of their own

    def groups(units) -> dict[str, tuple[str, ...]]:
        return {u.key: tuple(m.name for m in u.tensors) for u in units}

    raw = groups(raw_units)
    bridge = groups(plan_units([metas[n] for n in names]))
    tensors = {n: torch.zeros(m.shape, dtype=m.dtype) for n, m in metas.items()}
    hf = groups(u.meta for u in units_from_hf_tensors(tensors, names))
    assert raw == bridge == hf
    assert len(raw) == len(raw_units)  # no unit key repeats

    for layer in (0, 1):
        prefix = f"model.layers.{layer}.mlp"
        for e in range(_NUM_EXPERTS):
            assert raw[f"{prefix}.experts.{e}"] == tuple(f"{prefix}.experts.{e}.{p}_proj.weight" for p in _GATE_UP_DOWN)
        assert raw[f"{prefix}.shared_expert"] == tuple(f"{prefix}.shared_expert.{p}_proj.weight" for p in _GATE_UP_DOWN)
        assert raw[f"{prefix}.gate.weight"] == (f"{prefix}.gate.weight",)  # the router travels alone
        assert f"model.layers.{layer}.self_attn.qkv_proj" in raw
    assert raw["model.layers.2.mlp.gate_up_proj"] == (
        "model.layers.2.mlp.gate_proj.weight",
        "model.layers.2.mlp.up_proj.weight",
    )
    assert raw["model.layers.2.eh_proj.weight"] == ("model.layers.2.eh_proj.weight",)


_GATE_UP_DOWN = ("gate", "up", "down")


def test_hf_grouping_keeps_first_member_order_and_groups_qkv_bias_with_weights():
    from miles_sync.export.units import group_hf_names

    names = [
        f"{L}.self_attn.v_proj.bias",
        "model.norm.weight",
        f"{L}.self_attn.q_proj.weight",
        f"{L}.mlp.experts.7.down_proj.weight",
        f"{L}.self_attn.k_proj.weight",
        f"{L}.self_attn.v_proj.weight",
        f"{L}.mlp.experts.7.up_proj.weight",
        f"{L}.mlp.experts.7.gate_proj.weight",
        "model.norm.weight",  # a repeat counts once
    ]
    assert group_hf_names(names) == [
        (
            f"{L}.self_attn.qkv_proj",
            tuple(f"{L}.self_attn.{p}" for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "v_proj.bias")),
        ),
        ("model.norm.weight", ("model.norm.weight",)),
        (f"{L}.mlp.experts.7", tuple(f"{L}.mlp.experts.7.{p}_proj.weight" for p in _GATE_UP_DOWN)),
    ]
