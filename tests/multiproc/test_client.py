"""The engine client's contract, against the real reference engine over HTTP on loopback.

Edge fakes (tiny aiohttp servers in this process) stand in only where the reference engine cannot show the
behaviour: a server without the session endpoints, a server that never answers, and one that counts concurrent
control calls.
"""

from __future__ import annotations

import asyncio
import gc
import pickle
import time
import warnings
from collections.abc import Callable

import pytest
from aiohttp import web
from reference_server import reference_server

from miles_sync.engine.client import CONTROL_ENDPOINTS, SESSION_ENDPOINTS, EngineClient
from miles_sync.engine.reference.models import read_safetensors
from miles_sync.weights.checksum import tensor_checksum
from miles_sync.wire.api import EngineError
from miles_sync.wire.draft import DraftKind
from miles_sync.wire.protocol import (
    GenerateRequest,
    PauseMode,
    SamplingParams,
    Selector,
    WeightsCheckerAction,
    WeightsCheckerRequest,
)

API_KEY = "test-key-0123"


@pytest.fixture(scope="module")
def engine(reference_checkpoints, tmp_path_factory):
    with reference_server(
        model=reference_checkpoints / "target",
        log_dir=tmp_path_factory.mktemp("client"),
        draft_kind="mtp",
        weight_layout="aiter",
        api_key=API_KEY,
    ) as server:
        yield server


def run(coro_fn: Callable[[EngineClient], object], url: str, **options):
    async def main():
        async with EngineClient(url, **{"timeout_s": 30.0, "api_key": API_KEY, **options}) as client:
            return await coro_fn(client)

    return asyncio.run(main())


def greedy(max_new_tokens: int) -> GenerateRequest:
    return GenerateRequest(
        input_ids=(5, 17, 99), sampling_params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    )


def test_connect_probes_and_reads_server_info(engine):
    info = run(lambda c: c.connect(required=(*CONTROL_ENDPOINTS, "/update_weights_from_distributed")), engine.url)
    assert info.tp_size == 1 and info.speculative_algorithm is not None


def test_draft_report_and_model_info(engine):
    async def calls(client):
        return await client.draft_report(), await client.model_info()

    report, info = run(calls, engine.url)
    assert report.kind is DraftKind.MTP and report.owned_names
    assert all(name.startswith("model.layers.2.") for name in report.owned_names)
    assert info.weight_version == "default"


def test_400_bodies_are_surfaced(engine):
    async def calls(client):
        await client.begin_weight_update(Selector.TARGET)
        with pytest.raises(EngineError) as second:
            await client.begin_weight_update(Selector.TARGET)
        with pytest.raises(EngineError) as empty:
            await client.end_weight_update()  # strict policy: the target loaded nothing (the session closes anyway)
        with pytest.raises(EngineError) as no_session:
            await client.end_weight_update()
        return second.value, empty.value, no_session.value

    second, empty, no_session = run(calls, engine.url)
    assert (second.url, second.endpoint, second.status) == (engine.url, "/begin_weight_update", 400)
    assert "already open" in second.message and engine.url in str(second) and "HTTP 400" in str(second)
    assert empty.status == 400 and "target runner is selected by 'target' but loaded no tensor" in empty.message
    assert no_session.endpoint == "/end_weight_update" and "no weight update session is open" in no_session.message


def test_weights_checker_matches_the_checkpoint(engine, reference_checkpoints):
    request = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=Selector.TARGET)
    result = run(lambda c: c.weights_checker(request), engine.url)
    tensors = read_safetensors(reference_checkpoints / "target" / "model.safetensors")
    checksums = result.ranks[0].checksums
    # The engine stores linear weights shuffled (aiter) but reports logical checksums: equal to the checkpoint's.
    assert checksums and all(checksums[name] == tensor_checksum(tensors[name]) for name in checksums)


def test_version_pause_continue_and_generate(engine):
    async def calls(client):
        await client.update_weight_version("client-test-1")
        await client.pause_generation(PauseMode.RETRACT)
        await client.continue_generation()
        response = await client.generate(greedy(4))
        await client.health_generate()
        return response, await client.model_info()

    response, info = run(calls, engine.url)
    assert info.weight_version == "client-test-1"
    assert response.meta_info.weight_version == "client-test-1" and response.meta_info.completion_tokens == 4


