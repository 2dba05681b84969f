"""A recording HTTP proxy on loopback, for tests that must show what a controller sent to an engine.

    with recording_proxy(engine.url) as proxy:   # proxy.url speaks for the engine
        ...
    assert not proxy.requests_with(action="reset_tensors")

It forwards every request (method, path, query, headers, body) to the upstream server unchanged and records the
method, path and JSON body; answers come back unchanged. It runs on a thread of its own with its own event loop.
`proxy.delays` holds (path, predicate on the JSON body, seconds) rules: a matching request is held that long
before it is forwarded (how a test reorders what engines receive). `proxy.rewrites` holds (path, function) rules:
a matching request's JSON answer is replaced by the function's result (how a test makes one engine's answer
wrong). Each record carries its arrival time (time.monotonic(), comparable across the proxies of one process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    body: Any  # parsed JSON, or None
    at: float  # time.monotonic() on arrival


class RecordingProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.url = ""
        self.requests: list[Recorded] = []
        self.delays: list[tuple[str, Callable[[dict[str, Any]], bool], float]] = []
        self.rewrites: list[tuple[str, Callable[[Any], Any]]] = []

    def requests_with(self, **fields: Any) -> list[Recorded]:
        """Recorded requests whose JSON body has every given field with the given value."""
        return [
            r for r in self.requests if isinstance(r.body, dict) and all(r.body.get(k) == v for k, v in fields.items())
        ]

    def paths(self) -> list[str]:
        return [r.path for r in self.requests]

    async def _handle(self, request: web.Request, session: aiohttp.ClientSession) -> web.Response:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            body = None
        self.requests.append(Recorded(request.method, request.path, body, time.monotonic()))
        for path, matches, seconds in tuple(self.delays):
            if request.path == path and isinstance(body, dict) and matches(body):
                await asyncio.sleep(seconds)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        async with session.request(
            request.method,
            self.upstream + request.path_qs,
            data=raw,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=600),
        ) as answer:
            payload = await answer.read()
            kept = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_HEADERS}
            for path, rewrite in tuple(self.rewrites):
                if request.path == path:
                    payload = json.dumps(rewrite(json.loads(payload))).encode()
            return web.Response(status=answer.status, body=payload, headers=kept)


@contextlib.contextmanager
def recording_proxy(upstream: str) -> Iterator[RecordingProxy]:
    proxy = RecordingProxy(upstream)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def start() -> None:
        session = aiohttp.ClientSession()
        app = web.Application(client_max_size=2**30)
        app.router.add_route("*", "/{tail:.*}", lambda r: proxy._handle(r, session))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        proxy.url = f"http://127.0.0.1:{port}"
        state.update(runner=runner, session=session)
        ready.set()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        loop.run_forever()

    thread = threading.Thread(target=serve, name="recording-proxy", daemon=True)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("recording proxy did not start within 30 s")
    try:
        yield proxy
    finally:

        async def stop() -> None:
            await state["session"].close()
            await state["runner"].cleanup()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
