"""Bucket planning (miles_sync.sync.plan): greedy, lazy, units never straddle a bucket; the wire order of a bucket."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_sync.sync.plan import BucketPlan, plan_buckets
from miles_sync.wire.bucket import AtomicUnit, TensorMeta, aligned_order, layout_from_metadata


def unit(key: str, *sizes: int, dtype: torch.dtype = torch.uint8) -> AtomicUnit:
    """A unit of 1-D tensors of `sizes` elements."""
    return AtomicUnit(
        key=key,
        tensors=tuple(TensorMeta(name=f"{key}.{i}", shape=(n,), dtype=dtype) for i, n in enumerate(sizes)),
    )


def keys(plans: list[BucketPlan]) -> list[list[str]]:
    return [[u.key for u in p.units] for p in plans]


@pytest.mark.parametrize(
    ("sizes", "cap", "expected"),
    [
        ([], 10, []),
        ([4], 10, [["u0"]]),
        ([4, 6], 10, [["u0", "u1"]]),  # exactly at the cap still fits
        ([4, 7], 10, [["u0"], ["u1"]]),
        ([3, 3, 3, 3], 10, [["u0", "u1", "u2"], ["u3"]]),
        ([25], 10, [["u0"]]),  # larger than the cap: alone
        ([2, 25, 2], 10, [["u0"], ["u1"], ["u2"]]),
        ([25, 0, 3], 10, [["u0"], ["u1", "u2"]]),
        ([0, 0, 10, 0], 10, [["u0", "u1", "u2", "u3"]]),
        ([0], 1, [["u0"]]),
        ([9, 2, 8, 1, 1], 10, [["u0"], ["u1", "u2"], ["u3", "u4"]]),  # greedy, not bin packing
    ],
)
def test_greedy_table(sizes, cap, expected):
    plans = list(plan_buckets([unit(f"u{i}", n) for i, n in enumerate(sizes)], cap_bytes=cap))
    assert keys(plans) == expected
    assert [p.index for p in plans] == list(range(len(expected)))
    assert [p.num_bytes for p in plans] == [sum(u.num_bytes for u in p.units) for p in plans]


def test_unit_bytes_count_every_tensor_and_dtype():
    qkv = AtomicUnit(
        key="layers.0.qkv",
        tensors=(
            TensorMeta(name="q", shape=(4, 4), dtype=torch.bfloat16),
            TensorMeta(name="k", shape=(2, 4), dtype=torch.bfloat16),
            TensorMeta(name="v", shape=(2, 4), dtype=torch.bfloat16),
        ),
    )
    scale = AtomicUnit(key="scale", tensors=(TensorMeta(name="s", shape=(), dtype=torch.float32),))
    plans = list(plan_buckets([qkv, scale], cap_bytes=64))
    assert keys(plans) == [["layers.0.qkv"], ["scale"]]  # 64 + 4 > 64
    assert plans[0].num_bytes == 64 and plans[0].num_tensors == 3
    assert keys(list(plan_buckets([qkv, scale], cap_bytes=68))) == [["layers.0.qkv", "scale"]]


def test_wire_order_of_a_bucket_is_aligned_and_accepted_by_the_receiver():
    mixed = AtomicUnit(
        key="mixed",
        tensors=(
            TensorMeta(name="w", shape=(3,), dtype=torch.float8_e4m3fn),
            TensorMeta(name="s", shape=(3,), dtype=torch.float32),
            TensorMeta(name="b", shape=(1,), dtype=torch.bfloat16),
        ),
    )
    (plan,) = plan_buckets([mixed, unit("x", 1, dtype=torch.int64)], cap_bytes=1 << 20)
    order = aligned_order([t for u in plan.units for t in u.tensors])
    assert [t.name for t in order] == ["x.0", "s", "b", "w"]
    entries = layout_from_metadata(
        names=[t.name for t in order], dtypes=[t.dtype for t in order], shapes=[t.shape for t in order]
    )
    assert [e.start for e in entries] == [0, 8, 20, 22]


@pytest.mark.parametrize("cap", [0, -1])
def test_non_positive_cap_fails_at_call_time(cap):
    with pytest.raises(ValueError, match=f"cap_bytes must be positive; got {cap}"):
        plan_buckets([], cap_bytes=cap)  # not iterated: the error must not wait for the first bucket


def test_lazy_on_an_unbounded_stream():
    pulled: list[int] = []

    def stream() -> Iterator[AtomicUnit]:
        for i in itertools.count():
            pulled.append(i)
            yield unit(f"u{i}", 4)

    plans = plan_buckets(stream(), cap_bytes=8)
    assert pulled == []
    first = next(plans)
    assert [u.key for u in first.units] == ["u0", "u1"]
    assert pulled == [0, 1, 2]  # the unit that closed the bucket, no more
    assert keys(list(itertools.islice(plans, 2))) == [["u2", "u3"], ["u4", "u5"]]


units_strategy = st.lists(
    st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=4), min_size=0, max_size=30
).map(lambda sizes: [unit(f"u{i}", *s) for i, s in enumerate(sizes)])


@settings(max_examples=200, deadline=None)
@given(units=units_strategy, cap=st.integers(min_value=1, max_value=100))
def test_properties(units, cap):
    plans = list(plan_buckets(iter(units), cap_bytes=cap))
    # Concatenation gives the input back: nothing dropped, duplicated or reordered, no unit split.
    assert [u for p in plans for u in p.units] == units
    assert [p.index for p in plans] == list(range(len(plans)))
    for p in plans:
        assert p.units, "no empty buckets"
        assert p.num_bytes == sum(u.num_bytes for u in p.units)
        assert p.num_bytes <= cap or len(p.units) == 1
    # Greedy: each bucket after the first was opened only because its first unit did not fit the previous one.
    for prev, nxt in zip(plans, plans[1:]):
        assert prev.num_bytes + nxt.units[0].num_bytes > cap
