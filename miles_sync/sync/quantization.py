"""The sync's quantization against each engine's, checked before the pause: a sync never sends unquantized weights
to a block-FP8 engine, block-FP8 ones to an engine serving the model's dtype, or scales of another block size.

What an engine serves comes from what it reported at connect (`ServerInfo.quantization`, `weight_block_size`,
`dtype`; the reference engine reports all three) or, where the server leaves them out (SGLang detects a checkpoint's
quantization itself and reports `quantization` null), from the `quantization_config` of the config.json under its
`model_path` when that file is readable here. An engine whose quantization cannot be known is not refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from miles_sync.weights.fp8 import FP8_DTYPE, Fp8Block, block_from_config, is_quantized_weight, scale_name
from miles_sync.wire.api import ServerInfo
from miles_sync.wire.dtypes import dtype_name
from miles_sync.wire.text import raise_if

__all__: list[str] = []  # nothing here is imported from outside miles_sync.sync

_FP8 = dtype_name(FP8_DTYPE)
_UNKNOWN = object()


def engine_quantization(info: ServerInfo, *, config: Mapping[str, Any] | None) -> Fp8Block | None | object:
    """The block-FP8 spec the engine serves, None when it serves the model's dtype, or `_UNKNOWN`. Raises
    ValueError for a quantization other than block FP8 (nothing here can feed it)."""
    if info.quantization is not None and info.quantization != "fp8":
        raise ValueError(f"it serves quantization {info.quantization!r}; a sync sends none or block FP8")
    if info.quantization == "fp8" and info.weight_block_size is not None:
        return Fp8Block(block=tuple(int(b) for b in info.weight_block_size))
    if config is None:
        return _UNKNOWN
    spec = block_from_config(config)
    if spec is None and info.quantization == "fp8":
        raise ValueError("it serves per-tensor FP8 (quantization 'fp8' without a weight_block_size)")
    return spec


def quantization_problems(
    *,
    url: str,
    info: ServerInfo,
    config: Mapping[str, Any] | None,
    quantization: Fp8Block | None,
    exported_names: Iterable[str],
) -> list[str]:
    """Why this engine cannot load what the sync sends, naming the first quantized weight of the export and both
    dtypes (or both scale blocks); empty when it can, or when its quantization is unknown. Pure."""
    try:
        served = engine_quantization(info, config=config)
    except ValueError as exc:
        return [f"{url}: {exc}"]
    name = next((n for n in exported_names if is_quantized_weight(n)), None)
    if served is _UNKNOWN or name is None:
        return []
    model_dtype = info.dtype if info.dtype not in (None, "auto") else "the model's dtype"
    if served is None and quantization is not None:
        return [
            f"{url} serves {name} as {model_dtype}, but the sync would send it as {_FP8} with {scale_name(name)} "
            f"float32 (sync.quantization=fp8_block, block {list(quantization.block)})"
        ]
    if served is not None and quantization is None:
        return [
            f"{url} serves {name} as {_FP8} with {scale_name(name)} float32 (block FP8 {list(served.block)}), but "
            f"the sync would send it as {model_dtype} without scales (sync.quantization=none)"
        ]
    if served is not None and quantization is not None and served.block != quantization.block:
        return [
            f"{url} expects {scale_name(name)} for blocks of {list(served.block)}, but the sync would send scales "
            f"for blocks of {list(quantization.block)} (sync.fp8_block)"
        ]
    return []


def check_fleet_quantization(
    infos: Sequence[tuple[str, ServerInfo | None, Mapping[str, Any] | None]],
    *,
    quantization: Fp8Block | None,
    exported_names: Sequence[str],
) -> None:
    """`quantization_problems` over every engine ((url, info, its config.json or None)); ValueError naming all."""
    problems = [
        problem
        for url, info, config in infos
        if info is not None
        for problem in quantization_problems(
            url=url, info=info, config=config, quantization=quantization, exported_names=exported_names
        )
    ]
    raise_if(problems, what="quantization mismatch, nothing was sent")
