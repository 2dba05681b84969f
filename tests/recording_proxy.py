"""A recording HTTP proxy on loopback, for tests that must show what a controller sent to an engine.

    with recording_proxy(engine.url) as proxy:   # proxy.url speaks for the engine
        ...
    assert proxy.posts("/update_weights_from_tensor")

Any request through any proxy that asks a weights checker to reset_tensors (on SGLang: random values in every
parameter, and the server keeps serving) fails the test it arrived in (tests/conftest.py), except in a module marked
`allows_reset_tensors` (the opt-in mechanism check's).

It forwards every request (method, path, query, headers, body) to the upstream server unchanged and records the
method, path and JSON body; answers come back unchanged. It runs on a thread of its own with its own event loop.
`proxy.delays` holds (path, predicate on the JSON body, seconds) rules: a matching request is held that long
before it is forwarded (how a test reorders what engines receive). `proxy.rewrites` holds (path, function) rules:
a matching request's JSON answer is replaced by the function's result (how a test makes one engine's answer
wrong). Each record carries its arrival time (time.monotonic(), comparable across the proxies of one process).

Fault drills act at a precise point of a sync through `proxy.hold(path, nth=n)`: the n-th matching request from
then on is held on arrival until the test, having waited for it (`Hold.wait`) and acted (killed a process, read the
controller's progress), lets it through (`release`) or answers it itself without forwarding (`drop`). Given the
pids of the processes that may call it (`clients`), the proxy records which of them sent each request
(`Recorded.client_pid`, read from /proc while the connection is open). `segment_pid` and `p2p_ticket` read what a
recorded update_weights_from_tensor payload names, without unpickling its tensors' memory.

The proxy answers 502 for a request whose upstream cannot be reached (a killed engine), as a dead server would
fail it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}
# Every request any proxy of this process forwarded that asked a weights checker to reset_tensors, as (upstream,
# record): tests/conftest.py fails the test during which one arrived, unless its module allows it.
RESET_REQUESTS: list[tuple[str, Recorded]] = []


# torch's file_system strategy names a CPU shared-memory segment "/torch_<creator pid>_<random>_<counter>".
_SHM_HANDLE = re.compile(rb"/torch_([0-9]+)_[0-9]+_[0-9]+")


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    body: Any  # parsed JSON, or None
    at: float  # time.monotonic() on arrival
    client_pid: int | None = None  # which of the proxy's `clients` sent it (None: not one of them, or none given)


class Hold:
    """The `nth` request on `path` (whose JSON body `matches`) from the moment the hold was made, held on arrival
    until the test decides: `release` forwards it, `drop` answers it 502 without forwarding. A hold still undecided
    when the proxy stops is dropped."""

    def __init__(self, path: str, matches: Callable[[dict[str, Any]], bool] | None, nth: int) -> None:
        if nth < 1:
            raise ValueError(f"nth={nth}: the first matching request is nth=1")
        self.path = path
        self.nth = nth
        self._matches = matches
        self._num_seen = 0
        self._arrived = threading.Event()
        self._decided = threading.Event()
        self._forward = True
        self.request: Recorded | None = None

    @property
    def has_arrived(self) -> bool:
        return self._arrived.is_set()

    def wait(self, timeout_s: float) -> Recorded:
        """The held request, once it arrived; raises TimeoutError naming the hold after `timeout_s`."""
        if not self._arrived.wait(timeout_s):
            raise TimeoutError(f"request {self.nth} to {self.path} did not arrive within {timeout_s} s")
        assert self.request is not None
        return self.request

    def release(self) -> None:
        self._forward = True
        self._decided.set()

    def drop(self) -> None:
        self._forward = False
        self._decided.set()

    def _claims(self, path: str, body: Any) -> bool:
        """Counts a request; True for the one to hold (called on the proxy's loop only)."""
        if path != self.path or self._arrived.is_set():
            return False
        if self._matches is not None and not (isinstance(body, dict) and self._matches(body)):
            return False
        self._num_seen += 1
        return self._num_seen == self.nth


class RecordingProxy:
    def __init__(self, upstream: str, *, clients: Sequence[int] = ()) -> None:
        self.upstream = upstream.rstrip("/")
        self.url = ""
        self.clients = tuple(clients)  # pids whose requests `Recorded.client_pid` names
        self.requests: list[Recorded] = []
        self.delays: list[tuple[str, Callable[[dict[str, Any]], bool], float]] = []
        self.rewrites: list[tuple[str, Callable[[Any], Any]]] = []
        self.holds: list[Hold] = []

    def hold(self, path: str, *, nth: int = 1, matches: Callable[[dict[str, Any]], bool] | None = None) -> Hold:
        """Hold the `nth` request on `path` (with a JSON body that `matches`) counted from now (see Hold)."""
        hold = Hold(path, matches, nth)
        self.holds.append(hold)
        return hold

    def requests_with(self, **fields: Any) -> list[Recorded]:
        """Recorded requests whose JSON body has every given field with the given value."""
        return [
            r for r in self.requests if isinstance(r.body, dict) and all(r.body.get(k) == v for k, v in fields.items())
        ]

    def paths(self) -> list[str]:
        return [r.path for r in self.requests]

    def posts(self, path: str) -> list[Recorded]:
        """The POSTs to `path`, in arrival order (a client's endpoint probes are GETs)."""
        return [r for r in self.requests if r.method == "POST" and r.path == path]

    async def _handle(self, request: web.Request, session: aiohttp.ClientSession) -> web.Response:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            body = None
        client_pid = None
        if self.clients and request.transport is not None:
            client_pid = _socket_owner(
                request.transport.get_extra_info("peername"), request.transport.get_extra_info("sockname"), self.clients
            )
        record = Recorded(request.method, request.path, body, time.monotonic(), client_pid)
        self.requests.append(record)
        if isinstance(body, dict) and body.get("action") == "reset_tensors":
            RESET_REQUESTS.append((self.upstream, record))
        for path, matches, seconds in tuple(self.delays):
            if request.path == path and isinstance(body, dict) and matches(body):
                await asyncio.sleep(seconds)
        for hold in tuple(self.holds):
            if hold._claims(request.path, body):
                hold.request = record
                hold._arrived.set()
                await asyncio.to_thread(hold._decided.wait)
                if not hold._forward:
                    return web.Response(status=502, text=f"{request.path}: dropped by the recording proxy")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        try:
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
        except aiohttp.ClientConnectionError as exc:
            return web.Response(status=502, text=f"{self.upstream}: unreachable ({type(exc).__name__}: {exc})")


def segment_pid(payload: str) -> int | None:
    """The pid of the process that created the shared-memory segment a serialized payload names (torch names
    segments after their creator), or None when it names none (a CUDA IPC handle, a p2p ticket). Reads the bytes;
    unpickles nothing."""
    found = _SHM_HANDLE.search(base64.b64decode(payload))
    return None if found is None else int(found.group(1))


def p2p_ticket(payload: str) -> Any:
    """The p2p ticket (miles_sync.transport.p2p_loader.Ticket) a serialized payload carries, as the loader reads it."""
    from miles_sync.transport.p2p_loader import decode_ticket
    from miles_sync.wire.payload import decode_payload

    return decode_ticket(decode_payload(payload, load_format=None))


def _socket_owner(peer: Any, local: Any, pids: Sequence[int]) -> int | None:
    """Which of `pids` holds the TCP socket connected from `peer` to `local` (IPv4 (host, port) pairs), from
    /proc/net/tcp and the pids' file descriptors; None when none of them does."""
    if not (isinstance(peer, tuple) and isinstance(local, tuple)):
        return None

    def key(address: tuple) -> str:
        host = socket.inet_aton(address[0])[::-1].hex().upper()  # /proc/net/tcp: little-endian hex
        return f"{host}:{address[1]:04X}"

    inode = None
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if fields[1] == key(peer) and fields[2] == key(local):
                inode = fields[9]
                break
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return pid
    return None


@contextlib.contextmanager
def recording_proxy(upstream: str, *, host: str = "127.0.0.1", clients: Sequence[int] = ()) -> Iterator[RecordingProxy]:
    """A RecordingProxy for `upstream`, listening on `host` (an engine's node address where a test checks which
    node an engine URL names) at a port the OS picks; `clients`: see RecordingProxy. Stopped on exit, after every
    undecided hold was dropped."""
    proxy = RecordingProxy(upstream, clients=clients)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def start() -> None:
        session = aiohttp.ClientSession()
        app = web.Application(client_max_size=2**30)
        app.router.add_route("*", "/{tail:.*}", lambda r: proxy._handle(r, session))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        proxy.url = f"http://{host}:{port}"
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
        for hold in proxy.holds:
            if not hold._decided.is_set():
                hold.drop()

        async def stop() -> None:
            await state["session"].close()
            await state["runner"].cleanup()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
