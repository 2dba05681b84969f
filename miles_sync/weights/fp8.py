"""Block-FP8 weights: quantize, dequantize, which HF tensors are quantized, and SGLang's block/shard size rule.

The layout is the one DeepSeek-V3 and Qwen3-*-FP8 checkpoints ship and SGLang's block-FP8 path loads
(`sglang/srt/layers/quantization/fp8.py`, `Fp8LinearMethod.create_fp8_weight_`): a linear weight `<m>.weight` of
shape (..., N, K) is stored as `float8_e4m3fn` of the same shape, plus `<m>.weight_scale_inv` in float32 of shape
(..., ceil(N / block_n), ceil(K / block_k)), one scale per block. The scale is the *dequantization multiplier*:
w ~= float(q) * scale_inv, with scale_inv = amax(|block|) / 448 (the e4m3 maximum). Edge blocks are ragged (the
last block row/column covers what is left); an all-zero block gets the floor amax 1e-4 (SGLang's
`per_block_cast_to_fp8`), so its codes are zeros and it dequantizes to exact zeros.

Which tensors: the decoder's linear weights (attention q/k/v/o, DeepSeek's MLA projections, the MLP's
gate/up/down, every routed and shared expert's gate/up/down, an MTP layer's decoder block). Embeddings, the LM
head, norms, biases, the MoE router (`mlp.gate`) and the MTP head's own projections (`eh_proj`, `enorm`, `hnorm`,
`shared_head`) keep their dtype, as in the published FP8 checkpoints.

Everything here is pure and deterministic on one device: the same input bytes give the same FP8 bytes, so a
trainer's checksums of what it sent are exact.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles_sync.wire.codec import WireEnum

__all__ = [
    "DEFAULT_BLOCK",
    "FP8_DTYPE",
    "Fp8Block",
    "Quantization",
    "SCALE_DTYPE",
    "block_from_config",
    "dequantize",
    "is_quantized_weight",
    "quantize",
    "scale_name",
    "scale_shape",
    "sglang_dequantized",
    "weight_name",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_DTYPE = torch.float32
SCALE_SUFFIX = "_scale_inv"  # "<m>.weight" -> "<m>.weight_scale_inv"
DEFAULT_BLOCK = (128, 128)
_AMAX_FLOOR = 1e-4  # SGLang's per_block_cast_to_fp8 clamp: an all-zero block still gets a finite scale

# Linear weights an FP8 checkpoint stores quantized: the decoder block's projections and the experts'.
_QUANTIZED = re.compile(
    r".+\.(?:self_attn\.(?:(?:q|k|v|o|q_a|q_b|kv_b)_proj|kv_a_proj_with_mqa)|mlp\.(?:gate|up|down)_proj"
    r"|mlp\.(?:experts\.\d+|shared_experts?)\.(?:gate|up|down)_proj)\.weight"
)


class Quantization(WireEnum):
    """What a sync sends of the quantized linear weights: the export's dtype, or block FP8 with scales."""

    NONE = "none"
    FP8_BLOCK = "fp8_block"


@dataclass(frozen=True, kw_only=True)
class Fp8Block:
    """Block-FP8 quantization with blocks of `block` = (rows, cols) of a weight's last two dims."""

    block: tuple[int, int] = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        block = tuple(self.block)
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise ValueError(f"fp8 block {list(self.block)} must be two positive integers [rows, cols]")
        object.__setattr__(self, "block", block)


def is_quantized_weight(hf_name: str) -> bool:
    """Whether an FP8 checkpoint stores `hf_name` as an FP8 weight with a `weight_scale_inv` beside it."""
    return _QUANTIZED.fullmatch(hf_name) is not None


def scale_name(weight: str) -> str:
    """`<m>.weight` -> `<m>.weight_scale_inv`."""
    return weight + SCALE_SUFFIX


