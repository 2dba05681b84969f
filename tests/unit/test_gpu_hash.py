"""SGLang's GPU tensor hash computed on the CPU (miles_sync.weights.gpu_hash) against SGLang 0.5.23's own Triton
kernels run by Triton's CPU interpreter (tests/data/make_gpu_hash_cases.py wrote the vendored answers): every dtype a
checker sees, 0-5 bytes, the word, block, tile and reduce-chunk boundaries, and non-contiguous tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_hash_recipe import case_tensor

from miles_sync.weights import gpu_hash
from miles_sync.weights.checksum import TensorHash, sglang_digest
from miles_sync.weights.gpu_hash import sglang_gpu_digest, sglang_gpu_tensor_hash

CASES: list[dict[str, Any]] = json.loads((Path(__file__).parents[1] / "data" / "gpu_hash_cases.json").read_text())[
    "cases"
]
SMALL = [case for case in CASES if case["nbytes"] <= 1 << 17]


def tensor_of(case: dict[str, Any]) -> torch.Tensor:
    recipe = {key: case[key] for key in ("seed", "hex", "zeros") if key in case}
    tensor = case_tensor(case["dtype"], case["shape"], recipe, case.get("view"))
    assert tensor.numel() * tensor.element_size() == case["nbytes"]
    return tensor


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_the_hash_equals_sglangs_kernel(case):
    tensor = tensor_of(case)
    assert sglang_gpu_tensor_hash(tensor) == int(case["hash"])
    assert sglang_gpu_digest(tensor) == case["digest"] == f"{int(case['hash']):016x}"
    assert sglang_digest(tensor, TensorHash.GPU_HASH) == case["digest"]  # the route a GPU server's checks take


@pytest.mark.parametrize("chunk", [8192, 16384])
def test_chunking_does_not_change_the_hash(monkeypatch, chunk):
    """With one- and two-tile chunks, every multi-tile case spans several chunks, a short last one included."""
    monkeypatch.setattr(gpu_hash, "_CHUNK_WORDS", chunk)
    for case in SMALL + [c for c in CASES if c["name"] == "bf16-129-tiles"]:
        assert sglang_gpu_tensor_hash(tensor_of(case)) == int(case["hash"]), case["name"]


def test_the_cases_cover_every_dtype_and_boundary():
    assert {case["dtype"] for case in CASES} >= {
        "bfloat16",
        "float16",
        "float32",
        "float8_e4m3fn",
        "int8",
        "uint8",
        "int32",
        "int64",
    }
    nbytes = {case["nbytes"] for case in CASES}
    tile, block = 4 * 8192, 4 * 256
    assert {0, 1, 2, 3, 5, block, block + 4, tile, tile + 1, tile + 4} <= nbytes
    assert max(nbytes) > 1024 * tile  # more tiles than one reduce chunk: the reduction runs twice
    assert max(nbytes) > 4 * gpu_hash._CHUNK_WORDS  # several chunks here
    assert {case.get("view") for case in CASES} >= {"t", "cols", "offset1"}


def test_an_empty_tensor_hashes_to_zero():
    for tensor in (torch.empty(0, dtype=torch.uint8), torch.empty(0, 4096, dtype=torch.bfloat16)):
        assert sglang_gpu_tensor_hash(tensor) == 0
        assert sglang_gpu_digest(tensor) == "0000000000000000"


def test_changing_one_byte_changes_the_digest():
    tensor = case_tensor("bfloat16", [64, 64], {"seed": 3})
    digest = sglang_gpu_digest(tensor)
    for position in (0, 1, 4097, tensor.numel() * 2 - 1):
        changed = tensor.clone()
        changed.view(torch.uint8).view(-1)[position] ^= 0x01
        assert sglang_gpu_digest(changed) != digest, position


def test_a_transposed_tensor_hashes_like_its_contiguous_copy():
    base = case_tensor("bfloat16", [96, 64], {"seed": 22})
    assert not base.t().is_contiguous()
    assert sglang_gpu_digest(base.t()) == sglang_gpu_digest(base.t().contiguous())
    assert sglang_gpu_digest(base.t()) != sglang_gpu_digest(base)  # the bytes are reordered, so the hash moves
    assert sglang_gpu_digest(base[:, 1::2]) == sglang_gpu_digest(base[:, 1::2].contiguous())


def test_only_the_bytes_count():
    """The kernel sees words only: the same bytes under another dtype or shape hash alike, and up to three
    trailing zero bytes vanish into the padding (the vendored cases hex-010203 and hex-01020300 show it too)."""
    tensor = case_tensor("float32", [32, 48], {"seed": 5})
    assert sglang_gpu_digest(tensor) == sglang_gpu_digest(tensor.view(torch.int32).reshape(48, 32))
    three = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert sglang_gpu_digest(three) == sglang_gpu_digest(torch.tensor([1, 2, 3, 0], dtype=torch.uint8))
    assert sglang_gpu_digest(three) != sglang_gpu_digest(torch.tensor([1, 2, 3, 0, 0, 0, 0, 0], dtype=torch.uint8))


def test_the_constants_are_the_released_sglangs(sglang_source):
    """Re-derived from sglang 0.5.23's source (.venv-sglang): the kernel's constants and launch defaults, CUDA
    tensors routed to it by tensor_hash, and the checker's 16-hex format. A new SGLang that changes any of them
    fails here."""
    import re

    from sglang_source import source_reader

    read = source_reader(sglang_source("0.5.23"))
    kernel = read("sglang/kernels/ops/memory/gpu_tensor_hash.py")
    mm_utils = read("sglang/srt/managers/mm_utils.py")
    checker = read("sglang/srt/utils/weight_checker.py")

    def constant(name: str) -> int:
        return int(re.search(rf"^{name} = (0x[0-9A-Fa-f]+)$", kernel, re.M).group(1), 16)

    def default(name: str) -> int:
        return int(re.search(rf"{name}: int = (0x[0-9A-Fa-f]+|\d+)", kernel).group(1), 0)

    assert (constant("FMIX32_C1"), constant("FMIX32_C2")) == (gpu_hash._FMIX_C1, gpu_hash._FMIX_C2)
    assert (constant("POS_C1"), constant("POS_C2")) == tuple(position for position, _, _ in gpu_hash._KEYS)
    assert default("seed") == gpu_hash._SEED and default("tile_words") == gpu_hash._TILE_WORDS
    # block_words only splits a tile's sum inside the kernel, so the port has no use for it; pinned all the same.
    assert default("block_words") == 256 and default("reduce_chunk") == 1024
    assert "((seed * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF" in kernel
    assert "_rotl32(iu, 15)" in kernel and "_rotl32(iu, 13)" in kernel
    assert "return gpu_tensor_hash(tensor.cuda())" in mm_utils
    assert 'return f"{tensor_hash(t):016x}"' in checker
