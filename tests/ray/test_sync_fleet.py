"""The product on a local Ray cluster: 2 trainer ranks (TP=2, a real megatron-core model) and 2 reference engines
with frozen MTP drafts in the AITER layout, one controller actor per transport.

- 5 train -> sync -> generate rounds per transport: every sync verified (trainer checksums == each engine's), the
  weights really move each round, every sample carries the version that produced it, accept length holds;
- an engine killed during the broadcast fails that sync in bounded time without a version bump; the survivor is
  held exactly when bytes of that sync (a trained step) reached it, else serves the old version; the restarted
  engine gets full, verified weights in a re-created group before serving;
- the same rounds with shard_direct (each engine fed its own parameters by the trainer rank on its bundle);

What reached each engine is read at the engine's door: a recording proxy (tests/recording_proxy.py) in front of
it records every request, the trainer process that posted it and the memory its handles name; drills hold one
request there to act at that point of the sync, and trainer-side points are wrapped in the trainer processes
(tests/rank_probes.py).
- an engine without the session endpoints is refused at connect, by name;
- the embedding example (a pipeline with its own trainer actors) syncs into the same engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from aiohttp import web
from rank_probes import GATHERED_UNIT, refuse_gather, unwrap_calls, wrap_calls
from ray_fleet import (
    RAY_TIMEOUT_S,
    Fleet,
    current_urls,
    listeners_off_loopback,
    mean_accept_length,
    prompts,
    started_fleet,
    target_checksum,
    train_batch,
)
from recording_proxy import recording_proxy, segment_pid

from actors.controller import create_controller
from miles_sync.config import ModelConfig, SyncConfig, TrainerConfig
from miles_sync.transport.base import TransportKind
from miles_sync.wire.protocol import SamplingParams, Selector

REPO = Path(__file__).resolve().parents[2]
NUM_ROUNDS = 5
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)
MODEL = ModelConfig(arch="qwen3", speculative_algorithm="NEXTN", num_trained_mtp_layers=0)
# Small buckets: a sync of this 1.8 MiB model is several buckets, as a real one is many.
SYNC = dict(bucket_bytes=256 * 1024, http_timeout_s=20.0, collective_timeout_s=20.0, sync_timeout_s=90.0)


@pytest.fixture(scope="module")
def fleet(cluster, reference_checkpoints, tmp_path_factory) -> Iterator[Fleet]:
    with started_fleet(
        checkpoint_dir=str(reference_checkpoints / "target"),
        log_dir=tmp_path_factory.mktemp("engines"),
        trainer=TrainerConfig(tp=2, lr=1e-4),
        engine_collective_timeout_s=20.0,
        name="fleet",
    ) as fleet:
        yield fleet


@contextlib.contextmanager
def controller_for(fleet: Fleet, transport: TransportKind, *, urls=None, **sync_overrides):
    """A controller over the fleet's engines at `urls` (default: theirs; a proxy's URL speaks for its engine)."""
    sync = SyncConfig(transport=transport, **{**SYNC, **sync_overrides})
    urls = current_urls(fleet.engines.actors) if urls is None else tuple(urls)
    handle = create_controller(trainers=fleet.trainers.actors, engine_urls=urls, sync=sync, model=MODEL)
    try:
        yield handle
    finally:
        # Engines keep serving; the next controller makes its own group.
        ray.get(handle.close.remote(), timeout=RAY_TIMEOUT_S)
        ray.kill(handle)


def generate(engine_actors, round_index: int):
    refs = [a.generate.remote(prompts(round_index), sampling=GREEDY) for a in engine_actors]
    batches = ray.get(refs, timeout=RAY_TIMEOUT_S)
    return [sample for batch in batches for sample in batch]


def run_rounds(fleet: Fleet, controller, *, urls=None) -> list[float]:
    """Round 0 generates from the starting weights; rounds 1..N train on the previous samples, sync, generate.
    `urls`: the engines' URLs as the controller has them (default: theirs)."""
    actors = fleet.engines.actors
    urls = current_urls(actors) if urls is None else tuple(urls)
    assert ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).serving_engines == urls
    version = ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).weight_version
    samples = generate(actors, 0)
    assert {s.weight_version for s in samples} == {version}
    accept = [mean_accept_length(samples)]
    assert accept[0] > 2.0, f"an intact frozen draft agrees with the target most of the time, got {accept[0]}"
    checksums = {target_checksum(u) for u in urls}
    assert len(checksums) == 1
    for round_index in range(1, NUM_ROUNDS + 1):
        steps = fleet.trainers.train_step(train_batch(samples), timeout_s=RAY_TIMEOUT_S)
        assert len({s.loss for s in steps}) == 1, f"TP ranks computed different losses: {steps}"
        report = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
        assert report.committed, report.summary()
        assert report.selector is Selector.TARGET  # frozen draft: it is never in the session
        assert int(report.version) == int(report.previous_version if report.previous_version.isdecimal() else 0) + 1
        assert report.num_tensors == fleet.num_tensors and report.num_buckets > 1
        for engine in report.engines:
            assert engine.success and not engine.is_stale, engine
            assert engine.num_verified_tensors == fleet.num_tensors, engine
            assert engine.weight_version == report.version
        now = {target_checksum(u) for u in urls}
        assert len(now) == 1 and now != checksums, "every engine holds the same new weights after each step"
        checksums = now
        samples = generate(actors, round_index)
        assert {s.weight_version for s in samples} == {report.version}, "samples carry the version producing them"
        accept.append(mean_accept_length(samples))
        assert accept[-1] >= 0.9 * accept[0], f"accept length fell from {accept[0]} to {accept[-1]}: {accept}"
    return accept


