"""The SGLang router in front of the rollout engines: its launch spec, its process, and a client for its worker list.

Rollouts go to the router, which picks an engine per request. Which engines it may pick is decided by the sync
(miles_sync.sync.routing): an engine is admitted to the router's worker list only while it serves the fleet's
committed weights, and withdrawn before anything could be routed to it otherwise. This module is the mechanism:

- `RouterSpec.command` starts sglang-router 0.3.2's Rust router (`miles_sync.engine.router_launch`, in the SGLang
  server's venv) with an empty worker list, bound to one host (its Prometheus exporter too: the router's default
  binds that on 0.0.0.0:29000), round-robin by default;
- `RouterProcess` runs it (the engines' launcher: own process group, the address read from its output, a
  readiness wait on /liveness);
- `RouterClient` speaks the router's worker API: GET /workers, POST /workers {url} (202; the router then probes
  the engine's /health, /server_info and /model_info before it routes to it), DELETE /workers/{id}; `admit` and
  `withdraw` return only once the router's list shows the change, within their timeout. `routed_counts` reads
  how many requests the router sent to each engine (its per-worker circuit-breaker outcome counters).

A router started by the user is given by URL (`RouterClient(url)`); miles_sync then starts nothing.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from miles_sync.engine.command import LaunchCommand, reserve_port, url_host
from miles_sync.engine.process import EngineLauncher
from miles_sync.env import LOOPBACK_HOST
from miles_sync.wire.text import raise_if

__all__ = ["ROUTER_POLICIES", "RouterClient", "RouterProcess", "RouterSpec"]

ROUTER_POLICIES = ("round_robin", "random", "power_of_two", "cache_aware")
_POLL_S = 0.05
# One routed request per line: smg_worker_cb_outcomes_total{worker="URL",outcome="success"} 12
_OUTCOME = re.compile(r'^smg_worker_cb_outcomes_total\{worker="([^"]+)",outcome="[a-z_]+"\} ([0-9.e+]+)$')


class RouterError(RuntimeError):
    """The router refused a worker-list change, or did not show it within the timeout."""


@dataclass(frozen=True, kw_only=True)
class RouterWorker:
    """One entry of the router's worker list."""

    id: str
    url: str
    is_healthy: bool
    load: int


@dataclass(frozen=True, kw_only=True)
class RouterSpec:
    """How to start the router: the interpreter of the venv sglang-router is installed in, the load-balancing
    policy, and the router's own waits (seconds)."""

    python: str
    policy: str = "round_robin"
    request_timeout_s: int = 600
    health_check_interval_s: int = 10
    metrics_port: int = 0  # the Prometheus exporter's port on the router's host; 0: reserved at `command`

    def __post_init__(self) -> None:
        problems = []
        if self.policy not in ROUTER_POLICIES:
            problems.append(f"policy={self.policy!r} is not one of {ROUTER_POLICIES}")
        for name in ("request_timeout_s", "health_check_interval_s"):
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        raise_if(problems, what="invalid RouterSpec")

    def command(self, *, host: str) -> LaunchCommand:
        port, metrics_port = reserve_port(host), self.metrics_port or reserve_port(host)
        argv = (
            self.python,
            "-m",
            "miles_sync.engine.router_launch",
            "--host",
            host,
            "--port",
            str(port),
            "--prometheus-host",
            host,
            "--prometheus-port",
            str(metrics_port),
            "--policy",
            self.policy,
            "--request-timeout-secs",
            str(self.request_timeout_s),
            "--health-check-interval-secs",
            str(self.health_check_interval_s),
            "--log-level",
            "warn",
        )
        # The URL is read from the launcher's first line (url=None), so that the launcher keeps draining the
        # router's output (it logs to stdout) into the log file.
        return LaunchCommand(argv=argv, url=None, ready_path="/liveness")


class RouterProcess:
    """The router as a subprocess: `start` returns its client once it answers; `stop` in `finally`."""

    def __init__(
        self, *, spec: RouterSpec, log_dir: str | Path, host: str = LOOPBACK_HOST, timeout_s: float = 30.0
    ) -> None:
        self._host = host
        self._timeout_s = timeout_s
        # The exporter's port is fixed here so that the client knows where to read the routed counts.
        self._spec = spec if spec.metrics_port else replace(spec, metrics_port=reserve_port(host))
        self._launcher = EngineLauncher(spec=self._spec, log_dir=log_dir, host=host, startup_timeout_s=timeout_s)

    @property
    def url(self) -> str | None:
        return self._launcher.url

    @property
    def pid(self) -> int | None:
        return self._launcher.pid

    def start(self) -> RouterClient:
        url = self._launcher.start()
        metrics = f"http://{url_host(self._host)}:{self._spec.metrics_port}/metrics"
        return RouterClient(url, timeout_s=self._timeout_s, metrics_url=metrics)

    def stop(self) -> None:
        self._launcher.stop()

    def log_tail(self) -> str:
        return self._launcher.log_tail()


