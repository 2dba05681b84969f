"""What the controller plans from the trainer ranks' RankInfo, before any call: which ranks form each pipeline
stage and which of them is its export source (`stage_members`), and whether the colocated transport's feeds stay
on their nodes (`colocated_node_problems`). Pure; the Ray shell (actors/remote_source.py) only executes the plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles_sync.env import node_of_url
from miles_sync.sync.source import RankInfo
from miles_sync.transport.feeds import FeedPlan, feed_node_problems
from miles_sync.transport.membership import EngineEndpoint
from miles_sync.wire.text import raise_if

__all__ = ["colocated_node_problems", "stage_members"]


@dataclass(frozen=True, kw_only=True)
class StageMembers:
    """One pipeline stage: the positions (in the given rank order) of its ranks, and which of them is its source."""

    stage: int
    members: tuple[int, ...]
    source_index: int  # within `members`


def stage_members(infos: Sequence[RankInfo]) -> list[StageMembers]:
    """The stages in order, over the ranks whose RankInfo names each; raises ValueError when a stage has no export
    source or several, or the stages do not number 0..n-1."""
    by_stage: dict[int, list[int]] = {}
    for index, info in enumerate(infos):
        by_stage.setdefault(info.pp_rank, []).append(index)
    problems = []
    if sorted(by_stage) != list(range(len(by_stage))):
        problems.append(f"the ranks report pipeline stages {sorted(by_stage)}, not 0..{len(by_stage) - 1}")
    stages = []
    for stage in sorted(by_stage):
        members = by_stage[stage]
        sources = [i for i in members if infos[i].is_source]
        if len(sources) != 1:
            problems.append(
                f"pipeline stage {stage} has {len(sources)} export source ranks {[infos[i].rank for i in sources]}; "
                f"each stage needs exactly one (its tp 0 / dp 0 rank)"
            )
            continue
        stages.append(StageMembers(stage=stage, members=tuple(members), source_index=members.index(sources[0])))
    raise_if(problems, what="trainer ranks do not form a pipeline")
    return stages


def colocated_node_problems(ranks: Sequence[RankInfo], engines: Sequence[EngineEndpoint]) -> list[str]:
    """Each engine rank the colocated transport would feed from a trainer rank on another node, naming both nodes
    (`transport.feeds.feed_node_problems`); every stage's source follows its feed plan, or feeds every engine rank
    itself without one. A plan for another engine count is the plan's own check, at open."""
    if not ranks:
        return []
    nodes = {info.rank: info.node for info in ranks}
    trainer_nodes = [nodes.get(r, "?") for r in range(max(nodes) + 1)]
    engine_nodes = [node_of_url(e.url) for e in engines]
    problems = []
    for source in (info for info in ranks if info.is_source):
        plan = source.feeds
        if plan is None:
            plan = FeedPlan.single_source(
                tp_sizes=[e.tp_size for e in engines], rank=source.rank, num_trainers=len(trainer_nodes)
            )
        if len(plan.engines) == len(engines):
            problems += feed_node_problems(
                plan=plan, trainer_nodes=trainer_nodes, engines=engines, engine_nodes=engine_nodes
            )
    return problems
