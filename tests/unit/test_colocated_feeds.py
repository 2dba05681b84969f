"""The colocated feed assignment is pure: each engine TP rank fed by the trainer rank on its own device, each engine
posted by its TP rank 0's feeder, every unfed engine rank refused by name; derived from a placement plan. Spread
feeds (p2p: no device ties a feeder) go round robin over the trainer ranks, or over one pipeline stage's ranks. The
records the fan-out exchanges survive a pickle round trip (torch's object collectives pickle them)."""

from __future__ import annotations

import pickle

import pytest
import torch

from miles_sync.job.placement import Resources, plan_colocated_feeds, plan_placement
from miles_sync.transport.colocated import FlattenedContents
from miles_sync.transport.fan_out import BucketAnnouncement, FedPayload, RankHandles, RankOutcomes, SendEnd
from miles_sync.transport.feeds import Device, EngineFeed, FeedPlan, FeedRole, plan_feeds, plan_spread_feeds
from miles_sync.transport.membership import EngineEndpoint
from miles_sync.transport.shard_direct import DirectContents, RankContents
from miles_sync.weights.engine_layout import TPShape
from miles_sync.weights.layout import WeightLayout
from miles_sync.weights.shard_plan import DirectLayout
from miles_sync.wire.bucket import BucketEntry
from miles_sync.wire.protocol import Selector

CPU = Resources(num_cpus=0.01)


def gpu(node: str, index: int) -> Device:
    return Device(node=node, index=index)


A0, A1, A2, A3 = (gpu("10.0.0.1", i) for i in range(4))
B0, B1 = gpu("10.0.0.2", 0), gpu("10.0.0.2", 1)


@pytest.mark.parametrize(
    "trainer_devices, engine_devices, feeders, posters",
    [
        # 2 engines x TP=2 over 4 trainer ranks: each engine rank fed by its own device's trainer rank.
        ([A0, A1, A2, A3], [[A0, A1], [A2, A3]], [(0, 1), (2, 3)], [0, 2]),
        # Engine ranks listed out of device order: the assignment follows the devices, not the positions.
        ([A0, A1, A2, A3], [[A3, A2], [A1, A0]], [(3, 2), (1, 0)], [3, 1]),
        # Today's reference fleet: 2 TP=1 engines over 2 trainer ranks; engine j fed by rank j.
        ([A0, A1], [[A0], [A1]], [(0,), (1,)], [0, 1]),
        # Two trainer ranks on one device (e.g. CPU bundles sharing a node slot): the lowest rank feeds.
        ([A0, A0, A1, A1], [[A0, A1]], [(0, 2)], [0]),
        # Same index on two nodes are two devices.
        ([A0, B0, A1, B1], [[B0, B1], [A0, A1]], [(1, 3), (0, 2)], [1, 0]),
        # Fewer engine ranks than trainer ranks: the spare trainer ranks feed nobody.
        ([A0, A1, A2, A3], [[A2]], [(2,)], [2]),
    ],
)
def test_each_engine_rank_is_fed_from_its_own_device(trainer_devices, engine_devices, feeders, posters):
    plan = plan_feeds(trainer_devices=trainer_devices, engine_devices=engine_devices)
    assert plan.num_trainers == len(trainer_devices)
    assert [e.feeders for e in plan.engines] == feeders
    assert [e.poster for e in plan.engines] == posters
    for engine, ranks in zip(plan.engines, engine_devices):
        assert [trainer_devices[f] for f in engine.feeders] == ranks


