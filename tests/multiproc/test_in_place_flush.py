"""The flush an in_place sync sends after its resume (miles_sync.sync.frame.FleetSteps.flush_after_in_place_resume)
through the real engine client, against HTTP servers on loopback that answer /flush_cache as SGLang does: 400
while a request runs (one server, never idle, as under steady load) or 200 (an idle one). The window is
sync.in_place_flush_s: 0 (the default) asks once, a positive one retries the refusal that long and no longer."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from miles_sync.engine.client import EngineClient
from miles_sync.sync.frame import FLUSHED_AFTER_RESUME, FleetSteps

pytestmark = pytest.mark.multiproc
CONTROL_S = 30.0  # the client's own drain window for a 400 is as long: the in_place window must cut it short


async def flush_server(status: int, calls: list[float]) -> tuple[web.AppRunner, str]:
    """A server whose /flush_cache always answers `status` (SGLang's text bodies); each call's time into `calls`."""

    async def flush(request: web.Request) -> web.Response:
        calls.append(time.monotonic())
        text = "Cache flushed.\\n" if status == 200 else "Flush cache failed.\\n"
        return web.Response(status=status, text=text)

    app = web.Application()
    app.router.add_post("/flush_cache", flush)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


# Mutations: the client's own 30 s drain window instead of the session's (both cases fail on time); no retry at
# all (0.3 fails on its count); a retry at 0 (0 fails on its count).
@pytest.mark.parametrize("window_s", [0.0, 0.3])
def test_the_in_place_flush_is_bounded_by_its_window_and_reported_per_engine(window_s):
    busy_calls: list[float] = []

    async def main():
        busy_runner, busy_url = await flush_server(400, busy_calls)
        idle_runner, idle_url = await flush_server(200, [])
        clients = [EngineClient(url, timeout_s=CONTROL_S) for url in (busy_url, idle_url)]
        try:
            fleet = FleetSteps(clients, timeout_s=CONTROL_S, last_step="version", held=())
            fleet.attempted.add("send")  # weights were sent and both engines resumed
            for client in clients:
                fleet.state[client.url].done.add("resume")
            start = time.monotonic()
            warnings = await fleet.flush_after_in_place_resume(window_s=window_s)
            return fleet, warnings, time.monotonic() - start, busy_url, idle_url
        finally:
            for client in clients:
                await client.close()
            await busy_runner.cleanup()
            await idle_runner.cleanup()

    fleet, warnings, elapsed_s, busy_url, idle_url = asyncio.run(main())
    # The busy engine's client would retry its 400s for CONTROL_S; the window ends it.
    assert elapsed_s < window_s + 1.0, elapsed_s
    # One attempt at 0; at 0.3 the client's back-off retries within the window and stops at its end.
    assert len(busy_calls) == 1 if window_s == 0 else len(busy_calls) >= 2, busy_calls
    assert busy_calls[-1] - busy_calls[0] <= window_s + 0.2  # the last retry starts at the window's end
    assert fleet.state[busy_url].prefix_cache.startswith("not flushed: "), fleet.state[busy_url]
    assert fleet.state[idle_url].prefix_cache == FLUSHED_AFTER_RESUME
    assert len(warnings) == 1 and warnings[0].startswith(f"{busy_url}: prefix cache not flushed"), warnings
    assert set(fleet.state[idle_url].call_s) == {"flush-after-resume"}