def weight_name(scale: str) -> str | None:
    """`<m>.weight_scale_inv` -> `<m>.weight`; None for any other name."""
    return scale.removesuffix(SCALE_SUFFIX) if scale.endswith(".weight" + SCALE_SUFFIX) else None


def scale_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """Shape of the scales of a weight of `shape` (at least 2-D): leading dims kept, the last two divided by the
    block, rounded up (ragged edge blocks get a scale of their own)."""
    if len(shape) < 2:
        raise ValueError(f"a block-FP8 weight has at least 2 dims, got shape {tuple(shape)}")
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def quantize(weight: torch.Tensor, block: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 codes of `weight`'s shape, float32 scale_inv of `scale_shape`). Pure; computed in float32 on the
    weight's device. Non-finite inputs are refused (they would poison their block's scale)."""
    if not weight.is_floating_point():
        raise ValueError(f"cannot quantize a {weight.dtype} tensor to FP8")
    *lead, n, k = weight.shape if weight.dim() >= 2 else (None, None)
    if n is None:
        raise ValueError(f"a block-FP8 weight has at least 2 dims, got shape {tuple(weight.shape)}")
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    x = weight.detach().to(torch.float32).reshape(-1, n, k)
    if nb * bn != n or kb * bk != k:  # ragged edge blocks: zero padding never raises a block's amax
        padded = x.new_zeros((x.shape[0], nb * bn, kb * bk))
        padded[:, :n, :k] = x
        x = padded
    blocks = x.view(x.shape[0], nb, bn, kb, bk)
    # max(|x|) per block as two reductions: no full-size temporary.
    amax = torch.maximum(blocks.amax(dim=(2, 4), keepdim=True), blocks.amin(dim=(2, 4), keepdim=True).neg())
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"cannot quantize a tensor of shape {tuple(weight.shape)} holding inf or NaN to FP8")
    scale = amax.clamp(min=_AMAX_FLOOR) / FP8_MAX
    # |x| * (1 / scale) <= 448 up to one float32 rounding, which rounds to 448 in e4m3 (overflow starts at 464).
    codes = (blocks * scale.reciprocal()).to(FP8_DTYPE)
    codes = codes.view(x.shape[0], nb * bn, kb * bk)[:, :n, :k].reshape(weight.shape).contiguous()
    return codes, scale.reshape(*lead, nb, kb).contiguous()


def dequantize(
    codes: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int], *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """codes * scale_inv per block, cast to `dtype`: SGLang's `block_quant_dequant` (float32 product, one cast)."""
    if tuple(scale_inv.shape) != scale_shape(codes.shape, block):
        raise ValueError(
            f"scale_inv of shape {tuple(scale_inv.shape)} does not fit weight {tuple(codes.shape)} with block "
            f"{list(block)} (expected {scale_shape(codes.shape, block)})"
        )
    n, k = codes.shape[-2:]
    bn, bk = block
    if n % bn == 0 and k % bk == 0:  # whole blocks: broadcast each scale over its block (the same products)
        lead = codes.shape[:-2]
        blocks = codes.reshape(-1, n // bn, bn, k // bk, bk).to(torch.float32)
        product = blocks * scale_inv.reshape(-1, n // bn, 1, k // bk, 1).to(torch.float32)
        return product.to(dtype).reshape(*lead, n, k)
    scales = scale_inv.to(torch.float32).repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return (codes.to(torch.float32) * scales[..., :n, :k]).to(dtype)


def quantize_named(named: Iterable[tuple[str, torch.Tensor]], block: Sequence[int]) -> list[tuple[str, torch.Tensor]]:
    """The tensors as an FP8 checkpoint holds them, in order: each quantized weight followed by its scale, every
    other tensor as it is."""
    out = []
    for name, tensor in named:
        if is_quantized_weight(name):
            codes, scales = quantize(tensor, block)
            out += [(name, codes), (scale_name(name), scales)]
        else:
            out.append((name, tensor))
    return out


def quantization_config(spec: Fp8Block) -> dict[str, Any]:
    """The `quantization_config` entry of an FP8 checkpoint's config.json (DeepSeek-V3 / Qwen3-FP8 keys)."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(spec.block),
    }


def block_from_config(config: Any) -> Fp8Block | None:
    """The block-FP8 spec a checkpoint's config (mapping or transformers config) declares; None when it declares
    no quantization. ValueError for a quantization this module does not serve (per-tensor FP8, other methods)."""
    quant = (
        config.get("quantization_config")
        if isinstance(config, Mapping)
        else getattr(config, "quantization_config", None)
    )
    if quant is None:
        return None
    quant = quant if isinstance(quant, Mapping) else vars(quant)
    method, block = quant.get("quant_method"), quant.get("weight_block_size")
    if method != "fp8" or block is None:
        raise ValueError(
            f"quantization_config {dict(quant)} is not block FP8 (quant_method 'fp8' with weight_block_size); "
            "only block-FP8 checkpoints are served"
        )
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"block FP8 needs activation_scheme 'dynamic', got {quant.get('activation_scheme')!r}")
    return Fp8Block(block=tuple(int(b) for b in block))


def block_shard_problems(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    tp_size: int,
    block: Sequence[int],
    layer: int = 0,
    moe_intermediate_size: int | None = None,
) -> list[str]:
    """What SGLang's block-quant size check refuses for this model at `tp_size`, each naming the tensor: every
    output partition of a merged (q/k/v, gate/up) or column-parallel weight must be a multiple of block_n, and the
    input partition of a row-parallel weight at TP > 1 a multiple of block_k
    (`Fp8LinearMethod.validate_block_quant_shapes`; for experts `Fp8MoEMethod.create_weights`). Pure."""
    bn, bk = block
    prefix = f"model.layers.{layer}"
    kv_rows = max(1, num_key_value_heads // tp_size) * head_dim
    # Merged weights are checked at every TP size (len(output_partition_sizes) > 1), row-parallel ones at TP > 1.
    outputs = {
        f"{prefix}.self_attn.q_proj.weight": num_attention_heads * head_dim // tp_size,
        f"{prefix}.self_attn.k_proj.weight": kv_rows,
        f"{prefix}.self_attn.v_proj.weight": kv_rows,
        f"{prefix}.mlp.gate_proj.weight": intermediate_size // tp_size,
        f"{prefix}.mlp.up_proj.weight": intermediate_size // tp_size,
    }
    inputs = {
        f"{prefix}.self_attn.o_proj.weight": num_attention_heads * head_dim // tp_size,
        f"{prefix}.mlp.down_proj.weight": intermediate_size // tp_size,
    }
    if moe_intermediate_size is not None:
        outputs = {k: v for k, v in outputs.items() if ".mlp." not in k}
        inputs = {k: v for k, v in inputs.items() if ".mlp." not in k}
        outputs[f"{prefix}.mlp.experts.0.gate_proj.weight"] = moe_intermediate_size // tp_size
        outputs[f"{prefix}.mlp.experts.0.up_proj.weight"] = moe_intermediate_size // tp_size
        inputs[f"{prefix}.mlp.experts.0.down_proj.weight"] = moe_intermediate_size // tp_size
    problems = [
        f"{name}: its output partition of {rows} rows at tp_size={tp_size} is not divisible by the FP8 block's "
        f"block_n={bn}"
        for name, rows in outputs.items()
        if rows % bn
    ]
    if tp_size > 1:
        problems += [
            f"{name}: its input partition of {cols} columns at tp_size={tp_size} is not divisible by the FP8 "
            f"block's block_k={bk}"
            for name, cols in inputs.items()
            if cols % bk
        ]
    return problems


def sglang_dequantized(codes: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """What SGLang's weights checker hashes for a block-FP8 parameter: its dequantization to bfloat16
    (`Fp8BlockComparable.dequantize()`), so two (codes, scales) pairs that dequantize equally hash equally."""
    return dequantize(codes, scale_inv, block, dtype=torch.bfloat16)