def wait_until_running(server, *, timeout_s: float = 30.0) -> None:
    """Until the engine's scheduler runs a request (its /get_server_info internal state says so)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, info = server.get("/get_server_info")
        if status == 200 and info["internal_states"][0]["num_running"] >= 1:
            return
        assert time.monotonic() < deadline, f"no request running after {timeout_s} s: {info}"
        time.sleep(0.01)


def test_flush_cache_retries_only_while_requests_drain(engine):
    async def flush_while_generating(client, *, abort_after_s: float):
        running = asyncio.create_task(client.generate(greedy(2000)))  # far longer than this test waits
        await asyncio.to_thread(wait_until_running, engine)

        async def abort_later():
            # What a session does before flushing: pause with abort drains the running request.
            await asyncio.sleep(abort_after_s)
            await client.pause_generation(PauseMode.ABORT)

        aborter = asyncio.create_task(abort_later())
        start = time.monotonic()
        try:
            await client.flush_cache()  # the engine answers 400 at once while the request runs
            outcome = None
        except EngineError as exc:
            outcome = exc
        elapsed = time.monotonic() - start
        await aborter
        response = await running
        await client.continue_generation()
        return outcome, elapsed, response

    # Drain window longer than the abort delay: flush retries on each 400 and succeeds once the request is gone.
    outcome, elapsed, response = run(
        lambda c: flush_while_generating(c, abort_after_s=0.5), engine.url, flush_drain_s=30.0
    )
    assert outcome is None and 0.4 < elapsed < 10.0
    assert response.meta_info.finish_reason.type.value == "abort"
    # Drain window shorter than that: the 400 is surfaced, naming the running request.
    outcome, elapsed, _ = run(lambda c: flush_while_generating(c, abort_after_s=1.0), engine.url, flush_drain_s=0.3)
    assert outcome.status == 400 and "running" in outcome.message and "still running after 0.3 s" in str(outcome)
    assert elapsed < 1.0
    # Idle engine: one call.
    run(lambda c: c.flush_cache(), engine.url)


def test_api_key(engine):
    async def without_key(client):
        with pytest.raises(EngineError) as refused:
            await client.pause_generation(PauseMode.ABORT)
        start = time.monotonic()
        with pytest.raises(EngineError) as flush:
            await client.flush_cache()
        flush_s = time.monotonic() - start
        with pytest.raises(EngineError) as rollout:  # as on SGLang, an API key guards rollout routes too
            await client.generate(greedy(2))
        await client.health_generate()  # health routes never need a key
        return refused.value, flush.value, flush_s, rollout.value

    refused, flush, flush_s, rollout = run(without_key, engine.url, api_key=None, flush_drain_s=30.0)
    assert refused.status == 401 and API_KEY not in str(refused)
    assert flush.status == 401 and flush_s < 5.0  # a 401 is not a drain: no retries
    assert rollout.status == 401
    response = run(lambda client: client.generate(greedy(2)), engine.url)
    assert response.meta_info.completion_tokens == 2
    assert "test-key" not in repr(EngineClient(engine.url, timeout_s=1.0, api_key=API_KEY))


def test_admin_key_goes_to_admin_routes_and_the_api_key_to_rollout_routes(reference_checkpoints, tmp_path):
    """SGLang's auth levels: with --admin-api-key set, admin routes take only that key, rollout routes only the
    API key; the client sends each route the key it takes, and connect() probes without running a checksum."""
    admin_key = "admin-test-key"

    async def with_keys(client):
        info = await client.connect()
        await client.pause_generation(PauseMode.ABORT)
        await client.continue_generation()
        response = await client.generate(greedy(2))
        return info, response

    async def plain_key_on_admin_routes(client):
        with pytest.raises(EngineError) as refused:
            await client.pause_generation(PauseMode.ABORT)
        return refused.value

    with reference_server(
        model=reference_checkpoints / "target", log_dir=tmp_path, api_key=API_KEY, admin_api_key=admin_key
    ) as server:
        info, response = run(with_keys, server.url, admin_api_key=admin_key)
        refused = run(plain_key_on_admin_routes, server.url)
    assert info.miles_sync_checksum_names.value == "hf" and response.meta_info.completion_tokens == 2
    assert refused.status == 401 and admin_key not in str(refused) and API_KEY not in str(refused)
    assert admin_key not in repr(EngineClient(server.url, timeout_s=1.0, api_key=API_KEY, admin_api_key=admin_key))


def test_no_server_is_an_error_not_a_hang():
    async def main():
        server = await _start(web.Application())
        url = server.url
        await server.close()  # nothing listens there any more
        async with EngineClient(url, timeout_s=2.0) as client:
            with pytest.raises(EngineError) as refused:
                await client.server_info()
        return refused.value

    refused = asyncio.run(main())
    assert refused.status is None and refused.endpoint == "/get_server_info"


def test_engine_error_pickles():
    error = EngineError(url="http://127.0.0.1:1", endpoint="/end_weight_update", status=400, message="nope")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.url, copy.endpoint, copy.status, copy.message, str(copy)) == (
        error.url,
        error.endpoint,
        error.status,
        error.message,
        str(error),
    )


# ---- edge fakes ----------------------------------------------------------------------------------------------


class _Server:
    def __init__(self, runner: web.AppRunner, url: str) -> None:
        self.runner = runner
        self.url = url

    async def close(self) -> None:
        await self.runner.cleanup()


async def _start(app: web.Application) -> _Server:
    runner = web.AppRunner(app, shutdown_timeout=0.5)  # handlers that never answer must not delay cleanup
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return _Server(runner, f"http://127.0.0.1:{port}")


def _old_server(*, endpoints: tuple[str, ...]) -> web.Application:
    """A server that speaks the pre-session contract: everything but the given POST endpoints."""

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": "ok"})

    app = web.Application()

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"tp_size": 1, "extra": [1, 2]})

    app.router.add_get("/get_server_info", server_info)
    for path in endpoints:
        app.router.add_post(path, ok)
    return app


def test_connect_refuses_a_server_without_session_endpoints():
    async def main():
        present = tuple(p for p in CONTROL_ENDPOINTS if p not in SESSION_ENDPOINTS)
        server = await _start(_old_server(endpoints=present))
        try:
            async with EngineClient(server.url, timeout_s=5.0) as client:
                with pytest.raises(EngineError) as refused:
                    await client.connect()
                full = await _start(_old_server(endpoints=CONTROL_ENDPOINTS))
                try:
                    async with EngineClient(full.url, timeout_s=5.0) as ok_client:
                        info = await ok_client.connect()
                finally:
                    await full.close()
        finally:
            await server.close()
        return refused.value, info

    refused, info = asyncio.run(main())
    assert refused.status == 404 and refused.endpoint == "/begin_weight_update"
    assert "/begin_weight_update, /end_weight_update" in refused.message
    assert info.tp_size == 1


def test_every_call_times_out():
    async def main():
        async def never(request: web.Request) -> web.Response:
            await asyncio.sleep(3600)
            return web.Response()

        app = web.Application()
        app.router.add_post("/end_weight_update", never)
        app.router.add_get("/model_info", never)
        server = await _start(app)
        try:
            async with EngineClient(server.url, timeout_s=0.3) as client:
                start = time.monotonic()
                with pytest.raises(EngineError) as control:
                    await client.end_weight_update()
                with pytest.raises(EngineError) as read:
                    await client.model_info(timeout_s=0.2)
                elapsed = time.monotonic() - start
        finally:
            await server.close()
        return control.value, read.value, elapsed

    control, read, elapsed = asyncio.run(main())
    assert control.status is None and "timed out after 0.3 s" in control.message
    assert read.status is None and "timed out after 0.2 s" in read.message
    assert elapsed < 3.0


def test_control_calls_to_one_engine_are_serialized():
    in_flight = {"control": 0, "max_control": 0, "generate": 0, "max_generate": 0}

    def counting(kind: str, answer: dict):
        async def handle(request: web.Request) -> web.Response:
            in_flight[kind] += 1
            in_flight[f"max_{kind}"] = max(in_flight[f"max_{kind}"], in_flight[kind])
            await asyncio.sleep(0.05)
            in_flight[kind] -= 1
            return web.json_response(answer)

        return handle

    generated = {
        "output_ids": [1],
        "meta_info": {"prompt_tokens": 1, "completion_tokens": 1, "weight_version": "v"},
    }

    async def main():
        app = web.Application()
        app.router.add_post("/update_weight_version", counting("control", {"success": True, "message": "ok"}))
        app.router.add_post("/pause_generation", counting("control", {"message": "ok", "status": "ok"}))
        app.router.add_post("/generate", counting("generate", generated))
        server = await _start(app)
        try:
            async with EngineClient(server.url, timeout_s=5.0) as client:
                await asyncio.gather(
                    *(client.update_weight_version(str(i)) for i in range(4)),
                    *(client.pause_generation(PauseMode.ABORT) for _ in range(4)),
                    *(client.generate(greedy(1)) for _ in range(4)),
                )
        finally:
            await server.close()

    asyncio.run(main())
    assert in_flight["max_control"] == 1  # one control call at a time: answers carry no operation id
    assert in_flight["max_generate"] > 1  # generation is not serialized behind them


def test_a_failed_connect_closes_the_clients_of_the_engines_that_connected(engine):
    # Kills: EngineConnector.connect_all leaving the connected engines' clients open when another engine fails
    # (aiohttp reports a session collected unclosed as a ResourceWarning).
    from miles_sync.sync.draft_canary import CanarySettings
    from miles_sync.sync.fleet import EngineConnector

    connector = EngineConnector(
        timeout_s=10.0, endpoints=(), api_key=API_KEY, admin_api_key=None, guards_draft=False, canary=CanarySettings()
    )
    dead = "http://127.0.0.1:9"  # discard port: nothing listens

    def failed_url() -> str:
        try:
            asyncio.run(connector.connect_all([engine.url, dead]))
        except EngineError as exc:
            return exc.url  # the exception (and the frames it holds) dies here
        raise AssertionError("connect_all did not fail")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert failed_url() == dead
        gc.collect()
    unclosed = [str(w.message) for w in caught if "Unclosed client session" in str(w.message)]
    assert not unclosed, unclosed