def node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=60)


def trainer_pids(fleet: Fleet) -> list[int]:
    return ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in fleet.trainers.actors], timeout=60)


@contextlib.contextmanager
def engine_proxies(fleet: Fleet, *, clients=()):
    """A recording proxy in front of each engine, in engine order (`clients`: the pids it tells apart)."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(recording_proxy(u, clients=clients)) for u in current_urls(fleet.engines.actors)]


def posted_handles(proxy) -> set[tuple]:
    """Every update_weights_from_tensor request the proxy's engine got: (the pid of the trainer process that posted
    it, its load_format, the pid of the process whose shared memory each TP rank's handle names)."""
    return {
        (r.client_pid, r.body["load_format"], tuple(segment_pid(p) for p in r.body["serialized_named_tensors"]))
        for r in proxy.posts("/update_weights_from_tensor")
    }


def test_distributed_rounds(fleet):
    with controller_for(fleet, TransportKind.DISTRIBUTED) as controller:
        accept = run_rounds(fleet, controller)
        membership = ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).membership
        assert membership is not None and membership.backend == "gloo" and membership.world_size == 3
        assert membership.master_address == "127.0.0.1"
        # Every listener of the fleet, the update group's store included, is on loopback.
        off_loopback = listeners_off_loopback(own_pids(fleet, controller))
        assert off_loopback == [], off_loopback
    print("distributed accept lengths", accept)


def test_update_group_store_listens_on_loopback_only(fleet):
    with controller_for(fleet, TransportKind.DISTRIBUTED) as controller:
        ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
        assert listeners_off_loopback(own_pids(fleet, controller)) == []


def own_pids(fleet: Fleet, controller) -> list[int]:
    actors = [*fleet.trainers.actors, *fleet.engines.actors, controller]
    pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors], timeout=60)
    return pids + ray.get([a.pid.remote() for a in fleet.engines.actors], timeout=60)


def test_colocated_rounds(fleet):
    # Colocated placement: engine j shares a bundle, hence a node, with trainer rank j.
    plan = fleet.plan
    shared = {
        e.index: [t.index for t in plan.trainers if (t.group, t.bundle) == (e.group, e.bundle)] for e in plan.engines
    }
    assert shared == {0: [0], 1: [1]}
    for engine, ranks in shared.items():
        assert node_of(fleet.engines.actors[engine]) == node_of(fleet.trainers.actors[ranks[0]])
    pids = trainer_pids(fleet)
    with engine_proxies(fleet, clients=pids) as proxies:
        with controller_for(fleet, TransportKind.COLOCATED, urls=[p.url for p in proxies]) as controller:
            assert ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).membership is None  # no update group
            accept = run_rounds(fleet, controller, urls=[p.url for p in proxies])
        # Engine j mapped trainer rank j's own memory: every request engine j got in every round was posted by rank
        # j, as a flattened bucket whose one handle names a shared segment rank j's process created (torch names
        # segments "/torch_<pid>_...").
        for rank, proxy in enumerate(proxies):
            assert posted_handles(proxy) == {(pids[rank], "flattened_bucket", (pids[rank],))}
    print("colocated accept lengths", accept)


