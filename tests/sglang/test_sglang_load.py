"""Syncs into two real SGLang 0.5.23 CPU servers while clients keep requests in flight on them (tests/
generate_load.py: two clients per server, each sending a 32-token greedy /generate after another), in every pause
mode, sent to each server directly or through sglang-router in front of both, through the controller class with
a sender process, real gloo groups and HTTP on loopback.

What each mode promises, and what is asserted per request:

- retract and in_place: every request is answered, none aborted; every token is tagged with a version that a sync
  verified on that server (or the servers' starting version), the spans in sync order; some requests span two
  versions (the syncs really ran under them). No request waits longer than the syncs it overlapped plus SLACK_S.
- abort: every request is answered (200), either complete or with SGLang's finish reason "abort"; some are aborted.
- a sync whose verification fails under retract holds both servers paused: the requests it retracted wait, and
  complete after the next verified sync, tagged only with that sync's version (never the failed one's, which the
  servers were told before the verification failed).
- the prefix cache: after an abort or retract sync no request takes a prefix cached before it; after an in_place
  sync a request does wherever the report says the cache was not flushed.
- behind the SGLang router, a live server held by a failed verification leaves the router before the other server
  resumes, and no routed request reaches it after that.
- a trainer killed mid-send holds both servers, a server killed mid-send holds the survivor; their retracted
  requests complete after the next verified sync, none lost (the killed server's fail, none hangs).

Every sync is verified engine-exact; every server sits behind a recording proxy (tests/recording_proxy.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import aiohttp
import pytest
from generate_load import Answer, GenerateLoad, load_request, version_problem
from recording_proxy import recording_proxy
from sender_host import ProcessSource, SenderSettings, export_units, load_checkpoint
from sglang_server import enter_together, sglang_server

from miles_sync.engine.client import EngineClient
from miles_sync.engine.router import RouterClient, RouterProcess, RouterSpec
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.report import SyncReport
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.wire.protocol import PauseMode

BUCKET_BYTES = 512 * 1024
TIMEOUTS = SessionTimeouts(control_s=30.0, sync_s=120.0)
NO_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm=None, num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)
REQUEST = load_request(32)
IN_FLIGHT = 2  # clients per server
SLACK_S = 15.0  # beyond the syncs it overlapped: an unloaded 32-token request takes ~0.3 s here; CI's 2 cores are noisy
FLOW_TIMEOUT_S = 120.0
STARTING_VERSION = "default"  # what a freshly launched SGLang server reports
# A prompt no load request shares, long enough that a cached prefix is unmistakable; greedy, with log-probs.
PROBE = {
    "input_ids": list(range(60, 100)),
    "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
    "return_logprob": True,
}


@dataclass(frozen=True)
class Probe:
    """One PROBE answer: how many prompt tokens came from the prefix cache, the version that produced its tokens,
    and their log-probs."""

    cached_tokens: int
    version: str
    logprobs: tuple[float, ...]


async def probe(url: str) -> Probe:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/generate", json=PROBE, timeout=aiohttp.ClientTimeout(total=60)) as answer:
            assert answer.status == 200, await answer.text()
            meta = (await answer.json())["meta_info"]
    logprobs = tuple(float(entry[0]) for entry in meta["output_token_logprobs"])
    return Probe(int(meta["cached_tokens"]), str(meta["weight_version"]), logprobs)


@pytest.fixture(scope="module")
def launchers(reference_checkpoints, sglang_python, tmp_path_factory):
    """Two real servers (the last test kills the first)."""
    log_dir = tmp_path_factory.mktemp("sglang-load")
    model = reference_checkpoints / "target"
    with contextlib.ExitStack() as stack:
        yield enter_together(
            stack, *(sglang_server(model=model, python=sglang_python, log_dir=log_dir) for _ in range(2))
        )


@pytest.fixture(scope="module")
def servers(launchers):
    """The two servers, each behind a recording proxy: the proxies."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(recording_proxy(launcher.url)) for launcher in launchers]


@dataclass(frozen=True)
class Window:
    """One sync call's wall time (time.monotonic()) and report."""

    start: float
    end: float
    report: SyncReport


