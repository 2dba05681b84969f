"""Repetitions: how every figure a benchmark reports is taken, so that one run's figure holds on the next.

On this 2-core shared machine one measurement of a sync moves by 2-3x between runs (start-up costs land on the
first measurement of a run, another process takes a core for a second). So every case a benchmark compares runs in
**alternating repetitions**: A, B, C, A, B, C, ... (`alternate`), each repetition its own series (set-up and one
unmeasured warm-up sync, then the measured sync), so drift and start-up costs hit every case alike; every figure is
computed per repetition (a ratio from the A and B of the same repetition) and reported as the **median over the
repetitions with its spread** (`Spread`: `median [min-max]`, every value kept). A figure whose max/min exceeds
`UNSTABLE_SPREAD` is flagged `unstable`: it cannot hold a target or compare two commits on this machine.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["MIN_REPETITIONS", "UNSTABLE_SPREAD", "Spread", "alternate", "is_number", "median_of", "spreads_of"]

T = TypeVar("T")

MIN_REPETITIONS = 3  # a median of fewer is one sample's luck
UNSTABLE_SPREAD = 1.2  # max/min over the repetitions above this: flagged


@dataclass(frozen=True)
class Spread:
    """One figure over the repetitions of a run."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    @property
    def spread(self) -> float:
        """max/min of the magnitudes; inf when the values change sign (the figure is noise around zero)."""
        if any(math.isnan(v) for v in self.values):
            return math.nan
        if self.low < 0 < self.high or (self.low == 0) != (self.high == 0):
            return math.inf
        small, large = sorted((abs(self.low), abs(self.high)))
        return 1.0 if large == 0 else large / small

    @property
    def unstable(self) -> bool:
        return not self.spread <= UNSTABLE_SPREAD  # NaN (a figure missing in a repetition) counts as unstable

    def to_json(self) -> dict:
        return {
            "median": self.median,
            "min": self.low,
            "max": self.high,
            "spread": self.spread,
            "unstable": self.unstable,
            "values": list(self.values),
        }

    def __str__(self) -> str:
        flag = "  UNSTABLE" if self.unstable else ""
        return f"{_short(self.median)} [{_short(self.low)}-{_short(self.high)}]{flag}"


def _short(value: float) -> str:
    return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"


def alternate(
    cases: Sequence[tuple[str, Callable[[], T]]],
    *,
    repetitions: int,
    warmup: int = 0,
    log: Callable[[str], None] | None = None,
) -> dict[str, list[T]]:
    """Run every case once per repetition, in the same order each time (A, B, ..., A, B, ...); each case's results
    in repetition order. `warmup` whole repetitions run first and are discarded: for cases whose processes were
    just started, where the first pass through every case is slow for all of them by different amounts (first
    touch of a fresh engine's parameters, a new process group's first collectives) however each series warms up."""
    if repetitions < 1 or warmup < 0:
        raise ValueError(f"repetitions must be >= 1 and warmup >= 0, got {repetitions} and {warmup}")
    results: dict[str, list[T]] = {name: [] for name, _ in cases}
    for rep in range(warmup + repetitions):
        counted = rep >= warmup
        for name, run in cases:
            if log is not None:
                label = f"{rep - warmup + 1}/{repetitions}" if counted else f"warm-up {rep + 1}/{warmup}, discarded"
                log(f"  [{label}] {name}")
            result = run()
            if counted:
                results[name].append(result)
    return results


def median_of(repetitions: Sequence[Any]) -> Any:
    """One result of the same shape as each repetition's: dicts key by key, lists item by item, numbers their
    median (an int stays an int where every repetition agrees), anything else the first repetition's (labels,
    which must agree). Keys or items missing in some repetition keep the first repetition's shape."""
    first = repetitions[0]
    if isinstance(first, Mapping):
        return {key: median_of([r[key] for r in repetitions if isinstance(r, Mapping) and key in r]) for key in first}
    if isinstance(first, list | tuple) and all(
        isinstance(r, list | tuple) and len(r) == len(first) for r in repetitions
    ):
        return [median_of([r[i] for r in repetitions]) for i in range(len(first))]
    if is_number(first) and all(is_number(r) for r in repetitions):
        if all(r == first for r in repetitions):
            return first
        return statistics.median(float(r) for r in repetitions)
    return first


def spreads_of(repetitions: Sequence[Mapping[str, float]], keys: Sequence[str] | None = None) -> dict[str, Spread]:
    """`Spread` of each numeric key (`keys`, default every numeric key of the first repetition) over the
    repetitions; a key missing in a repetition counts as NaN there."""
    names = keys if keys is not None else [k for k, v in repetitions[0].items() if is_number(v)]
    return {k: Spread(tuple(float(r.get(k, math.nan)) for r in repetitions)) for k in names}


def is_number(value: object) -> bool:
    """A figure: an int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)