def test_shard_direct_rounds(fleet):
    """Each engine is fed by the trainer rank on its bundle, with no gather (the gather export fails if it runs):
    each rank converts its own TP shards, sends the other rank the halves its TP=1 engine lacks, and builds its
    engine's parameters; the engine-built HF tensors are verified exact; each engine maps only memory of its own
    rank."""
    pids = trainer_pids(fleet)
    refuse_gather(fleet.trainers.actors)
    try:
        with engine_proxies(fleet, clients=pids) as proxies:
            with controller_for(fleet, TransportKind.SHARD_DIRECT, urls=[p.url for p in proxies]) as controller:
                accept = run_rounds(fleet, controller, urls=[p.url for p in proxies])
            # Every request engine j got was posted by rank j, as a direct load of memory rank j's process built.
            for rank, proxy in enumerate(proxies):
                assert posted_handles(proxy) == {(pids[rank], "direct", (pids[rank],))}
    finally:
        unwrap_calls(fleet.trainers.actors, GATHERED_UNIT)
    print("shard_direct accept lengths", accept)


@contextlib.contextmanager
def server_without_sessions():
    """An SGLang-0.5.23-like server: the weight endpoints, but no /begin_weight_update or /end_weight_update."""
    loop = asyncio.new_event_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"success": False, "message": "not in this test"}, status=400)

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"tp_size": 1})

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "old", "weight_version": "0"})

    async def start() -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/get_server_info", server_info)
        app.router.add_get("/model_info", model_info)
        for path in (
            "/init_weights_update_group",
            "/destroy_weights_update_group",
            "/update_weights_from_distributed",
            "/update_weights_from_tensor",
            "/update_weight_version",
            "/pause_generation",
            "/continue_generation",
            "/weights_checker",
        ):
            app.router.add_post(path, refuse)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        return runner

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        sock.close()


def test_engine_without_session_endpoints_is_refused_at_connect(fleet):
    real_url = current_urls(fleet.engines.actors)[0]
    with server_without_sessions() as old_url:
        with pytest.raises(Exception) as info:
            create_controller(
                trainers=fleet.trainers.actors,
                engine_urls=[real_url, old_url],
                sync=SyncConfig(**SYNC),
                model=MODEL,
                timeout_s=60.0,
            )
    message = str(info.value)
    assert old_url in message and real_url not in message.replace(old_url, "")
    assert "/begin_weight_update" in message and "/end_weight_update" in message


def test_embedding_example_syncs_a_two_stage_pipelines_own_trainers(fleet, reference_checkpoints):
    urls = current_urls(fleet.engines.actors)
    before = {target_checksum(u) for u in urls}
    command = [
        sys.executable,
        str(REPO / "examples" / "embed_in_pipeline.py"),
        "--address",
        ray.get_runtime_context().gcs_address,
        "--checkpoint",
        str(reference_checkpoints / "target"),
        "--steps",
        "2",
        "--tp",
        "1",
        "--pp",
        "2",  # two stages: each stage's source rank syncs through an update group of its own
        *(arg for url in urls for arg in ("--engine-url", url)),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=RAY_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    committed = " committed (verification: exact):"
    assert len(lines) == 2 and all(committed in line and "selector target" in line for line in lines), lines
    after = {target_checksum(u) for u in urls}
    assert len(after) == 1 and after != before  # the pipeline's weights reached both engines


def test_bucket_progress_reaches_the_driver_while_the_sync_runs(fleet):
    first, second = current_urls(fleet.engines.actors)
    # The sync is held at its third bucket: engine 0's request for it waits in the proxy, so no bucket from the
    # third on can be acknowledged, while the first two were (a bucket is sent once the one before it was).
    with (
        recording_proxy(first) as proxy,
        controller_for(fleet, TransportKind.DISTRIBUTED, urls=[proxy.url, second]) as controller,
    ):
        hold = proxy.hold("/update_weights_from_distributed", nth=3)
        ref = controller.sync.remote()
        try:
            hold.wait(RAY_TIMEOUT_S)
            seen = []
            deadline = time.monotonic() + 10.0  # the held bucket's broadcast waits for engine 0 only so long
            while not seen or seen[-1] < 2:
                progress = ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).progress
                seen.append(0 if progress is None else len(progress.buckets))
                assert not ray.wait([ref], timeout=0)[0], "the sync ended with a bucket held"
                assert time.monotonic() < deadline, f"no acknowledged bucket reached the driver: {seen}"
        finally:
            hold.release()
        report = ray.get(ref, timeout=RAY_TIMEOUT_S)
        assert report.committed and report.num_buckets > 3, report.summary()
        # The buckets acknowledged before the held one were visible while the sync still ran, and no later one.
        assert seen[-1] == 2, seen
        final = ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).progress
        assert final.version == report.version
        assert [b.index for b in final.buckets] == list(range(report.num_buckets))
        assert final.buckets[-1].total_bytes == report.num_bytes