class Fleet:
    """The module's servers, the versions each was verified at (its starting version first), in sync order."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.order = [STARTING_VERSION]
        self.served = {u: {STARTING_VERSION} for u in urls}

    def record(self, report: SyncReport) -> None:
        self.order.append(report.version)
        for engine in report.engines:
            if engine.success:
                self.served[engine.url].add(report.version)


@pytest.fixture(scope="module")
def fleet(servers) -> Fleet:
    return Fleet([proxy.url for proxy in servers])


@pytest.fixture(scope="module")
def router_url(sglang_python, tmp_path_factory):
    """sglang-router 0.3.2 (it probes a worker's /health, /server_info and /model_info before it routes to it),
    started with an empty worker list; each controller given it as its gate admits the servers it verified."""
    process = RouterProcess(spec=RouterSpec(python=str(sglang_python)), log_dir=tmp_path_factory.mktemp("router"))
    try:
        yield process.start().url
    finally:
        process.stop()


def controller(urls, source, mode: PauseMode, *, gate=None) -> SyncController:
    return SyncController(
        engine_urls=urls,
        source=source,
        transport="distributed",
        selector_inputs=NO_DRAFT,
        pause_mode=mode,
        verify=True,
        timeouts=TIMEOUTS,
        show_progress=False,
        gate=gate,
    )


def settings(mode: PauseMode, **kwargs) -> SenderSettings:
    # abort and retract empty the servers, so the updates flush the prefix cache (the main job's choice); in_place
    # keeps requests running, and SGLang's update-time flush would fail on them.
    return SenderSettings(
        transport="distributed",
        bucket_bytes=BUCKET_BYTES,
        include_mtp=False,
        flush_cache=mode is not PauseMode.IN_PLACE,
        **kwargs,
    )


async def timed_sync(ctl: SyncController, fleet: Fleet, *, raise_on_failure: bool = True) -> Window:
    start = time.monotonic()
    report = await ctl.sync(raise_on_failure=raise_on_failure)
    window = Window(start, time.monotonic(), report)
    fleet.record(report)
    return window


def overlapped_s(answer: Answer, windows: list[Window]) -> float:
    """Seconds of the syncs whose wall time overlapped the request's."""
    return sum(w.end - w.start for w in windows if w.start < answer.answered_at and w.end > answer.sent_at)


async def wait_flowing(load: GenerateLoad, *, since: float) -> None:
    await asyncio.to_thread(load.wait_for_answers, per_url=IN_FLIGHT, since=since, timeout_s=FLOW_TIMEOUT_S)


def assert_versions_true(answers: list[Answer], fleet: Fleet) -> None:
    # A routed answer may come from either server: the versions verified on both.
    served = lambda url: fleet.served.get(url) or set.intersection(*fleet.served.values())  # noqa: E731
    problems = [p for a in answers if (p := version_problem(a, served=served(a.url), order=fleet.order))]
    assert not problems, problems[:5]


@pytest.mark.parametrize("via", ["direct", "router"])
@pytest.mark.parametrize("mode", [PauseMode.RETRACT, PauseMode.IN_PLACE, PauseMode.ABORT], ids=lambda m: m.value)
def test_syncs_under_load_keep_their_pause_modes_promise(fleet, source, router_url, mode, via):
    """Two verified syncs while requests run (module docstring, per mode), the load sent to each server directly
    or to the router in front of both (the controller then admits the servers it verified); the figures are
    printed (-s).

    The prefix cache: PROBE is asked twice before each sync (the second answer shows its prefix cached) and once
    after it. abort and retract promise that no token tagged with the new version comes from KV computed with the
    old weights: the probe after the sync takes nothing from the cache (mutation: updates that do not flush).
    in_place promises only what each engine's report says: where it says "not flushed", the probe reuses the old
    prefix; once the load ends, the server is flushed and probed again, and the log-prob difference of the stale
    answer from the fresh one (same weights, same version) is printed."""

    gate = RouterClient(router_url) if via == "router" else None
    targets, in_flight = ([router_url], 2 * IN_FLIGHT) if gate is not None else (fleet.urls, IN_FLIGHT)

    async def main():
        await source.call("configure", settings(mode))
        ctl = controller(fleet.urls, source, mode, gate=gate)
        await ctl.connect()
        windows, probes = [], []
        try:
            with GenerateLoad(targets, in_flight=in_flight, request=REQUEST) as load:
                await wait_flowing(load, since=0.0)
                for step in (1, 2):
                    cached_before = [[await probe(u) for _ in range(2)][1].cached_tokens for u in fleet.urls]
                    await source.call("step", step + 10 * list(PauseMode).index(mode) + 100 * (gate is not None))
                    windows.append(await timed_sync(ctl, fleet))
                    probes.append((cached_before, [await probe(u) for u in fleet.urls]))
                    await wait_flowing(load, since=windows[-1].end)  # serving again, at the new version
                load.stop(wait_s=FLOW_TIMEOUT_S)
            fresh = []
            for url in fleet.urls:  # idle now: the flush succeeds
                async with EngineClient(url, timeout_s=30.0) as client:
                    await client.flush_cache()
                fresh.append(await probe(url))
        finally:
            await ctl.close()
            if gate is not None:
                await gate.close()
        return windows, probes, fresh, list(load.answers)

    windows, probes, fresh, answers = asyncio.run(main())
    for window, (cached_before, after) in zip(windows, probes):
        report = window.report
        assert report.committed and report.verification == "engine-exact (sha256)", report.summary()
        assert all(n >= 30 for n in cached_before), cached_before
        assert [p.version for p in after] == [report.version] * 2, after
        for engine, answer in zip(report.engines, after):
            if mode is not PauseMode.IN_PLACE:
                assert engine.prefix_cache == "flushed with the updates"
                assert answer.cached_tokens == 0, f"{engine.url}: v{report.version} tokens from old-weight KV"
            elif engine.prefix_cache.startswith("not flushed"):
                assert answer.cached_tokens >= 30, (engine, answer)  # what the report says: the old prefix stays
            else:
                assert engine.prefix_cache == "flushed after the resume" and answer.cached_tokens == 0, engine
    failed = [(a.status, a.error) for a in answers if a.status != 200]
    assert not failed, failed[:5]
    aborted = [a for a in answers if a.finish == "abort"]
    complete = [a for a in answers if a.finish != "abort"]
    assert all(a.finish == "length" and a.spans and a.spans[-1][2] == 32 for a in complete), complete[:3]
    assert_versions_true(complete, fleet)
    slow = [(a.latency_s, s) for a in answers if a.latency_s > (s := overlapped_s(a, windows)) + SLACK_S]
    assert not slow, slow
    spanning = [a for a in complete if len(set(a.versions)) > 1]
    if mode is PauseMode.ABORT:
        assert aborted, "no request was in flight when an abort-mode pause ran"
    else:
        assert not aborted, aborted[:3]
        assert spanning, "no request spans a sync: none was in flight when the syncs ran"
    stale = [
        max(abs(a - b) for a, b in zip(p.logprobs, f.logprobs)) for p, f in zip(probes[-1][1], fresh) if p.cached_tokens
    ]
    assert all(f.cached_tokens == 0 and f.version == windows[-1].report.version for f in fresh), fresh
    pauses = ", ".join(f"{w.report.phases.pause_s:.3f}" for w in windows)
    resumes = ", ".join(f"{w.report.phases.resume_s:.3f}" for w in windows)
    syncs = ", ".join(f"{w.end - w.start:.3f}" for w in windows)
    latencies = sorted(a.latency_s for a in answers)
    print(
        f"\n[load] {mode.value} ({via}): sync_s {syncs}; pause_s {pauses}; resume_s {resumes}; {len(answers)} requests,"
        f" {len(aborted)} aborted, {len(spanning)} spanning versions;"
        f" latency p50 {latencies[len(latencies) // 2]:.3f} s max {latencies[-1]:.3f} s;"
        f" prefix cache after the syncs {[e.prefix_cache for w in windows for e in w.report.engines]},"
        f" max |stale - fresh| probe log-prob {stale or 'none stale'}"
    )


def test_requests_retracted_by_a_failed_sync_wait_and_complete_at_the_next_verified_version(fleet, source):
    """retract under load; the source drops a tensor, so bytes land and the verification fails on both servers.
    Both stay paused with the requests the pause retracted, although each was told the failed version before the
    verification; those requests complete after the next verified sync, every token tagged with a version verified
    on its server (mutation: the frame resumes held engines, and the failed version shows in the spans)."""

    async def main():
        await source.call("configure", settings(PauseMode.RETRACT, skip_names=("model.norm.weight",)))
        ctl = controller(fleet.urls, source, PauseMode.RETRACT)
        await ctl.connect()
        try:
            with GenerateLoad(fleet.urls, in_flight=IN_FLIGHT, request=REQUEST) as load:
                await wait_flowing(load, since=0.0)
                await source.call("step", 40)
                failed = await timed_sync(ctl, fleet, raise_on_failure=False)
                held = dict(ctl.held_engines)
                await source.call("configure", settings(PauseMode.RETRACT))
                await source.call("step", 41)
                recovered = await timed_sync(ctl, fleet)
                await wait_flowing(load, since=recovered.end)
                load.stop(wait_s=FLOW_TIMEOUT_S)
        finally:
            await ctl.close()
        return failed, held, recovered, list(load.answers)

    failed, held, recovered, answers = asyncio.run(main())
    assert not failed.report.committed and "verification failed" in failed.report.error, failed.report.summary()
    assert sorted(held) == sorted(fleet.urls)
    assert all(e.weight_version == failed.report.version for e in failed.report.engines)  # told before the verdict
    # Held paused: nothing completes until the recovery resumes (an answer then would be from unverified weights).
    answered_while_held = [a for a in answers if failed.end < a.answered_at < recovered.end]
    assert not answered_while_held, answered_while_held
    assert recovered.report.committed and recovered.report.verification == "engine-exact (sha256)"
    assert all(a.status == 200 and a.finish == "length" for a in answers), [a for a in answers if a.status != 200][:3]
    # The requests in flight across the failed sync: retracted by its pause, answered only after the recovery.
    across = [a for a in answers if a.sent_at < failed.end < a.answered_at]
    assert len(across) == len(fleet.urls) * IN_FLIGHT, across
    assert all(a.answered_at > recovered.start for a in across)
    assert all(a.versions[-1] == recovered.report.version for a in across), [a.spans for a in across]
    assert_versions_true(answers, fleet)
    assert all(failed.report.version not in a.versions for a in answers)


def break_checksum(answer: dict) -> dict:
    """The checker's answer with one parameter's digest changed: this server's verification fails."""
    checksums = answer["ranks"][0]["checksums"]
    checksums["model.norm.weight"] = "0" * len(checksums["model.norm.weight"])
    return answer


def test_a_live_server_held_by_its_verification_leaves_the_router_before_the_other_resumes(
    servers, fleet, source, router_url
):
    """sglang-router 0.3.2 in front of both servers, the load sent to the router. In one retract sync the first
    server's checker answer is made wrong (its proxy rewrites one digest): that server is held while the second,
    verified, resumes. The router's withdrawal of the first server (DELETE /workers/..., seen by a recording proxy
    in front of the router) comes before the second server's /continue_generation, and no /generate reaches the
    held server after it (mutation: withdrawing after the resume). The next sync verifies and relists it."""
    held_proxy, live_proxy = servers

    async def main(router_proxy):
        gate = RouterClient(router_proxy.url)
        await source.call("configure", settings(PauseMode.RETRACT))
        ctl = controller(fleet.urls, source, PauseMode.RETRACT, gate=gate)
        try:
            await ctl.connect()
            await source.call("step", 50)
            await timed_sync(ctl, fleet)  # both verified, both listed
            listed = sorted(await gate.worker_urls())
            with GenerateLoad([router_url], in_flight=2 * IN_FLIGHT, request=REQUEST) as load:
                await asyncio.to_thread(load.wait_for_answers, per_url=4, timeout_s=FLOW_TIMEOUT_S)
                held_proxy.rewrites.append(("/weights_checker", break_checksum))
                await source.call("step", 51)
                split = await timed_sync(ctl, fleet, raise_on_failure=False)
                held_proxy.rewrites.clear()
                held = dict(ctl.held_engines)
                listed_after = await gate.worker_urls()
                await asyncio.to_thread(load.wait_for_answers, per_url=4, since=split.end, timeout_s=FLOW_TIMEOUT_S)
                await source.call("step", 52)
                recovered = await timed_sync(ctl, fleet)
                relisted = sorted(await gate.worker_urls())
                load.stop(wait_s=FLOW_TIMEOUT_S)
        finally:
            await ctl.close()
            for url in fleet.urls:
                with contextlib.suppress(Exception):
                    await gate.withdraw(url)
            await gate.close()
        return listed, split, held, listed_after, recovered, relisted, list(load.answers)

    with recording_proxy(router_url) as router_proxy:
        listed, split, held, listed_after, recovered, relisted, answers = asyncio.run(main(router_proxy))
    assert listed == sorted(fleet.urls) and relisted == sorted(fleet.urls)
    report = split.report
    assert [e.success for e in report.engines] == [False, True], report.summary()
    assert list(held) == [held_proxy.url] and listed_after == (live_proxy.url,)
    withdrawals = [r.at for r in router_proxy.requests if r.method == "DELETE" and split.start < r.at < split.end]
    resumes = [r.at for r in live_proxy.requests if r.path == "/continue_generation" and split.start < r.at < split.end]
    assert len(withdrawals) == 1 and len(resumes) == 1, (withdrawals, resumes)
    assert withdrawals[0] < resumes[0], "the held server left the router after the other server resumed"
    reached = [r.at for r in held_proxy.requests if r.path == "/generate" and withdrawals[0] < r.at < recovered.start]
    assert not reached, f"{len(reached)} routed requests reached the held server after its withdrawal"
    assert recovered.report.committed and recovered.report.verification == "engine-exact (sha256)"
    assert all(a.status == 200 and a.finish == "length" for a in answers), [a for a in answers if a.status != 200][:3]


def test_a_trainer_killed_mid_send_under_load_holds_both_servers_until_a_verified_sync(fleet, reference_checkpoints):
    """retract under load; the sender process (the trainer's source rank) is killed while its buckets are on the
    wire. The sync fails without committing, both servers stay paused with the requests the pause retracted, and
    nothing is answered until a new source and controller (the restarted trainer) sync and verify; those requests
    then complete at that version, none lost."""
    target = reference_checkpoints / "target"
    tensors, num_layers = load_checkpoint(target)
    gate_unit = len(export_units(tensors, num_hidden_layers=num_layers, include_mtp=False)) - 2
    victim, restarted = ProcessSource(target_dir=target), ProcessSource(target_dir=target)

    async def main():
        await victim.call("configure", settings(PauseMode.RETRACT))
        ctl = controller(fleet.urls, victim, PauseMode.RETRACT)
        await ctl.connect()
        with GenerateLoad(fleet.urls, in_flight=IN_FLIGHT, request=REQUEST) as load:
            try:
                await wait_flowing(load, since=0.0)
                await victim.call("step", 60)
                await victim.call("gate", gate_unit)  # stops before its last units: earlier buckets landed
                start = time.monotonic()
                sync = asyncio.create_task(ctl.sync(raise_on_failure=False))
                assert await asyncio.to_thread(victim.gate_reached.wait, 60.0), "the send never reached the gate"
                victim.process.kill()
                failed = Window(start, 0.0, await asyncio.wait_for(sync, TIMEOUTS.sync_s + 30.0))
                failed = Window(start, time.monotonic(), failed.report)
                fleet.record(failed.report)
                held = dict(ctl.held_engines)
            finally:
                with contextlib.suppress(Exception):  # its source is gone
                    await ctl.close()
            await restarted.call("configure", settings(PauseMode.RETRACT))
            await restarted.call("step", 61)
            ctl = controller(fleet.urls, restarted, PauseMode.RETRACT)
            try:
                await ctl.connect()
                recovered = await timed_sync(ctl, fleet)
                await wait_flowing(load, since=recovered.end)
            finally:
                await ctl.close()
            load.stop(wait_s=FLOW_TIMEOUT_S)
        return failed, held, recovered, list(load.answers)

    try:
        failed, held, recovered, answers = asyncio.run(main())
    finally:
        victim.shutdown()
        restarted.shutdown()
    assert not failed.report.committed, failed.report.summary()
    assert failed.end - failed.start < TIMEOUTS.sync_s, failed.report.summary()
    assert "did not finish within" not in failed.report.error, failed.report.error  # no timeout happened
    assert sorted(held) == sorted(fleet.urls), (held, failed.report.summary())
    answered_while_held = [a for a in answers if failed.end < a.answered_at < recovered.start]
    assert not answered_while_held, answered_while_held
    assert recovered.report.committed and recovered.report.verification == "engine-exact (sha256)"
    assert all(a.status == 200 and a.finish == "length" for a in answers), [a for a in answers if a.status != 200][:3]
    across = [a for a in answers if a.sent_at < failed.end < a.answered_at]
    assert len(across) == len(fleet.urls) * IN_FLIGHT, across
    assert all(a.versions[-1] == recovered.report.version for a in across), [a.spans for a in across]
    assert_versions_true(answers, fleet)
    print(f"\n[load] trainer killed mid-send: failed in {failed.end - failed.start:.2f} s: {failed.report.error}")


def test_a_server_killed_under_load_leaves_the_survivor_held_until_a_sync_verifies_it(
    launchers, fleet, source, reference_checkpoints
):
    """Runs last: kills the module's first server while buckets are on the wire, under retract and load. The sync
    fails without committing; the survivor, which received some buckets, stays paused with the requests its pause
    retracted, and nothing it answers comes from the partial weights; a sync over the survivor alone verifies and
    resumes it, and its waiting requests complete at that version. The killed server's requests fail (connection
    lost), none hangs."""
    victim_url, survivor = fleet.urls
    tensors, num_layers = load_checkpoint(reference_checkpoints / "target")
    gate_unit = len(export_units(tensors, num_hidden_layers=num_layers, include_mtp=False)) - 2

    async def main():
        await source.call("configure", settings(PauseMode.RETRACT))
        ctl = controller(fleet.urls, source, PauseMode.RETRACT)
        await ctl.connect()
        with GenerateLoad(fleet.urls, in_flight=IN_FLIGHT, request=REQUEST, request_timeout_s=60.0) as load:
            try:
                await wait_flowing(load, since=0.0)
                await source.call("step", 70)
                await source.call("gate", gate_unit)
                start = time.monotonic()
                sync = asyncio.create_task(ctl.sync(raise_on_failure=False))
                assert await asyncio.to_thread(source.gate_reached.wait, 60.0), "the send never reached the gate"
                killed_at = time.monotonic()
                launchers[0].kill()
                source.gate_release.set()
                report = await asyncio.wait_for(sync, TIMEOUTS.sync_s + 30.0)
                failed = Window(start, time.monotonic(), report)
                fleet.record(report)
                held = dict(ctl.held_engines)
            finally:
                await ctl.close()
            await source.call("configure", settings(PauseMode.RETRACT))
            await source.call("step", 71)
            ctl = controller([survivor], source, PauseMode.RETRACT)
            try:
                await ctl.connect()
                recovered = await timed_sync(ctl, fleet)
            finally:
                await ctl.close()
            load.stop(wait_s=FLOW_TIMEOUT_S)
        return failed, held, recovered, killed_at, list(load.answers)

    failed, held, recovered, killed_at, answers = asyncio.run(main())
    assert not failed.report.committed and failed.end - failed.start < TIMEOUTS.sync_s, failed.report.summary()
    assert survivor in held, held
    on_survivor = [a for a in answers if a.url == survivor]
    assert not [a for a in on_survivor if failed.end < a.answered_at < recovered.start]
    assert all(a.status == 200 and a.finish == "length" for a in on_survivor), [a for a in on_survivor][:3]
    across = [a for a in on_survivor if a.sent_at < failed.end < a.answered_at]
    assert len(across) == IN_FLIGHT and all(a.versions[-1] == recovered.report.version for a in across), across
    assert_versions_true(on_survivor, fleet)
    # Its requests paused in the queue failed (its proxy answers 500 once the server is gone); none hung.
    lost = [a for a in answers if a.url == victim_url and a.answered_at > killed_at]
    assert len(lost) == IN_FLIGHT and all(a.status != 200 for a in lost), lost
