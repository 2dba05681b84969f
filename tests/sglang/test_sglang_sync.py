"""Syncs into two real SGLang 0.5.23 CPU servers (TP=1) through the controller class: a sender process holding
the reference checkpoint's tensors, real gloo groups, shared memory and HTTP on loopback.

Every committed sync is verified engine-exact: the source predicts SGLang's per-parameter SHA-256 digests over its
fused, sharded parameters from the bytes it sent, and the servers' own weights checker answers them. The failure
drills check what a real server does when a sync fails after bytes landed: held paused, not randomized (each
parameter holds its old or its sent value), version not committed, resumed verified by the next sync. Every server
sits behind a recording proxy that proves no request asked its checker to reset_tensors. The last test kills one of
the module's servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest
from recording_proxy import recording_proxy
from routed_rounds import routed_rounds
from sender_host import SenderSettings, export_units, exported_names, load_checkpoint, weights_at_step
from sglang_server import enter_together, sglang_server
from silent_member import silent_member

from miles_sync.engine.client import EngineClient
from miles_sync.engine.router import RouterClient, RouterProcess, RouterSpec
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.report import SyncError, SyncReport
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.transport.base import TransportKind
from miles_sync.transport.feeds import Device, plan_feeds
from miles_sync.transport.p2p_loader import LOADER_PATH
from miles_sync.weights.checksum import sglang_fused_tensor, sglang_parameter_names, sglang_tensor_hash
from miles_sync.wire.protocol import (
    GenerateRequest,
    PauseMode,
    SamplingParams,
    Selector,
    WeightsCheckerAction,
    WeightsCheckerRequest,
    WeightVersionSpan,
)

BUCKET_BYTES = 512 * 1024  # the 2.7 MB target travels in a handful of buckets
TIMEOUTS = SessionTimeouts(control_s=30.0, sync_s=120.0)
NO_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm=None, num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)
PROMPT = GenerateRequest(input_ids=(3, 100, 7), sampling_params=SamplingParams(max_new_tokens=6, temperature=0.0))
PROBE_SAMPLING = {"max_new_tokens": 6, "temperature": 0.0}  # PROMPT's, as the probe's raw JSON
PAUSED_PROBE_S = 3.0  # a paused server does not answer /generate; a serving one answers 6 tokens in milliseconds


def settings(transport: str, **kwargs) -> SenderSettings:
    return SenderSettings(transport=transport, bucket_bytes=BUCKET_BYTES, include_mtp=False, **kwargs)


@pytest.fixture(scope="module")
def checkpoint(reference_checkpoints):
    return load_checkpoint(reference_checkpoints / "target")


@pytest.fixture(scope="module")
def servers(reference_checkpoints, sglang_python, tmp_path_factory):
    """Two real servers, each behind a recording proxy: (launcher, proxy) pairs."""
    log_dir = tmp_path_factory.mktemp("sglang")
    model = reference_checkpoints / "target"
    with contextlib.ExitStack() as stack:
        launchers = enter_together(
            stack,
            *(
                sglang_server(model=model, python=sglang_python, log_dir=log_dir, custom_weight_loaders=(LOADER_PATH,))
                for _ in range(2)
            ),
        )
        yield [(launcher, stack.enter_context(recording_proxy(launcher.url))) for launcher in launchers]


def controller(urls, source, *, transport: str = "distributed", gate=None) -> SyncController:
    return SyncController(
        engine_urls=urls,
        source=source,
        transport=transport,
        selector_inputs=NO_DRAFT,
        pause_mode=PauseMode.ABORT,
        verify=True,
        timeouts=TIMEOUTS,
        show_progress=False,
        gate=gate,
    )


async def engine_checksums(url: str, *, timeout_s: float = 30.0) -> dict[str, str]:
    async with EngineClient(url, timeout_s=timeout_s) as client:
        result = await client.weights_checker(WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM))
    return dict(result.ranks[0].checksums)


async def generate(url: str, *, timeout_s: float = 60.0):
    async with EngineClient(url, timeout_s=timeout_s) as client:
        return await client.generate(PROMPT)


async def is_paused(url: str) -> bool:
    """SGLang reports no pause state: a paused server leaves /generate waiting until continue_generation. The probe
    asks for 6 greedy tokens (SGLang's default is 128 sampled ones, which a slow serving server may not
    finish in PAUSED_PROBE_S: it would read as paused, the direction that hides a server left paused)."""
    try:
        async with aiohttp.ClientSession() as session:
            timeout = aiohttp.ClientTimeout(total=PAUSED_PROBE_S)
            async with session.post(
                url + "/generate", json={"input_ids": [3, 100, 7], "sampling_params": PROBE_SAMPLING}, timeout=timeout
            ):
                return False
    except asyncio.TimeoutError:
        return True


def engine_digests(weights, *, num_layers: int) -> dict[str, str]:
    """What a TP=1 CPU server's checker answers for these HF weights (the target's layers only): SGLang's fused
    parameters (qkv_proj, gate_up_proj) hashed as loaded."""
    names = exported_names(weights, num_hidden_layers=num_layers, include_mtp=False)
    return {
        engine: sglang_tensor_hash(sglang_fused_tensor(engine, [weights[n] for n in parts]))
        for engine, parts in sglang_parameter_names(names).items()
    }


async def one_sync(urls, source, *, step: int) -> SyncReport:
    """One sync of `step`'s weights into `urls` by a fresh controller (closed after); raises SyncError if it fails."""
    await source.call("configure", settings("distributed"))
    ctl = controller(urls, source)
    await ctl.connect()
    try:
        await source.call("step", step)
        return await ctl.sync()
    finally:
        await ctl.close()


