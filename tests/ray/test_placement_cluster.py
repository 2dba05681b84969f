"""Several nodes: one simulated three-node cluster (tests/ray/multinode.py: head 127.0.0.2, workers 127.0.0.3 and
127.0.0.4, told apart by custom node resources) shared by every test here.

- disaggregated: the trainer ranks (TP=2) on the head, one engine on each worker; a sync across the nodes commits
  verified, the update group meets on the source rank's node, and every listener miles_sync opened binds its own
  node's address (none every interface); the colocated transport on this layout is refused at connect, naming the
  engine and its node;
- colocated: one bundle per worker (trainer rank j and engine j share it); a colocated sync commits verified and each
  engine maps memory of the trainer rank on its own node (read by a recording proxy on the engine's node in front of
  it: tests/recording_proxy.py);
- the main job submitted with `ray job submit` to this cluster completes, and its report records the nodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import ray
from multinode import HEAD_IP, WORKER_IPS, children_of, listeners, ray_ports, three_node_cluster
from ray_fleet import RAY_TIMEOUT_S
from recording_proxy import recording_proxy, segment_pid

from actors.controller import create_controller
from actors.placement import create_placement_groups
from actors.rollout import create_engines
from actors.trainer import create_trainers
from miles_sync.config import ModelConfig, SyncConfig, TrainerConfig
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.env import node_of_url
from miles_sync.job.placement import Resources, plan_colocated_feeds, plan_placement
from miles_sync.transport.base import TransportKind
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.draft import DraftKind

REPO = Path(__file__).resolve().parents[2]
ON_HEAD = Resources(num_cpus=0.01, custom=(("node_a", 1.0),))
ON_A_WORKER = Resources(num_cpus=0.01, custom=(("worker_node", 1.0),))
MODEL = ModelConfig(arch="qwen3", speculative_algorithm="NEXTN")
BUCKET_BYTES = 512 * 1024


@pytest.fixture(scope="module")
def cluster():
    with three_node_cluster() as started:
        yield started


def pid_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def engine_spec(target: str) -> ReferenceEngineSpec:
    return ReferenceEngineSpec(model_dir=target, draft_kind=DraftKind.MTP, weight_layout=WeightLayout.AITER)


def own_listeners(pids):
    """The listeners of `pids` that are not Ray's own (its core worker's, in the node's worker port range)."""
    return [s for s in listeners(pids) if not ray_ports(s.port)]


def assert_engines_bind_their_nodes(engines) -> None:
    """Every listener of each engine's server and its children (HTTP, update groups) is on the engine's node."""
    servers = ray.get([a.pid.remote() for a in engines.actors], timeout=60)
    for url, node, server in zip(engines.urls, engines.nodes, servers):
        found = listeners([server, *children_of(server)])
        assert found, f"engine {url} listens nowhere?"
        assert {s.address for s in found} == {node.node_ip}, (url, found)
        assert int(url.rsplit(":", 1)[1]) in {s.port for s in found}


def assert_new_listeners_bind_their_nodes(before, pids_by_node) -> None:
    """Every listener opened since `before` by a trainer rank (update groups, the colocated fan-out) is on that
    rank's node; nothing of theirs listens on every interface."""
    for node, pid in pids_by_node:
        mine = own_listeners([pid])
        assert not [s for s in mine if s.is_wildcard], mine
        new = [s for s in mine if s not in before]
        assert all(s.address == node for s in new), (node, new)


