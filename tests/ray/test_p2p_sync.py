"""The p2p transport on a local Ray cluster: two real megatron-core trainer ranks (TP=2) and two reference engines
of their own (one TP=2, one TP=1, AITER layout, answering SGLang's engine-parameter digests), started with the
p2p loader as their custom weight loader; no placement ties an engine rank to a trainer rank.

Every trainer rank converts its own shards and sends what it feeds point to point over each engine's channel
(plan_spread_feeds: engine ranks round robin over the trainer ranks), with no gather (the gather export is made to
fail if it runs at all: tests/rank_probes.py); every sync of trained weights is verified engine-exact per rank (and
the last one's weights, sent again through the gathered broadcast, leave every engine parameter as they were: an
anchor outside the routed build), and the engines generate from the new weights with the version that produced
them. What each engine was posted is read
by a recording proxy in front of it (tests/recording_proxy.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
import ray
from rank_probes import GATHERED_UNIT, P2P_TRANSFER, refuse_gather, unwrap_calls, wrap_calls
from ray_fleet import RAY_TIMEOUT_S, check_against_a_gathered_sync, prompts, rank_checksums, train_batch
from recording_proxy import p2p_ticket, recording_proxy

from actors.controller import create_controller
from actors.rollout import create_engines
from actors.trainer import create_trainers
from miles_sync.config import ModelConfig, SyncConfig, TrainerConfig
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.transport.base import TransportKind, transport_spec
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.protocol import ChecksumNames, SamplingParams

pytestmark = pytest.mark.slow

MODEL = ModelConfig(arch="qwen3", speculative_algorithm=None)
SYNC = dict(bucket_bytes=256 * 1024, http_timeout_s=20.0, collective_timeout_s=20.0, sync_timeout_s=90.0)
# The drill waits out one channel timeout (2 x the bucket timeout, which the HTTP timeout sets): short ones here.
DRILL_SYNC = SYNC | dict(http_timeout_s=5.0, collective_timeout_s=5.0, sync_timeout_s=40.0)
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
NUM_ROUNDS = 2


@pytest.fixture(scope="module")
def fleet(cluster, reference_checkpoints, tmp_path_factory) -> Iterator[tuple]:
    checkpoint = reference_checkpoints / "target"
    loaders = transport_spec(TransportKind.P2P).engine_weight_loaders()
    specs = [
        ReferenceEngineSpec(
            model_dir=str(checkpoint),
            tp_size=tp,
            weight_layout=WeightLayout.AITER,
            checksum_names=ChecksumNames.ENGINE,
            collective_timeout_s=20.0,
            custom_weight_loaders=loaders,
        )
        for tp in (2, 1)
    ]
    with ExitStack() as stack:
        engines = create_engines(specs=specs, log_dir=tmp_path_factory.mktemp("p2p"))
        stack.callback(engines.shutdown)
        trainers = create_trainers(trainer=TrainerConfig(tp=2, lr=1e-4), checkpoint_dir=str(checkpoint))
        stack.callback(trainers.shutdown)
        yield engines, trainers


def is_paused(url: str) -> bool:
    with urllib.request.urlopen(url + "/get_server_info", timeout=30) as answer:
        return bool(json.load(answer)["internal_states"][0]["is_paused"])


def posted_tickets(proxy, *, pids, tp_size: int) -> set[tuple]:
    """Every p2p update request the proxy's engine got: (the trainer rank that posted it, then per engine TP rank the
    channel rank its ticket's parameters come from and the number of trainer ranks feeding that engine's channel).
    A channel's trainer members are the engine's distinct feeders in rank order, so with the poster (its TP rank 0's
    feeder) these name the trainer rank that fed each engine rank."""
    (loader,) = transport_spec(TransportKind.P2P).engine_weight_loaders()
    out = set()
    for r in proxy.posts("/update_weights_from_tensor"):
        assert r.body["load_format"] == loader, r.body["load_format"]
        tickets = [p2p_ticket(p) for p in r.body["serialized_named_tensors"]]
        assert len(tickets) == tp_size
        per_rank = tuple((tuple(sorted({p.source for p in t.params})), t.channel.world_size - tp_size) for t in tickets)
        out.add((pids.index(r.client_pid), per_rank))
    return out


def test_every_trainer_rank_sends_its_own_shards_point_to_point_verified_engine_exact(fleet):
    engines, trainers = fleet
    pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in trainers.actors], timeout=60)
    refuse_gather(trainers.actors)
    stack = contextlib.ExitStack()
    proxies = [stack.enter_context(recording_proxy(u, clients=pids)) for u in engines.urls]
    controller = create_controller(
        trainers=trainers.actors,
        engine_urls=[p.url for p in proxies],
        sync=SyncConfig(transport=TransportKind.P2P, **SYNC),
        model=MODEL,
    )
    try:
        samples = ray.get(engines.actors[0].generate.remote(prompts(0), sampling=GREEDY), timeout=RAY_TIMEOUT_S)
        for round_index in range(1, NUM_ROUNDS + 1):
            trainers.train_step(train_batch(samples), timeout_s=RAY_TIMEOUT_S)
            report = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
            assert report.committed, report.summary()
            assert report.transport == "p2p"
            for result in report.engines:
                assert result.success and result.verification.startswith("engine-exact"), result
                assert result.num_verified_tensors == report.num_tensors > 0, (result, report.num_tensors)
                assert result.weight_version == report.version
            for engine in engines.actors:
                samples = ray.get(engine.generate.remote(prompts(round_index), sampling=GREEDY), timeout=RAY_TIMEOUT_S)
                assert {s.weight_version for s in samples} == {report.version}
        # Spread feeds: the TP=2 engine's ranks from trainer ranks 0 and 1 (channel ranks 0 and 1 of its two
        # feeders), the TP=1 engine's from rank 0 again (its only feeder, and its poster); rank 0 posts both.
        first, second = proxies
        assert posted_tickets(first, pids=pids, tp_size=2) == {(0, (((0,), 2), ((1,), 2)))}
        assert posted_tickets(second, pids=pids, tp_size=1) == {(0, (((0,), 1),))}
    finally:
        unwrap_calls(trainers.actors, GATHERED_UNIT)
        ray.get(controller.close.remote(), timeout=RAY_TIMEOUT_S)
        ray.kill(controller)
        stack.close()
    check_against_a_gathered_sync(trainers, engines.urls, model=MODEL, sync=SYNC)


def test_a_trainer_rank_killed_mid_send_fails_the_sync_closed_and_releases_every_engine_rank(fleet):
    """Last in the module (its trainer rank 1 dies): rank 1 kills itself as its transfers of the second bucket
    start, its tickets already posted, so the engine rank it feeds is inside the loader waiting for its bytes. gloo
    does not fail a pending receive when its peer's process dies, so that rank waits out the channel's timeout (the
    ticket's, 2 x the bucket timeout: 10 s here), then drops the channel and returns: the sync fails within its own
    timeout without committing, every engine answers its weights checker at once after, and the engines that took
    part of the new weights are held paused, not resumed, with the version kept."""
    engines, trainers = fleet
    controller = create_controller(
        trainers=trainers.actors,
        engine_urls=engines.urls,
        sync=SyncConfig(transport=TransportKind.P2P, **DRILL_SYNC),
        model=MODEL,
    )
    try:
        committed = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
        assert committed.committed and committed.num_buckets > 2, committed.summary()
        committed_checksums = {url: rank_checksums(url, timeout_s=30.0) for url in engines.urls}
        samples = ray.get(engines.actors[0].generate.remote(prompts(5), sampling=GREEDY), timeout=RAY_TIMEOUT_S)
        trainers.train_step(train_batch(samples), timeout_s=RAY_TIMEOUT_S)

        def die_at_second_bucket(index: int) -> None:  # nested: Ray pickles it by value
            if index == 1:
                os.kill(os.getpid(), signal.SIGKILL)

        # Rank 1 feeds one engine rank: its second channel transfer is the second bucket's.
        wrap_calls([trainers.actors[1]], P2P_TRANSFER, die_at_second_bucket)
        start = time.monotonic()
        failed = ray.get(controller.sync.remote(raise_on_failure=False), timeout=RAY_TIMEOUT_S)
        elapsed = time.monotonic() - start
        print(f"failed sync after {elapsed:.2f} s: {failed.error[:400]}")
        assert not failed.committed, failed.summary()
        assert elapsed < DRILL_SYNC["sync_timeout_s"], f"the failed sync took {elapsed:.1f} s"
        status = ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S)
        assert status.weight_version == committed.version
        for url in engines.urls:  # released: the checker runs on the scheduler, which a loader blocked would hold
            started = time.monotonic()
            checksums = rank_checksums(url, timeout_s=30.0)
            assert time.monotonic() - started < 10.0, url
            if url in status.held_engines:
                assert url not in status.serving_engines and is_paused(url), url
            else:  # resumed, so it must serve the committed weights, rank by rank
                assert url in status.serving_engines and checksums == committed_checksums[url], url
        assert status.held_engines, status  # the engines rank 1 fed took some of the new weights
        print(f"held {sorted(status.held_engines)}, serving {sorted(status.serving_engines)}")
    finally:
        with contextlib.suppress(ray.exceptions.RayActorError):  # rank 1 is dead, unless the drill failed first
            unwrap_calls([trainers.actors[1]], P2P_TRANSFER)
        ray.kill(controller)
