"""Trainers with pipeline and expert parallelism on a local Ray cluster (one for the module): 4 trainer ranks
(TP=2 x PP=2) of the dense reference model, and 2 trainer ranks (TP=2 x EP=2) of the Qwen3-MoE reference model,
each fleet with 2 reference engines of its model (frozen MTP draft, AITER layout).

- the RL step runs on all four ranks (megatron-core's pipeline schedule over gloo) and every rank reports the
  same loss;
- each stage's source rank exports only its own layers, through an update group of its own (distributed) or its
  own posts (colocated, shard_direct); with p2p every rank of each stage sends its own shards, with no gather, over
  the stage's own channels to the engines' custom weight loader; every sync commits, verified on both engines, and
  the engines serve the new version;
- a stage whose source rank dies mid-sync fails the sync within the timeouts, nothing is committed, and after the
  trainer group is restarted the next sync commits, verified;
- the MoE group trains with its experts split over two EP ranks, and its source rank sends every expert (its own
  and those gathered from the other EP rank), verified on every transport (shard_direct: as stacked FusedMoE
  parameters; p2p: each EP rank builds its engine's stacked experts from its own and the other rank's, sent point
  to point through the engines' custom weight loader).

What each engine was posted is read by a recording proxy in front of it (tests/recording_proxy.py); the gather
export is refused, and a rank killed at a given unit of it, from inside the trainer processes (tests/rank_probes.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import ray
from rank_probes import GATHERED_UNIT, refuse_gather, unwrap_calls, wrap_calls
from ray_fleet import RAY_TIMEOUT_S, current_urls, target_checksum
from recording_proxy import p2p_ticket, recording_proxy

from actors.controller import create_controller
from actors.rollout import EngineGroup, create_engines
from actors.trainer import TrainerGroup, create_trainers
from miles_sync.config import ModelConfig, SyncConfig, TrainerConfig
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.job.trainer import TrainBatch
from miles_sync.sync.attach import attached_source
from miles_sync.sync.selector import SelectorMode
from miles_sync.transport.base import TransportKind
from miles_sync.transport.p2p_loader import LOADER_PATH
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.draft import DraftKind
from miles_sync.wire.protocol import SamplingParams, Selector

pytestmark = pytest.mark.slow

MODEL = ModelConfig(arch="qwen3", speculative_algorithm="NEXTN", num_trained_mtp_layers=0)
TRAINER = TrainerConfig(tp=2, pp=2, lr=1e-3)
MOE_MODEL = ModelConfig(arch="qwen3_moe", speculative_algorithm="NEXTN", num_trained_mtp_layers=0)
MOE_TRAINER = TrainerConfig(tp=2, ep=2, lr=1e-3)  # the main job's MoE layout: experts split over the TP ranks
COLLECTIVE_TIMEOUT_S = 20.0
SYNC = dict(
    bucket_bytes=256 * 1024,
    http_timeout_s=20.0,
    collective_timeout_s=20.0,
    sync_timeout_s=90.0,
    selector=SelectorMode.TARGET,
)
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)
BATCH = TrainBatch(
    sequences=((1, 22, 127, 124, 109, 34, 187, 168), (5, 42, 227, 100, 245, 190, 183, 148)),
    num_prompt_tokens=(4, 4),
    rewards=(1.0, 0.0),
)


@dataclass
class PipelineFleet:
    engines: EngineGroup
    trainers: TrainerGroup
    checkpoint_dir: str

    def stage_sources(self) -> list[int]:
        """Index of each stage's export source rank, in stage order."""
        sources = sorted((info.pp_rank, i) for i, info in enumerate(self.trainers.ranks) if info.is_source)
        return [i for _, i in sources]


@contextlib.contextmanager
def started(checkpoint: str, trainer: TrainerConfig, log_dir) -> Iterator[PipelineFleet]:
    spec = ReferenceEngineSpec(
        model_dir=checkpoint,
        draft_kind=DraftKind.MTP,
        weight_layout=WeightLayout.AITER,
        collective_timeout_s=20.0,
        custom_weight_loaders=(LOADER_PATH,),  # for p2p; unused by the other transports
    )
    with contextlib.ExitStack() as stack:
        engines = create_engines(specs=[spec, spec], log_dir=log_dir)
        stack.callback(engines.shutdown)
        trainers = create_trainers(
            trainer=trainer, checkpoint_dir=checkpoint, collective_timeout_s=COLLECTIVE_TIMEOUT_S
        )
        fleet = PipelineFleet(engines=engines, trainers=trainers, checkpoint_dir=checkpoint)
        stack.callback(lambda: fleet.trainers.shutdown())
        yield fleet


