"""The tensors of the vendored GPU-hash cases (tests/data/gpu_hash_cases.json), built the same way by the script
that wrote the answers (tests/data/make_gpu_hash_cases.py, under .venv-sglang) and by tests/unit/test_gpu_hash.py."""

from __future__ import annotations

import math
from typing import Any

import torch


def case_tensor(dtype: str, shape: list[int], recipe: dict[str, Any], view: str | None = None) -> torch.Tensor:
    """Bytes from `recipe` ({"seed": n}: that many seeded random bytes, {"hex": "..."}, or {"zeros": True}),
    viewed as `dtype` and `shape`, then `view`: "t" (transposed), "cols" ([:, 1::2]) or "offset1" (a uint8
    slice [1:] of one more byte, so the data starts at an odd address)."""
    dt = getattr(torch, dtype)
    nbytes = math.prod(shape) * torch.empty((), dtype=dt).element_size()
    if view == "offset1":
        nbytes += 1
    if "hex" in recipe:
        data = torch.tensor(list(bytes.fromhex(recipe["hex"])), dtype=torch.uint8)
    elif recipe.get("zeros"):
        data = torch.zeros(nbytes, dtype=torch.uint8)
    else:
        generator = torch.Generator().manual_seed(recipe["seed"])
        data = torch.randint(0, 256, (nbytes,), generator=generator, dtype=torch.uint8)
    assert data.numel() == nbytes, (dtype, shape, recipe)
    if view == "offset1":
        return data[1:]
    tensor = data.view(dt).reshape(shape)
    if view == "t":
        return tensor.t()
    if view == "cols":
        return tensor[:, 1::2]
    assert view is None, view
    return tensor
