"""The sizing model: exported tensors of real configs, the collective formulas, the projection's limits, the CLI."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace

import pytest

from miles_sync.sizing.cli import main, parse_engines, parse_trainer, read_config
from miles_sync.sizing.collective import BroadcastAlgorithm, binomial_depth, broadcast_seconds
from miles_sync.sizing.costs import Costs, load_costs
from miles_sync.sizing.projection import Cluster, EngineFleet, TrainerLayout, Transport, project
from miles_sync.sizing.published import PUBLISHED, figures_for
from miles_sync.sizing.shapes import ExportDtype, TensorGroup, model_shape

GB = 1e9


@functools.cache
def shape_of(name: str):
    return model_shape(read_config(name)[0])


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("deepseek-v3", 685e9),  # 671B main model + 14B MTP module, as DeepSeek's model card counts them
        ("qwen3-235b-a22b", 235e9),
        ("llama-3-70b", 70.6e9),
    ],
)
def test_shipped_configs_have_the_published_parameter_counts(name, published):
    assert abs(shape_of(name).num_params - published) / published < 0.01


def test_deepseek_v3_main_model_without_mtp_is_671b():
    shape = shape_of("deepseek-v3")
    main_params = sum(g.numel for g in shape.groups if g.layer < shape.num_layers or g.name == "lm_head.weight")
    main_params += sum(g.numel for g in shape.groups if g.name == "model.norm.weight")
    assert abs(main_params - 671e9) / 671e9 < 0.01


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "qwen2", "llama", "deepseek_v3"])
def test_tensors_match_the_transformers_model(model_type):
    """Names and shapes against transformers' own model of the family, built on the meta device (DeepSeek-V3's
    MTP layer is not part of transformers' model: the config here has none)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4)
    extra = {
        "qwen3": dict(num_key_value_heads=2, head_dim=8),
        "qwen3_moe": dict(
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            moe_intermediate_size=16,
            decoder_sparse_step=2,
            mlp_only_layers=[2],
        ),
        "qwen2": dict(num_key_value_heads=2),
        "llama": dict(num_key_value_heads=2, tie_word_embeddings=True),
        "deepseek_v3": dict(
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=8,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            n_routed_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
        ),
    }[model_type]
    config = AutoConfig.for_model(model_type, **base, **extra)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    ours = {}
    shape = model_shape({**config.to_dict(), "model_type": model_type})
    for g in shape.groups:
        if "*" in g.name:
            for e in range(g.count):
                ours[g.name.replace("*", str(e))] = g.shape
        else:
            assert g.count == 1
            ours[g.name] = g.shape
    if model_type == "deepseek_v3":  # transformers keeps the router bias as a buffer, not a parameter
        expected |= {n: (4,) for n in ours if n.endswith("e_score_correction_bias")}
    assert ours == expected


def test_fp8_block_bytes_count_one_float32_scale_per_128_block():
    weight = TensorGroup(name="w", shape=(256, 384), is_quantizable=True)
    assert weight.num_bytes(ExportDtype.FP8_BLOCK) == 256 * 384 + 2 * 3 * 4
    ragged = TensorGroup(name="w", shape=(130, 129), count=3, is_quantizable=True)
    assert ragged.num_bytes(ExportDtype.FP8_BLOCK) == 3 * (130 * 129 + 4 * 4)
    assert ragged.num_tensors(ExportDtype.FP8_BLOCK) == 6
    norm = TensorGroup(name="n", shape=(128,))
    assert norm.num_bytes(ExportDtype.FP8_BLOCK) == norm.num_bytes(ExportDtype.BF16) == 256
    shape = shape_of("deepseek-v3")
    assert 0.5 < shape.num_bytes(ExportDtype.FP8_BLOCK) / shape.num_bytes(ExportDtype.BF16) < 0.51