def test_a_layout_with_unfed_engine_ranks_is_refused_naming_every_one():
    with pytest.raises(ValueError) as refused:
        plan_feeds(trainer_devices=[A0, A1], engine_devices=[[A0, A2], [B0, B1]])
    message = str(refused.value)
    for rank in ("engine 0 TP rank 1 on", "engine 1 TP rank 0 on", "engine 1 TP rank 1 on"):
        assert rank in message
    assert "engine 0 TP rank 0" not in message  # fed: not named
    assert "index=2" in message and "node='10.0.0.2'" in message


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(trainer_devices=[], engine_devices=[[A0]]), ["no trainer ranks", "engine 0 TP rank 0"]),
        (dict(trainer_devices=[A0], engine_devices=[]), ["no engines"]),
        (dict(trainer_devices=[A0], engine_devices=[[A0], []]), ["engine 1 has no TP ranks"]),
    ],
)
def test_empty_inputs_are_refused(kwargs, named):
    with pytest.raises(ValueError) as refused:
        plan_feeds(**kwargs)
    for part in named:
        assert part in str(refused.value)


def test_plan_answers_each_ranks_part():
    plan = plan_feeds(trainer_devices=[A0, A1, A2, A3], engine_devices=[[A0, A1], [A2, A3]])
    assert plan.feeding_ranks == (0, 1, 2, 3)
    assert [plan.feeds_of(r) for r in range(4)] == [((0, 0),), ((0, 1),), ((1, 0),), ((1, 1),)]
    assert [plan.posted_by(r) for r in range(4)] == [(0,), (), (1,), ()]
    assert FeedRole(plan=plan, rank=1, source_rank=0).members == (0, 1, 2, 3)
    # A source that feeds nobody still packs every bucket: it is a member of the fan-out.
    spare = plan_feeds(trainer_devices=[A0, A1, A2], engine_devices=[[A1], [A2]])
    assert FeedRole(plan=spare, rank=0, source_rank=0).members == (0, 1, 2)
    assert not FeedRole(plan=spare, rank=3, source_rank=0).is_member


def test_single_source_plan_feeds_everything_from_one_rank():
    plan = FeedPlan.single_source(tp_sizes=[2, 1])
    assert plan.engines == (EngineFeed(feeders=(0, 0), poster=0), EngineFeed(feeders=(0,), poster=0))
    assert plan.feeds_of(0) == ((0, 0), (0, 1), (1, 0)) and FeedRole(plan=plan, rank=0, source_rank=0).members == (0,)


def test_plan_is_checked_against_the_engines_it_is_used_with():
    plan = plan_feeds(trainer_devices=[A0, A1], engine_devices=[[A0], [A1]])
    plan.check_engines([EngineEndpoint(url="http://a", tp_size=1), EngineEndpoint(url="http://b", tp_size=1)])
    with pytest.raises(ValueError) as refused:
        plan.check_engines([EngineEndpoint(url="http://a", tp_size=2)])
    assert "covers 2 engine(s), the fleet has 1" in str(refused.value)
    assert "engine 0 (http://a) runs 2 TP rank(s), the plan feeds 1" in str(refused.value)


@pytest.mark.parametrize(
    "num_trainers, tp_sizes, ranks, feeders",
    [
        (2, [2], None, [(0, 1)]),  # trainer TP equals engine TP: rank r feeds engine rank r
        (2, [1, 1], None, [(0,), (1,)]),
        (2, [2, 1], None, [(0, 1), (0,)]),  # replicas wrap around
        (1, [2], None, [(0, 0)]),
        (4, [1, 1], (0, 1), [(0,), (1,)]),  # pipeline stage 0 of TP=2 x PP=2
        (4, [1, 1], (2, 3), [(2,), (3,)]),  # stage 1: its own ranks feed every engine its own layers
        (4, [2, 1], (2, 3), [(2, 3), (2,)]),
    ],
)
def test_spread_feeds_go_round_robin_over_the_ranks_given(num_trainers, tp_sizes, ranks, feeders):
    plan = plan_spread_feeds(num_trainers=num_trainers, tp_sizes=tp_sizes, ranks=ranks)
    assert [e.feeders for e in plan.engines] == feeders
    assert [e.poster for e in plan.engines] == [f[0] for f in feeders]
    assert plan.num_trainers == num_trainers


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(num_trainers=0, tp_sizes=[1]), "no trainer ranks"),
        (dict(num_trainers=2, tp_sizes=[1], ranks=()), "no trainer ranks"),
        (
            dict(num_trainers=2, tp_sizes=[1], ranks=(1, 2)),
            "ranks [1, 2] are not distinct ranks of a trainer group of 2",
        ),
        (dict(num_trainers=2, tp_sizes=[1], ranks=(1, 1)), "ranks [1, 1] are not distinct"),
        (dict(num_trainers=2, tp_sizes=[]), "no engines"),
        (dict(num_trainers=2, tp_sizes=[0]), "engine 0 has 0 TP ranks"),
    ],
)
def test_spread_feeds_refuse_bad_input_by_name(kwargs, named):
    with pytest.raises(ValueError, match="cannot spread feeds") as raised:
        plan_spread_feeds(**kwargs)
    assert named in str(raised.value)


