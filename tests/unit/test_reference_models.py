"""Reference engine models: HF families from local checkpoints, the MTP head's names and inputs, checkpoint builds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from miles_sync.engine.reference.checkpoints import (
    CheckpointRecipe,
    LanguageRecipe,
    ModelShape,
    build_checkpoints,
    next_token,
    sample_sequences,
)
from miles_sync.engine.reference.models import CausalLM, MTPHead, causal_mask, model_family, read_config
from miles_sync.engine.reference.runner import load_mtp_runner, load_target_runner

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

_SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    tie_word_embeddings=False,
)


def _tiny_recipe(seed: int = 0) -> CheckpointRecipe:
    shape = ModelShape(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    return CheckpointRecipe(
        seed=seed,
        language=LanguageRecipe(vocab_size=64, multiplier=5, increment=17),
        target=shape,
        draft=shape,
        target_steps=2,
        draft_steps=2,
        batch_size=4,
        seq_len=8,
    )


def _file_hashes(root: Path) -> dict[str, str]:
    files = [p for p in sorted(root.rglob("*")) if p.is_file()]
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_family_loads_from_local_checkpoint_bit_exact(model_type: str, tmp_path: Path) -> None:
    family = model_family(model_type)
    torch.manual_seed(0)
    hf = family.causal_lm_class(family.config_class(**_SMALL)).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)

    runner = load_target_runner(tmp_path)

    assert runner.owned_names() == frozenset(n for n, _ in hf.named_parameters())
    ids = torch.randint(0, 64, (2, 7))
    with torch.inference_mode():
        expected = hf(input_ids=ids).logits
        got = runner.model(ids).logits
    assert torch.equal(got, expected)


def test_right_padding_is_exact_at_real_positions(tmp_path: Path) -> None:
    lm = CausalLM(model_family("qwen3").config_class(**_SMALL), seed=0)
    ids = torch.randint(0, 64, (1, 5))
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    with torch.inference_mode():
        alone = lm(ids).logits
        batch = lm(torch.cat([padded, torch.randint(0, 64, (1, 8))])).logits
    torch.testing.assert_close(batch[0, :5], alone[0], rtol=1e-5, atol=1e-5)


def _mtp_head(model_type: str, **overrides) -> tuple[CausalLM, MTPHead]:
    config = model_family(model_type).config_class(**{**_SMALL, **overrides})
    return CausalLM(config, seed=0), MTPHead(config, seed=1)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_mtp_head_names_are_the_megatron_export_names(model_type: str) -> None:
    _, head = _mtp_head(model_type)
    n = _SMALL["num_hidden_layers"]
    expected = {
        f"model.layers.{n}.{suffix}"
        for suffix in [
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "input_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "post_attention_layernorm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "shared_head.norm.weight",
        ]
        + (["self_attn.q_norm.weight", "self_attn.k_norm.weight"] if model_type == "qwen3" else [])
        + ([f"self_attn.{p}_proj.bias" for p in "qkv"] if model_type == "qwen2" else [])
    }
    params = head.hf_parameters()
    assert set(params) == expected
    hidden = _SMALL["hidden_size"]
    assert tuple(params[f"model.layers.{n}.eh_proj.weight"].shape) == (hidden, 2 * hidden)
    assert "model.embed_tokens.weight" not in params and "lm_head.weight" not in params


def test_mtp_eh_proj_reads_the_embedding_half_first() -> None:
    lm, head = _mtp_head("qwen3")
    hidden = _SMALL["hidden_size"]
    eye, zero = torch.eye(hidden), torch.zeros(hidden, hidden)
    ids = torch.randint(0, 64, (1, 6))
    h1, h2 = torch.randn(1, 6, hidden), torch.randn(1, 6, hidden)
    shared = dict(embed_tokens=lm.hf.model.embed_tokens, lm_head=lm.hf.lm_head)
    with torch.inference_mode():
        head.eh_proj.weight.copy_(torch.cat([eye, zero], dim=1))  # reads only the embedding half
        only_embedding = [head(ids, h, **shared).logits for h in (h1, h2)]
        head.eh_proj.weight.copy_(torch.cat([zero, eye], dim=1))  # reads only the hidden half
        only_hidden = [head(ids, h, **shared).logits for h in (h1, h2)]
    assert torch.equal(only_embedding[0], only_embedding[1])
    assert not torch.equal(only_hidden[0], only_hidden[1])


def test_mtp_layer_is_causal() -> None:
    lm, head = _mtp_head("qwen3")
    shared = dict(embed_tokens=lm.hf.model.embed_tokens, lm_head=lm.hf.lm_head)
    ids = torch.randint(0, 64, (1, 8))
    hidden = torch.randn(1, 8, _SMALL["hidden_size"])
    changed_ids, changed_hidden = ids.clone(), hidden.clone()
    changed_ids[0, 5:] = (ids[0, 5:] + 1) % 64
    changed_hidden[0, 5:] += 1.0
    with torch.inference_mode():
        base = head(ids, hidden, **shared).logits
        later_changed = head(changed_ids, changed_hidden, **shared).logits
    assert torch.equal(base[0, :5], later_changed[0, :5])
    assert not torch.equal(base[0, 5:], later_changed[0, 5:])


def test_causal_mask_shape_and_values() -> None:
    mask = causal_mask(3, dtype=torch.float32)
    assert mask.shape == (1, 1, 3, 3)
    assert torch.equal(mask[0, 0] == 0, torch.tril(torch.ones(3, 3, dtype=torch.bool)))


def test_language_and_sampling_are_seeded() -> None:
    language = LanguageRecipe(noise=0.0)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = sample_sequences(g1, batch_size=2, length=10, language=language)
    b = sample_sequences(g2, batch_size=2, length=10, language=language)
    assert torch.equal(a, b)
    assert torch.equal(a[:, 1:], next_token(a[:, :-1], language))
    assert next_token(255, LanguageRecipe()) == (5 * 255 + 17) % 256


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoints(tmp_path_factory.mktemp("tiny") / "a", _tiny_recipe())


def test_checkpoint_build_is_deterministic(tiny_checkpoints: Path, tmp_path: Path) -> None:
    again = build_checkpoints(tmp_path / "b", _tiny_recipe())
    other_seed = build_checkpoints(tmp_path / "c", _tiny_recipe(seed=1))

    hashes = _file_hashes(tiny_checkpoints)
    files = ("config.json", "model.safetensors", "recipe.json")  # no tokenizer: vocab 64 is not byte-level
    assert set(hashes) == {f"{role}/{f}" for role in ("target", "draft") for f in files}
    assert hashes == _file_hashes(again)
    assert hashes["target/model.safetensors"] != _file_hashes(other_seed)["target/model.safetensors"]


def test_target_checkpoint_carries_the_mtp_layer(tiny_checkpoints: Path) -> None:
    config = read_config(tiny_checkpoints / "target")
    assert config.num_nextn_predict_layers == 1 and config.tie_word_embeddings is False
    record = json.loads((tiny_checkpoints / "target" / "recipe.json").read_text())
    assert record["role"] == "target" and record["recipe"]["seed"] == 0

    target = load_target_runner(tiny_checkpoints / "target")
    mtp = load_mtp_runner(tiny_checkpoints / "target", target=target)
    prefix = f"model.layers.{config.num_hidden_layers}."
    assert mtp.owned_names() and all(n.startswith(prefix) for n in mtp.owned_names())
    assert not any(n.startswith(prefix) for n in target.owned_names())
    assert read_config(tiny_checkpoints / "draft").num_nextn_predict_layers == 0


def test_transformers_loads_the_target_and_ignores_mtp_names(tiny_checkpoints: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoints / "target").eval()
    target = load_target_runner(tiny_checkpoints / "target")
    ids = torch.randint(0, 64, (1, 9))
    with torch.inference_mode():
        assert torch.equal(hf(input_ids=ids).logits, target.model(ids).logits)


def test_recipe_validation_names_values() -> None:
    with pytest.raises(ValueError, match="target_steps=0"):
        CheckpointRecipe(target_steps=0)
    with pytest.raises(ValueError, match="seq_len=2"):
        CheckpointRecipe(seq_len=2)
    with pytest.raises(ValueError, match="'gpt2'"):
        model_family("gpt2")
