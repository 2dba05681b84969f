"""Physical weight layouts an engine may apply after loading, and their exact inverses.

AITER's `shuffle_weight` (ROCm kernels) regroups each band of 16 rows: viewing the band as a 16 x C matrix of
16-byte vectors (C = K / V, V = 16 // itemsize elements per vector), it stores the transpose (C x 16) row-major.
Element (n, k) with n = 16*n0 + n1, k = V*c + e lands at flat offset n0*16*K + c*16*V + n1*V + e within its
leading batch. The shuffle is a permutation and is NOT idempotent: applying it to already-shuffled weights
silently corrupts them, which is why the engine must finalize only runners that received fresh bytes. Its order
(shuffles needed to restore the tensor) is the multiplicative order of 16 mod (16C - 1); for rows of exactly 256
bytes (C = 16) that order is 2, so a double shuffle restores and only a triple one shows the corruption.

Every layout is one `LayoutSpec` row in `LAYOUTS` (apply, undo, which tensors it transforms); engines and checksums
go through `layout_spec`, `apply_layout` and `undo_layout`, so adding a layout is its implementation plus one row.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from miles_sync.wire.codec import WireEnum

__all__ = ["LayoutSpec", "WeightLayout", "layout_spec", "undo_layout"]

_BAND_ROWS = 16  # rows per band (AITER's BN)
_K_MULTIPLE = 32  # elements per K block (AITER's BK); K must be a multiple
_VECTOR_BYTES = 16
_SUPPORTED_ITEMSIZES = (1, 2, 4)
# Permute through a same-width integer view: bitwise, and valid for dtypes without CPU copy kernels.
_BITS_BY_ITEMSIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


class WeightLayout(WireEnum):
    """How an engine stores a weight physically after its finalize hook."""

    NONE = "none"
    AITER = "aiter"


def _shuffle_problems(shape: Sequence[int], dtype: torch.dtype) -> list[str]:
    problems = []
    if len(shape) < 2:
        problems.append(f"needs a tensor of shape (..., N, K) with at least 2 dims; got shape {tuple(shape)}")
        return problems
    if dtype.itemsize not in _SUPPORTED_ITEMSIZES:
        problems.append(f"supports 1-, 2- and 4-byte dtypes; got {dtype} ({dtype.itemsize} bytes)")
    n, k = shape[-2], shape[-1]
    if n % _BAND_ROWS != 0 or k % _K_MULTIPLE != 0:
        problems.append(
            f"needs N % {_BAND_ROWS} == 0 and K % {_K_MULTIPLE} == 0; got N={n} (N % {_BAND_ROWS} = "
            f"{n % _BAND_ROWS}), K={k} (K % {_K_MULTIPLE} = {k % _K_MULTIPLE}) for shape {tuple(shape)}"
        )
    return problems


def can_shuffle(shape: Sequence[int], dtype: torch.dtype) -> bool:
    """True when `shuffle_weight` accepts a tensor of this shape and dtype."""
    return not _shuffle_problems(shape, dtype)


def _check_shuffle(shape: Sequence[int], dtype: torch.dtype) -> None:
    problems = _shuffle_problems(shape, dtype)
    if problems:
        raise ValueError("AITER shuffle_weight " + "; ".join(problems))


def _banded(x: torch.Tensor, *, transposed: bool) -> torch.Tensor:
    """x as (batch, N/16, 16, C, V) vectors, or (batch, N/16, C, 16, V) when `transposed` (the shuffled form)."""
    *batch, n, k = x.shape
    v = _VECTOR_BYTES // x.dtype.itemsize
    rows_then_vectors = (_BAND_ROWS, k // v) if not transposed else (k // v, _BAND_ROWS)
    # reshape, not view: non-contiguous inputs are copied once here instead of failing.
    return x.view(_BITS_BY_ITEMSIZE[x.dtype.itemsize]).reshape(math.prod(batch), n // _BAND_ROWS, *rows_then_vectors, v)


def _swap_vector_axes(x: torch.Tensor, *, transposed: bool) -> torch.Tensor:
    _check_shuffle(x.shape, x.dtype)
    out = _banded(x, transposed=transposed).permute(0, 1, 3, 2, 4).contiguous()
    return out.view(x.shape).view(x.dtype)


def shuffle_weight(x: torch.Tensor) -> torch.Tensor:
    """AITER's (16, 16) weight shuffle of a (..., N, K) tensor; returns a new contiguous tensor, `x` is not mutated.

    Equal to `aiter.ops.shuffle.shuffle_weight(x)` for 1-, 2- and 4-byte dtypes. Raises ValueError naming N and K
    when N % 16 or K % 32 is non-zero.
    """
    return _swap_vector_axes(x, transposed=False)


def unshuffle_weight(x: torch.Tensor) -> torch.Tensor:
    """Exact inverse of `shuffle_weight`: unshuffle_weight(shuffle_weight(x)) == x bit for bit."""
    return _swap_vector_axes(x, transposed=True)


def shuffle_order(shape: Sequence[int], dtype: torch.dtype) -> int:
    """How many consecutive shuffles restore a tensor of this shape: the multiplicative order of 16 mod (16C - 1).

    Within a band the shuffle sends vector index i (row-major over 16 x C) to 16*i mod (16C - 1), the last vector
    staying put. A tensor with no elements is restored by every shuffle (order 1).
    """
    _check_shuffle(shape, dtype)
    num_vectors_per_row = shape[-1] // (_VECTOR_BYTES // dtype.itemsize)
    if math.prod(shape) == 0:
        return 1
    modulus = _BAND_ROWS * num_vectors_per_row - 1
    order, power = 1, _BAND_ROWS % modulus
    while power != 1:
        power = power * _BAND_ROWS % modulus
        order += 1
    return order


@dataclass(frozen=True, kw_only=True)
class LayoutSpec:
    """One physical layout: `apply` (logical -> physical, a new tensor or `x` itself), `undo` (its exact inverse),
    and `applies_to(shape, dtype)`, whether an engine stores a linear weight of that shape and dtype in this layout
    (the others stay logical)."""

    apply: Callable[[torch.Tensor], torch.Tensor]
    undo: Callable[[torch.Tensor], torch.Tensor]
    applies_to: Callable[[Sequence[int], torch.dtype], bool]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _no_tensor(shape: Sequence[int], dtype: torch.dtype) -> bool:
    return False


LAYOUTS: Mapping[WeightLayout, LayoutSpec] = types.MappingProxyType(
    {
        WeightLayout.NONE: LayoutSpec(apply=_identity, undo=_identity, applies_to=_no_tensor),
        WeightLayout.AITER: LayoutSpec(apply=shuffle_weight, undo=unshuffle_weight, applies_to=can_shuffle),
    }
)


def _as_layout(layout: WeightLayout | str) -> WeightLayout:
    try:
        return WeightLayout(layout)
    except ValueError:
        allowed = ", ".join(m.value for m in WeightLayout)
        raise ValueError(f"Unknown weight layout {layout!r}; expected one of: {allowed}") from None


def layout_spec(layout: WeightLayout | str) -> LayoutSpec:
    """The registry row of `layout`; ValueError naming the known layouts for an unknown one."""
    return LAYOUTS[_as_layout(layout)]


def apply_layout(x: torch.Tensor, layout: WeightLayout | str) -> torch.Tensor:
    """Logical -> physical. NONE returns `x` itself; AITER returns a new shuffled tensor. Not idempotent for AITER:
    the caller must apply it exactly once to freshly loaded bytes."""
    return layout_spec(layout).apply(x)


def undo_layout(x: torch.Tensor, layout: WeightLayout | str) -> torch.Tensor:
    """Physical -> logical, the inverse of `apply_layout`. NONE returns `x` itself."""
    return layout_spec(layout).undo(x)
