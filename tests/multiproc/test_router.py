"""Rollouts through the real SGLang router (sglang-router 0.3.2, from the SGLang server's venv) in front of
reference engines, with the router's worker list following every sync's verdict (miles_sync.sync.routing).

One router, one source and the engines each test needs; counts come from the router itself (its worker list and
its per-worker routed-request counters) and from what the engines answer (their weight version per sample).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest
from reference_server import reference_server
from sender_host import SenderSettings
from sglang_server import SGLANG_PYTHON

from miles_sync.engine.client import EngineClient
from miles_sync.engine.command import reserve_port
from miles_sync.engine.router import RouterProcess, RouterSpec, parse_routed_counts
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.routing import RouteAction
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.wire.protocol import GenerateRequest, PauseMode, SamplingParams

pytestmark = pytest.mark.multiproc

FROZEN_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)
SETTINGS = SenderSettings(transport="distributed", bucket_bytes=1 << 20, include_mtp=False)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    if not SGLANG_PYTHON.is_file():
        pytest.fail(f"no SGLang server venv at {SGLANG_PYTHON.parent.parent}: run `bash launch/install_sglang.sh`")
    process = RouterProcess(spec=RouterSpec(python=str(SGLANG_PYTHON)), log_dir=tmp_path_factory.mktemp("router"))
    client = process.start()
    try:
        yield client
    finally:
        process.stop()


def start_engine(checkpoints: Path, log_dir: Path, *, port: int | None = None):
    return reference_server(
        model=checkpoints / "target",
        log_dir=log_dir,
        draft_kind="mtp",
        weight_layout="aiter",
        extra_args=() if port is None else ("--port", str(port)),
    )


def controller(urls, source, gate, *, pause_mode=PauseMode.ABORT, version_file=None) -> SyncController:
    return SyncController(
        engine_urls=urls,
        source=source,
        transport="distributed",
        selector_inputs=FROZEN_DRAFT,
        pause_mode=pause_mode,
        verify=True,
        timeouts=SessionTimeouts(control_s=20.0, sync_s=90.0),
        show_progress=False,
        gate=gate,
        version_file=version_file,
    )


async def generate_through(router_url: str, count: int, *, max_new_tokens: int = 4, spans: bool = False) -> list:
    """`count` greedy requests through the router at once; each answer's weight version (`spans`: the versions
    that produced its tokens, in order)."""
    async with EngineClient(router_url, timeout_s=120.0) as client:
        answers = await asyncio.gather(
            *(
                client.generate(
                    GenerateRequest(
                        input_ids=(1 + i % 7, 2, 3),
                        sampling_params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
                    )
                )
                for i in range(count)
            )
        )
    if spans:
        return [tuple(span.version for span in a.meta_info.weight_versions) for a in answers]
    return [a.meta_info.weight_version for a in answers]


def test_routed_counts_parse_the_routers_per_worker_outcomes():
    text = "\n".join(
        [
            "# TYPE smg_worker_cb_outcomes_total counter",
            'smg_worker_cb_outcomes_total{worker="http://127.0.0.1:1/",outcome="success"} 5',
            'smg_worker_cb_outcomes_total{worker="http://127.0.0.1:1",outcome="failure"} 2',
            'smg_worker_cb_outcomes_total{worker="http://127.0.0.1:2",outcome="success"} 1',
            'smg_worker_health{worker="http://127.0.0.1:2"} 1',
        ]
    )
    assert parse_routed_counts(text) == {"http://127.0.0.1:1": 7, "http://127.0.0.1:2": 1}


@pytest.mark.slow
def test_a_held_engine_gets_no_routed_request_and_rejoins_after_a_verified_sync(
    router, reference_checkpoints, source, tmp_path
):
    """Two engines behind the router. The second dies (SIGKILL) before a sync: the sync fails at the pause, the dead
    engine is held and withdrawn, and the next 20 routed requests all reach the survivor (the order of a withdrawal
    and the others' resume is shown on real servers, where a live engine is held by its verification:
    tests/sglang/test_sglang_load.py). The
    engine restarts at the same URL (the checkpoint's weights, not the fleet's): it stays out of the router until
    the next sync verifies on it, then takes requests again, at the fleet's version."""
    client = router
    port = reserve_port("127.0.0.1")

    async def main(a_url: str, b_url: str, restart_b) -> dict:
        await source.call("configure", SETTINGS)
        ctl = controller([a_url, b_url], source, client)
        out: dict = {}
        try:
            await ctl.connect()
            out["routed_at_connect"] = set(await client.worker_urls())
            await source.call("step", 1)
            out["v1"] = await ctl.sync()
            out["before"] = await client.routed_counts()
            await restart_b(kill_only=True)
            await source.call("step", 2)
            out["failed"] = await ctl.sync(raise_on_failure=False)
            out["listed_after_failure"] = set(await client.worker_urls())
            out["held"] = dict(ctl.held_engines)
            out["versions_while_held"] = await generate_through(client.url, 20)
            out["after_failure"] = await client.routed_counts()
            await restart_b(kill_only=False)
            out["listed_after_restart"] = set(await client.worker_urls())
            await source.call("step", 3)
            out["v3"] = await ctl.sync()
            out["listed_after_v3"] = set(await client.worker_urls())
            out["versions_after_v3"] = await generate_through(client.url, 20)
            out["after_v3"] = await client.routed_counts()
            out["changes"] = ctl.status().route_changes
        finally:
            await ctl.close()
            for url in (a_url, b_url):
                with contextlib.suppress(Exception):
                    await client.withdraw(url)
        return out

    with start_engine(reference_checkpoints, tmp_path) as a, contextlib.ExitStack() as stack:
        b = stack.enter_context(start_engine(reference_checkpoints, tmp_path, port=port))
        b_url = b.url
        holder = {"b": b, "stack": stack}

        async def restart_b(*, kill_only: bool) -> None:
            if kill_only:
                os.kill(holder["b"].process.pid, signal.SIGKILL)
                holder["b"].process.wait(timeout=15)
                return
            restarted = await asyncio.to_thread(
                lambda: holder["stack"].enter_context(start_engine(reference_checkpoints, tmp_path, port=port))
            )
            assert restarted.url == b_url

        out = asyncio.run(main(a.url, b_url, restart_b))
        a_url = a.url

    assert out["routed_at_connect"] == {a_url, b_url}
    assert out["v1"].committed and out["v1"].verification
    assert not out["failed"].committed
    assert b_url in out["held"] and "unreachable" in out["held"][b_url]
    assert out["listed_after_failure"] == {a_url}
    assert out["versions_while_held"] == ["1"] * 20
    assert out["after_failure"].get(b_url, 0) == out["before"].get(b_url, 0)  # not one more request to the held one
    assert out["after_failure"][a_url] - out["before"].get(a_url, 0) == 20
    assert out["listed_after_restart"] == {a_url}  # restarted with the checkpoint's weights: still out
    assert out["v3"].committed and out["v3"].version == "3"
    assert out["listed_after_v3"] == {a_url, b_url}
    assert set(out["versions_after_v3"]) == {"3"}
    assert out["after_v3"][b_url] > out["after_failure"].get(b_url, 0)  # the router sends it requests again
    actions = [(c.url, c.action) for c in out["changes"]]
    assert (b_url, RouteAction.WITHDRAWN) in actions and actions[-1] == (b_url, RouteAction.ADMITTED)


