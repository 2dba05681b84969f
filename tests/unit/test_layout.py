from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_sync.weights.layout import (
    WeightLayout,
    apply_layout,
    can_shuffle,
    shuffle_order,
    shuffle_weight,
    undo_layout,
    unshuffle_weight,
)

DTYPES_BY_ITEMSIZE = {
    1: [torch.float8_e4m3fn, torch.int8, torch.uint8],
    2: [torch.bfloat16, torch.float16],
    4: [torch.float32, torch.int32],
}
ALL_DTYPES = [d for ds in DTYPES_BY_ITEMSIZE.values() for d in ds]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype.itemsize])


def random_bits(shape, dtype, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def closed_form_offsets(n: int, k: int, itemsize: int) -> torch.Tensor:
    """Destination flat offset of every (row, col) element: n0*16*K + c*16*V + n1*V + e (layout.py docstring)."""
    v = 16 // itemsize
    rows = torch.arange(n).unsqueeze(1)
    cols = torch.arange(k).unsqueeze(0)
    n0, n1 = rows // 16, rows % 16
    c, e = cols // v, cols % v
    return n0 * 16 * k + c * 16 * v + n1 * v + e


shuffle_shapes = st.tuples(
    st.lists(st.integers(min_value=1, max_value=3), min_size=0, max_size=2),
    st.integers(min_value=1, max_value=4),
    st.integers(min_value=1, max_value=4),
)


@settings(max_examples=60, deadline=None)
@given(dims=shuffle_shapes, dtype=st.sampled_from(ALL_DTYPES), seed=st.integers(0, 2**16))
def test_shuffle_matches_closed_form_offsets(dims, dtype, seed):
    batch, bands, blocks = dims
    n, k = 16 * bands, 32 * blocks
    x = random_bits((*batch, n, k), dtype, seed)
    y = shuffle_weight(x)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()

    offsets = closed_form_offsets(n, k, dtype.itemsize).flatten()
    assert torch.equal(offsets.sort().values, torch.arange(n * k))  # the formula is a permutation
    flat_x = bits(x).reshape(-1, n * k)
    flat_y = bits(y).reshape(-1, n * k)
    # Element (n, k) of each batch lands at its closed-form offset, checked for every element.
    assert torch.equal(flat_y[:, offsets], flat_x)
    assert torch.equal(bits(unshuffle_weight(y)), bits(x))


def test_positions_table_bf16():
    # bf16: V = 8 elements per vector; K = 32 -> C = 4 vectors per row.
    offsets = closed_form_offsets(32, 32, 2)
    assert offsets[0, 0] == 0
    assert offsets[1, 0] == 8  # next row, same vector: one vector later
    assert offsets[0, 8] == 16 * 8  # next vector of row 0: after the 16 rows' first vectors
    assert offsets[16, 0] == 16 * 32  # second band starts after the first band's 16 * K elements
    x = torch.arange(32 * 32, dtype=torch.int32).to(torch.bfloat16).reshape(32, 32)
    flat = shuffle_weight(x).flatten()
    assert flat[8].item() == x[1, 0].item() and flat[128].item() == x[0, 8].item()


def shuffle_until_restored(x: torch.Tensor, *, limit: int) -> int:
    y = x
    for count in range(1, limit + 1):
        y = shuffle_weight(y)
        if torch.equal(bits(y), bits(x)):
            return count
    raise AssertionError(f"not restored after {limit} shuffles")


@pytest.mark.parametrize(
    ("dtype", "k", "expected"),
    [
        (torch.bfloat16, 32, 3),
        (torch.float8_e4m3fn, 32, 5),
        (torch.bfloat16, 128, 2),  # rows of 256 bytes: an involution
        (torch.float8_e4m3fn, 256, 2),
        (torch.float32, 64, 2),
        (torch.float32, 32, 7),
        (torch.bfloat16, 64, 7),
        (torch.int8, 96, 9),  # 16C - 1 = 95 = 5 * 19: lcm of the orders mod 5 (1) and mod 19 (9)
        (torch.bfloat16, 96, 95),
    ],
)
def test_measured_order_equals_formula(dtype, k, expected):
    x = random_bits((2, 32, k), dtype)
    assert shuffle_order(x.shape, dtype) == expected
    assert shuffle_until_restored(x, limit=128) == expected


def test_double_shuffle_restores_rows_of_256_bytes_but_triple_corrupts():
    x = random_bits((16, 128), torch.bfloat16)  # 128 bf16 = 256 bytes per row, C = 16
    once = shuffle_weight(x)
    twice = shuffle_weight(once)
    thrice = shuffle_weight(twice)
    assert not torch.equal(bits(once), bits(x))
    assert torch.equal(bits(twice), bits(x))  # a re-finalized engine can look healthy: parity says nothing
    assert not torch.equal(bits(thrice), bits(x))
    # With C = 4 (order 3) already the double shuffle is neither the original nor the intended layout.
    y = random_bits((16, 32), torch.bfloat16)
    assert not torch.equal(bits(shuffle_weight(shuffle_weight(y))), bits(y))
    assert not torch.equal(bits(shuffle_weight(shuffle_weight(y))), bits(shuffle_weight(y)))


def test_experts_are_shuffled_independently():
    x = random_bits((3, 32, 64), torch.bfloat16)
    y = shuffle_weight(x)
    for expert in range(3):
        assert torch.equal(bits(y[expert]), bits(shuffle_weight(x[expert])))


def test_non_contiguous_input_and_no_mutation():
    base = random_bits((64, 32), torch.float16)
    x = base.t()  # (32, 64), non-contiguous
    before = bits(x).clone()
    y = shuffle_weight(x)
    assert torch.equal(bits(y), bits(shuffle_weight(x.contiguous())))
    assert torch.equal(bits(x), before)
    assert y.data_ptr() != x.data_ptr()


def test_empty_tensors():
    x = torch.empty(0, 16, 32, dtype=torch.bfloat16)
    assert shuffle_weight(x).shape == x.shape
    assert shuffle_order(x.shape, x.dtype) == 1


@pytest.mark.parametrize(
    ("shape", "dtype", "expected"),
    [
        ((16, 32), torch.bfloat16, True),
        ((4, 32, 64), torch.float8_e4m3fn, True),
        ((16, 32), torch.float32, True),
        ((8, 32), torch.bfloat16, False),
        ((16, 48), torch.bfloat16, False),
        ((32,), torch.bfloat16, False),
        ((16, 32), torch.float64, False),
    ],
)
def test_can_shuffle(shape, dtype, expected):
    assert can_shuffle(shape, dtype) is expected


def test_errors_name_n_and_k():
    with pytest.raises(ValueError, match=r"N % 16 == 0 and K % 32 == 0; got N=10 \(N % 16 = 10\), K=64 "):
        shuffle_weight(torch.zeros(10, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"got N=16 \(N % 16 = 0\), K=48 \(K % 32 = 16\) for shape \(2, 16, 48\)"):
        shuffle_weight(torch.zeros(2, 16, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"at least 2 dims; got shape \(32,\)"):
        unshuffle_weight(torch.zeros(32))
    with pytest.raises(ValueError, match=r"1-, 2- and 4-byte dtypes; got torch.float64 \(8 bytes\)"):
        shuffle_order((16, 32), torch.float64)


def test_apply_and_undo_layout():
    x = random_bits((32, 64), torch.bfloat16)
    assert apply_layout(x, WeightLayout.NONE) is x
    assert undo_layout(x, "none") is x
    physical = apply_layout(x, "aiter")
    assert torch.equal(bits(physical), bits(shuffle_weight(x)))
    assert torch.equal(bits(undo_layout(physical, WeightLayout.AITER)), bits(x))
    assert WeightLayout("aiter") is WeightLayout.AITER and WeightLayout.AITER == "aiter"
    with pytest.raises(ValueError, match="Unknown weight layout 'marlin'; expected one of: none, aiter"):
        apply_layout(x, "marlin")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8, torch.float32])
def test_equals_aiter_shuffle_weight(dtype):
    shuffle_module = pytest.importorskip("aiter.ops.shuffle", exc_type=ImportError)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = random_bits((2, 64, 128), dtype).to(device)
    expected = shuffle_module.shuffle_weight(x, layout=(16, 16))
    assert torch.equal(bits(shuffle_weight(x)), bits(expected))