def test_staged_export_sends_the_same_bytes_and_a_failed_stage_changes_nothing(fleet):
    urls = current_urls(fleet.engines.actors)
    with controller_for(fleet, TransportKind.DISTRIBUTED) as controller:
        plain = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
        after_plain = {target_checksum(u) for u in urls}
    with controller_for(fleet, TransportKind.DISTRIBUTED, staged=True) as controller:
        # No training step in between: a staged sync of the same weights must leave the same bytes.
        staged = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
        assert staged.committed and staged.phases.stage_s > 0, staged.summary()
        assert staged.checksums == plain.checksums and staged.num_bytes == plain.num_bytes
        for engine in staged.engines:
            assert engine.success and engine.num_verified_tensors == fleet.num_tensors, engine
        assert {target_checksum(u) for u in urls} == after_plain and len(after_plain) == 1

        def fail(index: int) -> None:  # nested: Ray pickles it by value into the trainer processes
            if index == 3:
                raise RuntimeError(f"export failed on purpose at unit {index}")

        # Every rank fails at unit 3, after its collectives: no rank is left inside the export's collectives.
        wrap_calls(fleet.trainers.actors, GATHERED_UNIT, fail)
        try:
            failed = ray.get(controller.sync.remote(raise_on_failure=False), timeout=RAY_TIMEOUT_S)
        finally:
            unwrap_calls(fleet.trainers.actors, GATHERED_UNIT)
        assert not failed.committed and "on purpose" in failed.error, failed.summary()
        assert failed.phases.pause_s == 0.0  # it failed while staging: the engines were never paused
        assert ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).weight_version == staged.version
        assert set(ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).serving_engines) == set(urls)
        samples = generate(fleet.engines.actors, 7)
        assert {s.weight_version for s in samples} == {staged.version}
        assert ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S).committed  # and the next sync works


@contextlib.contextmanager
def victim_behind_a_proxy(fleet: Fleet):
    """A distributed controller whose engine 0 (the victim, ranks 1.. of the group) it reaches through a recording
    proxy; yields (controller, proxy, the victim's URL as the controller has it, the survivor's URL)."""
    victim_url, survivor_url = current_urls(fleet.engines.actors)
    with recording_proxy(victim_url) as proxy:
        with controller_for(fleet, TransportKind.DISTRIBUTED, urls=[proxy.url, survivor_url]) as controller:
            yield controller, proxy, proxy.url, survivor_url


def kill_during_broadcast(fleet: Fleet, controller, proxy):
    """Commit one sync, train one step (so the next sync carries other bytes than the committed ones: an engine
    that received them is told apart from one that did not), then run a sync in which the victim engine dies during
    the broadcast: once every engine has begun the session, its request for the first bucket is held in its proxy
    (so it never joins that broadcast), the engine is SIGKILLed and the request let through to the dead server.
    Returns (committed report, its update group, the survivor's checksum after it, failed report, seconds the
    failed sync took)."""
    victim = fleet.engines.actors[0]
    first = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
    group = ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).membership
    committed = target_checksum(current_urls(fleet.engines.actors)[1])
    fleet.trainers.train_step(train_batch(generate(fleet.engines.actors, 7)), timeout_s=RAY_TIMEOUT_S)
    hold = proxy.hold("/update_weights_from_distributed")
    start = time.monotonic()
    ref = controller.sync.remote(raise_on_failure=False)
    try:
        hold.wait(RAY_TIMEOUT_S)
        ray.get(victim.kill.remote(), timeout=60)
    finally:
        hold.release()
    failed = ray.get(ref, timeout=RAY_TIMEOUT_S)
    return first, group, committed, failed, time.monotonic() - start


