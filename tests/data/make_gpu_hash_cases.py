"""Writes tests/data/gpu_hash_cases.json: SGLang 0.5.23's own GPU tensor hash, executed on the CPU by Triton's
interpreter, over tensors rebuilt from a small recipe (tests/unit/test_gpu_hash.py rebuilds the same tensors).

    TRITON_INTERPRET=1 .venv-sglang/bin/python tests/data/make_gpu_hash_cases.py   # from the repository root, ~5 min

How the answers are produced:

- The kernel module (sglang/kernels/ops/memory/gpu_tensor_hash.py) is loaded from its file by path: importing the
  `sglang` package would pull in GPU-only extensions, while that file needs only torch and triton.
- The unmodified public `gpu_tensor_hash` is called (its default seed, tile_words=8192, block_words=256,
  reduce_chunk=1024, num_warps/num_stages=4, use_cg=True). The single thing bypassed is the `assert t.is_cuda` in it
  and in `_as_uint32_words`: the CPU tensor is handed over as a torch.Tensor subclass whose `is_cuda` property says
  True. Nothing else sees that property: `.contiguous()`, the zero padding and the uint32 view run on the CPU copy
  exactly as on a GPU (both little-endian), the buffers it allocates follow `tb.device` (CPU), and the interpreter
  runs both kernels, grids and the reduction loop as written. The kernels are pure integer functions of the words,
  so where the bytes live cannot change a bit of the answer.
- As an independent cross-check of that bypass, cases of at most a few tiles are hashed a second time by
  `launched_hash` below, which does the word conversion here on plain CPU tensors and launches the two kernels with
  the grids and constants `gpu_tensor_hash` uses; both must agree.
- `str(value)` is the 64-bit value `gpu_tensor_hash` returns and `digest` is `f"{value:016x}"`, which is what
  SGLang's weights checker reports for a CUDA tensor (`_hash_tensor` in sglang/srt/utils/weight_checker.py, via
  `tensor_hash` in sglang/srt/managers/mm_utils.py, which routes CUDA tensors to `gpu_tensor_hash`).

A case's tensor: `seed` -> that many random bytes from torch.Generator().manual_seed(seed) (torch.randint, uint8),
`hex` -> those bytes, `zeros` -> zero bytes; viewed as `dtype` and reshaped to `shape`; then `view` (if present)
is applied: "t" (transpose), "cols" ([:, 1::2]) or "offset1" (a uint8 slice [1:] of one more byte, so the data
starts at an odd address).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared case recipe
from gpu_hash_recipe import case_tensor  # noqa: E402

KERNEL_FILE = "sglang/kernels/ops/memory/gpu_tensor_hash.py"
OUT = Path(__file__).with_name("gpu_hash_cases.json")
TILE, BLOCK, REDUCE_CHUNK = 8192, 256, 1024  # gpu_tensor_hash's defaults, in 32-bit words / partials
CROSS_CHECK_MAX_WORDS = 4 * TILE

# (name, dtype, shape, recipe, view): recipe is {"seed": n}, {"hex": "..."} or {"zeros": True}.
CASES: list[tuple[str, str, list[int], dict[str, Any], str | None]] = [
    ("empty", "uint8", [0], {"seed": 1}, None),
    ("empty-2d-bf16", "bfloat16", [0, 4096], {"seed": 1}, None),
    ("1-byte", "uint8", [1], {"seed": 2}, None),
    ("2-bytes", "uint8", [2], {"seed": 3}, None),
    ("3-bytes", "uint8", [3], {"seed": 4}, None),
    ("5-bytes", "uint8", [5], {"seed": 5}, None),
    ("hex-010203", "uint8", [3], {"hex": "010203"}, None),
    ("hex-01020300", "uint8", [4], {"hex": "01020300"}, None),  # same words as the one above: same hash
    ("int8-21-bytes", "int8", [7, 3], {"seed": 6}, None),
    ("one-block", "uint8", [4 * BLOCK], {"seed": 7}, None),
    ("block-plus-1-word", "int8", [4 * BLOCK + 4], {"seed": 8}, None),
    ("fp16-odd-halves", "float16", [255], {"seed": 9}, None),
    ("one-tile", "float32", [TILE], {"seed": 10}, None),
    ("tile-plus-1-word", "float32", [TILE + 1], {"seed": 11}, None),
    ("tile-plus-1-byte", "uint8", [4 * TILE + 1], {"seed": 12}, None),
    ("zeros-one-tile", "float32", [TILE], {"zeros": True}, None),
    ("int32-3-tiles-plus-1", "int32", [3 * TILE + 1], {"seed": 13}, None),
    ("int64-2-tiles", "int64", [TILE], {"seed": 14}, None),
    ("int64-odd", "int64", [4099], {"seed": 15}, None),
    ("bf16-2d", "bfloat16", [3, 8193], {"seed": 16}, None),
    ("fp16-2d", "float16", [129, 257], {"seed": 17}, None),
    ("fp8-2d", "float8_e4m3fn", [64, 96], {"seed": 18}, None),
    ("fp8-odd", "float8_e4m3fn", [8193], {"seed": 19}, None),
    ("bf16-129-tiles", "bfloat16", [1024, 2049], {"seed": 20}, None),
    ("fp32-1025-tiles", "float32", [REDUCE_CHUNK * TILE + 1], {"seed": 21}, None),  # two reduce passes
    ("bf16-transposed", "bfloat16", [96, 64], {"seed": 22}, "t"),
    ("fp32-every-other-column", "float32", [64, 96], {"seed": 23}, "cols"),
    ("uint8-odd-address", "uint8", [4 * BLOCK + 7], {"seed": 24}, "offset1"),
]


class _ClaimsCuda(torch.Tensor):
    """A CPU tensor whose `is_cuda` says True: gets past `assert t.is_cuda` and changes nothing else."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def load_kernels() -> Any:
    site = next(Path(p) for p in sys.path if (Path(p) / KERNEL_FILE).is_file())
    spec = importlib.util.spec_from_file_location("sglang_gpu_tensor_hash", site / KERNEL_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sglang_hash(kernels: Any, tensor: torch.Tensor) -> int:
    """SGLang's public gpu_tensor_hash, unmodified, on a CPU tensor (see the module docstring)."""
    return kernels.gpu_tensor_hash(tensor.as_subclass(_ClaimsCuda))


def launched_hash(kernels: Any, tensor: torch.Tensor, seed: int = 0x243F6A88) -> int:
    """Cross-check: the caller's word conversion done here and the two kernels launched as gpu_tensor_hash does."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8)
    pad = (4 - (raw.numel() & 3)) & 3
    if pad:
        raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8)])
    words = raw.clone().view(torch.uint32)  # clone: a fresh, 4-byte-aligned buffer
    n = words.numel()
    if n == 0:
        return 0
    partials = torch.empty(triton.cdiv(n, TILE), dtype=torch.uint64)
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
        TILE=TILE,
        BLOCK=BLOCK,
        USE_CG=True,
        num_warps=4,
        num_stages=4,
    )
    current = partials
    while current.numel() > 1:
        following = torch.empty(triton.cdiv(current.numel(), REDUCE_CHUNK), dtype=torch.uint64)
        kernels.add_tree_reduce_u64_kernel[(following.numel(),)](
            current, following, current.numel(), CHUNK=REDUCE_CHUNK
        )
        current = following
    return kernels._final_splitmix64(int(current.item()))


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (Triton's CPU interpreter)"
    kernels = load_kernels()
    cases = []
    for name, dtype, shape, recipe, view in CASES:
        tensor = case_tensor(dtype, shape, recipe, view)
        started = time.perf_counter()
        value = sglang_hash(kernels, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= 4 * CROSS_CHECK_MAX_WORDS:
            assert launched_hash(kernels, tensor) == value, name
        case: dict[str, Any] = {"name": name, "dtype": dtype, "shape": shape, **recipe}
        if view is not None:
            case["view"] = view
        case.update(nbytes=nbytes, hash=str(value), digest=f"{value:016x}")
        cases.append(case)
        print(f"{name:26} {nbytes:>10} bytes  {case['digest']}  {time.perf_counter() - started:6.1f} s", flush=True)
    document = {
        "sglang": "0.5.23",
        "source": KERNEL_FILE + " (gpu_tensor_hash), run by TRITON_INTERPRET=1 with triton " + triton.__version__,
        "cases": cases,
    }
    lines = ",\n".join("  " + json.dumps(case) for case in cases)
    header = json.dumps({key: document[key] for key in ("sglang", "source")})[:-1]
    OUT.write_text(f'{header}, "cases": [\n{lines}\n]}}\n')  # one case per line


if __name__ == "__main__":
    main()