@pytest.fixture(scope="module")
def fleet(cluster, reference_checkpoints, tmp_path_factory) -> Iterator[PipelineFleet]:
    with started(str(reference_checkpoints / "target"), TRAINER, tmp_path_factory.mktemp("engines")) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def moe_fleet(cluster, reference_moe_checkpoint, tmp_path_factory) -> Iterator[PipelineFleet]:
    with started(str(reference_moe_checkpoint), MOE_TRAINER, tmp_path_factory.mktemp("moe-engines")) as fleet:
        yield fleet


@contextlib.contextmanager
def controller_for(
    fleet: PipelineFleet,
    transport: TransportKind,
    *,
    model: ModelConfig = MODEL,
    staged: bool = False,
    urls: tuple[str, ...] | None = None,
) -> Iterator[object]:
    """A controller over the fleet's engines at `urls` (default: theirs; a proxy's URL speaks for its engine)."""
    handle = create_controller(
        trainers=fleet.trainers.actors,
        engine_urls=current_urls(fleet.engines.actors) if urls is None else urls,
        sync=SyncConfig(transport=transport, staged=staged, **SYNC),
        model=model,
    )
    try:
        yield handle
    finally:
        ray.get(handle.close.remote(), timeout=RAY_TIMEOUT_S)
        ray.kill(handle)


def assert_verified(report, *, num_tensors: int) -> None:
    assert report.committed, report.summary()
    assert report.selector is Selector.TARGET and report.num_tensors == num_tensors
    for engine in report.engines:
        assert engine.success and not engine.is_stale and engine.num_verified_tensors == num_tensors, engine


def test_the_rl_step_runs_on_every_rank_of_the_pipeline(fleet):
    steps = fleet.trainers.train_step(BATCH, timeout_s=RAY_TIMEOUT_S)
    assert len(steps) == 4 and len({(s.loss, s.mean_token_nll) for s in steps}) == 1, steps
    assert [info.pp_rank for info in fleet.trainers.ranks] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    "transport", [TransportKind.DISTRIBUTED, TransportKind.COLOCATED, TransportKind.SHARD_DIRECT, TransportKind.P2P]
)
def test_each_stage_sends_its_own_layers_and_the_sync_verifies(fleet, transport):
    fleet.trainers.train_step(BATCH, timeout_s=RAY_TIMEOUT_S)
    names = [
        ray.get(fleet.trainers.actors[i].__ray_call__.remote(lambda actor: attached_source().exported_names()))
        for i in fleet.stage_sources()
    ]
    assert names[0] and names[1] and not set(names[0]) & set(names[1])
    assert any(".embed_tokens." in n for n in names[0]) and any("lm_head" in n for n in names[1])
    if transport is TransportKind.P2P:
        refuse_gather(fleet.trainers.actors)
    pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in fleet.trainers.actors], timeout=60)
    try:
        with contextlib.ExitStack() as stack:
            proxies = [
                stack.enter_context(recording_proxy(u, clients=pids)) for u in current_urls(fleet.engines.actors)
            ]
            with controller_for(fleet, transport, urls=tuple(p.url for p in proxies)) as controller:
                report = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
                status = ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S)
    finally:
        if transport is TransportKind.P2P:
            unwrap_calls(fleet.trainers.actors, GATHERED_UNIT)
    if transport is TransportKind.P2P:
        # Every stage feeds both engines its own layers from its own ranks (spread feeds within the stage: ranks
        # 0, 1 for stage 0 and 2, 3 for stage 1), each rank sending its own shards, nothing gathered: each ticket
        # comes over its stage's channel (slot: the stage's source rank) from that channel's one feeder, the rank
        # that posted it (the poster is the feeder of TP rank 0).
        sources = fleet.stage_sources()
        stage_of = {i: info.pp_rank for i, info in enumerate(fleet.trainers.ranks)}
        fed = set()
        for engine, proxy in enumerate(proxies):
            for r in proxy.posts("/update_weights_from_tensor"):
                (ticket,) = (p2p_ticket(h) for h in r.body["serialized_named_tensors"])
                poster = pids.index(r.client_pid)
                assert ticket.channel.world_size == 2 and {p.source for p in ticket.params} == {0}, ticket
                assert ticket.channel.slot == sources[stage_of[poster]], (ticket.channel, poster)
                fed.add((engine, poster))
        assert sorted(fed) == [(0, 0), (0, 2), (1, 1), (1, 3)], fed
    assert_verified(report, num_tensors=len(names[0]) + len(names[1]))
    assert set(report.checksums) == set(names[0]) | set(names[1])
    assert [b.index for b in status.progress.buckets] == list(range(report.num_buckets))
    if transport is TransportKind.DISTRIBUTED:  # one update group per stage, each with a port of its own
        assert [m.group_name[-4:] for m in status.memberships] == ["_pp0", "_pp1"]
        assert len({m.master_port for m in status.memberships}) == 2
        assert status.membership == status.memberships[0]
    else:
        assert status.memberships == ()
    urls = current_urls(fleet.engines.actors)
    assert len({target_checksum(u) for u in urls}) == 1
    samples = ray.get(fleet.engines.actors[0].generate.remote([[1, 2, 3, 4]], sampling=GREEDY), timeout=RAY_TIMEOUT_S)
    assert {s.weight_version for s in samples} == {report.version}


