"""Engine-exact rules for MoE experts: SGLang's FusedMoE names and stacking, AITER per expert, streaming digests,
partial expert sets left unpredicted, the TP split modeled for the digests and refused elsewhere; and the dense
reference recipe left as it was."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch

from miles_sync.engine.reference.checkpoints import (
    BUILT_IN_ARCHS,
    CheckpointRecipe,
    MoeCheckpointRecipe,
    cached_checkpoints,
    recipe_digest,
)
from miles_sync.sync.engine_digests import EngineDigester, EngineDigestPlan, EngineLayout
from miles_sync.weights.checksum import sglang_fused_tensor, sglang_parameter_names
from miles_sync.weights.engine_layout import (
    TPShape,
    is_linear_weight,
    rank_engine_digests,
    rank_engine_tensors,
    tp_problems,
)
from miles_sync.weights.layout import WeightLayout, shuffle_weight
from miles_sync.wire.protocol import Selector

E, WIDTH, H = 4, 32, 64  # experts, expert width (moe_intermediate_size), hidden
HEAD = "model.layers.0.mlp.experts."
SHAPE = TPShape(
    hidden_size=H,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=2 * WIDTH,
    vocab_size=256,
    num_experts=E,
    moe_intermediate_size=WIDTH,
)


def expert_names(num_experts: int = E, head: str = HEAD) -> list[str]:
    return [f"{head}{e}.{p}_proj.weight" for e in range(num_experts) for p in ("gate", "up", "down")]


def expert_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in expert_names():
        shape = (H, WIDTH) if "down_proj" in name else (WIDTH, H)
        tensors[name] = torch.randn(shape, generator=generator)
    tensors["model.layers.0.mlp.gate.weight"] = torch.randn((E, H), generator=generator)
    return tensors


def test_every_expert_present_stacks_into_w13_and_w2_in_fusedmoe_order():
    parts = sglang_parameter_names(expert_names() + ["model.layers.0.mlp.gate.weight"], num_experts=E)
    assert parts[f"{HEAD}w13_weight"] == tuple(f"{HEAD}{e}.{p}_proj.weight" for e in range(E) for p in ("gate", "up"))
    assert parts[f"{HEAD}w2_weight"] == tuple(f"{HEAD}{e}.down_proj.weight" for e in range(E))
    assert parts["model.layers.0.mlp.gate.weight"] == ("model.layers.0.mlp.gate.weight",)  # the router stays apart
    assert len(parts) == 3
    # Without num_experts, 0..the highest index seen; an MTP head's block has its own prefix.
    mtp = expert_names(head="model.layers.2.mlp.experts.")
    assert set(sglang_parameter_names(mtp)) == {
        "model.layers.2.mlp.experts.w13_weight",
        "model.layers.2.mlp.experts.w2_weight",
    }


@pytest.mark.parametrize(
    ("drop", "has_w2"),
    [
        ([f"{HEAD}3.gate_proj.weight", f"{HEAD}3.up_proj.weight", f"{HEAD}3.down_proj.weight"], False),  # expert 3
        ([f"{HEAD}1.up_proj.weight"], True),  # half of one expert's w13; every down projection is there
    ],
)
def test_a_partial_expert_set_is_not_predicted_as_a_stack(drop, has_w2):
    names = [n for n in expert_names() if n not in drop]
    parts = sglang_parameter_names(names, num_experts=E)
    assert f"{HEAD}w13_weight" not in parts and (f"{HEAD}w2_weight" in parts) == has_w2
    # As for partial q/k/v: each tensor stands alone, a name the engine never answers (the verifier reports it).
    assert all(parts[n] == (n,) for n in names if has_w2 is False or "down_proj" not in n)


def test_the_fused_tensor_is_fusedmoe_shaped_and_aiter_shuffles_each_expert():
    tensors = expert_tensors()
    w13 = torch.stack(
        [torch.cat([tensors[f"{HEAD}{e}.gate_proj.weight"], tensors[f"{HEAD}{e}.up_proj.weight"]]) for e in range(E)]
    )
    w2 = torch.stack([tensors[f"{HEAD}{e}.down_proj.weight"] for e in range(E)])
    parts = sglang_parameter_names(tensors, num_experts=E)
    assert torch.equal(sglang_fused_tensor(f"{HEAD}w13_weight", [tensors[n] for n in parts[f"{HEAD}w13_weight"]]), w13)
    assert is_linear_weight(f"{HEAD}w13_weight") and is_linear_weight(f"{HEAD}w2_weight")
    assert not is_linear_weight("model.layers.0.mlp.gate.weight")
    engine = rank_engine_tensors(tensors, shape=SHAPE, tp_rank=0, tp_size=1, layout=WeightLayout.AITER)
    assert torch.equal(engine[f"{HEAD}w13_weight"], torch.stack([shuffle_weight(w) for w in w13]))
    assert torch.equal(engine[f"{HEAD}w2_weight"], torch.stack([shuffle_weight(w) for w in w2]))
    assert torch.equal(engine["model.layers.0.mlp.gate.weight"], tensors["model.layers.0.mlp.gate.weight"])


@pytest.mark.parametrize("weight_layout", [WeightLayout.NONE, WeightLayout.AITER])
def test_expert_stacks_straddling_buckets_are_kept_until_complete(weight_layout):
    tensors = expert_tensors(seed=1)
    layout = EngineLayout(tp_size=1, weight_layout=weight_layout, shape=SHAPE, num_target_layers=1)
    digester = EngineDigester(EngineDigestPlan(layouts=(layout,)), names=tensors, selector=Selector.TARGET)
    late = {n for n in tensors if ".experts.0." in n}  # expert 0 last: every stack waits for it
    digester.add([(n, t) for n, t in tensors.items() if n not in late])
    assert digester.pending_bytes > 0
    digester.add([(n, t) for n, t in tensors.items() if n in late])
    assert digester.pending_bytes == 0
    (predicted,) = digester.finish()[layout]
    assert predicted == rank_engine_digests([("target", tensors)], shape=SHAPE, tp_size=1, layout=weight_layout)[0]
    assert set(predicted) == {f"{HEAD}w13_weight", f"{HEAD}w2_weight", "model.layers.0.mlp.gate.weight"}


def test_experts_split_across_tp_ranks_are_refused_where_the_split_is_not_modeled():
    assert tp_problems(SHAPE, 1) == []
    (problem,) = tp_problems(SHAPE, 2)
    assert "num_experts=4" in problem and "tp_size=2" in problem
    assert tp_problems(SHAPE, 2, split_experts=True) == []
    (odd,) = tp_problems(dataclasses.replace(SHAPE, moe_intermediate_size=33), 2, split_experts=True)
    assert "moe_intermediate_size=33 is not divisible by tp_size=2" in odd
    config = {"hidden_size": H, "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 256}
    moe = TPShape.from_config({**config, "num_experts": 4, "moe_intermediate_size": 32})
    assert (moe.num_experts, moe.moe_intermediate_size) == (4, 32)
    assert TPShape.from_config(config).num_experts == 0


def test_each_tp_rank_stacks_its_half_of_every_expert_as_fusedmoe_loads_it():
    """FusedMoE at TP=2, expert parallelism off: rank r's w13[e] is expert e's gate rows then up rows of block r,
    its w2[e] expert e's down columns of block r (SGLang's _load_w13 / _load_w2). Mutation: experts kept whole."""
    tensors = expert_tensors()
    half = WIDTH // 2
    for rank in range(2):
        engine = rank_engine_tensors(tensors, shape=SHAPE, tp_rank=rank, tp_size=2)
        rows = slice(rank * half, (rank + 1) * half)
        for e in range(E):
            gate, up, down = (tensors[f"{HEAD}{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
            assert torch.equal(engine[HEAD + "w13_weight"][e], torch.cat([gate[rows], up[rows]]))
            assert torch.equal(engine[HEAD + "w2_weight"][e], down[:, rows])
        assert engine[HEAD + "w13_weight"].shape == (E, 2 * half, H)
        assert engine[HEAD + "w2_weight"].shape == (E, H, half)
        assert torch.equal(engine["model.layers.0.mlp.gate.weight"], tensors["model.layers.0.mlp.gate.weight"])


def test_the_dense_recipe_and_its_digest_are_unchanged():
    """The dense checkpoint's bytes are named by this payload: any change would rebuild it."""
    import transformers

    dense = {
        "seed": 0,
        "language": {"vocab_size": 256, "multiplier": 5, "increment": 17, "noise": 0.05},
        "target": {
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
        },
        "draft": {
            "hidden_size": 96,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
        },
        "dtype": "float32",
        "target_steps": 60,
        "draft_steps": 60,
        "batch_size": 32,
        "seq_len": 64,
        "lr": 2e-3,
        "mtp_weight": 0.3,
        "log_every": 20,
    }
    assert dataclasses.asdict(CheckpointRecipe()) == dense
    payload = {"recipe": dense, "format": 3, "torch": torch.__version__, "transformers": transformers.__version__}
    assert (
        recipe_digest(CheckpointRecipe())
        == hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    )
    assert recipe_digest(MoeCheckpointRecipe()) != recipe_digest(CheckpointRecipe())


def test_cached_checkpoints_names_the_built_in_archs(tmp_path):
    assert BUILT_IN_ARCHS == ("qwen3", "qwen3_moe")
    with pytest.raises(ValueError, match="built-in: qwen3, qwen3_moe"):
        cached_checkpoints(tmp_path, arch="llama")
    with pytest.raises(ValueError, match="takes a MoeCheckpointRecipe"):
        cached_checkpoints(tmp_path, arch="qwen3_moe", recipe=CheckpointRecipe())