def test_disaggregated_sync_across_nodes_binds_every_listener_to_its_node(cluster, reference_checkpoints, tmp_path):
    target = str(reference_checkpoints / "target")
    plan = plan_placement(
        layout="disaggregated",
        num_trainers=2,
        num_engines=2,
        trainer=ON_HEAD,
        engine=ON_A_WORKER,
        engine_strategy="STRICT_SPREAD",
    )
    with ExitStack() as stack:
        placed = create_placement_groups(plan, timeout_s=60.0, name_prefix="disaggregated")
        stack.callback(placed.remove)
        engines = create_engines(specs=[engine_spec(target)] * 2, log_dir=tmp_path, placement=placed)
        stack.callback(engines.shutdown)
        trainers = create_trainers(trainer=TrainerConfig(tp=2), checkpoint_dir=target, placement=placed)
        stack.callback(trainers.shutdown)
        assert [(n.node_ip, n.bind_host) for n in trainers.nodes] == [(HEAD_IP, HEAD_IP)] * 2
        assert sorted(n.node_ip for n in engines.nodes) == sorted(WORKER_IPS)
        assert [node_of_url(u) for u in engines.urls] == [n.node_ip for n in engines.nodes]  # URLs name the nodes
        assert [r.node for r in trainers.ranks] == [HEAD_IP] * 2
        trainer_pids = [pid_of(a) for a in trainers.actors]
        before = own_listeners(trainer_pids)
        # Set-up's listeners: the trainer group's store on the head's address; torch's default group and
        # Megatron's (outside miles_sync's audit, docs/cluster.md#several-nodes) on the loopback interface's 127.0.0.1.
        assert before and {s.address for s in before} <= {HEAD_IP, "127.0.0.1"}, before
        assert HEAD_IP in {s.address for s in before}

        controller = create_controller(
            trainers=trainers.actors,
            engine_urls=engines.urls,
            sync=SyncConfig(bucket_bytes=BUCKET_BYTES),
            model=MODEL,
        )
        stack.callback(ray.kill, controller)
        report = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
        assert report.committed, report.summary()
        num_tensors = trainers.ranks[0].num_exported_tensors
        assert [e.num_verified_tensors for e in report.engines] == [num_tensors, num_tensors]
        membership = ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).membership
        assert membership.master_address == HEAD_IP  # the source rank's node
        (source_pid,) = [pid for pid, info in zip(trainer_pids, trainers.ranks) if info.is_source]
        store = [s for s in listeners([source_pid]) if s.port == membership.master_port]
        assert [s.address for s in store] == [HEAD_IP], store
        assert_engines_bind_their_nodes(engines)
        assert_new_listeners_bind_their_nodes(before, [(HEAD_IP, pid) for pid in trainer_pids])
        ray.get(controller.close.remote(), timeout=RAY_TIMEOUT_S)

        # The colocated transport would hand each engine a handle to memory on the head: refused before any sync.
        with pytest.raises(ValueError, match="no trainer rank runs on it") as refused:
            create_controller(
                trainers=trainers.actors,
                engine_urls=engines.urls,
                sync=SyncConfig(transport=TransportKind.COLOCATED, bucket_bytes=BUCKET_BYTES),
                model=MODEL,
            )
        for url in engines.urls:
            assert f"({url}) on node {node_of_url(url)}" in str(refused.value)


