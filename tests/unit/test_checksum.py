from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from miles_sync.weights.checksum import (
    compare_checksums,
    engine_digest,
    logical_checksum,
    role_checksums,
    tensor_checksum,
)
from miles_sync.weights.layout import WeightLayout, shuffle_weight


def test_checksum_is_sha256_of_header_and_little_endian_bytes():
    t = torch.tensor([1.0, 2.0], dtype=torch.float32)
    expected = hashlib.sha256(b"float32[2]\n" + struct.pack("<2f", 1.0, 2.0)).hexdigest()
    assert tensor_checksum(t) == expected
    scalar = torch.tensor(3, dtype=torch.int64)
    assert tensor_checksum(scalar) == hashlib.sha256(b"int64[]\n" + struct.pack("<q", 3)).hexdigest()
    empty = torch.empty(0, 3, dtype=torch.bfloat16)
    assert tensor_checksum(empty) == hashlib.sha256(b"bfloat16[0,3]\n").hexdigest()


def test_checksum_sees_every_bit_and_every_reinterpretation():
    t = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    base = tensor_checksum(t)
    assert tensor_checksum(t.clone()) == base
    flipped = t.clone()
    flipped.view(torch.int16)[3, 5] ^= 1  # lowest mantissa bit of one element
    assert tensor_checksum(flipped) != base
    assert tensor_checksum(t.view(torch.int16)) != base  # same bytes, other dtype
    assert tensor_checksum(t.reshape(16, 8)) != base  # same bytes, other shape
    assert tensor_checksum(t.reshape(-1)) != base
    # Signed zeros compare equal as values but are different bytes.
    assert tensor_checksum(torch.tensor([0.0])) != tensor_checksum(torch.tensor([-0.0]))


def test_checksum_of_views_equals_checksum_of_their_contiguous_copy():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base.t()
    assert not view.is_contiguous()
    assert tensor_checksum(view) == tensor_checksum(view.contiguous())
    assert tensor_checksum(base[1:3, 2:]) == tensor_checksum(base[1:3, 2:].clone())
    assert tensor_checksum(-base) == tensor_checksum((-base).clone())
    p = torch.nn.Parameter(base.clone())
    assert tensor_checksum(p) == tensor_checksum(base)  # parameters hash like their data


def test_checksum_rejects_unsupported_dtypes():
    with pytest.raises(ValueError, match="Unsupported dtype torch.complex64"):
        tensor_checksum(torch.zeros(2, dtype=torch.complex64))


def test_logical_checksum_agrees_across_layouts_and_exposes_a_double_shuffle():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    trainer = tensor_checksum(w)
    physical = shuffle_weight(w)  # what an AITER engine holds after one finalize
    assert tensor_checksum(physical) != trainer
    assert logical_checksum(physical, layout=WeightLayout.AITER) == trainer
    assert logical_checksum(w, layout="none") == trainer
    refinalized = shuffle_weight(physical)  # a runner finalized again without fresh bytes
    assert logical_checksum(refinalized, layout="aiter") != trainer


def test_role_checksums_prefix_draft_names_and_undo_layouts():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(16, 32, generator=gen)
    norm = torch.randn(32, generator=gen)
    target = role_checksums([("w", w), ("norm", norm)], role="target")
    assert target == {"w": tensor_checksum(w), "norm": tensor_checksum(norm)}
    draft = role_checksums(iter([("w", shuffle_weight(w)), ("norm", norm)]), role="draft", layouts={"w": "aiter"})
    assert draft == {"draft.w": tensor_checksum(w), "draft.norm": tensor_checksum(norm)}


def test_role_checksums_errors():
    with pytest.raises(ValueError, match="Unknown role 'mtp'; expected one of: target, draft"):
        role_checksums([], role="mtp")
    with pytest.raises(ValueError, match=r"duplicate names \['a'\], layouts for unknown names \['zz'\]"):
        role_checksums([("a", torch.zeros(1)), ("a", torch.ones(1))], role="target", layouts={"zz": "aiter"})


def test_engine_digest():
    checksums = {"b": "22", "a": "11", "draft.a": "33"}
    digest = engine_digest(checksums)
    assert digest == engine_digest(dict(reversed(list(checksums.items()))))  # insertion order is irrelevant
    assert len(digest) == 64
    assert digest != engine_digest({**checksums, "a": "12"})
    assert digest != engine_digest({"b": "22", "a": "11"})
    assert digest != engine_digest({"b": "22", "A": "11", "draft.a": "33"})
    # Field boundaries are part of the digest: moving a character from name to value changes it.
    assert engine_digest({"ab": "c"}) != engine_digest({"a": "bc"})
    assert engine_digest({}) == hashlib.sha256().hexdigest()


def test_compare_checksums_lines():
    expected = {"a": "aaaaaaaaaaaaaaaa", "b": "bbbbbbbbbbbbbbbb", "c": "cccc", "draft.w": "dddd"}
    actual = {"a": "aaaaaaaaaaaaaaaa", "b": "bbbbbbbbbbbbzzzz", "draft.w": "eeee", "x": "ffff"}
    assert compare_checksums(expected, actual) == [
        "differs b: expected bbbbbbbbbbbbbbbb, got bbbbbbbbbbbbzzzz",
        "differs draft.w: expected dddd, got eeee",
        "missing c: expected cccc, not reported",
        "extra x: reported ffff, not expected",
    ]
    assert compare_checksums(expected, dict(expected)) == []
    assert compare_checksums({}, {}) == []