def restart_victim(fleet: Fleet, controller, victim_url: str) -> str:
    new_url = ray.get(fleet.engines.actors[0].restart.remote(), timeout=RAY_TIMEOUT_S)
    ray.get(controller.replace_engine.remote(victim_url, new_url), timeout=RAY_TIMEOUT_S)
    return new_url


def test_engine_killed_during_broadcast(fleet):
    victim, survivor = fleet.engines.actors
    with victim_behind_a_proxy(fleet) as (controller, proxy, victim_url, survivor_url):
        first, group_before, _, failed, elapsed = kill_during_broadcast(fleet, controller, proxy)
        assert not failed.committed and failed.error, failed.summary()
        print(f"failed sync after {elapsed:.2f} s: {failed.error[:300]}")
        assert elapsed < SYNC["sync_timeout_s"], f"the failed sync took {elapsed:.1f} s"
        assert not ray.get(victim.is_running.remote(), timeout=60)
        assert ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).version == int(first.version)
        assert ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).weight_version == first.version
        assert {e.url: e.success for e in failed.engines} == {victim_url: False, survivor_url: False}

        new_url = restart_victim(fleet, controller, victim_url)
        # Until a sync succeeds on it, the restarted engine (checkpoint weights) takes no generation traffic.
        assert new_url in ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).stale_engines
        assert new_url not in ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).serving_engines

        recovered = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
        assert recovered.committed and int(recovered.version) > int(failed.version) > int(first.version)
        for engine in recovered.engines:
            assert engine.success and engine.num_verified_tensors == fleet.num_tensors, engine
        group_after = ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).membership
        assert group_after.group_name != group_before.group_name  # a new group, with the restarted engine in it
        assert [e.url for e in group_after.engines] == [new_url, survivor_url]
        assert set(ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S).serving_engines) == {
            new_url,
            survivor_url,
        }
        assert target_checksum(new_url) == target_checksum(survivor_url)
        for engine in (victim, survivor):
            samples = ray.get(engine.generate.remote(prompts(10), sampling=GREEDY), timeout=RAY_TIMEOUT_S)
            assert {s.weight_version for s in samples} == {recovered.version}


def test_survivor_of_a_killed_broadcast_serves_only_the_committed_weights(fleet):
    """The failed sync carried a trained step, so what the survivor holds afterwards tells what reached it. gloo's
    broadcast from the source may or may not have delivered a bucket to the survivor before the victim's death
    failed it (it did in both runs at 5cb4869: the survivor was held): either way the survivor is held exactly when
    its weights differ from the committed ones, and a survivor left serving serves the committed version; after
    the victim restarts, the next sync lands the trained step on both."""
    survivor = fleet.engines.actors[1]
    with victim_behind_a_proxy(fleet) as (controller, proxy, victim_url, survivor_url):
        first, _, committed, failed, _ = kill_during_broadcast(fleet, controller, proxy)
        try:
            assert not failed.committed
            status = ray.get(controller.status.remote(), timeout=RAY_TIMEOUT_S)
            changed = target_checksum(survivor_url) != committed  # the checker answers on a held engine too
            assert (survivor_url in status.held_engines) == changed, (status.held_engines, changed)
            assert (survivor_url in status.serving_engines) == (not changed), status.serving_engines
            if not changed:
                samples = ray.get(survivor.generate.remote(prompts(9), sampling=GREEDY), timeout=RAY_TIMEOUT_S)
                assert {s.weight_version for s in samples} == {first.version}
            print("survivor", "held: the failed sync's bytes reached it" if changed else "serving: nothing reached it")
        finally:
            restart_victim(fleet, controller, victim_url)
            recovered = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
            assert recovered.committed
        assert target_checksum(survivor_url) != committed  # the step the failed sync carried lands now
        samples = ray.get(survivor.generate.remote(prompts(9), sampling=GREEDY), timeout=RAY_TIMEOUT_S)
        assert {s.weight_version for s in samples} == {recovered.version}