def test_a_stage_role_counts_only_its_stages_ranks_as_members():
    plan = plan_spread_feeds(num_trainers=4, tp_sizes=[1, 1], ranks=(2, 3))
    assert FeedRole(plan=plan, rank=2, source_rank=2, every_rank=True, stage_ranks=(2, 3)).members == (2, 3)
    assert FeedRole(plan=plan, rank=2, source_rank=2, every_rank=True).members == (0, 1, 2, 3)


@pytest.mark.parametrize(
    "num_trainers, num_engines, tp, feeders",
    [
        (2, 2, 1, [(0,), (1,)]),  # the main job and the Ray fleet: engine j fed by trainer rank j
        (4, 2, 2, [(0, 1), (2, 3)]),  # engine j's TP rank r on bundle j * 2 + r
        (4, 1, 4, [(0, 1, 2, 3)]),
    ],
)
def test_feeds_follow_the_colocated_placement(num_trainers, num_engines, tp, feeders):
    placement = plan_placement(
        layout="colocated",
        num_trainers=num_trainers,
        num_engines=num_engines,
        trainer=CPU,
        engine=CPU,
        engine_tp_size=tp,
    )
    plan = plan_colocated_feeds(placement)
    assert [e.feeders for e in plan.engines] == feeders
    assert [e.poster for e in plan.engines] == [f[0] for f in feeders]


def test_disaggregated_placement_is_refused_for_the_colocated_transport():
    placement = plan_placement(layout="disaggregated", num_trainers=2, num_engines=2, trainer=CPU, engine=CPU)
    with pytest.raises(ValueError, match="needs the colocated placement layout, got 'disaggregated'"):
        plan_colocated_feeds(placement)


@pytest.mark.parametrize(
    "record",
    [
        Device(node="10.0.0.1", index=3),
        plan_feeds(trainer_devices=[A0, A1], engine_devices=[[A0, A1]]),
        FeedRole(plan=FeedPlan.single_source(tp_sizes=[1]), rank=0, source_rank=0),
        BucketAnnouncement(
            index=2,
            selector=Selector.TARGET,
            contents=FlattenedContents(
                num_bytes=8, entries=(BucketEntry(name="w", shape=(2,), dtype=torch.float32, start=0, end=8),)
            ),
        ),
        SendEnd(error="the source failed: boom"),
        RankHandles(rank=1, payloads=(FedPayload(engine=0, tp_rank=1, feeder=1, payload="abc"),)),
        RankHandles(rank=2, payloads=(), error="rank 2 could not encode its handles"),
        RankOutcomes(rank=0, failures=("http://a: refused",)),
        EngineEndpoint(
            url="http://a",
            tp_size=2,
            direct=DirectLayout(
                shape=TPShape(
                    hidden_size=64,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    head_dim=16,
                    intermediate_size=128,
                    vocab_size=100,
                ),
                tp_size=2,
                weight_layout=WeightLayout.AITER,
                num_target_layers=2,
            ),
        ),
        DirectContents(
            ranks=(
                RankContents(
                    layout=0,
                    tp_rank=1,
                    num_bytes=8,
                    entries=(BucketEntry(name="w", shape=(2,), dtype=torch.float32, start=0, end=8),),
                ),
            )
        ),
    ],
)
def test_records_round_trip(record):
    assert pickle.loads(pickle.dumps(record)) == record
