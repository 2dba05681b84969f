"""megatron-core's parallel-layout rules, shared by the trainer config and the parity harness."""

from __future__ import annotations

import pytest

from miles_sync.config import TrainerConfig
from miles_sync.megatron.parallel_layout import parallel_layout_problems, smallest_world_size
from miles_sync.parity.harness import ParityCase


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2, pp=1, ep=1, dp=1),
        dict(tp=1, pp=2, dp=1),
        dict(tp=2, pp=1, ep=2, etp=1, dp=2),
        dict(tp=2, pp=1, ep=2, etp=2, dp=2),  # the expert grid fills the whole stage
        dict(tp=1, pp=1, ep=4, etp=1, dp=4),
        dict(tp=4, pp=1, ep=2, etp=2, dp=1),  # experts split the tensor-parallel ranks
        dict(tp=2, pp=2, ep=4, etp=1, dp=2, world_size=8),
        dict(tp=2, pp=2, ep=2, world_size=8),  # dp derived: 2; etp defaults to tp
        dict(tp=2, pp=2, ep=2, etp=1, dp=1, num_layers=4, num_experts=8),
    ],
)
def test_valid_layouts_have_no_problems(layout):
    assert parallel_layout_problems(**layout) == []


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        (dict(tp=0, pp=1, dp=1), ["tp=0 must be at least 1"]),
        (
            dict(tp=1, pp=-1, ep=0, etp=0, dp=0, num_layers=0),
            [
                "pp=-1 must be at least 1",
                "ep=0 must be at least 1",
                "etp=0 must be at least 1",
                "dp=0 must be at least 1",
                "num_layers=0 must be at least 1",
            ],
        ),
        (dict(tp=2, pp=1, world_size=0), ["world_size=0 must be at least 1"]),
        (dict(tp=2, pp=2, world_size=6), ["world_size=6 is not divisible by tp*pp=2*2=4"]),
        (dict(tp=2, pp=1, dp=2, world_size=8), ["world_size=8 must equal tp*pp*dp=2*1*2=4"]),
        (
            dict(tp=2, pp=1, ep=3, etp=1, dp=1),
            ["etp*ep=1*3=3 does not divide tp*dp=2*1=2 (the expert layers need world_size=2 divisible by etp*ep*pp=3)"],
        ),
        (
            # etp defaults to tp: 2*2 expert ranks do not fit in a stage of 2*1 ranks.
            dict(tp=2, pp=2, ep=2, world_size=4),
            ["etp*ep=2*2=4 does not divide tp*dp=2*1=2 (the expert layers need world_size=4 divisible by etp*ep*pp=8)"],
        ),
        (dict(tp=1, pp=1, ep=4, dp=4, num_experts=6), ["num_experts=6 is not divisible by ep=4"]),
        (dict(tp=1, pp=2, dp=1, num_layers=3), ["num_layers=3 is not divisible by pp=2"]),
        (
            dict(tp=2, pp=2, ep=4, etp=1, dp=1, num_layers=3, num_experts=6),
            [
                "etp*ep=1*4=4 does not divide tp*dp=2*1=2",
                "num_experts=6 is not divisible by ep=4",
                "num_layers=3 is not divisible by pp=2",
            ],
        ),
    ],
)
def test_invalid_layouts_name_each_factor(layout, expected):
    problems = parallel_layout_problems(**layout)
    assert len(problems) == len(expected), problems
    for problem, part in zip(problems, expected, strict=True):
        assert part in problem


def test_dp_or_world_size_is_required():
    with pytest.raises(TypeError, match="dp or world_size"):
        parallel_layout_problems(tp=1, pp=1)


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        (dict(tp=2, pp=1, ep=1), 2),
        (dict(tp=1, pp=1, ep=2), 2),
        (dict(tp=2, pp=2, ep=2), 8),  # etp = tp: tp*pp*ep
        (dict(tp=2, pp=1, ep=2, etp=1), 2),  # the expert grid fits the tensor-parallel ranks
        (dict(tp=2, pp=1, ep=3, etp=1), 6),
        (dict(tp=0, pp=1, ep=1), 1),  # bad factors count as 1; the problems name them
    ],
)
def test_smallest_world_size(layout, expected):
    world_size = smallest_world_size(**layout)
    assert world_size == expected
    if min(layout.values()) >= 1:
        assert parallel_layout_problems(**layout, world_size=world_size) == []


@pytest.mark.parametrize(
    ("trainer", "case"),
    [
        (dict(tp=2, ep=3, etp=1), dict(tp=2, ep=3, etp=1)),
        (dict(tp=2, ep=2, etp=2), dict(tp=2, ep=2)),  # the case's etp defaults to tp
        (dict(tp=0), dict(tp=0)),
    ],
)
def test_config_and_parity_harness_refuse_a_layout_with_the_same_words(trainer, case):
    expected = parallel_layout_problems(**trainer, pp=1, dp=1)
    assert expected
    with pytest.raises(ValueError) as from_config:
        TrainerConfig(**trainer)
    with pytest.raises(ValueError) as from_harness:
        ParityCase(arch="qwen3_moe", num_experts=12, **case).validate(world_size=max(case["tp"], 1))
    for problem in expected:
        assert problem in str(from_config.value)
        assert problem in str(from_harness.value)


def test_parity_case_passes_model_facts():
    with pytest.raises(ValueError) as info:
        ParityCase(arch="qwen3_moe", ep=2, num_experts=3, num_layers=3, pp=1).validate(world_size=2)
    assert "num_experts=3 is not divisible by ep=2" in str(info.value)
    # Experts are an MoE fact: a dense arch's unused num_experts is not checked against ep.
    ParityCase(arch="qwen3", num_experts=3).validate(world_size=2)
    with pytest.raises(ValueError, match="num_layers=3 is not divisible by pp=2"):
        ParityCase(arch="qwen3", pp=2, num_layers=3).validate(world_size=2)
