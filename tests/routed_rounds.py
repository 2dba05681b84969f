"""The routed transports driven end to end for the real-SGLang tier: two real megatron-core trainer ranks (TP=2, Ray
actors on a loopback cluster) with a given feed plan sync into running servers through shard_direct's routed form
and/or p2p (the servers then run the p2p loader as their custom weight loader), one controller per transport on the
same trainer ranks, with the gather export made to fail if it is entered (tests/rank_probes.py); each trained round
must commit, pass its check with every sent tensor counted, and the servers must then generate with that version."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import ray
from rank_probes import refuse_gather

from actors.controller import create_controller
from actors.trainer import create_trainers
from launch.cluster import connect_ray
from miles_sync.config import ClusterConfig, ModelConfig, SyncConfig, TrainerConfig
from miles_sync.engine.client import EngineClient
from miles_sync.engine.rollout import generate_samples
from miles_sync.job.rl import make_prompts, train_batch
from miles_sync.sync.report import SyncReport
from miles_sync.transport.base import TransportKind
from miles_sync.transport.feeds import FeedPlan
from miles_sync.wire.protocol import SamplingParams

RAY_TIMEOUT_S = 300.0
MODEL = ModelConfig(arch="qwen3", speculative_algorithm=None)
SYNC = dict(bucket_bytes=256 * 1024, http_timeout_s=60.0, collective_timeout_s=60.0, sync_timeout_s=180.0)
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


def samples(urls: Sequence[str], round_index: int) -> list:
    async def main():
        prompts = make_prompts(round_index, num_prompts=4, length=4)
        batches = []
        for url in urls:
            async with EngineClient(url, timeout_s=60.0) as client:
                batches.append(await generate_samples(client, prompts, sampling=GREEDY))
        return [s for batch in batches for s in batch]

    return asyncio.run(main())


def routed_rounds(
    urls: Sequence[str],
    *,
    checkpoint: Path,
    feeds: FeedPlan,
    num_rounds: int = 2,
    transports: Sequence[TransportKind] = (TransportKind.SHARD_DIRECT,),
) -> list[SyncReport]:
    """Per transport in turn, `num_rounds` train -> routed sync -> generate rounds into the servers at `urls`; every
    round's report, in order."""

    reports = []
    with connect_ray(ClusterConfig(num_cpus=3)):
        trainers = create_trainers(trainer=TrainerConfig(tp=2, lr=1e-4), checkpoint_dir=str(checkpoint), feeds=feeds)
        try:
            refuse_gather(trainers.actors)
            rollouts = samples(urls, 0)
            for transport in transports:
                sync = SyncConfig(transport=transport, **SYNC)
                controller = create_controller(trainers=trainers.actors, engine_urls=list(urls), sync=sync, model=MODEL)
                try:
                    for round_index in range(1, num_rounds + 1):
                        trainers.train_step(train_batch(rollouts), timeout_s=RAY_TIMEOUT_S)
                        report = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
                        assert report.committed and report.transport == transport.value, report.summary()
                        for engine in report.engines:
                            assert engine.success and engine.num_verified_tensors == report.num_tensors > 0, engine
                        rollouts = samples(urls, round_index)
                        assert {s.weight_version for s in rollouts} == {report.version}
                        reports.append(report)
                finally:
                    ray.get(controller.close.remote(), timeout=RAY_TIMEOUT_S)
                    ray.kill(controller)
        finally:
            trainers.shutdown()
    return reports
