"""Block-FP8 checkpoints for any engine kind: a copy of a checkpoint with its linear weights quantized, and the
start-up check SGLang's block-FP8 loader makes (the reference engine makes the same one).

`fp8_checkpoint` writes `<src>-fp8-<rows>x<cols>-v<format>` next to a checkpoint once (atomically: a temporary directory
renamed into place), with every quantized weight (`miles_sync.weights.fp8.is_quantized_weight`) in float8_e4m3fn
plus its float32 `weight_scale_inv`, every other tensor and file unchanged, and config.json declaring the
`quantization_config` of DeepSeek-V3 / Qwen3-FP8 checkpoints. An engine serving it serves block FP8, which is how a
job chooses FP8 rollouts: the engine's quantization follows its checkpoint (SGLang's and the reference engine's).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from miles_sync.weights.fp8 import (
    Fp8Block,
    block_from_config,
    block_shard_problems,
    quantization_config,
    quantize_named,
)
from miles_sync.wire.text import raise_if

__all__ = ["default_block", "fp8_checkpoint", "fp8_serving_problems"]

_WEIGHTS_FILE = "model.safetensors"
_FORMAT = 1  # bump when `quantize` changes its bytes: a copy built by another version is never reused


def fp8_checkpoint(src: str | os.PathLike, spec: Fp8Block) -> Path:
    """The block-FP8 copy of checkpoint directory `src` (built on first use, reused after); its path."""
    from safetensors.torch import load_file, save_file

    src = Path(src)
    rows, cols = spec.block
    dst = src.with_name(f"{src.name}-fp8-{rows}x{cols}-v{_FORMAT}")
    if (dst / _WEIGHTS_FILE).is_file():
        return dst
    config = json.loads((src / "config.json").read_text())
    if block_from_config(config) is not None:
        raise ValueError(f"checkpoint {str(src)!r} is quantized already: {config['quantization_config']}")
    problems = fp8_serving_problems(config, tp_size=1, spec=spec)
    raise_if(problems, what=f"cannot quantize {str(src)!r} to block FP8 {list(spec.block)}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=src.parent))
    try:
        for item in src.iterdir():
            if item.name not in (_WEIGHTS_FILE, "config.json") and item.is_file():
                shutil.copy2(item, tmp / item.name)
        tensors = dict(quantize_named(load_file(str(src / _WEIGHTS_FILE)).items(), spec.block))
        save_file(tensors, str(tmp / _WEIGHTS_FILE))
        config["quantization_config"] = quantization_config(spec)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        try:
            tmp.rename(dst)
        except OSError:  # another process built it first: keep theirs
            if not (dst / _WEIGHTS_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def fp8_serving_problems(config: dict[str, Any], *, tp_size: int, spec: Fp8Block | None = None) -> list[str]:
    """What SGLang's block-FP8 loader refuses for a checkpoint's config.json at `tp_size`, each naming a tensor of
    layer 0 (every layer has its shapes); `spec` overrides the config's own block. Empty when it serves."""
    spec = block_from_config(config) if spec is None else spec
    if spec is None:
        return []
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    moe = config.get("moe_intermediate_size") if config.get("num_experts") else None
    return block_shard_problems(
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        tp_size=tp_size,
        block=spec.block,
        moe_intermediate_size=None if moe is None else int(moe),
    )


def default_block(config: dict[str, Any], *, tp_size: int) -> Fp8Block:
    """128x128, or the largest square power-of-two block below it that every TP partition of the model divides
    (SGLang's size check passes); 128x128 when none does (the check then names what fails)."""
    for size in (128, 64, 32, 16):
        spec = Fp8Block(block=(size, size))
        if not fp8_serving_problems(config, tp_size=tp_size, spec=spec):
            return spec
    return Fp8Block()
