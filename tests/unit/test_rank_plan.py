"""The controller's plan over trainer ranks (miles_sync.sync.rank_plan): pipeline stages and their sources, and
colocated feeds that would cross nodes. Pure tables; the Ray tier runs the same plans on real trainer actors."""

from __future__ import annotations

import pytest

from miles_sync.sync.rank_plan import StageMembers, colocated_node_problems, stage_members
from miles_sync.sync.source import RankInfo
from miles_sync.transport.feeds import EngineFeed, FeedPlan
from miles_sync.transport.membership import EngineEndpoint


def rank(r: int, *, pp: int = 0, source: bool = False, node: str = "127.0.0.2", feeds=None) -> RankInfo:
    return RankInfo(
        rank=r,
        world_size=4,
        tp_rank=r % 2,
        pp_rank=pp,
        dp_rank=0,
        is_source=source,
        num_exported_tensors=3,
        node=node,
        feeds=feeds,
    )


def test_two_stages_in_order_each_with_its_source_position():
    infos = [rank(0, pp=1), rank(1, pp=1, source=True), rank(2, pp=0, source=True), rank(3, pp=0)]
    assert stage_members(infos) == [
        StageMembers(stage=0, members=(2, 3), source_index=0),
        StageMembers(stage=1, members=(0, 1), source_index=1),
    ]


@pytest.mark.parametrize(
    ("infos", "message"),
    [
        ([rank(0), rank(1)], "pipeline stage 0 has 0 export source ranks []"),
        ([rank(0, source=True), rank(1, source=True)], "pipeline stage 0 has 2 export source ranks [0, 1]"),
        ([rank(0, source=True), rank(1, pp=2, source=True)], "the ranks report pipeline stages [0, 2], not 0..1"),
    ],
)
def test_ranks_that_do_not_form_a_pipeline_are_refused_naming_why(infos, message):
    with pytest.raises(ValueError, match="trainer ranks do not form a pipeline") as caught:
        stage_members(infos)
    assert message in str(caught.value)


def test_feeds_on_their_own_nodes_pass_and_a_cross_node_feed_is_named():
    plan = FeedPlan(num_trainers=2, engines=(EngineFeed(feeders=(0,), poster=0), EngineFeed(feeders=(1,), poster=1)))
    engines = [EngineEndpoint(url="http://127.0.0.2:1", tp_size=1), EngineEndpoint(url="http://127.0.0.3:1", tp_size=1)]
    on_nodes = [rank(0, source=True, node="127.0.0.2", feeds=plan), rank(1, node="127.0.0.3", feeds=plan)]
    assert colocated_node_problems(on_nodes, engines) == []
    crossed = [rank(0, source=True, node="127.0.0.2", feeds=plan), rank(1, node="127.0.0.2", feeds=plan)]
    problems = colocated_node_problems(crossed, engines)
    assert len(problems) == 1 and "127.0.0.3" in problems[0], problems


def test_a_source_without_a_plan_feeds_every_engine_rank_itself():
    engines = [EngineEndpoint(url="http://127.0.0.3:1", tp_size=2)]
    problems = colocated_node_problems([rank(0, source=True, node="127.0.0.2")], engines)
    assert problems == [
        "engine 0 (http://127.0.0.3:1) on node 127.0.0.3 would be fed across nodes by rank 0 on 127.0.0.2 "
        "(no trainer rank runs on it)"
    ]
    assert colocated_node_problems([], engines) == []