def test_colocated_sync_feeds_each_engine_from_its_own_node(cluster, reference_checkpoints, tmp_path):
    target = str(reference_checkpoints / "target")
    plan = plan_placement(
        layout="colocated",
        num_trainers=2,
        num_engines=2,
        trainer=ON_A_WORKER,
        engine=Resources(num_cpus=0.01),
        strategy="STRICT_SPREAD",
    )
    with ExitStack() as stack:
        placed = create_placement_groups(plan, timeout_s=60.0, name_prefix="colocated")
        stack.callback(placed.remove)
        engines = create_engines(specs=[engine_spec(target)] * 2, log_dir=tmp_path, placement=placed)
        stack.callback(engines.shutdown)
        trainers = create_trainers(
            trainer=TrainerConfig(tp=2), checkpoint_dir=target, placement=placed, feeds=plan_colocated_feeds(plan)
        )
        stack.callback(trainers.shutdown)
        trainer_nodes = [n.node_ip for n in trainers.nodes]
        assert sorted(trainer_nodes) == sorted(WORKER_IPS)  # one bundle per worker
        assert [n.node_ip for n in engines.nodes] == trainer_nodes  # engine j shares trainer j's bundle
        trainer_pids = [pid_of(a) for a in trainers.actors]
        before = own_listeners(trainer_pids)
        # Each engine's proxy listens on the engine's node: the colocated transport checks each engine's node by the
        # address its URL names.
        proxies = [
            stack.enter_context(recording_proxy(url, host=node_of_url(url), clients=trainer_pids))
            for url in engines.urls
        ]

        controller = create_controller(
            trainers=trainers.actors,
            engine_urls=[p.url for p in proxies],
            sync=SyncConfig(transport=TransportKind.COLOCATED, bucket_bytes=BUCKET_BYTES),
            model=MODEL,
        )
        stack.callback(ray.kill, controller)
        report = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
        assert report.committed, report.summary()
        num_tensors = trainers.ranks[0].num_exported_tensors
        assert [e.num_verified_tensors for e in report.engines] == [num_tensors, num_tensors]
        # Engine j mapped memory of trainer rank j, on its own node: rank j posted every request engine j got, each a
        # flattened bucket whose handle names a shared segment rank j's process created (torch names segments
        # "/torch_<pid>_...").
        for rank, proxy in enumerate(proxies):
            posted = {
                (r.client_pid, r.body["load_format"], tuple(segment_pid(h) for h in r.body["serialized_named_tensors"]))
                for r in proxy.posts("/update_weights_from_tensor")
            }
            assert posted == {(trainer_pids[rank], "flattened_bucket", (trainer_pids[rank],))}
            assert node_of_url(engines.urls[rank]) == node_of_url(proxy.url) == trainer_nodes[rank]
        assert_engines_bind_their_nodes(engines)
        # The fan-out group that carried each bucket from the source to the other node binds each rank's node.
        assert_new_listeners_bind_their_nodes(before, list(zip(trainer_nodes, trainer_pids)))
        ray.get(controller.close.remote(), timeout=RAY_TIMEOUT_S)


def test_unplaceable_plan_times_out_naming_the_group(cluster):
    plan = plan_placement(
        layout="disaggregated",
        num_trainers=1,
        num_engines=1,
        trainer=ON_HEAD,
        engine=Resources(num_cpus=0.01, custom=(("gpu_node", 1.0),)),
    )
    available = ray.available_resources().get("node_a")
    with pytest.raises(TimeoutError, match=r"engines \[\{'CPU': 0.01, 'gpu_node': 1.0\}\]") as info:
        create_placement_groups(plan, timeout_s=2.0)
    assert "trainers" not in str(info.value)  # the trainer group could be placed
    # Nothing is left behind: the head's resource comes back (removal is asynchronous in Ray).
    deadline = time.monotonic() + 30.0
    while ray.available_resources().get("node_a") != available and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("node_a") == available


def test_ray_job_submit_runs_the_main_job_across_the_nodes(cluster, tmp_path):
    overrides = [
        f"output_dir={tmp_path}",
        "run_name=nodes",
        "num_rounds=1",
        "rollout.num_prompts=3",
        "rollout.max_new_tokens=16",
        "cluster.trainer_node_resource=node_a",
        "cluster.engine_node_resource=worker_node",
        "cluster.engine_strategy=STRICT_SPREAD",
    ]
    submit = ["bash", str(REPO / "launch" / "submit.sh"), "--address", cluster.dashboard_url, *overrides]
    done = subprocess.run(submit, cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "succeeded" in output, output[-4000:]
    assert f"cluster at {cluster.gcs_address}" in output  # it joined this cluster
    report = json.loads((tmp_path / "nodes" / "report.json").read_text())
    assert report["status"] == "completed" and report["rounds"][0]["verified"]
    nodes = report["machine"]["nodes"]
    assert [r["node"] for r in nodes["trainer_ranks"]] == [HEAD_IP] * 2
    assert sorted(e["node"] for e in nodes["engines"]) == sorted(WORKER_IPS)
    assert all(node_of_url(e["url"]) == e["bind_host"] == e["node"] for e in nodes["engines"])
