"""Placement on a simulated two-node Ray cluster (`ray.cluster_utils.Cluster`, both nodes on 127.0.0.1), told
apart by custom node resources: "trainer_node" on the head, "rollout_node" on the second node.

Disaggregated: the real trainer ranks (TP=2) land on the trainer node, the real engines on the rollout node, and a
sync across the two pools commits verified. Colocated with STRICT_SPREAD: each bundle on its own node, trainer
rank i and engine i in bundle i, hence on one node.
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack

import pytest
import ray
from ray.cluster_utils import Cluster
from ray_fleet import RAY_TIMEOUT_S

from actors.controller import create_controller
from actors.placement import create_placement_groups
from actors.rollout import create_engines
from actors.trainer import create_trainers
from miles_sync.config import ModelConfig, SyncConfig, TrainerConfig
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.engine.rollout import RolloutWorker
from miles_sync.job.placement import Resources, plan_placement
from miles_sync.job.trainer import TrainerWorker
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.draft import DraftKind

NODE_ARGS = dict(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=80 * 2**20)
ON_TRAINER_NODE = Resources(num_cpus=0.01, custom=(("trainer_node", 1.0),))
ON_ROLLOUT_NODE = Resources(num_cpus=0.01, custom=(("rollout_node", 1.0),))


@pytest.fixture(scope="module")
def nodes():
    """(trainer node id, rollout node id) of a two-node cluster the driver is connected to."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**NODE_ARGS, "resources": {"trainer_node": 2}, "include_dashboard": False},
    )
    try:
        rollout = cluster.add_node(**NODE_ARGS, resources={"rollout_node": 2})
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            yield cluster.head_node.node_id, rollout.node_id
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


def node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=60)


def test_disaggregated_trainers_and_engines_land_on_their_nodes_and_sync(nodes, reference_checkpoints, tmp_path):
    trainer_node, rollout_node = nodes
    target = str(reference_checkpoints / "target")
    plan = plan_placement(
        layout="disaggregated", num_trainers=2, num_engines=2, trainer=ON_TRAINER_NODE, engine=ON_ROLLOUT_NODE
    )
    spec = ReferenceEngineSpec(model_dir=target, draft_kind=DraftKind.MTP, weight_layout=WeightLayout.AITER)
    with ExitStack() as stack:
        placed = create_placement_groups(plan, timeout_s=60.0, name_prefix="two-node")
        stack.callback(placed.remove)
        engines = create_engines(specs=[spec, spec], log_dir=tmp_path, placement=placed)
        stack.callback(engines.shutdown)
        trainers = create_trainers(trainer=TrainerConfig(tp=2), checkpoint_dir=target, placement=placed)
        stack.callback(trainers.shutdown)
        assert [node_of(a) for a in trainers.actors] == [trainer_node, trainer_node]
        assert [node_of(a) for a in engines.actors] == [rollout_node, rollout_node]
        controller = create_controller(
            trainers=trainers.actors,
            engine_urls=engines.urls,
            sync=SyncConfig(bucket_bytes=512 * 1024),
            model=ModelConfig(arch="qwen3", speculative_algorithm="NEXTN"),
            options={"num_cpus": 0},
        )
        stack.callback(ray.kill, controller)
        report = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
        assert report.committed, report.summary()
        num_tensors = trainers.ranks[0].num_exported_tensors
        assert [e.num_verified_tensors for e in report.engines] == [num_tensors, num_tensors]
        ray.get(controller.close.remote(), timeout=RAY_TIMEOUT_S)


def test_colocated_bundles_spread_over_nodes_keep_each_trainer_with_its_engine(nodes, tmp_path):
    plan = plan_placement(
        layout="colocated",
        num_trainers=2,
        num_engines=2,
        trainer=Resources(num_cpus=0.01),
        engine=Resources(num_cpus=0.01),
        strategy="STRICT_SPREAD",
    )
    spec = ReferenceEngineSpec(model_dir=str(tmp_path / "never-started"))
    with ExitStack() as stack:
        placed = create_placement_groups(plan, timeout_s=60.0)
        stack.callback(placed.remove)
        # The actors are only constructed (cheap); where they run is what this test is about.
        trainers = [
            ray.remote(TrainerWorker)
            .options(**placed.trainer_options(rank))
            .remote(rank=rank, trainer=TrainerConfig(tp=2), checkpoint_dir="unused")
            for rank in range(2)
        ]
        engines = [
            ray.remote(RolloutWorker).options(**placed.engine_options(j)).remote(spec=spec, log_dir=str(tmp_path))
            for j in range(2)
        ]
        for actor in trainers + engines:
            stack.callback(ray.kill, actor)
        trainer_nodes = [node_of(a) for a in trainers]
        assert sorted(trainer_nodes) == sorted(nodes)  # one bundle per node
        assert [node_of(a) for a in engines] == trainer_nodes  # engine j shares trainer j's bundle


def test_unplaceable_plan_times_out_naming_the_group(nodes):
    plan = plan_placement(
        layout="disaggregated",
        num_trainers=1,
        num_engines=1,
        trainer=ON_TRAINER_NODE,
        engine=Resources(num_cpus=0.01, custom=(("gpu_node", 1.0),)),
    )
    with pytest.raises(TimeoutError, match=r"engines \[\{'CPU': 0.01, 'gpu_node': 1.0\}\]") as info:
        create_placement_groups(plan, timeout_s=2.0)
    assert "trainers" not in str(info.value)  # the trainer group could be placed
    # Nothing is left behind: the trainer node's resource comes back (removal is asynchronous in Ray).
    deadline = time.monotonic() + 30.0
    while ray.available_resources().get("trainer_node") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("trainer_node") == 2.0
