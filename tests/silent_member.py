"""An engine endpoint that passes the controller's probes and takes /init_weights_update_group, but never joins
the update group: the member of a rendezvous that never completes (fault drills against reference engines and
real SGLang servers)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from aiohttp import web

from miles_sync.engine.client import CONTROL_ENDPOINTS

__all__ = ["SilentMember", "silent_member"]


@dataclass
class SilentMember:
    """An engine endpoint that passes the controller's probes and takes /init_weights_update_group, but never
    joins the group (its handler waits until the server closes)."""

    url: str
    init_requests: list[dict] = field(default_factory=list)


@contextlib.contextmanager
def silent_member(*, weight_version: str, refuses_init: bool = False) -> Iterator[SilentMember]:
    loop = asyncio.new_event_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    member = SilentMember(url=f"http://127.0.0.1:{sock.getsockname()[1]}")
    closing = asyncio.Event()

    async def init(request: web.Request) -> web.Response:
        member.init_requests.append(await request.json())
        if refuses_init:
            return web.json_response({"success": False, "message": "backend 'gloo' is not supported here"}, status=400)
        await closing.wait()
        return web.json_response({"success": False, "message": "closing"}, status=400)

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"tp_size": 1})

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "silent", "weight_version": weight_version})

    async def destroy(request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": "nothing to destroy"})

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"success": False, "message": "not in this test"}, status=400)

    async def start() -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/get_server_info", server_info)
        app.router.add_get("/model_info", model_info)
        app.router.add_post("/init_weights_update_group", init)
        app.router.add_post("/destroy_weights_update_group", destroy)
        for path in (*CONTROL_ENDPOINTS, "/update_weights_from_distributed"):
            app.router.add_post(path, refuse)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        return runner

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield member
    finally:
        loop.call_soon_threadsafe(closing.set)
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        sock.close()
