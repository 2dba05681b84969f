"""Block FP8: quantize/dequantize round trips within the e4m3 bound (random and adversarial blocks), the tensors an
FP8 checkpoint quantizes, SGLang's block/partition size rule, (weight, scale) units in the bucket plan and the pack
stream, and the scale names, shapes and dtypes of published block-FP8 checkpoints (tests/data, header-only)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from miles_sync.export.units import ExportedUnit, quantize_unit, quantized_unit_meta, units_from_hf_tensors
from miles_sync.sync.buffers import FreshBuffers
from miles_sync.sync.packing import PackStream, bucket_tensors
from miles_sync.sync.plan import plan_buckets
from miles_sync.weights.checksum import tensor_checksum
from miles_sync.weights.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Block,
    block_from_config,
    dequantize,
    is_quantized_weight,
    quantization_config,
    quantize,
    scale_name,
    scale_shape,
)
from miles_sync.weights.fp8_checkpoint import default_block, fp8_serving_problems
from miles_sync.wire.bucket import AtomicUnit, TensorMeta

HEADERS = Path(__file__).parent.parent / "data" / "fp8_checkpoint_headers.json"
_SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "BF16": torch.bfloat16}


def e4m3_error_bound(weight: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """Per-element bound on |weight - dequantize(quantize(weight))|: half an e4m3 ULP at the element's binade (3
    mantissa bits: |w| * 2^-4) or, below the smallest normal, half the subnormal spacing (2^-10 * scale_inv)."""
    n, k = weight.shape[-2:]
    scales = scale_inv.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :n, :k]
    relative = weight.to(torch.float32).abs() * 2.0**-4
    return torch.maximum(relative, scales * 2.0**-10) * (1 + 1e-6) + math.ulp(1.0) * scales


def _assert_round_trip(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = quantize(weight, block)
    assert codes.dtype == FP8_DTYPE and codes.shape == weight.shape
    assert scales.dtype == torch.float32 and tuple(scales.shape) == scale_shape(weight.shape, block)
    restored = dequantize(codes, scales, block)
    error = (restored - weight.float()).abs()
    bound = e4m3_error_bound(weight, scales, block)
    assert bool((error <= bound).all()), f"max error {error.max()} past the bound at {torch.argmax(error - bound)}"
    return codes, scales


@pytest.mark.parametrize(
    ("shape", "block"),
    [
        ((128, 256), (128, 128)),
        ((70, 100), (32, 32)),
        ((33, 65), (32, 32)),
        ((3, 96, 40), (32, 16)),
        ((1, 1), (128, 128)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_weights_round_trip_within_the_e4m3_bound(shape, block, dtype):
    torch.manual_seed(0)
    weight = (torch.randn(shape) * torch.logspace(-3, 1, shape[-1])).to(dtype)
    codes, scales = _assert_round_trip(weight, block)
    # Each block's amax lands on 448 exactly: the scale is the dequantization multiplier amax / 448.
    padded = torch.zeros(*shape[:-2], scales.shape[-2] * block[0], scales.shape[-1] * block[1])
    padded[..., : shape[-2], : shape[-1]] = weight.float()
    amax = padded.unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0])).abs().amax(dim=(-3, -1))
    torch.testing.assert_close(scales, amax / FP8_MAX, rtol=0, atol=0)
    assert float(codes.float().abs().amax()) == FP8_MAX


def test_zero_blocks_dequantize_to_exact_zeros():
    weight = torch.zeros(64, 96)
    weight[:32, :32] = torch.randn(32, 32)  # one live block; the other five are all zero
    codes, scales = _assert_round_trip(weight, (32, 32))
    restored = dequantize(codes, scales, (32, 32))
    assert torch.equal(restored[32:], torch.zeros(32, 96)) and torch.equal(restored[:, 32:], torch.zeros(64, 64))
    assert bool(torch.isfinite(scales).all()) and float(scales[1, 1]) > 0


def test_one_huge_outlier_costs_only_its_own_block():
    torch.manual_seed(1)
    weight = torch.randn(64, 64) * 1e-3
    weight[5, 7] = 1e6
    codes, scales = _assert_round_trip(weight, (32, 32))
    restored = dequantize(codes, scales, (32, 32))
    assert float(restored[5, 7]) == pytest.approx(1e6, rel=2**-4)
    # The outlier's block flushes its small values; the three other blocks keep e4m3 precision.
    others = (restored - weight).abs()[32:, :]
    assert float(others.max()) <= float(weight[32:].abs().max()) * 2**-4


def test_ragged_edges_get_their_own_scales_and_exact_shapes():
    weight = torch.arange(33 * 65, dtype=torch.float32).reshape(33, 65) / 100
    codes, scales = _assert_round_trip(weight, (32, 32))
    assert scales.shape == (2, 3)
    # The last block row holds one row and the last block column one column: their scales see only those.
    assert float(scales[1, 2]) == pytest.approx(float(weight[32, 64]) / FP8_MAX)
    assert float(scales[0, 2]) == pytest.approx(float(weight[:32, 64].abs().max()) / FP8_MAX)


def test_quantization_is_deterministic_and_refuses_what_it_cannot_encode():
    weight = torch.randn(40, 50)
    first, second = quantize(weight, (16, 16)), quantize(weight.clone(), (16, 16))
    assert torch.equal(first[0].view(torch.uint8), second[0].view(torch.uint8)) and torch.equal(first[1], second[1])
    bad = weight.clone()
    bad[3, 3] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize(bad, (16, 16))
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize(torch.ones(8), (4, 4))
    with pytest.raises(ValueError, match="does not fit"):
        dequantize(first[0], first[1][:, :2], (16, 16))
    with pytest.raises(ValueError, match="two positive integers"):
        Fp8Block(block=(128, 0))


@pytest.mark.parametrize(
    ("name", "quantized"),
    [
        ("model.layers.0.self_attn.q_proj.weight", True),
        ("model.layers.3.self_attn.o_proj.weight", True),
        ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", True),
        ("model.layers.0.mlp.gate_proj.weight", True),
        ("model.layers.0.mlp.down_proj.weight", True),
        ("model.layers.1.mlp.experts.17.up_proj.weight", True),
        ("model.layers.1.mlp.shared_expert.gate_proj.weight", True),
        ("model.layers.1.mlp.shared_experts.down_proj.weight", True),
        ("model.layers.2.self_attn.q_proj.bias", False),
        ("model.layers.1.mlp.gate.weight", False),  # the router
        ("model.layers.0.self_attn.q_norm.weight", False),
        ("model.layers.0.input_layernorm.weight", False),
        ("model.embed_tokens.weight", False),
        ("lm_head.weight", False),
        ("model.layers.2.eh_proj.weight", False),  # the MTP head's own projection
    ],
)
def test_which_tensors_an_fp8_checkpoint_quantizes(name, quantized):
    assert is_quantized_weight(name) is quantized


def test_published_fp8_headers_match_what_the_export_sends():
    """Every tensor of each header: the export's unit for it, quantized, has exactly the header's names, dtypes and
    shapes (weights float8_e4m3fn, scales float32 of ceil-divided shapes, everything else untouched)."""
    headers = json.loads(HEADERS.read_text())
    assert len(headers) == 3
    for checkpoint, header in headers.items():
        entries = {n: e for n, e in header.items() if n != "__metadata__"}
        assert "Reconstructed" in header["__metadata__"]["provenance"]
        expected = {n: (_SAFETENSORS_DTYPES[e["dtype"]], tuple(e["shape"])) for n, e in entries.items()}
        for name, (dtype, shape) in expected.items():
            if name.endswith("_scale_inv"):
                continue
            source = TensorMeta(name=name, shape=shape, dtype=torch.bfloat16)
            sent = quantized_unit_meta(AtomicUnit(key=name, tensors=(source,)), Fp8Block()).tensors
            if dtype == torch.float8_e4m3fn:
                assert [(t.name, t.dtype, t.shape) for t in sent] == [
                    (name, dtype, shape),
                    (scale_name(name), *expected[scale_name(name)]),
                ], checkpoint
            else:
                assert sent == (source,), f"{checkpoint}: {name} must stay {dtype}"
        num_scales = sum(n.endswith("_scale_inv") for n in entries)
        assert num_scales == sum(e["dtype"] == "F8_E4M3" for e in entries.values()) > 0


def _tiny_dense(hidden: int = 64, inter: int = 96) -> dict[str, torch.Tensor]:
    torch.manual_seed(2)
    p = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (128, hidden),
        f"{p}self_attn.q_proj.weight": (hidden, hidden),
        f"{p}self_attn.k_proj.weight": (hidden // 2, hidden),
        f"{p}self_attn.v_proj.weight": (hidden // 2, hidden),
        f"{p}self_attn.o_proj.weight": (hidden, hidden),
        f"{p}input_layernorm.weight": (hidden,),
        f"{p}mlp.gate_proj.weight": (inter, hidden),
        f"{p}mlp.up_proj.weight": (inter, hidden),
        f"{p}mlp.down_proj.weight": (hidden, inter),
        "lm_head.weight": (128, hidden),
    }
    return {n: torch.randn(s) for n, s in shapes.items()}


def test_weight_and_scale_never_straddle_buckets():
    tensors = _tiny_dense()
    units = [quantize_unit(u, Fp8Block(block=(32, 32))) for u in units_from_hf_tensors(tensors, tensors)]
    qkv = next(u for u in units if u.meta.key.endswith("qkv_proj"))
    assert [t.name.rsplit(".", 2)[-2:] for t in qkv.meta.tensors] == [
        ["q_proj", "weight"],
        ["q_proj", "weight_scale_inv"],
        ["k_proj", "weight"],
        ["k_proj", "weight_scale_inv"],
        ["v_proj", "weight"],
        ["v_proj", "weight_scale_inv"],
    ]
    for cap in (1, 3000, 5000, 9000, 10**6):
        plans = list(plan_buckets((u.meta for u in units), cap_bytes=cap))
        bucket_of = {t.name: p.index for p in plans for u in p.units for t in u.tensors}
        for name in tensors:
            if is_quantized_weight(name):
                assert bucket_of[name] == bucket_of[scale_name(name)], (cap, name)
        assert [u.key for p in plans for u in p.units] == [u.meta.key for u in units]
    # Meta only on ranks without tensors (not the export source): same plan, nothing quantized there.
    bare = quantize_unit(ExportedUnit(meta=units_from_hf_tensors(tensors, tensors)[1].meta, tensors=None), Fp8Block())
    assert bare.tensors is None and len(bare.meta.tensors) == 6


def test_the_pack_stream_sends_the_quantized_bytes_and_hashes_them():
    tensors = _tiny_dense()
    spec = Fp8Block(block=(32, 32))
    stream = PackStream(
        units_from_hf_tensors(tensors, tensors),
        cap_bytes=8000,
        buffers=FreshBuffers(device=torch.device("cpu"), shared=False),
        hash_inline=True,
        quantization=spec,
    )
    sent, checksums = {}, {}
    for packed in iter(stream.next_bucket, None):
        sent.update((n, t.clone()) for n, t in bucket_tensors(packed.bucket))
        checksums.update(packed.checksums)
    assert stream.quantize_s > 0
    for name, tensor in tensors.items():
        if not is_quantized_weight(name):
            assert torch.equal(sent[name], tensor)
            continue
        codes, scales = quantize(tensor, spec.block)
        assert torch.equal(sent[name].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(sent[scale_name(name)], scales)
        # Expected digests come from the exact bytes sent: bit-exact against a fresh quantization.
        assert checksums[name] == tensor_checksum(codes) and checksums[scale_name(name)] == tensor_checksum(scales)
    # Linear weights: 1 byte per element plus one float32 per 32x32 block (a quarter of float32 and then some).
    linear = [t for n, t in tensors.items() if is_quantized_weight(n)]
    expected = sum(t.numel() * 4 for n, t in tensors.items() if not is_quantized_weight(n))
    expected += sum(t.numel() for t in linear)
    expected += sum(4 * torch.Size(scale_shape(t.shape, spec.block)).numel() for t in linear)
    assert sum(t.numel() * t.element_size() for t in sent.values()) == expected


_TINY_CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


def test_sglang_refuses_a_partition_that_splits_a_block_naming_the_tensor():
    problems = fp8_serving_problems(_TINY_CONFIG, tp_size=1, spec=Fp8Block())
    # k/v of 2 heads x 32 = 64 rows cannot hold 128-row blocks, even unsplit: q/k/v are one merged weight.
    assert problems == [
        f"model.layers.0.self_attn.{p}_proj.weight: its output partition of 64 rows at tp_size=1 is not divisible "
        "by the FP8 block's block_n=128"
        for p in "kv"
    ]
    # Row-parallel at TP=2: o_proj keeps 64 input columns per rank, down_proj 192; 128-column blocks split both.
    assert fp8_serving_problems(_TINY_CONFIG, tp_size=2, spec=Fp8Block(block=(32, 128))) == [
        f"model.layers.0.{name}: its input partition of {cols} columns at tp_size=2 is not divisible by the FP8 "
        "block's block_k=128"
        for name, cols in (("self_attn.o_proj.weight", 64), ("mlp.down_proj.weight", 192))
    ]
    assert fp8_serving_problems(_TINY_CONFIG, tp_size=2, spec=Fp8Block(block=(32, 32))) == []
    assert default_block(_TINY_CONFIG, tp_size=1).block == (64, 64)
    assert default_block(_TINY_CONFIG, tp_size=2).block == (32, 32)
    real = {**_TINY_CONFIG, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32}
    assert default_block({**real, "num_key_value_heads": 8, "head_dim": 128}, tp_size=8).block == (128, 128)


def test_the_checkpoint_config_round_trips_the_block():
    spec = Fp8Block(block=(32, 32))
    config = {"quantization_config": quantization_config(spec)}
    assert block_from_config(config) == spec and block_from_config({}) is None
    with pytest.raises(ValueError, match="not block FP8"):
        block_from_config({"quantization_config": {"quant_method": "awq"}})