async def model_version(url: str) -> str:
    async with EngineClient(url, timeout_s=30.0) as client:
        return (await client.model_info()).weight_version


async def cached_tokens(url: str) -> int:
    """How many of CACHE_PROBE's prompt tokens the server took from its prefix (radix) cache: SGLang's
    meta_info.cached_tokens, which the typed response does not carry."""
    async with aiohttp.ClientSession() as session:
        timeout = aiohttp.ClientTimeout(total=60.0)
        async with session.post(url + "/generate", json=CACHE_PROBE, timeout=timeout) as response:
            assert response.status == 200, await response.text()
            return int((await response.json())["meta_info"]["cached_tokens"])


# A prompt long enough that its cached prefix is unmistakable; one greedy token.
CACHE_PROBE = {"input_ids": list(range(10, 50)), "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}


# flush: the source flushes the prefix cache with every update (the main job's default for abort and retract); or
# the session's own /flush_cache after the pause.
@pytest.mark.parametrize(
    ("transport", "flush_with_updates"),
    [("distributed", True), ("colocated", True), ("shard_direct", True), ("distributed", False)],
    ids=["distributed", "colocated", "shard_direct", "distributed-session-flush"],
)
def test_syncs_into_real_servers_are_verified_engine_exact(servers, source, checkpoint, transport, flush_with_updates):
    urls = [proxy.url for _, proxy in servers]
    tensors, num_layers = checkpoint
    num_tensors = len(exported_names(tensors, num_hidden_layers=num_layers, include_mtp=False))

    async def main():
        await source.call("configure", settings(transport, flush_cache=flush_with_updates))
        ctl = controller(urls, source, transport=transport)
        await ctl.connect()
        reports, answers, cached = [], [], []
        try:
            for step in (1, 2):
                # The probe's prefix is cached before the sync (asked twice: the second answer shows it cached),
                # and must be gone after it: KV computed with the old weights is never reused.
                before = [[await cached_tokens(u) for _ in range(2)][1] for u in urls]
                await source.call("step", step)
                reports.append(await ctl.sync())
                cached.append((before, [await cached_tokens(u) for u in urls]))
                answers.append([await generate(u) for u in urls])
            versions = [await model_version(u) for u in urls]
        finally:
            await ctl.close()
        return reports, answers, versions, cached

    reports, answers, versions, cached = asyncio.run(main())
    for before, after in cached:
        assert all(n >= 30 for n in before) and after == [0, 0], cached
    for report in reports:
        calls = [set(e.call_s) for e in report.engines]
        # Each engine's calls are timed by step; the session's /flush_cache only where the source does not flush.
        expected = {"pause", "begin", "end", "version", "verify-checksum", "resume"}
        assert calls == [expected if flush_with_updates else expected | {"flush"}] * 2, calls
        assert all(s > 0 for e in report.engines for s in e.call_s.values())
        outcome = "flushed with the updates" if flush_with_updates else "flushed"
        assert [e.prefix_cache for e in report.engines] == [outcome] * 2
    for report, responses in zip(reports, answers):
        assert report.committed and report.error is None and report.selector is Selector.ALL
        assert report.verification == "engine-exact (sha256)", report
        assert all(
            e.verification == "engine-exact (sha256)" and e.num_verified_tensors == num_tensors for e in report.engines
        )
        for response in responses:  # SGLang's meta_info, decoded: the version that produced every token
            assert response.meta_info.weight_version == report.version
            assert response.meta_info.weight_versions == (WeightVersionSpan(version=report.version, start=0, end=6),)
    assert versions == [reports[-1].version] * 2


@pytest.mark.parametrize(
    ("faulty", "named"),
    [
        # The exporter dropped a tensor: each server still holds the old copy, which the prediction does not have.
        (dict(skip_names=("model.norm.weight",)), "rank 0 target model.norm.weight extra"),
        # The exporter sent a tensor the server does not serve: SGLang ignores it with 200 success, the sync fails.
        (
            dict(extra_names=("model.layers.0.mlp.unserved.weight",)),
            "rank 0 target model.layers.0.mlp.unserved.weight missing",
        ),
    ],
    ids=["dropped tensor", "unserved tensor"],
)
def test_a_failed_verification_holds_real_servers_with_their_weights_untouched(
    servers, source, checkpoint, faulty, named
):
    """Bytes landed, then verification failed: each server stays paused and unrouted, its parameters the old or the
    sent values (never randomized), the version uncommitted; the next full sync verifies and resumes it."""
    urls = [proxy.url for _, proxy in servers]

    async def main():
        await one_sync(urls, source, step=3)  # the state before the failure: a verified version
        before = [await engine_checksums(u) for u in urls]
        await source.call("configure", settings("distributed", **faulty))
        ctl = controller(urls, source)
        await ctl.connect()
        try:
            previous = ctl.weight_version
            await source.call("step", 4)
            with pytest.raises(SyncError) as failed:
                await ctl.sync()
            after = [await engine_checksums(u) for u in urls]
            paused = [await is_paused(u) for u in urls]
            held, serving, committed = dict(ctl.held_engines), ctl.serving_engines, ctl.weight_version
            await source.call("configure", settings("distributed"))
            recovered = await ctl.sync()
            resumed = [await generate(u, timeout_s=10.0) for u in urls]
        finally:
            await ctl.close()
        return before, previous, failed.value.report, after, paused, held, serving, committed, recovered, resumed

    before, previous, failure, after, paused, held, serving, committed, recovered, resumed = asyncio.run(main())
    sent = engine_digests(weights_at_step(checkpoint[0], 4), num_layers=checkpoint[1])
    assert not failure.committed and "verification failed" in failure.error
    for url in urls:
        assert f"{url} (engine-exact (sha256)): " in failure.error and named in failure.error, failure.error
    assert sorted(held) == sorted(urls) and serving == () and committed == previous
    assert paused == [True, True]
    # Not randomized: every parameter holds its value from before or, for the ones the failed sync sent, a new one;
    # the untouched ones (the dropped tensor) still hold exactly the old bytes.
    for old, new in zip(before, after):
        assert set(new) == set(old)
        if "skip_names" in faulty:
            assert new["model.norm.weight"] == old["model.norm.weight"]
            assert all(new[n] == sent[n] for n in new if n != "model.norm.weight")
        else:  # the unserved tensor was ignored; every parameter the server serves holds the sent bytes
            assert new == sent and new != old
    assert recovered.committed and recovered.verification == "engine-exact (sha256)"
    assert [r.meta_info.weight_version for r in resumed] == [recovered.version] * 2


def test_the_router_lists_only_the_real_servers_a_sync_verified(servers, source, sglang_python, tmp_path):
    """sglang-router 0.3.2 in front of both servers (it probes their /health, /server_info and /model_info before it
    routes): a verified sync leaves both listed and the requests it routes answer at that version, split between
    them; a sync whose verification fails holds both, and the router lists neither before either could be resumed;
    the next verified sync lists both again."""
    urls = [proxy.url for _, proxy in servers]
    process = RouterProcess(spec=RouterSpec(python=str(sglang_python)), log_dir=tmp_path)

    async def through_router(router: RouterClient, count: int) -> list[str]:
        async with EngineClient(router.url, timeout_s=60.0) as client:
            answers = await asyncio.gather(*(client.generate(PROMPT) for _ in range(count)))
        return [a.meta_info.weight_version for a in answers]

    async def main(router: RouterClient):
        await source.call("configure", settings("distributed"))
        ctl = controller(urls, source, gate=router)
        out = {}
        try:
            await ctl.connect()
            await source.call("step", 5)
            out["good"] = await ctl.sync()
            out["listed"] = sorted(await router.worker_urls())
            before = await router.routed_counts()
            out["versions"] = await through_router(router, 6)
            after = await router.routed_counts()
            out["per_server"] = [after.get(u, 0) - before.get(u, 0) for u in urls]
        finally:
            await ctl.close()
        # A source that drops a tensor (configured before its controller opens the transport): bytes land, the
        # verification fails on both servers.
        await source.call("configure", settings("distributed", skip_names=("model.norm.weight",)))
        ctl = controller(urls, source, gate=router)
        try:
            await ctl.connect()
            await source.call("step", 6)
            out["failed"] = await ctl.sync(raise_on_failure=False)
            out["listed_after_failure"] = await router.worker_urls()
            await source.call("configure", settings("distributed"))
            out["recovered"] = await ctl.sync()
            out["listed_after_recovery"] = sorted(await router.worker_urls())
            out["versions_after"] = await through_router(router, 4)
        finally:
            await ctl.close()
            for url in urls:
                with contextlib.suppress(Exception):
                    await router.withdraw(url)
            await router.close()
        return out

    router = process.start()
    try:
        out = asyncio.run(main(router))
    finally:
        process.stop()
    assert out["good"].committed and out["listed"] == sorted(urls)
    assert out["versions"] == [out["good"].version] * 6 and out["per_server"] == [3, 3]  # round robin
    assert not out["failed"].committed and out["listed_after_failure"] == ()
    assert out["recovered"].committed and out["listed_after_recovery"] == sorted(urls)
    assert out["versions_after"] == [out["recovered"].version] * 4


def test_servers_holding_another_version_are_found_without_a_sync_and_pass_once_synced(servers, source):
    """The check before round 0 (SyncController.check_engines) against real servers that hold an earlier run's
    weights: the trainer's weights of step 7 are hashed on the sender, not sent; each server's own checker answers,
    engine-exact with SHA-256 (a CPU server); both are named with the parameters that differ, nothing is written
    to them (a second check answers the same), and after one sync both pass."""
    urls = [proxy.url for _, proxy in servers]

    async def main():
        await source.call("configure", settings("distributed"))
        await source.call("step", 7)
        ctl = controller(urls, source)
        await ctl.connect()
        try:
            before = [await engine_checksums(u) for u in urls]
            stale = await ctl.check_engines()
            after = [await engine_checksums(u) for u in urls]
            report = await ctl.sync()
            return before, stale, after, report, await ctl.check_engines()
        finally:
            await ctl.close()

    before, stale, after, report, synced = asyncio.run(main())
    assert stale.selector is Selector.ALL and stale.to_sync == tuple(urls), stale.summary()
    assert all(e.method == "engine-exact (sha256)" and "differs" in e.message for e in stale.engines), stale.summary()
    assert after == before  # the check wrote nothing
    assert report.committed and report.verification == "engine-exact (sha256)", report
    assert synced.to_sync == () and all(e.holds_trainer_weights for e in synced.engines), synced.summary()


def test_a_rendezvous_that_never_completes_leaves_real_servers_serving(servers, source):
    """A member takes the init call but never joins: the sync fails while opening the group, before any pause;
    the real servers, which joined a rendezvous that could not complete, are released when the trainer side gives
    up, keep serving the committed version, and the next sync over them alone verifies."""
    urls = [proxy.url for _, proxy in servers]

    async def main():
        committed = await one_sync(urls, source, step=5)
        with silent_member(weight_version=committed.version) as member:
            await source.call("configure", settings("distributed"))
            ctl = controller([*urls, member.url], source)
            await ctl.connect()
            started = time.monotonic()
            try:
                with pytest.raises(SyncError) as failed:
                    await ctl.sync()
            finally:
                await ctl.close()
            elapsed = time.monotonic() - started
            init_requests = list(member.init_requests)
        served = [await generate(u, timeout_s=30.0) for u in urls]
        recovered = await one_sync(urls, source, step=6)
        return committed, failed.value.report, elapsed, init_requests, served, recovered

    committed, failure, elapsed, init_requests, served, recovered = asyncio.run(main())
    assert "did not rendezvous" in failure.error and failure.phases.pause_s == 0.0, failure.error
    assert elapsed < TIMEOUTS.sync_s, f"the failed sync took {elapsed:.1f} s"
    assert [(r["rank_offset"], r["world_size"]) for r in init_requests] == [(3, 4)]
    assert [r.meta_info.weight_version for r in served] == [committed.version] * 2
    assert recovered.committed and recovered.verification == "engine-exact (sha256)"


def test_p2p_feeds_each_server_from_its_own_trainer_rank(servers, reference_checkpoints):
    """p2p from two real megatron-core trainer ranks (TP=2) into the two TP=1 servers, server j fed by trainer rank
    j: each rank sends the other the halves of the sharded tensors its server lacks (point to point), with no gather
    (tests/routed_rounds.py), then its server the whole parameters point to point through the server's custom weight
    loader; the round is verified engine-exact, every sent tensor counted. (The same exchange feeding shared memory,
    shard_direct's routed form, runs into reference engines in tests/ray/test_sync_fleet.py and into the real TP=2
    server in test_sglang_tp2.py.)"""
    devices = [Device(node="127.0.0.1", index=r) for r in range(2)]
    feeds = plan_feeds(trainer_devices=devices, engine_devices=[[d] for d in devices])
    urls = [launcher.url for launcher, _ in servers]
    # One round: the tier's time goes to the servers.
    checkpoint = reference_checkpoints / "target"
    (report,) = routed_rounds(urls, checkpoint=checkpoint, feeds=feeds, num_rounds=1, transports=(TransportKind.P2P,))
    assert report.transport == "p2p"
    assert [e.verification for e in report.engines] == ["engine-exact (sha256)"] * 2, report.summary()


def test_a_server_killed_mid_send_fails_the_sync_and_the_survivor_is_held_then_resumed(servers, source, checkpoint):
    """Runs last: kills the module's first server while buckets are on the wire. The sync fails within its
    timeouts without committing; the survivor, which received some of the buckets, stays paused with each parameter
    at its old or its new value; a later sync over the survivor alone verifies and resumes it."""
    (victim, victim_proxy), (_, survivor_proxy) = servers
    urls = [victim_proxy.url, survivor_proxy.url]
    survivor = survivor_proxy.url
    tensors, num_layers = checkpoint
    gate_unit = len(export_units(tensors, num_hidden_layers=num_layers, include_mtp=False)) - 2

    async def main():
        await one_sync(urls, source, step=5)
        before = await engine_checksums(survivor)
        await source.call("configure", settings("distributed"))
        ctl = controller(urls, source)
        await ctl.connect()
        try:
            previous = ctl.weight_version
            await source.call("step", 6)
            await source.call("gate", gate_unit)  # the sender stops before its last units: earlier buckets landed
            sync = asyncio.create_task(ctl.sync())
            assert await asyncio.to_thread(source.gate_reached.wait, 60.0), "the send never reached the gate"
            victim.kill()
            started = time.monotonic()
            source.gate_release.set()
            with pytest.raises(SyncError) as failed:
                await asyncio.wait_for(sync, TIMEOUTS.sync_s + 30.0)
            elapsed = time.monotonic() - started
            held, committed = dict(ctl.held_engines), ctl.weight_version
        finally:
            await ctl.close()
        # The survivor's scheduler may still sit in the broken broadcast until its group gives up; its checker answers
        # after that (waited on, bounded by the session's own limit), never a sleep.
        after = await engine_checksums(survivor, timeout_s=TIMEOUTS.sync_s)
        paused = await is_paused(survivor)
        recovered = await one_sync([survivor], source, step=7)
        served = await generate(survivor, timeout_s=10.0)
        return before, previous, failed.value.report, elapsed, held, committed, after, paused, recovered, served

    before, previous, failure, elapsed, held, committed, after, paused, recovered, served = asyncio.run(main())
    assert not failure.committed and committed == previous
    assert elapsed < TIMEOUTS.sync_s, f"the failed sync took {elapsed:.1f} s"
    assert survivor in held and paused
    assert set(after) == set(before) and after != before  # some buckets landed before the failure
    sent = engine_digests(weights_at_step(tensors, 6), num_layers=num_layers)
    mixed = {n for n in after if after[n] != before[n]}
    assert all(after[n] == sent[n] for n in mixed), sorted(n for n in mixed if after[n] != sent[n])
    assert recovered.committed and recovered.verification == "engine-exact (sha256)"
    assert served.meta_info.weight_version == recovered.version
