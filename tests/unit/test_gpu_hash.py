"""SGLang's GPU tensor hash computed on the CPU (miles_sync.weights.gpu_hash) against SGLang 0.5.23's own Triton
kernels, run by Triton's CPU interpreter (tests/data/make_gpu_hash_cases.py wrote the vendored answers): every dtype a
checker sees, sizes around the word, block, tile and reduce-chunk boundaries, a transposed tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_sync.weights.checksum import TensorHash, sglang_digest, sglang_tensor_hash
from miles_sync.weights.gpu_hash import sglang_gpu_digest, sglang_gpu_tensor_hash

CASES = json.loads((Path(__file__).parents[1] / "data" / "gpu_hash_cases.json").read_text())["cases"]


def case_tensor(dtype: str, shape: list[int], seed: int) -> torch.Tensor:
    """As make_gpu_hash_cases.case_tensor: seeded random bytes viewed as `dtype`."""
    dt = getattr(torch, dtype)
    numel = 1
    for d in shape:
        numel *= d
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (numel * torch.empty((), dtype=dt).element_size(),), generator=generator)
    return data.to(torch.uint8).view(dt).reshape(shape)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['dtype']}{c['shape']}{'T' if c.get('transposed') else ''}")
def test_the_hash_equals_sglangs_kernel(case):
    tensor = case_tensor(case["dtype"], case["shape"], case["seed"])
    if case.get("transposed"):
        tensor = tensor.t()
    assert sglang_gpu_tensor_hash(tensor) == int(case["hash"])
    assert sglang_gpu_digest(tensor) == case["digest"] == sglang_digest(tensor, TensorHash.GPU_HASH)


def test_every_dtype_and_boundary_is_covered():
    dtypes = {c["dtype"] for c in CASES}
    assert {"bfloat16", "float16", "float32", "float8_e4m3fn", "int8", "uint8", "int32", "int64"} <= dtypes
    nbytes = {_nbytes(c) for c in CASES}
    assert {0, 1, 2, 3, 5, 4 * 8192, 4 * 8193} <= nbytes  # empty, sub-word, one tile, one word over it
    assert max(nbytes) > 4 * 8192 * 1024  # more tiles than one reduce chunk: the two-level reduction


def _nbytes(case) -> int:
    numel = 1
    for d in case["shape"]:
        numel *= d
    return numel * torch.empty((), dtype=getattr(torch, case["dtype"])).element_size()


def test_one_flipped_bit_changes_the_digest_and_it_is_not_sha256():
    tensor = case_tensor("bfloat16", [64, 64], 3)
    flipped = tensor.clone()
    flipped.view(torch.int16)[17, 5] ^= 1
    assert sglang_gpu_digest(tensor) != sglang_gpu_digest(flipped)
    assert sglang_gpu_digest(tensor) != sglang_tensor_hash(tensor)  # the CPU server's answer for the same bytes


def test_a_view_hashes_like_its_contiguous_copy():
    base = case_tensor("float32", [64, 96], 4)
    assert sglang_gpu_digest(base.t()) == sglang_gpu_digest(base.t().contiguous())
    assert sglang_gpu_digest(base[:, 1::2]) == sglang_gpu_digest(base[:, 1::2].contiguous())


def test_the_constants_are_the_released_wheels(sglang_wheel):
    """Re-derived from the sglang 0.5.23 wheel: the kernel's constants and launch defaults, CUDA tensors routed to
    it by tensor_hash, and the checker's 16-hex format. A new SGLang that changes any of them fails here."""
    import re
    import zipfile

    from miles_sync.weights import gpu_hash

    with zipfile.ZipFile(sglang_wheel("0.5.23")) as wheel:
        kernel = wheel.read("sglang/kernels/ops/memory/gpu_tensor_hash.py").decode()
        mm_utils = wheel.read("sglang/srt/managers/mm_utils.py").decode()
        checker = wheel.read("sglang/srt/utils/weight_checker.py").decode()

    def constant(name: str) -> int:
        return int(re.search(rf"^{name} = (0x[0-9A-Fa-f]+)$", kernel, re.M).group(1), 16)

    def default(name: str) -> int:
        return int(re.search(rf"{name}: int = (0x[0-9A-Fa-f]+|\d+)", kernel).group(1), 0)

    assert (constant("FMIX32_C1"), constant("FMIX32_C2")) == (int(gpu_hash._FMIX_C1), int(gpu_hash._FMIX_C2))
    assert (constant("POS_C1"), constant("POS_C2")) == tuple(position for position, _, _ in gpu_hash._KEYS)
    assert default("seed") == gpu_hash._SEED and default("tile_words") == gpu_hash._TILE_WORDS
    assert "((seed * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF" in kernel
    assert "_rotl32(iu, 15)" in kernel and "_rotl32(iu, 13)" in kernel
    assert "return gpu_tensor_hash(tensor.cuda())" in mm_utils
    assert 'return f"{tensor_hash(t):016x}"' in checker
