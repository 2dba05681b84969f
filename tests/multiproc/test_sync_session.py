"""Full sync sessions through the controller class: a sender process holding a real model's tensors and two
reference engine processes (frozen or trained MTP draft, AITER layout, strict finalize), over real gloo groups,
shared memory and HTTP on loopback. Every sync is verified by checksums; the test also recomputes the expected
checksums itself and reads them back from the engines.

Every engine sits behind a recording proxy: no request the controller or the sender made may ask an engine's
weights checker to reset_tensors (on SGLang that fills the weights with random values and keeps serving them; the
check is tests/conftest.py's, after every test)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
from recording_proxy import recording_proxy, segment_pid
from reference_server import reference_server
from sender_host import SenderSettings, export_units, exported_names, load_checkpoint, weights_at_step

from miles_sync.engine.client import EngineClient
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.plan import plan_buckets
from miles_sync.sync.report import SyncError
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.weights.checksum import DRAFT_PREFIX, tensor_checksum
from miles_sync.wire.protocol import (
    GenerateRequest,
    PauseMode,
    SamplingParams,
    Selector,
    WeightsCheckerAction,
    WeightsCheckerRequest,
)

BUCKET_BYTES = 256 * 1024  # the 2.7 MB target travels in about a dozen buckets
COLLECTIVE_TIMEOUT_S = 15.0
TIMEOUTS = SessionTimeouts(control_s=20.0, sync_s=90.0)
ENGINE_ARGS = dict(draft_kind="mtp", weight_layout="aiter", finalize_policy="strict")
PROMPT = GenerateRequest(input_ids=(3, 100, 7), sampling_params=SamplingParams(max_new_tokens=6, temperature=0.0))


def frozen_draft(mode: SelectorMode = SelectorMode.AUTO) -> SelectorInputs:
    return SelectorInputs(
        mode=mode, speculative_algorithm="mtp", num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
    )


TRAINED_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=1, conversion_mode=ConversionMode.RAW
)


def settings(transport: str, *, include_mtp: bool, plan_feeds: bool = False) -> SenderSettings:
    return SenderSettings(
        transport=transport, bucket_bytes=BUCKET_BYTES, include_mtp=include_mtp, plan_feeds=plan_feeds
    )


def start_engine(checkpoints: Path, log_dir: Path):
    return reference_server(
        model=checkpoints / "target",
        log_dir=log_dir,
        **ENGINE_ARGS,
        extra_args=("--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S)),
    )


@pytest.fixture(scope="module")
def checkpoint(reference_checkpoints):
    return load_checkpoint(reference_checkpoints / "target")


class ProxiedEngine:
    """An engine process reached through its recording proxy (`url` is the proxy's)."""

    def __init__(self, server, proxy) -> None:
        self.server = server
        self.proxy = proxy
        self.url = proxy.url
        self.process = server.process


@contextlib.contextmanager
def proxied_engine(checkpoints: Path, log_dir: Path):
    with start_engine(checkpoints, log_dir) as server, recording_proxy(server.url) as proxy:
        yield ProxiedEngine(server, proxy)


@pytest.fixture(scope="module")
def engines(reference_checkpoints, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("engines")
    with proxied_engine(reference_checkpoints, log_dir) as a, proxied_engine(reference_checkpoints, log_dir) as b:
        yield [a, b]


def controller(urls, source, *, transport: str, selector_inputs: SelectorInputs) -> SyncController:
    return SyncController(
        engine_urls=urls,
        source=source,
        transport=transport,
        selector_inputs=selector_inputs,
        pause_mode=PauseMode.RETRACT,
        verify=True,
        timeouts=TIMEOUTS,
        show_progress=False,
    )


async def engine_checksums(url: str, selector: Selector) -> dict[str, str]:
    async with EngineClient(url, timeout_s=20.0) as client:
        result = await client.weights_checker(
            WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=selector)
        )
    return dict(result.ranks[0].checksums)


async def generate(url: str):
    async with EngineClient(url, timeout_s=60.0) as client:
        return await client.generate(PROMPT)


def expected_checksums(checkpoint, *, step: int, include_mtp: bool) -> dict[str, str]:
    tensors, num_layers = checkpoint
    weights = weights_at_step(tensors, step)
    names = exported_names(weights, num_hidden_layers=num_layers, include_mtp=include_mtp)
    return {n: tensor_checksum(weights[n]) for n in names}


def num_buckets(checkpoint, *, include_mtp: bool) -> int:
    tensors, num_layers = checkpoint
    units = export_units(tensors, num_hidden_layers=num_layers, include_mtp=include_mtp)
    return sum(1 for _ in plan_buckets((u.meta for u in units), cap_bytes=BUCKET_BYTES))


def test_distributed_syncs_with_a_frozen_draft(engines, source, checkpoint):
    urls = [e.url for e in engines]

    async def main():
        await source.call("configure", settings("distributed", include_mtp=False))
        draft_before = [await engine_checksums(u, Selector.DRAFT) for u in urls]
        ctl = controller(urls, source, transport="distributed", selector_inputs=frozen_draft())
        await ctl.connect()
        reports = []
        try:
            for step in (1, 2):
                await source.call("step", step)
                reports.append(await ctl.sync())
                expected = expected_checksums(checkpoint, step=step, include_mtp=False)
                for url in urls:
                    assert await engine_checksums(url, Selector.TARGET) == expected
                    response = await generate(url)
                    assert response.meta_info.weight_version == reports[-1].version
            membership = ctl.membership
        finally:
            await ctl.close()
        draft_after = [await engine_checksums(u, Selector.DRAFT) for u in urls]
        return reports, membership, draft_before, draft_after, ctl

    reports, membership, draft_before, draft_after, ctl = asyncio.run(main())
    num_tensors = len(expected_checksums(checkpoint, step=0, include_mtp=False))
    assert [r.version for r in reports] == ["1", "2"] and ctl.version == 2 and ctl.weight_version == "2"
    assert reports[1].previous_version == "1"
    for r in reports:
        assert r.committed and r.selector is Selector.TARGET and r.error is None
        assert r.num_buckets == num_buckets(checkpoint, include_mtp=False) > 4
        assert r.num_tensors == num_tensors
        assert [e.num_verified_tensors for e in r.engines] == [num_tensors, num_tensors]
        assert all(e.success and not e.is_stale and e.weight_version == r.version for e in r.engines)
        assert r.phases.send_s > 0 and r.gb_per_s > 0
    # Two TP=1 engines behind the source: world size 3, offsets 1 and 2; the group was reused by the second sync.
    assert membership.world_size == 3 and [e.rank_offset for e in membership.engines] == [1, 2]
    assert 0 < membership.master_port < 65536
    # The frozen draft was never in a session: its (logical) weights are untouched, and it was not re-shuffled.
    assert draft_before == draft_after and all(k.startswith(DRAFT_PREFIX) for k in draft_after[0])


def test_colocated_syncs_with_a_trained_draft(engines, source, checkpoint):
    urls = [e.url for e in engines]

    async def main():
        await source.call("configure", settings("colocated", include_mtp=True, plan_feeds=True))
        ctl = controller(urls, source, transport="colocated", selector_inputs=TRAINED_DRAFT)
        await ctl.connect()
        reports = []
        try:
            for step in (3, 4):
                await source.call("step", step)
                reports.append(await ctl.sync())
            expected = expected_checksums(checkpoint, step=4, include_mtp=True)
            held = [{**await engine_checksums(u, Selector.ALL)} for u in urls]
            responses = [await generate(u) for u in urls]
        finally:
            await ctl.close()
        return reports, expected, held, responses, ctl

    reports, expected, held, responses, ctl = asyncio.run(main())
    assert ctl.membership is None  # no update group on the colocated path
    num_tensors = len(expected)
    for r in reports:
        assert r.committed and r.selector is Selector.ALL and r.transport == "colocated"
        assert r.num_buckets == num_buckets(checkpoint, include_mtp=True)
        assert [e.num_verified_tensors for e in r.engines] == [num_tensors, num_tensors]
    # The MTP draft picked its own names out of the same buckets: the engine reports them under "draft.".
    mtp_prefix = f"model.layers.{checkpoint[1]}."
    for checksums in held:
        for name, value in expected.items():
            key = DRAFT_PREFIX + name if name.startswith(mtp_prefix) else name
            assert checksums[key] == value, name
    assert [r.meta_info.weight_version for r in responses] == [reports[-1].version] * 2
    # Each engine mapped its feeder's own memory: every handle posted to it (as the engine's proxy received it)
    # names a shared segment created by the sender process, its only co-located trainer rank.
    for engine in engines:
        posted = [  # without the body-less capability probe
            r.body for r in engine.proxy.requests if r.path == "/update_weights_from_tensor" and r.body is not None
        ]
        assert len(posted) == sum(r.num_buckets for r in reports)
        assert {segment_pid(b["serialized_named_tensors"][0]) for b in posted} == {source.process.pid}


def test_failed_verification_holds_engines_paused_with_their_weights_untouched(engines, source, checkpoint):
    """Bytes landed, then the sync failed: each engine stays paused and unrouted, holding exactly what it received
    (new values) and what it kept (old values), nothing else; the next full sync verifies and resumes it."""
    urls = [e.url for e in engines]
    dropped = "model.norm.weight"

    async def main():
        await source.call("configure", settings("distributed", include_mtp=False))
        ctl = controller(urls, source, transport="distributed", selector_inputs=frozen_draft())
        await ctl.connect()
        try:
            await source.call("step", 3)
            await ctl.sync()  # the state before the failure: a verified version
        finally:
            await ctl.close()
        before = [await engine_checksums(u, Selector.TARGET) for u in urls]
        faulty = SenderSettings(
            transport="distributed", bucket_bytes=BUCKET_BYTES, include_mtp=False, skip_names=(dropped,)
        )
        await source.call("configure", faulty)
        ctl = controller(urls, source, transport="distributed", selector_inputs=frozen_draft())
        await ctl.connect()
        try:
            previous = ctl.weight_version
            await source.call("step", 8)
            with pytest.raises(SyncError) as failed:
                await ctl.sync()
            after = [await engine_checksums(u, Selector.TARGET) for u in urls]
            paused = [await is_paused(u) for u in urls]
            versions = [await model_version(u) for u in urls]
            held, serving = ctl.held_engines, ctl.serving_engines
            committed_after_failure = ctl.weight_version
            # A full export repairs both engines in the next sync, which resumes them.
            await source.call("configure", settings("distributed", include_mtp=False))
            recovered = await ctl.sync()
            resumed = [not await is_paused(u) for u in urls]
            served = [await generate(u) for u in urls]
        finally:
            await ctl.close()
        return (
            previous,
            committed_after_failure,
            failed.value.report,
            before,
            after,
            paused,
            versions,
            held,
            serving,
            recovered,
            resumed,
            served,
            ctl,
        )

    (previous, committed, failure, before, after, paused, versions, held, serving, recovered, resumed, served, ctl) = (
        asyncio.run(main())
    )
    # The exporter dropped a tensor: every engine still holds its old copy, which the trainer never sent.
    assert not failure.committed and "verification failed" in failure.error
    for url in urls:
        assert f"{url} (exact): extra {dropped}" in failure.error
    assert all(not e.success and e.is_stale for e in failure.engines)
    assert sorted(held) == sorted(urls) and all("verify" in reason for reason in held.values()) and serving == ()
    # Held, not reset: paused, and every tensor is the value it had before or the one the trainer sent.
    assert paused == [True, True]
    new = expected_checksums(checkpoint, step=8, include_mtp=False)
    for old_sums, new_sums in zip(before, after):
        assert set(new_sums) == set(old_sums)
        assert new_sums[dropped] == old_sums[dropped]
        assert all(new_sums[n] == new[n] for n in new_sums if n != dropped)
    # update_weight_version ran before the verification, but the version is not committed.
    assert versions == [failure.version] * 2 and committed == previous
    assert recovered.committed and int(recovered.version) == int(failure.version) + 1
    assert recovered.verification == "exact" and all(e.verification == "exact" for e in recovered.engines)
    assert resumed == [True, True] and ctl.held_engines == {} and ctl.serving_engines == tuple(urls)
    assert [r.meta_info.weight_version for r in served] == [recovered.version] * 2


def test_selector_cross_check_fails_before_anything_is_sent(engines, source, checkpoint):
    urls = [e.url for e in engines]

    async def main():
        await source.call("configure", settings("colocated", include_mtp=False))
        before = [await engine_checksums(u, Selector.ALL) for u in urls]
        versions_before = [(await generate(u)).meta_info.weight_version for u in urls]
        # Forcing 'all' while the export carries none of the MTP draft's names is the double-finalize bug.
        ctl = controller(urls, source, transport="colocated", selector_inputs=frozen_draft(SelectorMode.ALL))
        await ctl.connect()
        try:
            with pytest.raises(SyncError) as failed:
                await ctl.sync()
        finally:
            await ctl.close()
        after = [await engine_checksums(u, Selector.ALL) for u in urls]
        versions_after = [(await generate(u)).meta_info.weight_version for u in urls]
        return failed.value.report, before, after, versions_before, versions_after, ctl

    report, before, after, versions_before, versions_after, ctl = asyncio.run(main())
    assert not report.committed and report.selector is None and report.num_bytes == 0
    assert "selector cross-check failed, nothing was sent" in report.error and "mtp draft" in report.error
    assert not any(e.is_stale for e in report.engines) and ctl.stale_engines == ()
    assert before == after and versions_before == versions_after  # untouched, still serving


@pytest.mark.slow
def test_engine_killed_mid_sync_then_group_recreated(reference_checkpoints, source, checkpoint, tmp_path):
    async def main(survivor, victim):
        await source.call("configure", settings("distributed", include_mtp=False))
        ctl = controller([survivor.url, victim.url], source, transport="distributed", selector_inputs=frozen_draft())
        await ctl.connect()
        try:
            await source.call("step", 5)
            good = await ctl.sync()
            first_membership = ctl.membership

            # Pulling the first unit of bucket 3 happens after bucket 0 was acknowledged by both engines.
            tensors, num_layers = checkpoint
            units = export_units(tensors, num_hidden_layers=num_layers, include_mtp=False)
            plans = list(plan_buckets((u.meta for u in units), cap_bytes=BUCKET_BYTES))
            gate_unit = sum(len(p.units) for p in plans[:3])
            await source.call("step", 6)
            await source.call("gate", gate_unit)
            source.gate_reached.clear()
            source.gate_release.clear()

            async def kill_during_sync():
                assert await asyncio.to_thread(source.gate_reached.wait, 60.0)
                victim.process.kill()
                await asyncio.to_thread(victim.process.wait, 10.0)
                source.gate_release.set()

            killer = asyncio.create_task(kill_during_sync())
            start = time.monotonic()
            with pytest.raises(SyncError) as failed:
                await ctl.sync()
            failed_s = time.monotonic() - start
            await killer
            survivor_after_failure = await model_version(survivor.url)
            survivor_paused = await is_paused(survivor.url)

            # A restarted engine joins; the next sync re-creates the group and gives it full, verified weights.
            with proxied_engine(reference_checkpoints, tmp_path) as restarted:
                await ctl.replace_engine(victim.url, restarted.url)
                assert ctl.stale_engines == (survivor.url, restarted.url)
                await source.call("step", 7)
                recovered = await ctl.sync()
                second_membership = ctl.membership
                served = [await generate(u) for u in (survivor.url, restarted.url)]
                held = await engine_checksums(restarted.url, Selector.TARGET)
                serving = ctl.serving_engines
                await ctl.close()
        finally:
            await ctl.close()
        return (
            good,
            failed.value.report,
            failed_s,
            survivor_after_failure,
            survivor_paused,
            recovered,
            served,
            held,
            first_membership,
            second_membership,
            serving,
            ctl,
        )

    with (
        proxied_engine(reference_checkpoints, tmp_path) as survivor,
        proxied_engine(reference_checkpoints, tmp_path) as victim,
    ):
        (
            good,
            failure,
            failed_s,
            survivor_version,
            survivor_paused,
            recovered,
            served,
            held,
            first_membership,
            second_membership,
            serving,
            ctl,
        ) = asyncio.run(main(survivor, victim))
        survivor_url = survivor.url

    assert good.committed and good.version == "1"
    # The failed sync: bounded by the timeouts, no version bump anywhere, the survivor resumed on the old version.
    assert not failure.committed and failure.version == "2"
    assert failed_s < COLLECTIVE_TIMEOUT_S + TIMEOUTS.control_s
    assert "bucket" in failure.error
    assert survivor_version == "1"
    # It loaded bucket 0 before the failure, so it may hold partial weights: stale, and held paused.
    assert failure.stale_engines == (survivor_url, failure.engines[1].url)
    assert survivor_paused
    # Recovery: a new group (new name and port), version 3 (2 is never reused), full verified weights on both.
    assert recovered.committed and recovered.version == "3" and ctl.version == 3
    assert second_membership.group_name != first_membership.group_name
    assert all(e.success and not e.is_stale for e in recovered.engines)
    assert [r.meta_info.weight_version for r in served] == ["3", "3"]
    assert held == expected_checksums(checkpoint, step=7, include_mtp=False)
    assert serving == (survivor_url, recovered.engines[1].url)


async def model_version(url: str) -> str:
    async with EngineClient(url, timeout_s=20.0) as client:
        return (await client.model_info()).weight_version


async def is_paused(url: str) -> bool:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/get_server_info", timeout=aiohttp.ClientTimeout(total=20)) as answer:
            return bool((await answer.json())["internal_states"][0]["is_paused"])
