"""One real SGLang 0.5.23 CPU server with TP=2 (one core per rank): a sync is verified engine-exact per TP rank,
each rank's answer predicted from the bytes sent (its vocab-parallel, column- and row-parallel shards), over the
distributed, the colocated (one shared-memory handle to each bucket per engine rank) and the shard_direct transport
(each engine rank maps only its own parameters, loaded with load_format "direct"), and shard_direct's routed form from
two real megatron-core trainer ranks, each feeding its own server rank with no gather."""

from __future__ import annotations

import asyncio

import pytest
from routed_rounds import routed_rounds
from sender_host import SenderSettings, exported_names, load_checkpoint

from miles_sync.engine.client import EngineClient
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.transport.base import TransportKind
from miles_sync.transport.feeds import Device, plan_feeds
from miles_sync.wire.protocol import PauseMode, WeightsCheckerAction, WeightsCheckerRequest

TIMEOUTS = SessionTimeouts(control_s=30.0, sync_s=120.0)
NO_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm=None, num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)


@pytest.fixture(scope="module")
def server(server_pool, target_tp2_kind):
    """The TP=2 real server from the tier's pool (test_direct_load_sglang.py runs on it next)."""
    (launcher,) = server_pool.get(target_tp2_kind, 1)
    return launcher


@pytest.mark.parametrize("transport", ["distributed", "colocated", "shard_direct"])
def test_a_tp2_server_is_verified_engine_exact_per_rank(server, source, reference_checkpoints, transport):
    tensors, num_layers = load_checkpoint(reference_checkpoints / "target")
    num_tensors = len(exported_names(tensors, num_hidden_layers=num_layers, include_mtp=False))

    async def main():
        await source.call("configure", SenderSettings(transport=transport, bucket_bytes=512 * 1024, include_mtp=False))
        ctl = SyncController(
            engine_urls=[server.url],
            source=source,
            transport=transport,
            selector_inputs=NO_DRAFT,
            pause_mode=PauseMode.ABORT,
            verify=True,
            timeouts=TIMEOUTS,
            show_progress=False,
        )
        await ctl.connect()
        try:
            await source.call("step", 1 if transport == "distributed" else 2)
            report = await ctl.sync()
        finally:
            await ctl.close()
        async with EngineClient(server.url, timeout_s=30.0) as client:
            answer = await client.weights_checker(WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM))
        return report, answer

    report, answer = asyncio.run(main())
    assert report.committed and report.verification == "engine-exact (sha256)", report
    (engine,) = report.engines
    assert engine.verification == "engine-exact (sha256)" and engine.num_verified_tensors == num_tensors
    # Two ranks answered, each its own shard: the vocab-parallel embedding differs between them.
    assert sorted(r.parallelism_info[0].tp_rank for r in answer.ranks) == [0, 1]
    embed = "model.embed_tokens.weight"
    assert answer.ranks[0].checksums[embed] != answer.ranks[1].checksums[embed]


def test_each_trainer_rank_feeds_its_own_server_rank_without_a_gather(server, reference_checkpoints):
    """shard_direct's routed form, then p2p: two real megatron-core trainer ranks (TP=2) each send the server rank of
    the same index its own parameters, with no gather (tests/routed_rounds.py): mapped from shared memory, then
    point to point through the server's custom weight loader; every trained round is verified engine-exact per
    rank (one round each), every sent tensor counted."""
    # One host: trainer rank r and server rank r share "device" r, so rank r's shared memory feeds server rank r.
    devices = [Device(node="127.0.0.1", index=r) for r in range(2)]
    feeds = plan_feeds(trainer_devices=devices, engine_devices=[devices])
    transports = (TransportKind.SHARD_DIRECT, TransportKind.P2P)
    checkpoint = reference_checkpoints / "target"
    reports = routed_rounds([server.url], checkpoint=checkpoint, feeds=feeds, num_rounds=1, transports=transports)
    assert [r.transport for r in reports] == ["shard_direct", "p2p"]
    for report in reports:
        assert [e.verification for e in report.engines] == ["engine-exact (sha256)"], report.summary()