@pytest.mark.slow
def test_a_joiner_is_routed_only_after_a_sync_verifies_it_at_the_fleets_version(
    router, reference_checkpoints, source, tmp_path
):
    """A third engine joins a fleet at version 1: paused, not routed, while a direct request to it would wait; the
    next sync (version 2) verifies it engine-exact with the others, and only then does the router list it. A new
    controller over the same engines continues at their version, never below it."""
    client = router

    async def main(urls: list[str], joiner: str) -> dict:
        await source.call("configure", SETTINGS)
        ctl = controller(urls, source, client)
        out: dict = {}
        try:
            await ctl.connect()
            await source.call("step", 1)
            out["v1"] = await ctl.sync()
            await ctl.add_engine(joiner)
            out["listed_after_join"] = set(await client.worker_urls())
            out["serving_after_join"] = ctl.serving_engines
            await source.call("step", 2)
            out["v2"] = await ctl.sync()
            out["listed_after_v2"] = set(await client.worker_urls())
            async with EngineClient(joiner, timeout_s=20.0) as direct:
                out["joiner_version"] = (await direct.model_info()).weight_version
        finally:
            await ctl.close()
        restarted = controller([*urls, joiner], source, client)
        try:
            await restarted.connect()
            out["version_after_restart"] = restarted.version
            await source.call("step", 3)
            out["v3"] = await restarted.sync()
            await restarted.remove_engine(joiner)
            out["listed_after_remove"] = set(await client.worker_urls())
        finally:
            await restarted.close()
            for url in (*urls, joiner):
                with contextlib.suppress(Exception):
                    await client.withdraw(url)
        return out

    with (
        start_engine(reference_checkpoints, tmp_path) as a,
        start_engine(reference_checkpoints, tmp_path) as b,
        start_engine(reference_checkpoints, tmp_path) as c,
    ):
        out = asyncio.run(main([a.url, b.url], c.url))
        urls, joiner = [a.url, b.url], c.url

    assert out["v1"].committed
    assert out["listed_after_join"] == set(urls) and joiner not in out["serving_after_join"]
    assert out["v2"].committed and out["v2"].version == "2"
    joined = next(e for e in out["v2"].engines if e.url == joiner)
    assert joined.success and joined.num_verified_tensors > 0 and joined.verification
    assert out["listed_after_v2"] == {*urls, joiner}
    assert out["joiner_version"] == "2"
    assert out["version_after_restart"] == 2
    assert out["v3"].committed and out["v3"].version == "3"
    assert out["listed_after_remove"] == set(urls)


