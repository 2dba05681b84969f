from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_sync.wire.bucket import (
    BucketEntry,
    TensorMeta,
    aligned_order,
    layout_from_metadata,
    pack_bucket,
    unpack_bucket,
)
from miles_sync.wire.dtypes import SUPPORTED_DTYPE_NAMES, SUPPORTED_DTYPES, dtype_from_name, dtype_name

ROUND_TRIP_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.int8,
    torch.int32,
    torch.int64,
]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same-width integer view: compares NaN payloads, signed zeros and fp8 bit patterns exactly."""
    return t.view(BITS[t.dtype.itemsize])


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, *, seed: int, contiguous: bool) -> torch.Tensor:
    """Random bit patterns (not just random values) of `shape`; a strided view of a larger tensor when not
    `contiguous`."""
    gen = torch.Generator().manual_seed(seed)
    if contiguous or len(shape) == 0:
        base_shape = shape
    elif len(shape) == 1:
        base_shape = (shape[0] * 2,)
    else:
        base_shape = (*shape[:-2], shape[-1], shape[-2])
    numel = 1
    for d in base_shape:
        numel *= d
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    base = raw.view(dtype).reshape(base_shape)
    if contiguous or len(shape) == 0:
        return base
    if len(shape) == 1:
        return base[::2]
    return base.transpose(-1, -2)


tensor_specs = st.lists(
    st.tuples(
        st.sampled_from(ROUND_TRIP_DTYPES),
        st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=3).map(tuple),
        st.booleans(),
    ),
    min_size=0,
    max_size=8,
)


def build_named(specs, seed: int) -> list[tuple[str, torch.Tensor]]:
    return [
        (f"t{i}", random_tensor(shape, dtype, seed=seed + i, contiguous=contiguous))
        for i, (dtype, shape, contiguous) in enumerate(specs)
    ]


@settings(max_examples=150, deadline=None)
@given(specs=tensor_specs, seed=st.integers(min_value=0, max_value=2**16))
def test_round_trip_is_bit_exact_and_receiver_layout_matches(specs, seed):
    named = build_named(specs, seed)
    bucket = pack_bucket(named)

    # No padding: the buffer is exactly the sum of the tensors' bytes and every offset is aligned.
    assert bucket.buffer.numel() == sum(t.numel() * t.dtype.itemsize for _, t in named)
    assert all(e.start % e.dtype.itemsize == 0 for e in bucket.entries)

    # The receiver sees only names/dtypes/shapes (in the bucket's order) and must rebuild the same layout.
    received = layout_from_metadata(
        names=[e.name for e in bucket.entries],
        dtypes=[dtype_name(e.dtype) for e in bucket.entries],
        shapes=[list(e.shape) for e in bucket.entries],
    )
    assert received == bucket.entries

    wire = bucket.buffer.clone()  # what a broadcast would deliver
    unpacked = dict(unpack_bucket(wire, received))
    assert set(unpacked) == {n for n, _ in named}
    for name, original in named:
        got = unpacked[name]
        assert got.dtype == original.dtype and got.shape == original.shape
        assert torch.equal(bits(got), bits(original))


@settings(max_examples=150, deadline=None)
@given(
    metas=st.lists(
        st.tuples(st.sampled_from(ROUND_TRIP_DTYPES), st.integers(min_value=0, max_value=7)), min_size=0, max_size=10
    )
)
def test_receiver_rejects_exactly_the_unaligned_orders(metas):
    names = [f"m{i}" for i in range(len(metas))]
    offset, first_bad = 0, None
    for name, (dtype, n) in zip(names, metas):
        if first_bad is None and offset % dtype.itemsize != 0:
            first_bad = name
        offset += n * dtype.itemsize
    kwargs = dict(names=names, dtypes=[dtype_name(d) for d, _ in metas], shapes=[[n] for _, n in metas])
    if first_bad is None:
        entries = layout_from_metadata(**kwargs)
        assert [e.name for e in entries] == names
    else:
        with pytest.raises(ValueError, match=f"Unaligned received tensor {first_bad} "):
            layout_from_metadata(**kwargs)

    # The sender's order always passes.
    ordered = aligned_order([TensorMeta(name=n, shape=(k,), dtype=d) for n, (d, k) in zip(names, metas)])
    layout_from_metadata(
        names=[m.name for m in ordered], dtypes=[m.dtype for m in ordered], shapes=[m.shape for m in ordered]
    )


def test_aligned_order_is_stable_descending_itemsize():
    metas = [
        TensorMeta(name="a", shape=(3,), dtype=torch.int8),
        TensorMeta(name="b", shape=(1,), dtype=torch.bfloat16),
        TensorMeta(name="c", shape=(1,), dtype=torch.float32),
        TensorMeta(name="d", shape=(5,), dtype=torch.float8_e4m3fn),
        TensorMeta(name="e", shape=(), dtype=torch.int64),
        TensorMeta(name="f", shape=(2,), dtype=torch.float16),
        TensorMeta(name="g", shape=(1,), dtype=torch.int32),
    ]
    assert [m.name for m in aligned_order(metas)] == ["e", "c", "g", "b", "f", "a", "d"]
    assert aligned_order([]) == []


def test_pack_layout_table():
    named = [
        ("norm", torch.ones(3, dtype=torch.bfloat16)),
        ("scale", torch.ones((), dtype=torch.float32)),
        ("qweight", torch.ones(5, dtype=torch.int8)),
        ("empty", torch.ones(0, 2, dtype=torch.int64)),
        ("step", torch.ones((), dtype=torch.int64)),
    ]
    bucket = pack_bucket(named)
    assert [(e.name, e.start, e.end) for e in bucket.entries] == [
        ("empty", 0, 0),
        ("step", 0, 8),
        ("scale", 8, 12),
        ("norm", 12, 18),
        ("qweight", 18, 23),
    ]
    assert bucket.num_bytes == 23
    assert bucket.names == ["empty", "step", "scale", "norm", "qweight"]
    assert bucket.entries[2] == BucketEntry(name="scale", shape=(), dtype=torch.float32, start=8, end=12)
    assert bucket.entries[2].num_bytes == 4


def test_pack_does_not_mutate_inputs_and_copies_parameters():
    w = torch.nn.Parameter(torch.randn(4, 4))
    before = w.detach().clone()
    bucket = pack_bucket([("w", w)])
    assert torch.equal(w.detach(), before)
    bucket.buffer.zero_()  # the buffer owns its bytes
    assert torch.equal(w.detach(), before)


def test_pack_into_preallocated_out_uses_its_prefix():
    out = torch.full((64,), 0xAB, dtype=torch.uint8)
    named = [("a", torch.arange(4, dtype=torch.float32)), ("b", torch.arange(3, dtype=torch.int8))]
    bucket = pack_bucket(named, out=out)
    assert bucket.buffer.numel() == 19
    assert bucket.buffer.data_ptr() == out.data_ptr()
    assert torch.all(out[19:] == 0xAB)  # untouched tail
    views = dict(unpack_bucket(bucket.buffer, bucket.entries))
    assert torch.equal(views["a"], named[0][1]) and torch.equal(views["b"], named[1][1])
    # Reusing the same out for the next bucket overwrites in place (double-buffer slot reuse).
    again = pack_bucket([("c", torch.full((2,), 7, dtype=torch.int64))], out=out)
    assert again.buffer.data_ptr() == out.data_ptr()
    assert torch.equal(dict(unpack_bucket(again.buffer, again.entries))["c"], torch.full((2,), 7))


def test_pack_rejects_bad_out_and_inputs():
    named = [("a", torch.zeros(4, dtype=torch.float32))]
    with pytest.raises(ValueError, match="out holds 15 bytes but the bucket \\['a'\\] needs 16"):
        pack_bucket(named, out=torch.empty(15, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        pack_bucket(named, out=torch.empty(16, dtype=torch.float32))
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        pack_bucket(named, out=torch.empty(4, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="storage offset 2, not a multiple of the largest itemsize 4"):
        pack_bucket(named, out=torch.empty(32, dtype=torch.uint8)[2:])
    with pytest.raises(ValueError, match="Duplicate tensor names in one bucket: \\['a'\\]"):
        pack_bucket([("a", torch.zeros(1)), ("b", torch.zeros(1)), ("a", torch.zeros(2))])
    with pytest.raises(ValueError, match="Unsupported dtype torch.complex64"):
        pack_bucket([("z", torch.zeros(2, dtype=torch.complex64))])


def test_empty_bucket():
    bucket = pack_bucket([])
    assert bucket.entries == () and bucket.buffer.numel() == 0
    assert unpack_bucket(bucket.buffer, ()) == []
    assert layout_from_metadata(names=[], dtypes=[], shapes=[]) == ()


def test_unpack_is_zero_copy():
    bucket = pack_bucket([("a", torch.zeros(2, 3, dtype=torch.float32)), ("b", torch.zeros(4, dtype=torch.int8))])
    views = dict(unpack_bucket(bucket.buffer, bucket.entries))
    views["b"][1] = 5
    assert bucket.buffer[24 + 1].item() == 5
    views["a"][1, 2] = 1.0
    assert bucket.buffer[20:24].view(torch.float32).item() == 1.0
    assert views["a"].untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()


def test_unpack_rejects_mismatched_buffers_and_entries():
    bucket = pack_bucket([("a", torch.zeros(4, dtype=torch.float32))])
    with pytest.raises(ValueError, match="buffer holds 17 bytes but the entries describe 16"):
        unpack_bucket(torch.zeros(17, dtype=torch.uint8), bucket.entries)
    with pytest.raises(ValueError, match="buffer holds 15 bytes"):
        unpack_bucket(torch.zeros(15, dtype=torch.uint8), bucket.entries)
    gap = (BucketEntry(name="a", shape=(2,), dtype=torch.float32, start=8, end=16),)
    with pytest.raises(ValueError, match="a \\[8, 16\\) \\(expected start 0, 8 bytes\\)"):
        unpack_bucket(torch.zeros(16, dtype=torch.uint8), gap)


def test_layout_from_metadata_errors_name_the_tensor():
    with pytest.raises(ValueError, match="Unaligned received tensor w .*offset 3 is not a multiple of itemsize 2"):
        layout_from_metadata(names=["b", "w"], dtypes=["int8", "bfloat16"], shapes=[[3], [2, 2]])
    with pytest.raises(ValueError, match="Negative dimension in received tensor\\(s\\): bad \\(2, -1\\)"):
        layout_from_metadata(names=["ok", "bad"], dtypes=["float32", "float32"], shapes=[[1], [2, -1]])
    with pytest.raises(ValueError, match="got 2 names, 1 dtypes, 2 shapes"):
        layout_from_metadata(names=["a", "b"], dtypes=["float32"], shapes=[[1], [1]])
    with pytest.raises(ValueError, match="Unsupported dtype name 'torch.float32'"):
        layout_from_metadata(names=["a"], dtypes=["torch.float32"], shapes=[[1]])


def test_dtype_codec_round_trips_the_allow_list():
    assert dtype_from_name("bfloat16") is torch.bfloat16
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name(torch.float8_e4m3fn) == "float8_e4m3fn"
    for name in SUPPORTED_DTYPE_NAMES:
        assert dtype_name(dtype_from_name(name)) == name
        assert str(dtype_from_name(name)) == f"torch.{name}"  # bare torch names, as SGLang resolves them
    with pytest.raises(ValueError) as err:
        dtype_from_name("bf16")
    assert all(name in str(err.value) for name in SUPPORTED_DTYPE_NAMES)


@pytest.mark.parametrize("bad", ["bf16", "torch.bfloat16", "complex64", "qint8", ""])
def test_dtype_from_name_rejects_unknown_names(bad):
    with pytest.raises(ValueError, match=f"Unsupported dtype name {bad!r}; supported: bool, uint8"):
        dtype_from_name(bad)


def test_dtype_name_rejects_unsupported_dtypes():
    with pytest.raises(ValueError, match="Unsupported dtype torch.complex64; supported: .*bfloat16"):
        dtype_name(torch.complex64)


def test_dtype_table_is_the_union_of_the_old_bucket_and_payload_lists():
    # The bucket list had fp4/fp8-e8m0 but no wide unsigned ints; the payload list had those but no fp4.
    for name in ("uint16", "uint32", "uint64", "float4_e2m1fn_x2", "float8_e8m0fnu", "float8_e4m3fnuz", "bool"):
        if hasattr(torch, name):
            assert name in SUPPORTED_DTYPE_NAMES
    assert SUPPORTED_DTYPES == tuple(dtype_from_name(n) for n in SUPPORTED_DTYPE_NAMES)
    assert len(set(SUPPORTED_DTYPE_NAMES)) == len(SUPPORTED_DTYPE_NAMES)


@pytest.mark.parametrize("bad", [None, 3, torch.float32])
def test_dtype_from_name_rejects_non_strings_with_a_value_error(bad):
    with pytest.raises(ValueError, match="Unsupported dtype name"):
        dtype_from_name(bad)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_every_table_dtype_packs_and_lays_out(dtype):
    raw = torch.arange(24, dtype=torch.uint8) % 2  # 0/1 bytes: valid bits for every dtype, bool included
    t = raw.view(dtype).reshape(-1)
    bucket = pack_bucket([("a", torch.ones(1, dtype=torch.float64)), ("t", t)])
    entries = layout_from_metadata(
        names=bucket.names,
        dtypes=[dtype_name(e.dtype) for e in bucket.entries],
        shapes=[e.shape for e in bucket.entries],
    )
    assert entries == bucket.entries
    got = dict(unpack_bucket(bucket.buffer, entries))
    assert got["t"].dtype == dtype and torch.equal(got["t"].view(torch.uint8), t.view(torch.uint8))
