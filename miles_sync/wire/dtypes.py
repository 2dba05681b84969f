"""The one dtype table of the wire: which tensor dtypes may travel, and their wire names.

Every path that moves weights (the flattened bucket layout of the distributed path, the tensor payload codec of the
colocated path, the protocol's dtype fields, checksums) accepts exactly these dtypes, so a tensor that one path
accepts is never refused by another. Names are bare torch names ("bfloat16"), as SGLang resolves them; dtypes the
installed torch lacks (newer fp8/fp4 formats, unsigned ints on older releases) are left out.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["config_dtype", "dtype_from_name", "dtype_name"]

_CANDIDATE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)

_DTYPES_BY_NAME: dict[str, torch.dtype] = {
    name: dtype for name in _CANDIDATE_NAMES if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}
_NAMES_BY_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES_BY_NAME.items()}

SUPPORTED_DTYPE_NAMES: tuple[str, ...] = tuple(_DTYPES_BY_NAME)
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_DTYPES_BY_NAME.values())


def dtype_from_name(name: str) -> torch.dtype:
    """Wire name ("bfloat16") -> torch dtype; ValueError naming the value and the allowed names otherwise."""
    dtype = _DTYPES_BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"Unsupported dtype name {name!r}; supported: {', '.join(SUPPORTED_DTYPE_NAMES)}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch dtype -> bare wire name (torch.bfloat16 -> "bfloat16"); ValueError naming the value and the allowed
    names outside the table."""
    name = _NAMES_BY_DTYPE.get(dtype) if isinstance(dtype, torch.dtype) else None
    if name is None:
        raise ValueError(f"Unsupported dtype {dtype}; supported: {', '.join(SUPPORTED_DTYPE_NAMES)}")
    return name


def config_dtype(config: Any) -> torch.dtype:
    """The parameter dtype an HF config declares (`dtype`, or `torch_dtype` in older transformers), float32 when
    it declares none: the dtype an engine serving that checkpoint holds every weight in."""
    dtype = getattr(config, "dtype", None)
    dtype = getattr(config, "torch_dtype", None) if dtype is None else dtype
    if dtype is None:
        return torch.float32
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."))
