"""Syncs from two pipeline stages: two sender processes, each holding one stage's tensors of a real model (stage 0:
the embedding and the first half of the layers; stage 1: the rest, the final norm and the LM head), composed by
`PipelineSource` under one controller, into two reference engines behind recording proxies.

What is shown on real engines, gloo groups and shared memory on loopback: each stage has an update group of its
own, created in stage order on every engine even when the engines receive the set-up requests in opposite orders;
every engine receives stage 0's buckets before stage 1's; one begin and one end per engine wrap both stages; the
verification covers the union of both stages' checksums and names a tensor no stage sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from recording_proxy import recording_proxy, segment_pid
from reference_server import reference_server
from sender_host import ProcessSource, SenderSettings, exported_names, load_checkpoint
from test_sync_session import (
    BUCKET_BYTES,
    COLLECTIVE_TIMEOUT_S,
    ENGINE_ARGS,
    controller,
    engine_checksums,
    expected_checksums,
    frozen_draft,
    generate,
)

from miles_sync.sync.pipeline import PipelineSource, stage_group_name
from miles_sync.sync.report import SyncError
from miles_sync.wire.protocol import Selector

pytestmark = pytest.mark.slow

SET_UP_DELAY_S = 2.0


@pytest.fixture(scope="module")
def checkpoint(reference_checkpoints):
    return load_checkpoint(reference_checkpoints / "target")


def stage_names(checkpoint, stage: int) -> tuple[str, ...]:
    """The names a 2-stage pipeline's stage exports (the frozen MTP layer is in neither)."""
    tensors, num_layers = checkpoint
    names = exported_names(tensors, num_hidden_layers=num_layers, include_mtp=False)
    first = [n for n in names if n.startswith("model.embed_tokens.") or _layer(n) < num_layers // 2]
    return tuple(first) if stage == 0 else tuple(n for n in names if n not in first)


def _layer(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else 10**6


def stage_settings(checkpoint, stage: int, transport: str, *, also_skip: tuple[str, ...] = ()) -> SenderSettings:
    tensors, num_layers = checkpoint
    names = exported_names(tensors, num_hidden_layers=num_layers, include_mtp=False)
    other = set(names) - set(stage_names(checkpoint, stage))
    return SenderSettings(
        transport=transport, bucket_bytes=BUCKET_BYTES, include_mtp=False, skip_names=(*sorted(other), *also_skip)
    )


@pytest.fixture(scope="module")
def stages(reference_checkpoints):
    sources = [ProcessSource(target_dir=reference_checkpoints / "target") for _ in range(2)]
    yield sources
    for source in sources:
        source.shutdown()


@pytest.fixture(scope="module")
def engines(reference_checkpoints, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("engines")
    with contextlib.ExitStack() as stack:
        proxies = []
        for _ in range(2):
            server = stack.enter_context(
                reference_server(
                    model=Path(reference_checkpoints) / "target",
                    log_dir=log_dir,
                    **ENGINE_ARGS,
                    extra_args=("--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S)),
                )
            )
            proxies.append(stack.enter_context(recording_proxy(server.url)))
        yield proxies


@pytest.fixture(autouse=True)
def fresh_records(engines):
    for proxy in engines:
        proxy.requests.clear()
        proxy.delays.clear()
    yield


async def configure(stages, checkpoint, transport: str, *, step: int, also_skip: tuple[str, ...] = ()) -> None:
    for stage, source in enumerate(stages):
        await source.call("configure", stage_settings(checkpoint, stage, transport, also_skip=also_skip))
        await source.call("step", step)


def group_of(body: dict) -> str:
    return body["group_name"]


def posted(proxy, path: str) -> list[dict]:
    """The JSON bodies posted to `path`, without the body-less capability probes."""
    return [r.body for r in proxy.requests if r.path == path and r.body is not None]


def test_two_stages_set_up_in_stage_order_against_opposite_delays_and_send_in_stage_order(engines, stages, checkpoint):
    """Engine 0 gets stage 0's group set-up late, engine 1 stage 1's: opened concurrently, each engine would block
    in a different stage's rendezvous (engines join one group at a time, as SGLang's scheduler does). The
    controller opens the stages one after another, so the sync commits, verified on both engines."""
    urls = [p.url for p in engines]
    engines[0].delays.append(("/init_weights_update_group", lambda b: group_of(b).endswith("_pp0"), SET_UP_DELAY_S))
    engines[1].delays.append(("/init_weights_update_group", lambda b: group_of(b).endswith("_pp1"), SET_UP_DELAY_S))

    async def main():
        await configure(stages, checkpoint, "distributed", step=1)
        pipeline = PipelineSource(stages)
        ctl = controller(urls, pipeline, transport="distributed", selector_inputs=frozen_draft())
        await ctl.connect()
        progress = []
        try:
            reports = [await ctl.sync()]
            progress.append([b.index for b in ctl.progress.buckets])
            for source in stages:
                await source.call("step", 2)
            reports.append(await ctl.sync())
            held = [await engine_checksums(u, Selector.TARGET) for u in urls]
            memberships = pipeline.memberships
        finally:
            await ctl.close()
        return reports, held, memberships, progress

    reports, held, memberships, progress = asyncio.run(main())
    expected = expected_checksums(checkpoint, step=2, include_mtp=False)
    for report in reports:
        assert report.committed and report.verification == "exact", report.error
        assert report.num_tensors == len(expected) and report.checksums.keys() == expected.keys()
        assert [e.num_verified_tensors for e in report.engines] == [len(expected)] * 2
    assert held == [expected, expected]
    # One group per stage, each with a port of its own; the second sync reused them.
    base = memberships[0].group_name.removesuffix("_pp0")
    assert [m.group_name for m in memberships] == [stage_group_name(base, stage=k, num_stages=2) for k in (0, 1)]
    assert memberships[0].master_port != memberships[1].master_port
    assert progress == [list(range(reports[0].num_buckets))]
    for proxy in engines:
        joined = [group_of(b) for b in posted(proxy, "/init_weights_update_group")]
        assert joined == [m.group_name for m in memberships]
        broadcasts = [group_of(b) for b in posted(proxy, "/update_weights_from_distributed")]
        # Per sync: every stage-0 bucket, then every stage-1 bucket; one begin and one end per engine and sync.
        per_sync = len(broadcasts) // 2
        for sync in (broadcasts[:per_sync], broadcasts[per_sync:]):
            stage_of = [0 if name == memberships[0].group_name else 1 for name in sync]
            assert stage_of == sorted(stage_of) and set(stage_of) == {0, 1}
        assert len(posted(proxy, "/begin_weight_update")) == len(posted(proxy, "/end_weight_update")) == 2


def test_colocated_stages_post_in_stage_order(engines, stages, checkpoint):
    urls = [p.url for p in engines]

    async def main():
        await configure(stages, checkpoint, "colocated", step=3)
        ctl = controller(urls, PipelineSource(stages), transport="colocated", selector_inputs=frozen_draft())
        await ctl.connect()
        try:
            report = await ctl.sync()
            held = [await engine_checksums(u, Selector.TARGET) for u in urls]
            served = [await generate(u) for u in urls]
        finally:
            await ctl.close()
        return report, held, served

    report, held, served = asyncio.run(main())
    expected = expected_checksums(checkpoint, step=3, include_mtp=False)
    assert report.committed and report.transport == "colocated", report.error
    assert held == [expected, expected]
    assert [r.meta_info.weight_version for r in served] == [report.version] * 2
    pids = [s.process.pid for s in stages]
    for proxy in engines:
        bodies = posted(proxy, "/update_weights_from_tensor")
        senders = [pids.index(segment_pid(b["serialized_named_tensors"][0])) for b in bodies]
        assert senders == sorted(senders) and set(senders) == {0, 1}
        assert all(b["selector"] == Selector.TARGET.value for b in bodies)


def test_a_tensor_no_stage_sent_fails_verification_and_nothing_commits(engines, stages, checkpoint):
    urls = [p.url for p in engines]
    dropped = "model.norm.weight"  # stage 1's; neither stage sends it

    async def main():
        await configure(stages, checkpoint, "distributed", step=4, also_skip=(dropped,))
        ctl = controller(urls, PipelineSource(stages), transport="distributed", selector_inputs=frozen_draft())
        await ctl.connect()
        try:
            before = ctl.weight_version
            with pytest.raises(SyncError) as failed:
                await ctl.sync()
            after = ctl.weight_version
            await configure(stages, checkpoint, "distributed", step=5)
            recovered = await ctl.sync()
        finally:
            await ctl.close()
        return failed.value.report, before, after, recovered

    failure, before, after, recovered = asyncio.run(main())
    assert not failure.committed and before == after
    for url in urls:
        assert f"{url} (exact): extra {dropped}" in failure.error
    assert recovered.committed and recovered.verification == "exact"
