"""Regenerates tests/data/gpu_hash_cases.json: SGLang 0.5.23's own GPU tensor-hash kernels, run on the CPU by
Triton's interpreter, over tensors rebuilt from a seed (tests/unit/test_gpu_hash.py rebuilds the same ones).

    TRITON_INTERPRET=1 .venv-sglang/bin/python tests/data/make_gpu_hash_cases.py   # ~4 min (the 33 MB case)

The kernel module is loaded from its file (importing the `sglang` package pulls in GPU-only extensions). Two things
of `gpu_tensor_hash` are bypassed, neither changing a bit of the result: its `assert tensor.is_cuda` (the
interpreter runs on CPU tensors), and the uint32 / uint64 buffers, replaced by int32 / int64 ones of the same bits
(CPU torch lacks some uint32 ops; the kernel converts every loaded word to uint32, and the partial sums are stored
and reloaded as 64-bit patterns). The launch constants are `gpu_tensor_hash`'s defaults; `USE_CG` (a cache hint)
is off because the interpreter has no cache modifiers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402

KERNEL = "sglang/kernels/ops/memory/gpu_tensor_hash.py"
OUT = Path(__file__).with_name("gpu_hash_cases.json")
# (dtype, shape, seed): every dtype a checker sees; 0-3 and 5 bytes; one block, one tile and one word over it;
# several tiles; a four-MiB chunk boundary of miles_sync's implementation; more tiles than one reduce chunk (1024).
CASES = [
    ("uint8", [0], 1),
    ("uint8", [1], 2),
    ("uint8", [2], 3),
    ("uint8", [3], 4),
    ("uint8", [5], 5),
    ("int8", [7, 3], 6),
    ("uint8", [1024], 7),
    ("float32", [256], 8),
    ("float32", [8192], 9),
    ("float32", [8193], 10),
    ("bfloat16", [3, 8193], 11),
    ("float16", [129, 257], 12),
    ("float8_e4m3fn", [64, 96], 13),
    ("int32", [24577], 14),
    ("int64", [4099], 15),
    ("bfloat16", [512, 4100], 16),
    ("float32", [1048577], 17),
    ("float32", [8396801], 18),
]


def case_tensor(dtype: str, shape: list[int], seed: int) -> torch.Tensor:
    """The case's tensor: seeded random bytes, viewed as `dtype` (tests/unit/test_gpu_hash.py has the same)."""
    dt = getattr(torch, dtype)
    numel = 1
    for d in shape:
        numel *= d
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (numel * torch.empty((), dtype=dt).element_size(),), generator=generator)
    return data.to(torch.uint8).view(dt).reshape(shape)


def kernel_hash(kernels, tensor: torch.Tensor, seed: int = 0x243F6A88) -> int:
    raw = tensor.contiguous().reshape(-1).view(torch.uint8)
    pad = -raw.numel() % 4
    if pad:
        raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8)])
    words = raw.view(torch.int32)
    n = words.numel()
    if n == 0:
        return 0
    partials = torch.empty(triton.cdiv(n, 8192), dtype=torch.int64)
    kernels.hash_tiles32_kernel_blocked[(partials.numel(),)](
        words,
        partials,
        n,
        seed1=seed & 0xFFFFFFFF,
        seed2=((seed * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF,
        FM_C1=kernels.FMIX32_C1,
        FM_C2=kernels.FMIX32_C2,
        POS_A=kernels.POS_C1,
        POS_B=kernels.POS_C2,
        TILE=8192,
        BLOCK=256,
        USE_CG=False,
    )
    current = partials
    while current.numel() > 1:
        following = torch.empty(triton.cdiv(current.numel(), 1024), dtype=torch.int64)
        kernels.add_tree_reduce_u64_kernel[(following.numel(),)](current, following, current.numel(), CHUNK=1024)
        current = following
    return kernels._final_splitmix64(int(current.item()) & ((1 << 64) - 1))


def main() -> None:
    site = next(Path(p) for p in sys.path if (Path(p) / KERNEL).is_file())
    spec = importlib.util.spec_from_file_location("gpu_tensor_hash", site / KERNEL)
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    cases = []
    for dtype, shape, seed in CASES:
        value = kernel_hash(kernels, case_tensor(dtype, shape, seed))
        cases.append({"dtype": dtype, "shape": shape, "seed": seed, "hash": str(value), "digest": f"{value:016x}"})
        print(dtype, shape, cases[-1]["digest"], flush=True)
    transposed = case_tensor("bfloat16", [96, 64], 19).t()  # the caller hashes its contiguous copy
    value = kernel_hash(kernels, transposed)
    cases.append(
        {
            "dtype": "bfloat16",
            "shape": [96, 64],
            "seed": 19,
            "transposed": True,
            "hash": str(value),
            "digest": f"{value:016x}",
        }
    )
    OUT.write_text(json.dumps({"sglang": "0.5.23", "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
