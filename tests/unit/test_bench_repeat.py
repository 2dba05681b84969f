"""The benchmarks' repetition rules (benchmarks/_repeat.py) and the two-commit comparison's arithmetic
(benchmarks/bench_compare.py): alternation order, medians of nested results, spreads and their flags, per-round
ratios."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    """A benchmarks/ module, with benchmarks/ on sys.path only while it imports (the session's path stays as it
    was: benchmarks/ holds top-level modules whose names nothing else should resolve to)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        return importlib.import_module(name)


_repeat = _load("_repeat")
_compare = _load("bench_compare")
_procstat = _load("_procstat")
UNSTABLE_SPREAD, Spread, alternate = _repeat.UNSTABLE_SPREAD, _repeat.Spread, _repeat.alternate
median_of, spreads_of = _repeat.median_of, _repeat.spreads_of
_without_outputs, compare_rows, headline = _compare._without_outputs, _compare.compare_rows, _compare.headline


def counting_case(calls: list[str]):
    """`case(name)`: a run that records its name in `calls` and returns how many runs there were so far."""

    def case(name: str):
        def run() -> int:
            calls.append(name)
            return len(calls)

        return run

    return case


def test_cases_alternate_in_the_same_order_every_repetition() -> None:
    calls: list[str] = []
    case = counting_case(calls)
    results = alternate([("a", case("a")), ("b", case("b")), ("c", case("c"))], repetitions=3)
    assert calls == ["a", "b", "c"] * 3
    assert results == {"a": [1, 4, 7], "b": [2, 5, 8], "c": [3, 6, 9]}
    with pytest.raises(ValueError, match="repetitions must be >= 1"):
        alternate([("a", case("a"))], repetitions=0)


def test_warmup_repetitions_run_every_case_and_are_discarded() -> None:
    calls: list[str] = []
    case = counting_case(calls)
    results = alternate([("a", case("a")), ("b", case("b"))], repetitions=2, warmup=1)
    assert calls == ["a", "b"] * 3
    assert results == {"a": [3, 5], "b": [4, 6]}  # the first pass (1, 2) is not among the results


def test_median_of_nested_results_keeps_their_shape() -> None:
    reps = [
        {"model": "m", "bytes": 10, "gbps": 1.0, "cases": [{"case": "x", "s": 3.0}], "ok": True},
        {"model": "m", "bytes": 10, "gbps": 5.0, "cases": [{"case": "x", "s": 1.0}], "ok": True},
        {"model": "m", "bytes": 10, "gbps": 2.0, "cases": [{"case": "x", "s": 2.0}], "ok": True},
    ]
    assert median_of(reps) == {"model": "m", "bytes": 10, "gbps": 2.0, "cases": [{"case": "x", "s": 2.0}], "ok": True}
    assert isinstance(median_of(reps)["bytes"], int)  # every repetition agrees: the int stays
    assert median_of([{"n": 1}, {"n": 2}, {"n": 4}]) == {"n": 2.0}
    # a key one repetition lacks: the median of those that have it
    assert median_of([{"a": 1.0, "b": 7.0}, {"a": 3.0}, {"a": 2.0}]) == {"a": 2.0, "b": 7.0}


def test_spread_flags_figures_that_move_more_than_the_threshold() -> None:
    steady = Spread((1.0, 1.1, 1.05))
    assert (steady.median, steady.low, steady.high) == (1.05, 1.0, 1.1)
    assert steady.spread == pytest.approx(1.1) and not steady.unstable
    assert str(steady) == "1.050 [1.000-1.100]"
    moving = Spread((1.0, 1.0 * UNSTABLE_SPREAD + 0.01, 1.1))
    assert moving.unstable and str(moving).endswith("UNSTABLE")
    assert Spread((-0.1, 0.2, 0.05)).spread == math.inf  # changes sign: noise around zero
    assert Spread((-1.0, -1.1, -1.05)).spread == pytest.approx(1.1)
    assert Spread((0.0, 0.0, 0.0)).spread == 1.0
    assert Spread((1.0, math.nan, 1.0)).unstable  # missing in a repetition
    assert Spread((2.0, 2.0, 2.0)).to_json() == {
        "median": 2.0,
        "min": 2.0,
        "max": 2.0,
        "spread": 1.0,
        "unstable": False,
        "values": [2.0, 2.0, 2.0],
    }


def test_spreads_of_takes_every_numeric_key_and_marks_missing_ones() -> None:
    reps = [{"a": 1.0, "b": 2.0, "name": "x"}, {"a": 1.1, "b": 4.0, "name": "x"}, {"a": 1.0, "name": "x"}]
    spreads = spreads_of(reps)
    assert set(spreads) == {"a", "b"}
    assert not spreads["a"].unstable
    assert spreads["b"].unstable and math.isnan(spreads["b"].values[2])


def test_compare_reads_old_and_new_results_alike_and_ratios_per_round() -> None:
    old = {"ratio_vs_ceiling": 0.5, "wall_s": 600, "topologies": {"tp2_vs_tp1_total_s": 1.5}, "commit": "abc"}
    new = {
        "ratio_vs_ceiling": 0.6,
        "wall_s": 900,
        "repetitions": 3,
        "topologies": {"tp2_vs_tp1_total_s": 1.2, "fed_x": 0.9},
        "spread": {"ratio_vs_ceiling": {"median": 0.6}},
    }
    assert headline(old) == {"ratio_vs_ceiling": 0.5, "topologies.tp2_vs_tp1_total_s": 1.5}
    assert headline(new) == {
        "ratio_vs_ceiling": 0.6,
        "topologies.tp2_vs_tp1_total_s": 1.2,
        "topologies.fed_x": 0.9,
    }
    base = [{"k": 1.0, "gone": 1.0}, {"k": 2.0, "gone": 1.0}]
    this = [{"k": 1.5, "new": 3.0}, {"k": 2.0, "new": 3.0}]
    rows = {r["key"]: r for r in compare_rows(base, this)}
    assert rows["k"]["ratio"] == pytest.approx(1.25) and (rows["k"]["ratio_min"], rows["k"]["ratio_max"]) == (1.0, 1.5)
    assert not rows["k"]["resolved"]  # one round 1.0: no difference resolved
    assert rows["gone"]["missing"] == "this" and rows["new"]["missing"] == "base"
    resolved = compare_rows([{"k": 1.0}, {"k": 1.0}], [{"k": 1.3}, {"k": 1.1}])[0]
    assert resolved["resolved"] and resolved["ratio"] == pytest.approx(1.2)


def test_compare_gives_each_run_its_own_outputs() -> None:
    options = ["--quick", "--json", "a.json", "--png=b.png", "--models", "m", "--compare", "HEAD~1", "--log-dir", "d"]
    assert _without_outputs(options) == ["--quick", "--models", "m"]


def test_the_peak_sampler_sees_a_peak_its_polling_would_miss() -> None:
    """The sender's peak memory (peak_extra_mem_over_bucket) is the kernel's high-water mark, reset at start: a
    150 MiB allocation freed long before the next poll is still counted, as it is every time."""
    import os

    pid = os.getpid()
    sampler = _procstat.PeakSampler([pid], interval_s=60.0).start()  # the poll never runs while the peak lasts
    transient = bytearray(150 * 2**20)  # zero-filled: every page touched
    del transient
    assert sampler.stop()[pid] >= 140 * 2**20
