"""The shard_direct transport into reference engines over real processes and HTTP: each engine TP rank receives only
its own parameters (fused, sharded, vocab-padded, in the engine's AITER layout) with load_format "direct", and the
sync is verified engine-exact per rank, against answers this test recomputes from the weights it sent.

One fleet for the module: a TP=2 and a TP=1 engine serving the pre-trained target with its MTP draft (frozen: the
sessions select the target only), the AITER layout, SGLang's finalize policy.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from reference_server import generate, tp_fleet
from sender_host import SenderSettings, load_checkpoint, weights_at_step

from miles_sync.engine.client import EngineClient
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.sync.verify import engine_exact_problems
from miles_sync.weights.checksum import sglang_tensor_hash
from miles_sync.weights.engine_layout import TPShape, rank_engine_tensors
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.payload import encode_named_tensors
from miles_sync.wire.protocol import PauseMode, Selector, WeightsCheckerAction, WeightsCheckerRequest

pytestmark = pytest.mark.slow

TIMEOUTS = SessionTimeouts(control_s=20.0, sync_s=90.0)
FROZEN_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)
TRAINED_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=1, conversion_mode=ConversionMode.RAW
)
PROMPT = [3, 32, 177]


@pytest.fixture(scope="module")
def fleet(reference_checkpoints, tmp_path_factory):
    """[TP=2, TP=1] engines in the AITER layout with a frozen MTP draft, started once for the module."""
    with tp_fleet(
        model=reference_checkpoints / "target",
        log_dir=tmp_path_factory.mktemp("shard-direct"),
        tp_sizes=(2, 1),
        draft_kind="mtp",
        weight_layout="aiter",
        finalize_policy="sglang",
        checksum_names="engine",
    ) as engines:
        yield engines


def controller(urls, source, *, selector_inputs: SelectorInputs = FROZEN_DRAFT, staged: bool = False) -> SyncController:
    return SyncController(
        engine_urls=urls,
        source=source,
        transport="shard_direct",
        selector_inputs=selector_inputs,
        pause_mode=PauseMode.RETRACT,
        verify=True,
        staged=staged,
        timeouts=TIMEOUTS,
        show_progress=False,
    )


def settings(**overrides) -> SenderSettings:
    return SenderSettings(
        **{"transport": "shard_direct", "bucket_bytes": 256 * 1024, "include_mtp": False, **overrides}
    )


def target_answer(url: str) -> list[dict[str, str]]:
    async def main():
        async with EngineClient(url, timeout_s=20.0) as client:
            request = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=Selector.TARGET)
            return await client.weights_checker(request)

    return [dict(rank.checksums) for rank in asyncio.run(main()).ranks]


def expected_answer(weights, *, shape: TPShape, tp_size: int, num_layers: int) -> list[dict[str, str]]:
    """What each rank of a faithful engine answers for the target part of these full HF weights."""
    target = {n: t for n, t in weights.items() if not n.startswith(f"model.layers.{num_layers}.")}
    return [
        {
            name: sglang_tensor_hash(tensor)
            for name, tensor in rank_engine_tensors(
                target, shape=shape, tp_rank=r, tp_size=tp_size, layout=WeightLayout.AITER
            ).items()
        }
        for r in range(tp_size)
    ]


def received_bytes(server) -> list[int]:
    """Per TP rank, the bytes of tensor data the engine counts it took in since start."""
    status, answer = server.get("/get_server_info")
    assert status == 200, answer
    return answer["miles_sync_received_bytes"]


def sync_steps(urls, source, steps, **options):
    async def main():
        ctl = controller(urls, source, **options)
        await ctl.connect()
        try:
            reports = []
            for step in steps:
                await source.call("step", step)
                reports.append(await ctl.sync(raise_on_failure=False))
            return reports
        finally:
            await ctl.close()

    return asyncio.run(main())


def test_each_rank_receives_its_own_parameters_and_the_sync_verifies_engine_exact(
    fleet, source, shape, reference_checkpoints
):
    urls = [server.url for server in fleet]
    asyncio.run(source.call("configure", settings()))
    before = [received_bytes(server) for server in fleet]
    reports = sync_steps(urls, source, (1, 2))
    received = [[a - b for a, b in zip(received_bytes(server), start)] for server, start in zip(fleet, before)]
    for report in reports:
        assert report.committed and report.selector is Selector.TARGET, report.error
        assert report.transport == "shard_direct"
        assert [e.verification for e in report.engines] == ["engine-exact (sha256)"] * 2, report.engines
    tensors, num_layers = load_checkpoint(reference_checkpoints / "target")
    weights = weights_at_step(tensors, 2)
    for server, tp in zip(fleet, (2, 1)):
        assert target_answer(server.url) == expected_answer(weights, shape=shape, tp_size=tp, num_layers=num_layers)
    # Each rank took in exactly its own parameters, twice (the engine's own count): about half the model at TP=2.
    target = {n: t for n, t in weights.items() if not n.startswith(f"model.layers.{num_layers}.")}
    model_bytes = sum(t.numel() * t.element_size() for t in target.values())
    for rank_received, tp in zip(received, (2, 1)):
        own = [
            sum(
                t.numel() * t.element_size()
                for t in rank_engine_tensors(target, shape=shape, tp_rank=r, tp_size=tp).values()
            )
            for r in range(tp)
        ]
        assert rank_received == [2 * n for n in own], (tp, rank_received, own)
    assert all(0.45 < n / (2 * model_bytes) < 0.6 for n in received[0]), (received[0], model_bytes)
    outputs = [generate(server, PROMPT, max_new_tokens=12)[1] for server in fleet]
    assert {o["meta_info"]["weight_version"] for o in outputs} == {reports[-1].version}
    assert outputs[0]["output_ids"] == outputs[1]["output_ids"]


def test_a_staged_export_is_replayed_through_the_shard_plan(fleet, source):
    """sync.staged: the buckets packed (and the layouts' digests predicted) before the pause go through the same
    plan inside it; verified engine-exact per rank."""
    urls = [server.url for server in fleet]
    asyncio.run(source.call("configure", settings()))
    source.stage_results.clear()
    (report,) = sync_steps(urls, source, (5,), staged=True)
    assert report.committed and report.phases.stage_s > 0, report.error
    assert [e.verification for e in report.engines] == ["engine-exact (sha256)"] * 2, report.engines
    assert [r.engine_layouts for r in source.stage_results] == [2]  # the TP=2 and the TP=1 layout, ahead


def test_a_trained_draft_is_refused_before_anything_is_sent(fleet, source):
    urls = [server.url for server in fleet]
    before = [target_answer(u) for u in urls]
    asyncio.run(source.call("configure", settings(include_mtp=True)))
    (report,) = sync_steps(urls, source, (3,), selector_inputs=TRAINED_DRAFT)
    assert not report.committed
    assert "shard_direct transport loads the target's own parameters" in report.error, report.error
    assert all(url in report.error for url in urls), report.error
    assert [target_answer(u) for u in urls] == before
    assert all(generate(server, PROMPT, max_new_tokens=4)[0] == 200 for server in fleet)  # still serving


def test_a_fused_group_exported_in_part_is_refused_at_open(fleet, source):
    urls = [server.url for server in fleet]
    before = [target_answer(u) for u in urls]
    skipped = "model.layers.0.self_attn.k_proj.weight"
    asyncio.run(source.call("configure", settings(skip_names=(skipped,))))
    (report,) = sync_steps(urls, source, (4,))
    assert not report.committed and "transport set-up failed" in report.error, report.error
    assert "model.layers.0.self_attn.q_proj.weight: exported without the rest of its fused group" in report.error
    assert [target_answer(u) for u in urls] == before


def test_a_corrupted_slice_is_named_by_rank_and_parameter(fleet, shape, target_runner_weights):
    """Rank 1 of the TP=2 engine loads a qkv_proj shard with one element changed (its own direct payload); the
    engine-exact check names that rank and parameter only."""
    tp2 = fleet[0]
    ranks = [
        rank_engine_tensors(target_runner_weights, shape=shape, tp_rank=r, tp_size=2, layout=WeightLayout.AITER)
        for r in range(2)
    ]
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    bad = {**ranks[1], qkv: ranks[1][qkv].clone()}
    bad[qkv][0, 0] += 1.0

    def load(payload_ranks):
        tp2.ok("/begin_weight_update", {"selector": "target"})
        try:
            body = {
                "serialized_named_tensors": [encode_named_tensors(list(r.items())) for r in payload_ranks],
                "load_format": "direct",
                "selector": "target",
            }
            status, answer = tp2.post("/update_weights_from_tensor", body)
            assert status == 200, answer
        finally:
            tp2.ok("/end_weight_update")

    load(ranks)
    expected = target_answer(tp2.url)
    assert expected == [{n: sglang_tensor_hash(t) for n, t in r.items()} for r in ranks]
    load([ranks[0], bad])

    async def check():
        async with EngineClient(tp2.url, timeout_s=20.0) as client:
            request = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=Selector.TARGET)
            return await client.weights_checker(request)

    problems, _ = engine_exact_problems(
        expected=expected, ranks=asyncio.run(check()).ranks, selector=Selector.TARGET, sent_names=()
    )
    assert len(problems) == 1 and problems[0].startswith(f"rank 1 target {qkv} differs"), problems
    load(ranks)
    assert torch.equal(bad[qkv][1:], ranks[1][qkv][1:])  # one element apart
