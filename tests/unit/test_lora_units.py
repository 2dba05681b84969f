"""LoRA sync's pure parts: config and spec validation, PEFT naming and config, payload encoding with SGLang's
checksums, the reference engine's checksum verdicts and target-module names, and the launch flags."""

from __future__ import annotations

import hashlib

import pytest
import torch

from miles_sync.config import LoraSyncConfig, SyncConfig, SyncMode
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.engine.reference.lora import AdapterConfig, checksum_problems, hf_target_modules, tensor_sha256
from miles_sync.export.lora import peft_adapter_config, peft_names
from miles_sync.megatron.lora import LoraSpec
from miles_sync.sync.adapter import encode_adapter
from miles_sync.sync.lora import adapter_name
from miles_sync.weights.fp8 import Quantization
from miles_sync.wire.payload import decode_payload
from miles_sync.wire.protocol import LoadFormat

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def _named() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {A: torch.randn(4, 16, generator=generator), B: torch.randn(8, 4, generator=generator)}


def test_sglang_checksum_is_plain_sha256_of_the_raw_bytes():
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # non-contiguous: hashed as its values in order
    assert tensor_sha256(tensor) == hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def test_checksum_verdicts_name_value_diffs_missing_and_extra_tensors():
    named = _named()
    expected = {name: tensor_sha256(t) for name, t in named.items()}
    assert checksum_problems(named, expected, tp_rank=1) is None
    corrupt = {**named, A: named[A] + 1}
    message = checksum_problems(corrupt, expected, tp_rank=1)
    assert message.startswith("[LORA-CHECK] rank1 adapter sync MISMATCH of 2 expected: 1 value-diff") and A in message
    assert "1 missing" in checksum_problems({B: named[B]}, expected, tp_rank=0)
    assert "1 extra" in checksum_problems({**named, "x": named[B]}, expected, tp_rank=0)


@pytest.mark.parametrize("flatten_min_bytes, load_format", [(2**20, None), (0, LoadFormat.FLATTENED_BUCKET)])
def test_encoded_adapter_carries_one_full_copy_per_tp_rank_and_sglang_checksums(flatten_min_bytes, load_format):
    named = _named()
    payload, kept = encode_adapter(named, config_dict={"r": 4}, tp_sizes=[2, 1, 2], flatten_min_bytes=flatten_min_bytes)
    assert payload.load_format is load_format and sorted(payload.payloads) == [1, 2]
    assert [len(payload.payloads[tp]) for tp in (1, 2)] == [1, 2]
    assert payload.checksums == {name: tensor_sha256(t) for name, t in named.items()}
    assert payload.num_bytes == (4 * 16 + 8 * 4) * 4 and payload.num_tensors == 2 and kept
    form = None if load_format is None else load_format.value
    for one in payload.payloads[2]:
        decoded = dict(decode_payload(one, load_format=form, is_adapter=True))
        assert decoded.keys() == named.keys() and all(torch.equal(decoded[n], named[n]) for n in named)
    request = payload.request(name=adapter_name("policy", "3"), tp_size=2)
    assert request.lora_name == "policy-v3" and request.expected_checksums == payload.checksums
    with pytest.raises(ValueError, match="not 4"):
        payload.request(name="policy", tp_size=4)
    with pytest.raises(ValueError, match="no tensors"):
        encode_adapter({}, config_dict={}, tp_sizes=[1], flatten_min_bytes=0)


def test_lora_spec_adapts_fused_modules_whole():
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "down_proj"))
    assert spec.megatron_modules == {"linear_qkv", "linear_fc2"} and spec.scale == 2.0
    with pytest.raises(ValueError, match=r"megatron fuses \['gate_proj', 'up_proj'\]"):
        LoraSpec(rank=4, alpha=8.0, target_modules=("gate_proj",))
    with pytest.raises(ValueError, match="rank=0.*not adaptable"):
        LoraSpec(rank=0, alpha=8.0, target_modules=("lm_head",))


def test_peft_names_and_config_read_back_as_the_engine_reads_them():
    assert peft_names("model.layers.1.mlp.down_proj.weight") == (
        "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight",
        "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight",
    )
    spec = LoraSpec(rank=8, alpha=16.0, target_modules=("o_proj", "q_proj", "k_proj", "v_proj"))
    config = AdapterConfig.from_peft(peft_adapter_config(spec), name="policy")
    assert config.rank == 8 and config.scale == 2.0
    assert config.target_modules == {"q_proj", "k_proj", "v_proj", "o_proj"}
    with pytest.raises(ValueError, match="DoRA"):
        AdapterConfig.from_peft({**peft_adapter_config(spec), "use_dora": True}, name="policy")


def test_sglang_target_module_names_map_to_the_reference_models():
    assert hf_target_modules(["qkv_proj", "o_proj"]) == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert len(hf_target_modules(["all"])) == 7
    with pytest.raises(ValueError, match="lm_head"):
        hf_target_modules(["lm_head"])


def test_sync_lora_config_validates_and_gives_the_engines_room():
    lora = LoraSyncConfig(rank=16, target_modules=("q_proj", "v_proj"))
    settings = lora.engine_settings()
    assert settings.max_rank == 16 and settings.target_modules == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="rank=0"):
        LoraSyncConfig(rank=0)
    with pytest.raises(ValueError, match="quantization must be none"):
        SyncConfig(mode=SyncMode.LORA, quantization=Quantization.FP8_BLOCK)
    with pytest.raises(ValueError, match="no mechanism_check"):
        SyncConfig(mode=SyncMode.LORA, mechanism_check=True)
    argv = ReferenceEngineSpec(model_dir="m", lora=settings).command(host="127.0.0.1").argv
    assert argv[argv.index("--enable-lora") :][:6] == (
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--lora-target-modules",
        "q_proj",
        "v_proj",
    )
    assert "--enable-lora" not in ReferenceEngineSpec(model_dir="m").command(host="127.0.0.1").argv
