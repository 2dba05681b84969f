"""Placement planning is pure: bundles, slots and shared bundles for both layouts, and every refusal named."""

from __future__ import annotations

import pytest

from miles_sync.job.placement import ActorRole, PlacementLayout, Resources, plan_placement

CPU = Resources(num_cpus=0.01)
GPU_TRAINER = Resources(num_cpus=1, num_gpus=1)
GPU_ENGINE = Resources(num_cpus=1, num_gpus=0.2)
TRAIN_POOL = Resources(num_cpus=0.01, custom=(("trainer_node", 1.0),))
ROLLOUT_POOL = Resources(num_cpus=0.01, custom=(("rollout_node", 1.0),))


def _shared_bundles(plan) -> dict[int, tuple[int, ...]]:
    """Engine index -> the trainer ranks in the same bundle (empty tuples when disaggregated)."""
    return {
        e.index: tuple(t.index for t in plan.trainers if (t.group, t.bundle) == (e.group, e.bundle))
        for e in plan.engines
    }


def _bundles(plan):
    return [[b.as_bundle() for b in g.bundles] for g in plan.groups]


def _slots(slots):
    return [(s.index, s.group, s.bundle) for s in slots]


@pytest.mark.parametrize(
    "num_trainers, num_engines, tp, trainer, engine, bundles, engine_slots, shared",
    [
        # One engine per trainer rank: every bundle holds one of each.
        (2, 2, 1, CPU, CPU, [[{"CPU": 0.02}, {"CPU": 0.02}]], [(0, 0, 0), (1, 0, 1)], {0: (0,), 1: (1,)}),
        # One engine spanning 4 GPUs: its actor sits on the bundle of its first TP rank.
        (
            4,
            1,
            4,
            GPU_TRAINER,
            GPU_ENGINE,
            [[{"CPU": 2, "GPU": 1.2}, {"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}]],
            [(0, 0, 0)],
            {0: (0,)},
        ),
        # Two TP-2 engines over four trainer GPUs: engines on bundles 0 and 2.
        (
            4,
            2,
            2,
            GPU_TRAINER,
            GPU_ENGINE,
            [[{"CPU": 2, "GPU": 1.2}, {"CPU": 1, "GPU": 1}, {"CPU": 2, "GPU": 1.2}, {"CPU": 1, "GPU": 1}]],
            [(0, 0, 0), (1, 0, 2)],
            {0: (0,), 1: (2,)},
        ),
    ],
)
def test_colocated_plans_share_a_bundle_per_engine(
    num_trainers, num_engines, tp, trainer, engine, bundles, engine_slots, shared
):
    plan = plan_placement(
        layout="colocated",
        num_trainers=num_trainers,
        num_engines=num_engines,
        trainer=trainer,
        engine=engine,
        engine_tp_size=tp,
    )
    assert plan.layout is PlacementLayout.COLOCATED
    assert _bundles(plan) == bundles
    assert _slots(plan.trainers) == [(i, 0, i) for i in range(num_trainers)]
    assert _slots(plan.engines) == engine_slots
    assert _shared_bundles(plan) == shared
    assert {s.role for s in plan.trainers} == {ActorRole.TRAINER}
    assert {s.role for s in plan.engines} == {ActorRole.ENGINE}
    # Every actor fits in its bundle: the sum of what the slots of a bundle ask for is exactly the bundle.
    for g, group in enumerate(plan.groups):
        for b, bundle in enumerate(group.bundles):
            asked = [s.resources for s in plan.slots() if (s.group, s.bundle) == (g, b)]
            total = asked[0]
            for more in asked[1:]:
                total = total + more
            assert total.as_bundle() == bundle.as_bundle()


@pytest.mark.parametrize(
    "num_trainers, num_engines, trainer, engine, bundles",
    [
        (2, 2, CPU, CPU, [[{"CPU": 0.01}] * 2, [{"CPU": 0.01}] * 2]),
        (
            2,
            3,
            TRAIN_POOL,
            ROLLOUT_POOL,
            [
                [{"CPU": 0.01, "trainer_node": 1.0}] * 2,
                [{"CPU": 0.01, "rollout_node": 1.0}] * 3,
            ],
        ),
        (8, 1, GPU_TRAINER, Resources(num_cpus=4, num_gpus=8), [[{"CPU": 1, "GPU": 1}] * 8, [{"CPU": 4, "GPU": 8}]]),
    ],
)
def test_disaggregated_plans_keep_trainers_and_engines_apart(num_trainers, num_engines, trainer, engine, bundles):
    plan = plan_placement(
        layout=PlacementLayout.DISAGGREGATED,
        num_trainers=num_trainers,
        num_engines=num_engines,
        trainer=trainer,
        engine=engine,
    )
    assert [g.name for g in plan.groups] == ["trainers", "engines"]
    assert [g.strategy for g in plan.groups] == ["PACK", "PACK"]
    assert _bundles(plan) == bundles
    assert _slots(plan.trainers) == [(i, 0, i) for i in range(num_trainers)]
    assert _slots(plan.engines) == [(j, 1, j) for j in range(num_engines)]
    assert _shared_bundles(plan) == {j: () for j in range(num_engines)}


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (dict(layout="sideways"), ["layout='sideways'"]),
        (dict(num_trainers=0, num_engines=-1), ["num_trainers=0", "num_engines=-1"]),
        (dict(engine_tp_size=0), ["engine_tp_size=0"]),
        (dict(strategy="TIGHT"), ["strategy='TIGHT'"]),
        (dict(trainer=Resources(), engine=Resources()), ["trainer resources are empty", "engine resources are empty"]),
        (dict(layout="colocated", num_trainers=4, num_engines=3), ["3 * 1 != 4"]),
        (dict(layout="colocated", num_trainers=2, num_engines=2, engine_tp_size=2), ["2 * 2 != 2"]),
    ],
)
def test_bad_plans_name_every_offending_value(kwargs, fragments):
    arguments = dict(layout="disaggregated", num_trainers=2, num_engines=2, trainer=CPU, engine=CPU) | kwargs
    with pytest.raises(ValueError) as info:
        plan_placement(**arguments)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_resources_add_merge_custom_amounts_and_drop_zeros():
    a = Resources(num_cpus=1, custom=(("x", 1.0),))
    b = Resources(num_gpus=0.5, custom=(("x", 0.5), ("y", 2.0)))
    total = a + b
    assert total == Resources(num_cpus=1, num_gpus=0.5, custom=(("x", 1.5), ("y", 2.0)))
    assert total.as_bundle() == {"CPU": 1, "GPU": 0.5, "x": 1.5, "y": 2.0}
    assert Resources(num_cpus=0.01).as_bundle() == {"CPU": 0.01}
    assert Resources(num_cpus=0.01).as_actor_options() == {"num_cpus": 0.01, "num_gpus": 0.0, "resources": {}}
    assert Resources().is_empty and not a.is_empty


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(num_cpus=-1), "num_cpus=-1"),
        (dict(custom=(("x", -2.0),)), "custom[x]=-2.0"),
        (dict(custom=(("x", 1.0), ("x", 2.0))), "['x'] are listed more than once"),
        (dict(custom=(("GPU", 1.0),)), "['GPU'] must be given as num_cpus / num_gpus"),
    ],
)
def test_bad_resources_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match="invalid Resources") as info:
        Resources(**kwargs)
    assert fragment in str(info.value)