def test_unsupported_model_type_is_named():
    with pytest.raises(ValueError, match="'gpt2'"):
        model_shape({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="'hidden_size'"):
        model_shape({"model_type": "llama"})


def test_binomial_and_ring_broadcast_formulas():
    assert [binomial_depth(p) for p in range(1, 10)] == [0, 1, 1, 2, 2, 2, 2, 3, 3]
    args = dict(link_gbps=1.0, algorithm=BroadcastAlgorithm.BINOMIAL)
    for receivers in range(1, 40):  # on a network the root's NIC carries one copy per round
        assert broadcast_seconds(GB, num_receivers=receivers, **args) == math.ceil(math.log2(receivers + 1))
    assert broadcast_seconds(GB, num_receivers=2, **args, shares_nic=False) == 1.0  # loopback: depth only
    ring = [broadcast_seconds(GB, num_receivers=r, link_gbps=1.0, algorithm=BroadcastAlgorithm.RING) for r in (1, 127)]
    assert ring[0] == 1.0 and 1.0 < ring[1] < 1.07  # S / B plus the pipeline fill
    assert broadcast_seconds(GB, num_receivers=0, **args) == 0.0


COSTS = Costs(
    memcpy_gbps=500.0,
    fresh_copy_gbps=100.0,
    load_gbps=300.0,
    hash_gbps=50.0,
    link_gbps=1.0,
    per_sync_s=0.05,
    per_bucket_s=1e-3,
    per_tensor_s=1e-6,
)


def projected(transport=Transport.BROADCAST, *, engines=4, link=50.0, name="qwen3-235b-a22b", **kw):
    kw.setdefault("trainer", TrainerLayout(tp=4, pp=4, ep=8))
    kw.setdefault("costs", COSTS)
    return project(
        shape_of(name),
        transport=transport,
        engines=EngineFleet(count=engines, tp=8),
        cluster=Cluster(link_gbps=link, intra_gbps=400.0),
        **kw,
    )


@pytest.mark.parametrize("algorithm", list(BroadcastAlgorithm))
@pytest.mark.parametrize("transport", [Transport.BROADCAST, Transport.PER_STAGE])
def test_more_engines_never_make_a_broadcast_cheaper(algorithm, transport):
    times = [projected(transport, engines=n, algorithm=algorithm).sync_s for n in range(1, 65)]
    assert all(b >= a for a, b in zip(times, times[1:]))
    assert times[-1] > times[0]


def test_more_link_bandwidth_never_slows_a_broadcast():
    times = [projected(link=g).sync_s for g in (5, 10, 25, 50, 100, 400)]
    assert all(b <= a for a, b in zip(times, times[1:]))


def test_colocated_does_not_depend_on_the_link_when_the_replica_fits_a_node():
    trainer = TrainerLayout(tp=8)
    times = {projected(Transport.COLOCATED, link=g, trainer=trainer, name="llama-3-70b").sync_s for g in (1, 50, 400)}
    assert len(times) == 1
    spanning = [projected(Transport.COLOCATED, link=g).sync_s for g in (5, 50)]  # tp4 pp4 ep8: 4 nodes per replica
    assert spanning[0] > spanning[1]


def test_staged_pause_is_shorter_and_holds_the_packed_model():
    plain, staged = projected(), projected(staged=True)
    assert staged.pause_s < plain.pause_s
    assert staged.stage_s > 0 and staged.sync_s == pytest.approx(staged.stage_s + staged.pause_s)
    assert staged.sender_extra_bytes == plain.num_bytes
    assert plain.sender_extra_bytes == 2 * (1 << 30)  # double-buffered bucket
    assert plain.engine_rank_extra_bytes == 1 << 30
    assert projected(Transport.COLOCATED).engine_rank_extra_bytes == 0


def test_per_stage_sources_skip_the_pipeline_hop():
    one, per_stage = projected(link=5.0), projected(Transport.PER_STAGE, link=5.0)
    assert one.terms["pp_hop"] > 0 and per_stage.terms["pp_hop"] == 0
    assert per_stage.sync_s < one.sync_s
    assert per_stage.num_bytes == one.num_bytes


def test_p2p_sends_each_engine_rank_its_shard_from_the_ranks_that_hold_it():
    """Engine ranks fed round robin by one replica's ranks (tp4 pp4 ep8: a stage spans max(4, 8) = 8 ranks, so 32
    feeders): each engine rank's shard is S / 8 and crosses the link once; no broadcast, no load step, no staging."""
    shard = projected(Transport.P2P).num_bytes / 8
    for engines in (1, 4, 8):  # 8, 32, 64 engine ranks over 32 feeders: 1, 1, 2 shards on the busiest
        p = projected(Transport.P2P, engines=engines, link=50.0)
        busiest = math.ceil(engines * 8 / 32) * shard
        assert p.terms["link"] == pytest.approx(busiest / 50e9)
        assert p.terms["load"] == 0 and p.engine_rank_extra_bytes == 0 and p.stage_s == 0
    # More engines than feeders: the busiest rank sends more, but far less than a broadcast to every rank moves.
    assert projected(Transport.P2P, engines=16).sync_s > projected(Transport.P2P, engines=4).sync_s
    assert projected(Transport.P2P, engines=16, link=5.0).terms["link"] < projected(engines=16, link=5.0).terms["link"]
    with pytest.raises(ValueError, match="no staged form"):
        projected(Transport.P2P, staged=True)


def test_costs_round_trip_and_reject_bad_values(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(COSTS.to_json())
    assert load_costs(path) == COSTS
    reference = load_costs()
    assert reference.machine and reference.shared_cores is not None
    with pytest.raises(ValueError, match="bogus"):
        Costs.from_dict({**json.loads(COSTS.to_json()), "bogus": 1})
    with pytest.raises(ValueError, match="memcpy_gbps=0"):
        replace(COSTS, memcpy_gbps=0)


def test_layout_arguments_are_parsed_and_checked():
    assert parse_trainer("tp=8,pp=4,ep=8") == TrainerLayout(tp=8, pp=4, ep=8)
    assert parse_engines("16x8") == EngineFleet(count=16, tp=8)
    with pytest.raises(ValueError, match="dp=2"):
        parse_trainer("tp=2,dp=2")
    with pytest.raises(ValueError, match="--engines"):
        parse_engines("8 by 2")


def test_published_figures_cite_a_source_and_match_a_shipped_config():
    shipped = {"deepseek-v3", "qwen3-235b-a22b", "llama-3-70b"}
    assert all(f.source and set(f.configs) <= shipped and f.seconds > 0 for f in PUBLISHED)
    assert {f.seconds for f in figures_for("deepseek-v3")} >= {52.98, 6.29}
    assert figures_for(None) == ()


def test_cli_prints_a_table_per_transport_and_the_published_figures(capsys):
    argv = ["--config", "deepseek-v3", "--trainer", "tp=8,pp=4,ep=8", "--engines", "16x8", "--link-gbps", "50"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "684.5B parameters" in out
    labels = ("broadcast ", "broadcast staged", "per_stage ", "per_stage staged", "colocated ", "colocated staged")
    for label in (*labels, "p2p "):
        assert any(line.startswith(label) for line in out.splitlines()), label
    assert "52.98 s  Miles NCCL broadcast" in out
    assert main([*argv, "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 7  # p2p has no staged form
    assert main(["--config", "no-such-model", "--link-gbps", "1"]) == 2
    assert "no-such-model" in capsys.readouterr().err