@pytest.mark.slow
def test_the_committed_version_survives_a_restart_of_the_controller_and_every_engine(
    reference_checkpoints, source, tmp_path
):
    """A controller commits versions 1 and 2 with a version file; its only engine restarts (it loaded the
    checkpoint: it reports no version) and a new controller connects: numbering continues at 3. Without the file
    the same restart would start over at 1 (the engines' answers are all a controller has)."""
    version_file = str(tmp_path / "state" / "committed_version.json")
    port = reserve_port("127.0.0.1")

    async def run(url: str, *, steps, with_file: bool) -> tuple[int, list[str]]:
        await source.call("configure", SETTINGS)
        ctl = controller([url], source, None, version_file=version_file if with_file else None)
        try:
            await ctl.connect()
            start, versions = ctl.version, []
            for step in steps:
                await source.call("step", step)
                versions.append((await ctl.sync()).version)
        finally:
            await ctl.close()
        return start, versions

    with start_engine(reference_checkpoints, tmp_path, port=port) as engine:
        first = asyncio.run(run(engine.url, steps=(1, 2), with_file=True))
    with start_engine(reference_checkpoints, tmp_path, port=port) as engine:  # restarted: the checkpoint again
        resumed = asyncio.run(run(engine.url, steps=(3,), with_file=True))
    with start_engine(reference_checkpoints, tmp_path, port=port) as engine:
        without = asyncio.run(run(engine.url, steps=(4,), with_file=False))
    assert first == (0, ["1", "2"])
    assert resumed == (2, ["3"])
    assert without == (0, ["1"])  # what the file prevents


@pytest.mark.slow
def test_200_concurrent_rollouts_through_the_router_across_3_syncs_lose_nothing(
    router, reference_checkpoints, source, tmp_path
):
    """200 requests in flight through the router while 3 syncs run back to back (retract pause: SGLang requeues the
    running requests and resumes them after the sync). Every request answers, with a version the fleet committed."""
    client = router

    async def main(urls: list[str]) -> tuple[list[str], list, dict, dict]:
        await source.call("configure", SETTINGS)
        ctl = controller(urls, source, client, pause_mode=PauseMode.RETRACT)
        try:
            await ctl.connect()
            before = await client.routed_counts()
            rollouts = asyncio.create_task(generate_through(client.url, 200, max_new_tokens=16, spans=True))
            reports = []
            for step in (1, 2, 3):
                await source.call("step", step)
                reports.append(await ctl.sync())
            versions = await asyncio.wait_for(rollouts, timeout=300)
            after = await client.routed_counts()
        finally:
            await ctl.close()
            for url in urls:
                with contextlib.suppress(Exception):
                    await client.withdraw(url)
        return versions, reports, before, after

    with start_engine(reference_checkpoints, tmp_path) as a, start_engine(reference_checkpoints, tmp_path) as b:
        versions, reports, before, after = asyncio.run(main([a.url, b.url]))
        urls = [a.url, b.url]

    assert [r.committed for r in reports] == [True, True, True]
    assert len(versions) == 200 and all(versions)
    committed = {"default", *(r.version for r in reports)}
    produced = {v for spans in versions for v in spans}
    assert produced <= committed
    # In flight across the syncs: tokens came from at least two versions, some requests' from more than one.
    assert len(produced) >= 2 and any(len(set(spans)) > 1 for spans in versions), versions[:5]
    assert sum(after.get(u, 0) - before.get(u, 0) for u in urls) == 200