def test_staged_export_packs_every_stage_before_the_pause_and_sends_the_same_bytes(fleet):
    with controller_for(fleet, TransportKind.DISTRIBUTED) as controller:
        plain = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
    with controller_for(fleet, TransportKind.DISTRIBUTED, staged=True) as controller:
        staged = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
    assert_verified(staged, num_tensors=plain.num_tensors)
    assert staged.phases.stage_s > 0 and staged.checksums == plain.checksums  # no step between: the same bytes


def test_a_stage_source_dying_mid_sync_commits_nothing_and_a_restarted_group_syncs(fleet):
    urls = current_urls(fleet.engines.actors)
    with controller_for(fleet, TransportKind.DISTRIBUTED) as controller:
        committed = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
        assert committed.committed, committed.summary()
        fleet.trainers.train_step(BATCH, timeout_s=RAY_TIMEOUT_S)
        victim = fleet.trainers.actors[fleet.stage_sources()[1]]

        def die(index: int) -> None:  # nested: Ray pickles it by value
            if index == 2:
                os.kill(os.getpid(), signal.SIGKILL)

        wrap_calls([victim], GATHERED_UNIT, die)  # stage 1's source dies as unit 2 of its export is built
        failed = ray.get(controller.sync.remote(raise_on_failure=False), timeout=RAY_TIMEOUT_S)
        status = ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S)
    assert not failed.committed and "stage 1" in failed.error, failed.summary()
    assert failed.total_s < SYNC["sync_timeout_s"]  # the dead rank's stage peer gave up at its collective timeout
    assert status.version == int(committed.version) and status.weight_version == committed.version

    fleet.trainers.shutdown(timeout_s=30.0)
    fleet.trainers = create_trainers(
        trainer=TRAINER, checkpoint_dir=fleet.checkpoint_dir, collective_timeout_s=COLLECTIVE_TIMEOUT_S
    )
    with controller_for(fleet, TransportKind.DISTRIBUTED) as controller:
        recovered = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
    # A new controller continues from the engines' committed version (the failed one never reached them).
    assert int(recovered.version) == int(committed.version) + 1
    assert_verified(recovered, num_tensors=committed.num_tensors)
    assert len({target_checksum(u) for u in urls}) == 1


@pytest.mark.parametrize(
    "transport", [TransportKind.DISTRIBUTED, TransportKind.COLOCATED, TransportKind.SHARD_DIRECT, TransportKind.P2P]
)
def test_expert_parallel_moe_trains_and_its_source_sends_every_expert(moe_fleet, transport):
    steps = moe_fleet.trainers.train_step(BATCH, timeout_s=RAY_TIMEOUT_S)
    assert len({(s.loss, s.mean_token_nll) for s in steps}) == 1, steps
    (source,) = moe_fleet.stage_sources()
    names = ray.get(
        moe_fleet.trainers.actors[source].__ray_call__.remote(lambda actor: attached_source().exported_names())
    )
    experts = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in names if ".mlp.experts." in n}
    assert experts == {0, 1, 2, 3}  # EP rank 0 holds experts 0-1, EP rank 1 holds 2-3
    with controller_for(moe_fleet, transport, model=MOE_MODEL) as controller:
        report = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
    assert_verified(report, num_tensors=len(names))
    assert set(report.checksums) == set(names)
    assert len({target_checksum(u) for u in current_urls(moe_fleet.engines.actors)}) == 1
