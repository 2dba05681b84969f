"""The built-in Qwen3-MoE checkpoint (4 experts, top-2, its MTP layer frozen and not served) synced into real SGLang
0.5.23 CPU servers: at TP=1 and at TP=2, where SGLang's FusedMoE splits every expert over the ranks (gate and up
rows, down columns; expert parallelism off) and stacks the experts into `experts.w13_weight` [E, 2I/tp, H] and
`experts.w2_weight` [E, H, I/tp]. Each rank's stacked experts are predicted from the bytes sent and answered by the
server's own checker, engine-exact. A TP=2 server whose rank 1 holds other values in one expert's gate rows (written
by a direct update of that expert: rank 0's half unchanged) is named by rank and parameter by the check the job
runs before round 0, and only there. One server at a time (a TP=2 server takes both cores)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from sender_host import ProcessSource, SenderSettings, exported_names, load_checkpoint, weights_at_step
from sglang_server import sglang_server

from miles_sync.engine.client import EngineClient
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.report import SyncReport
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.wire.payload import encode_named_tensors
from miles_sync.wire.protocol import (
    PauseMode,
    Selector,
    UpdateWeightsFromTensorRequest,
    WeightsCheckerAction,
    WeightsCheckerRequest,
)

TIMEOUTS = SessionTimeouts(control_s=30.0, sync_s=120.0)
NO_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm=None, num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)
W13 = "model.layers.0.mlp.experts.w13_weight"
W2 = "model.layers.0.mlp.experts.w2_weight"
GATE = "model.layers.0.mlp.experts.1.gate_proj.weight"  # expert 1's gate rows: rank r keeps [r*I/2, (r+1)*I/2)


@pytest.fixture(scope="module")
def tp2_server(reference_moe_checkpoint, sglang_python, tmp_path_factory):
    """One TP=2 server for the module's TP=2 tests (started after the TP=1 test stopped its own)."""
    log_dir = tmp_path_factory.mktemp("moe-tp2")
    with sglang_server(model=reference_moe_checkpoint, python=sglang_python, log_dir=log_dir, tp_size=2) as server:
        yield server


@pytest.fixture(scope="module")
def moe_source(reference_moe_checkpoint):
    process_source = ProcessSource(target_dir=reference_moe_checkpoint)
    yield process_source
    process_source.shutdown()


def controller(url: str, source) -> SyncController:
    return SyncController(
        engine_urls=[url],
        source=source,
        transport="distributed",
        selector_inputs=NO_DRAFT,
        pause_mode=PauseMode.RETRACT,
        verify=True,
        timeouts=TIMEOUTS,
        show_progress=False,
    )


async def sync_step(url: str, source, step: int) -> SyncReport:
    await source.call("configure", SenderSettings(transport="distributed", bucket_bytes=256 * 1024, include_mtp=False))
    ctl = controller(url, source)
    await ctl.connect()
    try:
        await source.call("step", step)
        return await ctl.sync()
    finally:
        await ctl.close()


async def rank_checksums(url: str) -> list[dict[str, str]]:
    async with EngineClient(url, timeout_s=30.0) as client:
        answer = await client.weights_checker(WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM))
    ranks = sorted(answer.ranks, key=lambda r: r.parallelism_info[0].tp_rank)
    return [dict(r.checksums) for r in ranks]


def check_verified_sync(url: str, source, checkpoint, *, tp_size: int, step: int) -> None:
    tensors, num_layers = load_checkpoint(checkpoint)
    num_tensors = len(exported_names(tensors, num_hidden_layers=num_layers, include_mtp=False))

    async def main():
        report = await sync_step(url, source, step=step)
        return report, await rank_checksums(url)

    report, ranks = asyncio.run(main())
    assert report.committed and report.verification == "engine-exact (sha256)", report.summary()
    (engine,) = report.engines
    assert engine.num_verified_tensors == num_tensors, engine
    assert len(ranks) == tp_size and all({W13, W2} <= set(r) for r in ranks), [sorted(r)[:8] for r in ranks]
    if tp_size == 2:  # each rank holds its own half of every expert
        assert ranks[0][W13] != ranks[1][W13] and ranks[0][W2] != ranks[1][W2]


def test_moe_syncs_into_a_real_tp1_server_are_verified_engine_exact(
    reference_moe_checkpoint, sglang_python, moe_source, tmp_path
):
    with sglang_server(model=reference_moe_checkpoint, python=sglang_python, log_dir=tmp_path) as server:
        check_verified_sync(server.url, moe_source, reference_moe_checkpoint, tp_size=1, step=1)


def test_moe_syncs_into_a_real_tp2_server_are_verified_engine_exact_per_rank(
    tp2_server, moe_source, reference_moe_checkpoint
):
    """Mutation: experts modeled as whole at TP=2 (engine_layout.shard_kind without its expert rule) fails it:
    'rank 0 target model.layers.0.mlp.experts.w13_weight differs'."""
    check_verified_sync(tp2_server.url, moe_source, reference_moe_checkpoint, tp_size=2, step=2)


def test_a_corrupted_expert_shard_on_a_real_tp2_server_is_named_by_rank_and_parameter(
    tp2_server, moe_source, reference_moe_checkpoint
):
    """A check that ignored ranks, or hashed each stack whole, would not say which rank differs."""
    tensors, _ = load_checkpoint(reference_moe_checkpoint)
    trained = weights_at_step(tensors, 3)[GATE]
    corrupted = trained.clone()
    corrupted[trained.shape[0] // 2 :] += 1.0  # rank 1's rows only

    async def main(url: str):
        committed = await sync_step(url, moe_source, step=3)
        before = await rank_checksums(url)
        async with EngineClient(url, timeout_s=30.0) as client:
            await client.pause_generation(PauseMode.RETRACT)
            await client.begin_weight_update(Selector.TARGET)
            payload = encode_named_tensors([(GATE, corrupted)])
            await client.update_weights_from_tensor(
                UpdateWeightsFromTensorRequest(serialized_named_tensors=(payload,) * 2)
            )
            await client.end_weight_update()
            await client.continue_generation()
        after = await rank_checksums(url)
        ctl = controller(url, moe_source)
        await ctl.connect()
        try:
            check = await ctl.check_engines()  # the trainer is still at step 3
        finally:
            with contextlib.suppress(Exception):
                await ctl.close()
        return committed, before, after, check

    committed, before, after, check = asyncio.run(main(tp2_server.url))
    assert committed.committed and committed.verification == "engine-exact (sha256)"
    changed = [sorted(n for n in b if a[n] != b[n]) for b, a in zip(before, after)]
    assert changed == [[], [W13]], changed  # the server itself: only rank 1's stacked gate/up rows changed
    (engine,) = check.engines
    assert not engine.holds_trainer_weights and engine.method == "engine-exact (sha256)", check.summary()
    assert f"rank 1 target {W13}" in engine.message and "rank 0" not in engine.message, engine.message
