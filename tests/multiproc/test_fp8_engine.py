"""The reference engine serves block FP8: FP8 storage plus scales, compute with the dequantized weights, SGLang's
checker semantics (engine names hash the bfloat16 dequantization, hf names the bytes sent), and the sync's
quantization checked against each engine's before anything is sent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_sync.engine.reference.models import read_safetensors
from miles_sync.engine.reference.runner import load_runners, load_target_runner
from miles_sync.engine.reference.weights_checker import WeightsChecker
from miles_sync.sync.quantization import check_fleet_quantization, quantization_problems
from miles_sync.weights.checksum import sglang_parameter_names, sglang_tensor_hash, tensor_checksum
from miles_sync.weights.fp8 import (
    FP8_DTYPE,
    Fp8Block,
    dequantize,
    is_quantized_weight,
    quantize,
    scale_name,
    sglang_dequantized,
)
from miles_sync.weights.fp8_checkpoint import fp8_checkpoint
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.api import ServerInfo
from miles_sync.wire.protocol import ChecksumNames, Role, WeightsCheckerAction, WeightsCheckerRequest

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

SPEC = Fp8Block(block=(32, 32))
IDS = torch.tensor([[1, 5, 9, 30, 2, 17, 40]])
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def fp8_dir(reference_checkpoints: Path) -> Path:
    return fp8_checkpoint(reference_checkpoints / "target", SPEC)


def test_the_fp8_checkpoint_quantizes_exactly_the_linear_weights(reference_checkpoints: Path, fp8_dir: Path):
    original, quantized = read_safetensors(reference_checkpoints / "target"), read_safetensors(fp8_dir)
    assert fp8_checkpoint(reference_checkpoints / "target", SPEC) == fp8_dir  # built once
    for name, tensor in original.items():
        if is_quantized_weight(name):
            codes, scales = quantize(tensor, SPEC.block)
            assert torch.equal(quantized[name].view(torch.uint8), codes.view(torch.uint8))
            assert torch.equal(quantized[scale_name(name)], scales)
        else:
            assert torch.equal(quantized[name], tensor) and scale_name(name) not in quantized
    assert sum(is_quantized_weight(n) for n in original) == 21  # 7 per decoder layer, the MTP layer's included


@pytest.mark.parametrize("layout", [WeightLayout.NONE, WeightLayout.AITER])
def test_an_fp8_runner_computes_with_the_dequantized_weights(reference_checkpoints: Path, fp8_dir: Path, layout):
    target, draft = load_runners(fp8_dir, draft_kind="mtp", layout=layout)
    stored = read_safetensors(fp8_dir)
    assert target.quantization == SPEC and draft.quantization == SPEC
    assert target.expected(Q_PROJ).dtype == FP8_DTYPE
    assert target.expected(scale_name(Q_PROJ)).shape == (4, 4)
    assert "model.layers.2.self_attn.q_proj.weight_scale_inv" in draft.owned_names()
    assert "model.layers.2.eh_proj.weight" in draft.owned_names()  # stays float32
    assert (layout is WeightLayout.AITER) == (Q_PROJ in target.shuffled_names())
    # The same model loaded unquantized with the dequantized weights computes bit-identical logits.
    dequantized = {
        n: dequantize(t, stored[scale_name(n)], SPEC.block) if is_quantized_weight(n) else t
        for n, t in stored.items()
        if not n.endswith("_scale_inv")
    }
    plain = load_target_runner(reference_checkpoints / "target", layout=layout)
    plain.load(dequantized.items())
    plain.finalize_all()
    with torch.inference_mode():
        assert torch.equal(target.model(IDS).logits, plain.model(IDS).logits)


def test_an_fp8_runner_refuses_unquantized_bytes_and_takes_new_fp8_ones(fp8_dir: Path):
    target = load_target_runner(fp8_dir, layout=WeightLayout.AITER)
    with pytest.raises(ValueError, match=rf"{Q_PROJ}: expected shape \(128, 128\) dtype float8_e4m3fn, got .* float32"):
        target.load([(Q_PROJ, torch.zeros(128, 128))])
    weight = torch.randn(128, 128)
    codes, scales = quantize(weight, SPEC.block)
    target.reset_session()
    target.load([(Q_PROJ, codes), (scale_name(Q_PROJ), scales)])
    target.finalize(sorted(target.loaded_in_session()))  # the AITER layout applies to the FP8 codes here
    param = dict(target.model.hf_parameters())[Q_PROJ]
    assert torch.equal(param, dequantize(codes, scales, SPEC.block))


def test_the_checker_answers_sent_bytes_by_hf_name_and_sglang_dequantized_digests_by_engine_name(fp8_dir: Path):
    sent = read_safetensors(fp8_dir)  # what a block-FP8 sync of the checkpoint's weights sends
    target = load_target_runner(fp8_dir, layout=WeightLayout.AITER)
    request = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM)
    hf = WeightsChecker({Role.TARGET: target}).handle(request, roles={Role.TARGET}).ranks[0].checksums
    assert hf[Q_PROJ] == tensor_checksum(sent[Q_PROJ]) and hf[scale_name(Q_PROJ)] == tensor_checksum(
        sent[scale_name(Q_PROJ)]
    )
    engine = WeightsChecker({Role.TARGET: target}, checksum_names=ChecksumNames.ENGINE)
    answered = engine.handle(request, roles={Role.TARGET}).ranks[0].checksums
    assert not any(name.endswith("_scale_inv") for name in answered)
    owned = [n for n in sent if n in target.owned_names() and not n.endswith("_scale_inv")]
    for name, parts in sglang_parameter_names(owned).items():
        if all(is_quantized_weight(p) for p in parts):
            codes = torch.cat([sent[p] for p in parts])
            scales = torch.cat([sent[scale_name(p)] for p in parts])
            assert answered[name] == sglang_tensor_hash(sglang_dequantized(codes, scales, SPEC.block)), name
    assert (
        "model.layers.0.self_attn.qkv_proj.weight" in answered and "model.layers.1.mlp.gate_up_proj.weight" in answered
    )
    # Two (codes, scales) pairs that dequantize equally answer equally (halved codes stay normal e4m3 numbers here,
    # so halving them and doubling the scales is exact), and a different weight answers differently.
    weight = torch.rand(128, 128) + 1.0
    codes, scales = quantize(weight, SPEC.block)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    digests = []
    for pair in ((codes, scales), ((codes.float() / 2).to(FP8_DTYPE), scales * 2), quantize(-weight, SPEC.block)):
        target.reset_session()
        target.load([(Q_PROJ, pair[0]), (scale_name(Q_PROJ), pair[1])])
        target.finalize(sorted(target.loaded_in_session()))
        digests.append(engine.handle(request, roles={Role.TARGET}).ranks[0].checksums[qkv])
    assert digests[0] == digests[1] != digests[2]
    assert not torch.equal(codes.view(torch.uint8), (codes.float() / 2).to(FP8_DTYPE).view(torch.uint8))


FP8_ENGINE = ServerInfo(quantization="fp8", weight_block_size=(32, 32), dtype="float32", model_path="/x")
PLAIN_ENGINE = ServerInfo(dtype="bfloat16", model_path="/x")
NAMES = ("model.embed_tokens.weight", Q_PROJ)


def test_a_sync_refuses_an_engine_of_another_quantization_naming_tensor_and_dtypes():
    def problems(info, quantization, config=None):
        return quantization_problems(
            url="http://e", info=info, config=config, quantization=quantization, exported_names=NAMES
        )

    assert problems(FP8_ENGINE, SPEC) == [] and problems(PLAIN_ENGINE, None) == []
    assert problems(FP8_ENGINE, None) == [
        f"http://e serves {Q_PROJ} as float8_e4m3fn with {Q_PROJ}_scale_inv float32 (block FP8 [32, 32]), but the "
        "sync would send it as float32 without scales (sync.quantization=none)"
    ]
    assert problems(PLAIN_ENGINE, SPEC, config={}) == [
        f"http://e serves {Q_PROJ} as bfloat16, but the sync would send it as float8_e4m3fn with {Q_PROJ}_scale_inv "
        "float32 (sync.quantization=fp8_block, block [32, 32])"
    ]
    assert "blocks of [128, 128]" in problems(FP8_ENGINE, Fp8Block())[0]
    # SGLang leaves `quantization` null for a checkpoint's own: its config.json decides; unreadable: not refused.
    fp8_config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}}
    assert "float8_e4m3fn" in problems(ServerInfo(dtype="auto"), None, config=fp8_config)[0]
    assert problems(ServerInfo(dtype="auto"), SPEC, config=None) == []
    assert "quantization 'awq'" in problems(ServerInfo(quantization="awq"), SPEC)[0]
    with pytest.raises(ValueError, match="quantization mismatch, nothing was sent: http://a serves"):
        check_fleet_quantization([("http://a", FP8_ENGINE, None)], quantization=None, exported_names=NAMES)