class RouterClient:
    """The router's worker API. Every call has `timeout_s`; usable from any event loop (one HTTP session each)."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, metrics_url: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.metrics_url = metrics_url
        self._timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def __getstate__(self) -> dict:
        # Sent to the controller actor: it opens its own session on its own loop.
        return {**self.__dict__, "_session": None, "_session_loop": None}

    def __repr__(self) -> str:
        return f"RouterClient({self.url!r})"

    async def close(self) -> None:
        if self._session is not None and self._session_loop is asyncio.get_running_loop():
            await self._session.close()
        self._session, self._session_loop = None, None

    async def workers(self) -> tuple[RouterWorker, ...]:
        status, body = await self._request("GET", "/workers")
        if status != 200:
            raise RouterError(f"router {self.url}: GET /workers answered {status}: {body[:300]}")
        return tuple(
            RouterWorker(
                id=str(w["id"]), url=str(w["url"]).rstrip("/"), is_healthy=bool(w["is_healthy"]), load=int(w["load"])
            )
            for w in json.loads(body)["workers"]
        )

    async def worker_urls(self) -> tuple[str, ...]:
        return tuple(w.url for w in await self.workers())

    async def admit(self, url: str) -> None:
        """Add `url` to the worker list and wait until the router lists it healthy (it probes the engine first).
        Already listed: nothing to do."""
        url = url.rstrip("/")
        if any(w.url == url and w.is_healthy for w in await self.workers()):
            return
        if url not in await self.worker_urls():
            status, body = await self._request("POST", "/workers", body={"url": url})
            if status not in (200, 201, 202):
                raise RouterError(f"router {self.url}: adding {url} answered {status}: {body[:300]}")
        await self._until(lambda ws: any(w.url == url and w.is_healthy for w in ws), f"{url} listed healthy")

    async def withdraw(self, url: str) -> None:
        """Remove `url` from the worker list and wait until the router no longer lists it. Not listed: nothing."""
        url = url.rstrip("/")
        for worker in await self.workers():
            if worker.url == url:
                status, body = await self._request("DELETE", f"/workers/{urllib.parse.quote(worker.id)}")
                if status not in (200, 202, 204, 404):
                    raise RouterError(f"router {self.url}: removing {url} answered {status}: {body[:300]}")
        await self._until(lambda ws: all(w.url != url for w in ws), f"{url} gone from the worker list")

    async def routed_counts(self) -> dict[str, int]:
        """Requests the router has sent to each engine URL so far (successes and failures), from its Prometheus
        exporter; an engine never routed to is absent."""
        if self.metrics_url is None:
            raise RouterError(f"router {self.url}: no metrics URL (a router miles_sync did not start)")
        status, body = await self._request("GET", "", url=self.metrics_url)
        if status != 200:
            raise RouterError(f"router metrics {self.metrics_url} answered {status}")
        return parse_routed_counts(body)

    async def _until(self, predicate, what: str) -> None:
        deadline = time.monotonic() + self._timeout_s
        while True:
            workers = await self.workers()
            if predicate(workers):
                return
            if time.monotonic() > deadline:
                listed = ", ".join(f"{w.url} (healthy {w.is_healthy})" for w in workers) or "none"
                raise RouterError(f"router {self.url}: not {what} within {self._timeout_s} s; listed: {listed}")
            await asyncio.sleep(_POLL_S)

    async def _request(
        self, method: str, path: str, *, body: Mapping | None = None, url: str | None = None
    ) -> tuple[int, str]:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session_loop is not loop:
            # One session per event loop (a caller may use the client from several asyncio.run calls; a session of
            # a finished loop cannot even be closed). No proxies: the router is on this cluster's network.
            self._session = aiohttp.ClientSession(trust_env=False)
            self._session_loop = loop
        target = url if url is not None else self.url + path
        try:
            async with self._session.request(
                method, target, json=body, timeout=aiohttp.ClientTimeout(total=self._timeout_s)
            ) as response:
                return response.status, await response.text()
        except asyncio.TimeoutError:
            raise RouterError(f"{method} {target}: no answer within {self._timeout_s} s") from None
        except aiohttp.ClientError as exc:
            raise RouterError(f"{method} {target}: {type(exc).__name__}: {exc}") from None


def parse_routed_counts(metrics: str) -> dict[str, int]:
    """Per engine URL, the sum of the router's `smg_worker_cb_outcomes_total` lines (Prometheus text). Pure."""
    counts: dict[str, int] = {}
    for line in metrics.splitlines():
        match = _OUTCOME.match(line.strip())
        if match:
            url = match.group(1).rstrip("/")
            counts[url] = counts.get(url, 0) + int(float(match.group(2)))
    return counts
