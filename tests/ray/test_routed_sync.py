"""Routed shard_direct on a local Ray cluster: two real megatron-core trainer ranks (TP=2) and one TP=2 reference
engine (AITER layout, answering SGLang's engine-parameter digests), engine rank r on trainer rank r's bundle.

Every trainer rank converts its own shards and feeds its own engine rank, with no gather: the gather export is
made to fail if it runs at all (tests/rank_probes.py), each engine rank takes in about half the model per sync (its
own count), and every sync of trained weights is verified engine-exact per rank against the digests the feeders
computed as they built each parameter; as an anchor outside that build, the last sync's weights sent again through
the gathered broadcast must leave every engine parameter as it was. The engine then generates from the new weights
with the version that produced them. What the engine was posted is read by a recording proxy in front of it
(tests/recording_proxy.py).
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
import ray
from rank_probes import GATHERED_UNIT, refuse_gather, unwrap_calls
from ray_fleet import RAY_TIMEOUT_S, check_against_a_gathered_sync, prompts, train_batch
from recording_proxy import recording_proxy, segment_pid

from actors.controller import create_controller
from actors.placement import create_placement_groups
from actors.rollout import DEFAULT_ENGINE_RESOURCES, create_engines
from actors.trainer import DEFAULT_TRAINER_RESOURCES, create_trainers
from miles_sync.config import ModelConfig, SyncConfig, TrainerConfig
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.engine.reference.models import read_safetensors
from miles_sync.job.placement import plan_colocated_feeds, plan_placement
from miles_sync.transport.base import TransportKind
from miles_sync.weights.layout import WeightLayout
from miles_sync.weights.shard_plan import is_target_layer
from miles_sync.wire.protocol import ChecksumNames, SamplingParams

pytestmark = pytest.mark.slow

MODEL = ModelConfig(arch="qwen3", speculative_algorithm=None)
SYNC = dict(bucket_bytes=256 * 1024, http_timeout_s=20.0, collective_timeout_s=20.0, sync_timeout_s=90.0)
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
NUM_ROUNDS = 2


@pytest.fixture(scope="module")
def tp2_fleet(cluster, reference_checkpoints, tmp_path_factory) -> Iterator[tuple]:
    plan = plan_placement(
        layout="colocated",
        num_trainers=2,
        num_engines=1,
        trainer=DEFAULT_TRAINER_RESOURCES,
        engine=DEFAULT_ENGINE_RESOURCES,
        engine_tp_size=2,
    )
    checkpoint = reference_checkpoints / "target"
    spec = ReferenceEngineSpec(
        model_dir=str(checkpoint),
        tp_size=2,
        weight_layout=WeightLayout.AITER,
        checksum_names=ChecksumNames.ENGINE,
        collective_timeout_s=20.0,
    )
    with ExitStack() as stack:
        placed = create_placement_groups(plan, timeout_s=60.0, name_prefix="routed")
        stack.callback(placed.remove)
        engines = create_engines(specs=[spec], log_dir=tmp_path_factory.mktemp("routed"), placement=placed)
        stack.callback(engines.shutdown)
        trainers = create_trainers(
            trainer=TrainerConfig(tp=2, lr=1e-4),
            checkpoint_dir=str(checkpoint),
            placement=placed,
            feeds=plan_colocated_feeds(plan),
        )
        stack.callback(trainers.shutdown)
        # What the target runner holds: the checkpoint's MTP layers belong to its draft.
        num_layers = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
        model_bytes = sum(
            t.numel() * t.element_size()
            for name, t in read_safetensors(checkpoint / "model.safetensors").items()
            if is_target_layer(name, num_target_layers=num_layers)
        )
        yield engines, trainers, model_bytes


def received_bytes(url: str) -> list[int]:
    """Each engine rank's own count of the tensor bytes it took in so far."""
    with urllib.request.urlopen(f"{url}/get_server_info", timeout=60) as response:
        return [int(n) for n in json.load(response)["miles_sync_received_bytes"]]


def test_each_trainer_rank_feeds_its_own_engine_rank_without_a_gather_verified_engine_exact(tp2_fleet):
    engines, trainers, model_bytes = tp2_fleet
    (url,) = engines.urls
    (engine,) = engines.actors
    pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in trainers.actors], timeout=60)
    refuse_gather(trainers.actors)
    stack = ExitStack()
    proxy = stack.enter_context(recording_proxy(url, clients=pids))
    controller = create_controller(
        trainers=trainers.actors,
        engine_urls=[proxy.url],
        sync=SyncConfig(transport=TransportKind.SHARD_DIRECT, **SYNC),
        model=MODEL,
    )
    try:
        samples = ray.get(engine.generate.remote(prompts(0), sampling=GREEDY), timeout=RAY_TIMEOUT_S)
        before = received_bytes(url)
        for round_index in range(1, NUM_ROUNDS + 1):
            steps = trainers.train_step(train_batch(samples), timeout_s=RAY_TIMEOUT_S)
            assert len({s.loss for s in steps}) == 1, steps
            report = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
            assert report.committed, report.summary()
            assert report.transport == "shard_direct"
            (result,) = report.engines
            assert result.success and result.verification.startswith("engine-exact"), result
            # Every HF tensor sent is accounted for by the engine parameters that matched.
            assert result.num_verified_tensors == report.num_tensors > 0, (result, report.num_tensors)
            assert result.weight_version == report.version
            samples = ray.get(engine.generate.remote(prompts(round_index), sampling=GREEDY), timeout=RAY_TIMEOUT_S)
            assert {s.weight_version for s in samples} == {report.version}
        per_rank = [(a - b) / NUM_ROUNDS for a, b in zip(received_bytes(url), before)]
        # Each rank's own parameters: half the model, plus its copy of the replicated norms.
        assert all(0.45 < n / model_bytes < 0.55 for n in per_rank), (per_rank, model_bytes)
        # Every request: engine rank r's handle maps memory trainer rank r built (a direct load), posted by rank 0
        # (the feeder of engine rank 0).
        posted = {
            (r.client_pid, r.body["load_format"], tuple(segment_pid(h) for h in r.body["serialized_named_tensors"]))
            for r in proxy.posts("/update_weights_from_tensor")
        }
        assert posted == {(pids[0], "direct", (pids[0], pids[1]))}
    finally:
        unwrap_calls(trainers.actors, GATHERED_UNIT)
        ray.get(controller.close.remote(), timeout=RAY_TIMEOUT_S)
        ray.kill(controller)
        stack.close()
    check_against_a_gathered_sync(trainers, engines.urls, model=MODEL, sync=SYNC)
