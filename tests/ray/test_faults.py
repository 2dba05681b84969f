"""Fault drills on the Ray fleet (2 trainer ranks at TP=2, 2 reference engines), one fault per test:

- an engine killed before the sync starts;
- an engine killed after every bucket was broadcast and acknowledged, before finalize and verify;
- the trainer's source rank killed mid-sync (the trainer group is then re-created);
- an engine SIGSTOPped mid-sync past the HTTP timeout, then SIGCONTed;
- a rendezvous that never completes (a member that takes the init call but never joins).

Each failed sync must end within its configured timeout (plus the bounded teardown), leave the version where it
was, let no engine answer from partial weights (its checksum equals the committed one, or it is held paused with
its weights untouched and unrouted), and the next sync must commit with every engine verified (which resumes the
held ones). The engine killed during a broadcast is covered in
test_sync_fleet.py.

Each mid-sync fault strikes at a request held in a recording proxy in front of an engine (tests/recording_proxy.py):
the drill waits until the sync reached it, strikes, then lets the request go on or answers it itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import ray
from ray_fleet import (
    RAY_TIMEOUT_S,
    Fleet,
    current_urls,
    local_ray,
    prompts,
    started_fleet,
    target_checksum,
    train_batch,
)
from recording_proxy import recording_proxy
from silent_member import silent_member

from actors.controller import create_controller
from actors.trainer import create_trainers
from miles_sync.config import ModelConfig, SyncConfig, TrainerConfig
from miles_sync.engine.client import EngineClient
from miles_sync.engine.rollout import generate_samples
from miles_sync.sync.report import SyncProgress, SyncReport
from miles_sync.transport.base import TransportKind
from miles_sync.wire.api import EngineError
from miles_sync.wire.protocol import DestroyWeightsUpdateGroupRequest, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
MODEL = ModelConfig(arch="qwen3", speculative_algorithm="NEXTN", num_trained_mtp_layers=0)
TRAINER = TrainerConfig(tp=2, lr=1e-4)
ENGINE_COLLECTIVE_TIMEOUT_S = 10.0
# Small timeouts, so that every fault ends quickly; several buckets per sync, as a real model has many.
FAULT_SYNC = SyncConfig(
    transport=TransportKind.DISTRIBUTED,
    bucket_bytes=256 * 1024,
    http_timeout_s=4.0,
    collective_timeout_s=8.0,
    sync_timeout_s=40.0,
)
# After its deadline a failed session still tears down: source close, end, checksum read, resume, each one engine
# call bounded by the HTTP timeout (one more kept as margin). The slack is for a shared 2-core machine.
TEARDOWN_CALLS = 5
SLACK_S = 10.0
FAILED_SYNC_BOUND_S = FAULT_SYNC.sync_timeout_s + TEARDOWN_CALLS * FAULT_SYNC.http_timeout_s + SLACK_S


@pytest.fixture(scope="module")
def fleet(reference_checkpoints, tmp_path_factory) -> Iterator[Fleet]:
    with (
        local_ray(num_cpus=2),
        started_fleet(
            checkpoint_dir=str(reference_checkpoints / "target"),
            log_dir=tmp_path_factory.mktemp("engines"),
            trainer=TRAINER,
            engine_collective_timeout_s=ENGINE_COLLECTIVE_TIMEOUT_S,
            name="faults",
        ) as fleet,
    ):
        yield fleet


@contextlib.contextmanager
def controller_for(fleet: Fleet, *, urls: Sequence[str] | None = None, extra_urls: Sequence[str] = ()) -> Iterator[Any]:
    """A controller over the engines at `urls` (default: the fleet's own; a proxy's URL speaks for its engine) and
    `extra_urls`."""
    urls = [*(current_urls(fleet.engines.actors) if urls is None else urls), *extra_urls]
    handle = create_controller(trainers=fleet.trainers.actors, engine_urls=urls, sync=FAULT_SYNC, model=MODEL)
    try:
        yield handle
    finally:
        ray.get(handle.close.remote(), timeout=RAY_TIMEOUT_S)
        ray.kill(handle)


def call(controller, method: str, *args: Any, **kwargs: Any) -> Any:
    return ray.get(getattr(controller, method).remote(*args, **kwargs), timeout=RAY_TIMEOUT_S)


# ---- the committed state, and what must hold after a failure ----------------------------------------------------


@dataclass(frozen=True)
class Committed:
    version: str
    checksum: str  # every engine's target checksum at that version
    num_buckets: int


def commit_then_train(fleet: Fleet, controller, *, round_index: int) -> Committed:
    """Commit a sync, then take one training step, so that the next sync's weights differ from the committed ones
    (an engine that received any of them is then told apart by its checksum)."""
    report = call(controller, "sync")
    assert report.committed, report.summary()
    checksums = {target_checksum(u) for u in current_urls(fleet.engines.actors)}
    assert len(checksums) == 1, checksums
    samples = [s for url in current_urls(fleet.engines.actors) for s in generated(url, round_index=round_index)]
    fleet.trainers.train_step(train_batch(samples), timeout_s=RAY_TIMEOUT_S)
    return Committed(version=report.version, checksum=checksums.pop(), num_buckets=report.num_buckets)


def generated(url: str, *, round_index: int) -> tuple:
    async def run() -> tuple:
        async with EngineClient(url, timeout_s=60.0) as client:
            return await generate_samples(client, prompts(round_index), sampling=GREEDY)

    return asyncio.run(run())


def wait_out_engine_rendezvous(sync_started: float) -> None:
    """Until the real engines' joins of a failed sync's group timed out. An engine runs one rendezvous at a time,
    as SGLang's scheduler does (it joins inline), so a join asked for while it is still blocked in an abandoned one
    starts only when that one ends; a sync started earlier could time out through no fault of its own. The engines
    were asked to join after `sync_started` (time.monotonic), so their rendezvous ended ENGINE_COLLECTIVE_TIMEOUT_S
    after it at the latest."""
    time.sleep(max(0.0, sync_started + ENGINE_COLLECTIVE_TIMEOUT_S + 1.0 - time.monotonic()))


def timed_sync(controller, *, meanwhile: Callable[[], None] | None = None) -> tuple[SyncReport, float]:
    """One sync expected to fail: its report, and the seconds it took (asserted within the failed-sync bound).
    `meanwhile` runs once the sync started (a drill striking mid-sync)."""
    start = time.monotonic()
    ref = controller.sync.remote(raise_on_failure=False)
    if meanwhile is not None:
        meanwhile()
    report = ray.get(ref, timeout=FAILED_SYNC_BOUND_S + 60.0)
    elapsed = time.monotonic() - start
    assert not report.committed and report.error, report.summary()
    assert elapsed < FAILED_SYNC_BOUND_S, f"the failed sync took {elapsed:.1f} s (bound {FAILED_SYNC_BOUND_S} s)"
    print(f"failed sync after {elapsed:.2f} s: {report.error[:400]}")
    return report, elapsed


def assert_version_kept(controller, committed: Committed) -> None:
    assert call(controller, "status").version == int(committed.version)
    assert call(controller, "status").weight_version == committed.version


def assert_no_partial_weights(controller, urls: Sequence[str], committed: Committed, *, round_index: int) -> list[str]:
    """Every engine in `urls` (all alive) either holds the committed weights and generates under the committed
    version, or is held: paused (the controller sent it no continue_generation), left out of the serving engines
    and listed with a reason. Returns the former."""
    serving = set(call(controller, "status").serving_engines)
    held = call(controller, "status").held_engines
    intact = []
    for url in urls:
        if target_checksum(url) == committed.checksum:
            assert {s.weight_version for s in generated(url, round_index=round_index)} == {committed.version}
            intact.append(url)
            continue
        assert is_paused(url), f"{url} holds uncommitted weights but was resumed"
        assert url not in serving, f"{url} holds uncommitted weights but the controller still routes to it"
        assert held.get(url), f"{url} holds uncommitted weights but is not listed as held"
    return intact


def is_paused(url: str) -> bool:
    async def read() -> bool:
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/get_server_info", timeout=aiohttp.ClientTimeout(total=30)) as answer:
                return bool((await answer.json())["internal_states"][0]["is_paused"])

    return asyncio.run(read())


def restart_engines(fleet: Fleet, controller, indices: Sequence[int], old_urls: Sequence[str]) -> list[str]:
    """Restart the killed engines and hand their new URLs to the controller; until a sync succeeds on them they
    must not take generation traffic (a replacement serves checkpoint weights)."""
    new_urls = ray.get([fleet.engines.actors[i].restart.remote() for i in indices], timeout=RAY_TIMEOUT_S)
    for old, new in zip(old_urls, new_urls):
        call(controller, "replace_engine", old, new)
    stale, serving = call(controller, "status").stale_engines, call(controller, "status").serving_engines
    assert all(u in stale and u not in serving for u in new_urls), (new_urls, stale, serving)
    return new_urls


def assert_full_sync(
    fleet: Fleet, controller, committed: Committed, *, round_index: int, urls: Sequence[str] | None = None
) -> SyncReport:
    """The next sync commits a newer version on every engine, each verified tensor by tensor, and every engine
    then serves it. `urls`: the engines' URLs as the controller has them (default: the fleet's own)."""
    report = call(controller, "sync")
    assert report.committed, report.summary()
    assert int(report.version) > int(committed.version)
    urls = tuple(current_urls(fleet.engines.actors) if urls is None else urls)
    assert [e.url for e in report.engines] == list(urls)
    for engine in report.engines:
        assert engine.success and not engine.is_stale, engine
        assert engine.num_verified_tensors == fleet.num_tensors, engine
        assert engine.weight_version == report.version, engine
    assert call(controller, "status").weight_version == report.version
    assert call(controller, "status").serving_engines == urls and call(controller, "status").stale_engines == ()
    assert len({target_checksum(u) for u in urls}) == 1
    for url in urls:
        assert {s.weight_version for s in generated(url, round_index=round_index)} == {report.version}
    return report


# ---- the tests --------------------------------------------------------------------------------------------------


def test_engine_killed_before_the_sync(fleet):
    victim, survivor = fleet.engines.actors
    with controller_for(fleet) as controller:
        victim_url, survivor_url = current_urls(fleet.engines.actors)
        committed = commit_then_train(fleet, controller, round_index=1)
        ray.get(victim.kill.remote(), timeout=60)

        failed, _ = timed_sync(controller)
        assert victim_url in failed.error
        assert_version_kept(controller, committed)
        # Nothing was sent: the survivor keeps serving the committed weights, and stays in rotation.
        assert assert_no_partial_weights(controller, [survivor_url], committed, round_index=2) == [survivor_url]
        assert survivor_url in call(controller, "status").serving_engines

        restart_engines(fleet, controller, [0], [victim_url])
        report = assert_full_sync(fleet, controller, committed, round_index=3)
        assert target_checksum(survivor_url) != committed.checksum  # the trained weights arrived
        assert report.num_buckets == committed.num_buckets


def test_engine_killed_after_the_broadcast_before_finalize(fleet):
    victim = fleet.engines.actors[0]
    engine_url, survivor_url = current_urls(fleet.engines.actors)
    with recording_proxy(engine_url) as proxy, controller_for(fleet, urls=[proxy.url, survivor_url]) as controller:
        victim_url = proxy.url
        committed = commit_then_train(fleet, controller, round_index=4)
        # The victim's end_weight_update, the first call after the send, waits in its proxy while the victim dies.
        hold = proxy.hold("/end_weight_update")

        def kill_before_end() -> None:
            try:
                hold.wait(FAULT_SYNC.sync_timeout_s)
                ray.get(victim.kill.remote(), timeout=60)
            finally:
                hold.release()  # on to the dead server

        failed, _ = timed_sync(controller, meanwhile=kill_before_end)
        assert not ray.get(victim.is_running.remote(), timeout=60)
        # Every bucket had reached every engine; the first step after the send failed, on the victim only.
        progress = call(controller, "status").progress
        assert progress.version == failed.version and len(progress.buckets) == committed.num_buckets
        assert failed.error.startswith("end failed on 1 of 2 engine(s)") and victim_url in failed.error, failed.error
        assert_version_kept(controller, committed)
        # The survivor finalized the whole unverified version: it is held paused, never served as the old one.
        assert assert_no_partial_weights(controller, [survivor_url], committed, round_index=5) == []

        restart_engines(fleet, controller, [0], [victim_url])
        assert_full_sync(fleet, controller, committed, round_index=6)


def test_source_rank_killed_mid_sync(fleet):
    source_rank = fleet.source_rank
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(recording_proxy(u)) for u in current_urls(fleet.engines.actors)]
        urls = [p.url for p in proxies]
        controller = stack.enter_context(controller_for(fleet, urls=urls))
        committed = commit_then_train(fleet, controller, round_index=7)
        # Every engine's request for the second bucket waits in its proxy: the first bucket reached every engine
        # (a bucket goes out once the one before it was acknowledged), and no engine is inside a broadcast when the
        # source rank dies.
        holds = [p.hold("/update_weights_from_distributed", nth=2) for p in proxies]
        start = time.monotonic()
        ref = controller.sync.remote(raise_on_failure=False)
        try:
            for hold in holds:
                hold.wait(FAULT_SYNC.sync_timeout_s)
            while not has_acknowledged_a_bucket(call(controller, "status").progress, after=committed):
                assert not ray.wait([ref], timeout=0.05)[0], "the sync ended before its first bucket was acknowledged"
                assert time.monotonic() - start < FAULT_SYNC.sync_timeout_s, "no bucket was acknowledged"
            ray.kill(fleet.source, no_restart=True)
        finally:
            for hold in holds:
                hold.drop()  # their poster is gone: no engine joins that bucket's broadcast
        failed = ray.get(ref, timeout=FAILED_SYNC_BOUND_S + 60.0)
        elapsed = time.monotonic() - start
        assert elapsed < FAILED_SYNC_BOUND_S, f"the failed sync took {elapsed:.1f} s"
        print(f"failed sync after {elapsed:.2f} s: {failed.error[:400]}")
        assert not failed.committed and f"trainer {source_rank}:" in failed.error, failed.summary()
        assert_version_kept(controller, committed)
        # Both engines took the first bucket(s) of the new weights: both are held paused.
        assert assert_no_partial_weights(controller, urls, committed, round_index=8) == []
        # The dead rank could not tear its group down: the controller destroyed the engines' side itself.
        assert {url: held_update_groups(url) for url in urls} == {url: [] for url in urls}

    # The controller keeps its trainer handles for life: recovery is a new trainer group and a new controller.
    fleet.trainers.shutdown(timeout_s=30.0)
    fleet.trainers = create_trainers(trainer=TRAINER, checkpoint_dir=fleet.checkpoint_dir, placement=fleet.placed)
    with controller_for(fleet) as controller:
        assert_full_sync(fleet, controller, committed, round_index=9)


def held_update_groups(url: str) -> list[str]:
    """The update groups an engine holds, read from its refusal to destroy a group that cannot exist (the
    engine lists the groups it has in that message; there is no read-only endpoint for them)."""

    async def ask() -> str:
        async with EngineClient(url, timeout_s=30.0) as client:
            try:
                await client.destroy_weights_update_group(DestroyWeightsUpdateGroupRequest(group_name="no-such-group"))
            except EngineError as exc:
                return str(exc)
        raise AssertionError(f"{url} destroyed a group named 'no-such-group'")

    message = asyncio.run(ask())
    found = re.search(r"groups: \[(.*?)\]", message)
    assert found is not None, message
    return re.findall(r"'([^']*)'", found.group(1))


def has_acknowledged_a_bucket(progress: SyncProgress | None, *, after: Committed) -> bool:
    # Until the new sync starts, `progress` still shows the committed sync's buckets.
    return progress is not None and progress.version != after.version and bool(progress.buckets)


def test_engine_stopped_past_the_http_timeout(fleet):
    victim = fleet.engines.actors[0]
    engine_url, other_url = current_urls(fleet.engines.actors)
    with recording_proxy(engine_url) as proxy, controller_for(fleet, urls=[proxy.url, other_url]) as controller:
        urls = [proxy.url, other_url]
        committed = commit_then_train(fleet, controller, round_index=10)
        pgid = ray.get(victim.pid.remote(), timeout=60)  # the server leads its own process group
        # Once the first bucket was acknowledged, the victim's request for the second waits in its proxy while the
        # victim is SIGSTOPped, then goes on to the stopped server.
        hold = proxy.hold("/update_weights_from_distributed", nth=2)

        def stop_at_the_second_bucket() -> None:
            try:
                hold.wait(FAULT_SYNC.sync_timeout_s)
                os.killpg(pgid, signal.SIGSTOP)
            finally:
                hold.release()

        try:
            failed, _ = timed_sync(controller, meanwhile=stop_at_the_second_bucket)
        finally:
            os.killpg(pgid, signal.SIGCONT)
        assert urls[0] in failed.error and "no answer" in failed.error, failed.error
        assert_version_kept(controller, committed)
        wait_until_answering(engine_url, timeout_s=60.0)
        # Both engines took the first bucket(s) of the new weights: each is held paused.
        assert assert_no_partial_weights(controller, urls, committed, round_index=11) == []
        assert call(controller, "status").serving_engines == ()

        assert_full_sync(fleet, controller, committed, round_index=12, urls=urls)  # the same engine, no restart


def wait_until_answering(url: str, *, timeout_s: float) -> None:
    """Wait until the continued engine answers again (it first works through the calls it missed while stopped)."""

    async def run() -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as session:
            while True:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(url + "/get_server_info") as response:
                        if response.status == 200:
                            return
                assert time.monotonic() < deadline, f"{url} not answering {timeout_s} s after SIGCONT"
                await asyncio.sleep(0.2)

    asyncio.run(run())


def test_rendezvous_that_never_completes(fleet):
    urls = list(current_urls(fleet.engines.actors))
    with controller_for(fleet) as controller:
        committed = commit_then_train(fleet, controller, round_index=13)
    with silent_member(weight_version=committed.version) as member:
        with controller_for(fleet, extra_urls=[member.url]) as controller:
            started = time.monotonic()
            failed, _ = timed_sync(controller)
            assert "did not rendezvous" in failed.error and member.url in failed.error, failed.error
            assert failed.phases.pause_s == 0.0  # it failed while opening the group: no engine was paused
            assert_version_kept(controller, committed)
            # The member was counted in the group and asked to join, but never did.
            assert [(r["rank_offset"], r["world_size"]) for r in member.init_requests] == [(3, 4)]
            assert assert_no_partial_weights(controller, urls, committed, round_index=14) == urls
            assert set(call(controller, "status").serving_engines) >= set(urls)
    wait_out_engine_rendezvous(started)
    with controller_for(fleet) as controller:  # the next sync, with the real engines only
        assert_full_sync(fleet, controller, committed, round_index=15)


def test_a_refused_init_fails_the_sync_without_waiting_out_the_rendezvous(fleet):
    urls = list(current_urls(fleet.engines.actors))
    with controller_for(fleet) as controller:
        committed = commit_then_train(fleet, controller, round_index=16)
    with silent_member(weight_version=committed.version, refuses_init=True) as member:
        with controller_for(fleet, extra_urls=[member.url]) as controller:
            started = time.monotonic()
            failed, elapsed = timed_sync(controller)
            assert member.url in failed.error and "not supported here" in failed.error, failed.error
            # A member that refused can never join: the sync does not wait for the rendezvous to time out (the
            # real engines stay blocked in it until their own timeout meanwhile).
            assert elapsed < FAULT_SYNC.collective_timeout_s, f"{elapsed:.1f} s: it waited out the rendezvous"
            assert failed.phases.pause_s == 0.0
            assert_version_kept(controller, committed)
            assert assert_no_partial_weights(controller, urls, committed, round_index=17) == urls
    wait_out_engine_rendezvous(started)
    with controller_for(fleet) as controller:
        assert_full_sync(fleet, controller, committed, round_index=18)
