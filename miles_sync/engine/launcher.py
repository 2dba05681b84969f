"""Start, watch, stop and restart one SGLang-compatible engine server as a subprocess; plus the rollout worker.

Two server kinds, chosen once by the spec record (never branched on later):
- `ReferenceEngineSpec`: `python -m miles_sync.engine.reference.serve ... --port 0`; the OS picks the port and the
  server prints "listening on URL" once it accepts connections, which the launcher reads from its stdout;
- `SGLangEngineSpec`: `python -m sglang.launch_server ...`; SGLang needs a port up front, so the launcher asks
  the OS for a free one (bind to port 0, read it, release it) right before the start.

Either way the launcher then waits for GET /health_generate to answer 200 (one real token generated), with a
timeout, and tears the process down if anything fails. The server runs in its own session (process group), so
`stop` reaches SGLang's child processes too: SIGTERM, then SIGKILL after `stop_timeout_s`.

`RolloutWorker` fronts one launched engine for the rollout actor: lifecycle plus generation, every sample tagged
with the weight version the engine reported for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from miles_sync.config import EngineConfig, EngineKind, FinalizePolicy
from miles_sync.engine.client import EngineClient
from miles_sync.env import ENGINE_ADMIN_API_KEY_VARIABLE, ENGINE_API_KEY_VARIABLE
from miles_sync.layout import WeightLayout
from miles_sync.protocol import GenerateRequest, SamplingParams
from miles_sync.selector import DraftKind

__all__ = [
    "EngineLauncher",
    "EngineStartError",
    "LaunchCommand",
    "ReferenceEngineSpec",
    "RolloutWorker",
    "SGLangEngineSpec",
    "Sample",
    "engine_spec",
    "generate_samples",
    "reserve_port",
]

_LISTENING = "listening on "
_HEALTH_POLL_S = 0.1
_LOG_TAIL_CHARS = 3000


class EngineStartError(RuntimeError):
    """The server did not come up (exited, printed no address, or never answered healthy) within the timeout."""


@dataclass(frozen=True, kw_only=True)
class LaunchCommand:
    """One server start: the argv and the URL if it is known in advance (None: read it from the server's stdout)."""

    argv: tuple[str, ...]
    url: str | None
    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # added to the server's environment; secrets


@dataclass(frozen=True, kw_only=True)
class ReferenceEngineSpec:
    """The built-in CPU reference engine (`miles_sync.engine.reference.serve`)."""

    model_dir: str
    draft_kind: DraftKind = DraftKind.NONE
    draft_dir: str | None = None  # standalone drafts only
    weight_layout: WeightLayout = WeightLayout.NONE
    finalize_policy: FinalizePolicy = FinalizePolicy.STRICT
    spec_steps: int = 3
    is_draft_frozen: bool = False
    num_threads: int | None = 1  # torch intra-op threads of the server; None: torch's default
    collective_timeout_s: float | None = None  # None: the server's default (MILES_SYNC_COLLECTIVE_TIMEOUT_S)
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr, a log or a report
    admin_api_key: str | None = field(default=None, repr=False)  # the admin routes' key; a secret as well

    def __post_init__(self) -> None:
        problems = []
        for what, key in (("api_key", self.api_key), ("admin_api_key", self.admin_api_key)):
            if key is not None and not key:
                problems.append(f"{what} must be None or a non-empty string")
        if self.spec_steps < 1:
            problems.append(f"spec_steps={self.spec_steps} must be at least 1")
        if self.num_threads is not None and self.num_threads < 1:
            problems.append(f"num_threads={self.num_threads} must be at least 1 (or None)")
        if self.collective_timeout_s is not None and not self.collective_timeout_s > 0:
            problems.append(f"collective_timeout_s={self.collective_timeout_s} must be positive (or None)")
        if (self.draft_dir is not None) != (DraftKind(self.draft_kind) is DraftKind.STANDALONE):
            problems.append(f"draft_dir={self.draft_dir!r} must be given exactly for draft_kind 'standalone'")
        if problems:
            raise ValueError("invalid ReferenceEngineSpec: " + "; ".join(problems))

    def command(self, *, host: str) -> LaunchCommand:
        argv = [
            sys.executable, "-m", "miles_sync.engine.reference.serve",
            "--model", self.model_dir,
            "--draft-kind", DraftKind(self.draft_kind).value,
            "--weight-layout", WeightLayout(self.weight_layout).value,
            "--finalize-policy", FinalizePolicy(self.finalize_policy).value,
            "--spec-steps", str(self.spec_steps),
            "--host", host, "--port", "0",
        ]  # fmt: skip
        if self.draft_dir is not None:
            argv += ["--draft", self.draft_dir]
        if self.is_draft_frozen:
            argv.append("--draft-is-frozen")
        if self.num_threads is not None:
            argv += ["--threads", str(self.num_threads)]
        if self.collective_timeout_s is not None:
            argv += ["--collective-timeout-s", str(self.collective_timeout_s)]
        # Keys travel in the environment, never on the command line (readable by every local user).
        keys = ((ENGINE_API_KEY_VARIABLE, self.api_key), (ENGINE_ADMIN_API_KEY_VARIABLE, self.admin_api_key))
        secrets = {variable: key for variable, key in keys if key is not None}
        return LaunchCommand(argv=tuple(argv), url=None, env=secrets)


@dataclass(frozen=True, kw_only=True)
class SGLangEngineSpec:
    """An SGLang server (GPU nodes). `extra_args` go to `sglang.launch_server` as they are."""

    model_path: str
    tp_size: int = 1
    extra_args: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr, a log or a report
    admin_api_key: str | None = field(default=None, repr=False)  # SGLang's --admin-api-key; a secret as well

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"invalid SGLangEngineSpec: tp_size={self.tp_size} must be at least 1")

    def command(self, *, host: str) -> LaunchCommand:
        port = reserve_port(host)
        argv = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", self.model_path, "--host", host, "--port", str(port), "--tp-size", str(self.tp_size),
            *self.extra_args,
        ]  # fmt: skip
        if self.api_key is not None:  # SGLang reads its keys from the command line only
            argv += ["--api-key", self.api_key]
        if self.admin_api_key is not None:
            argv += ["--admin-api-key", self.admin_api_key]
        return LaunchCommand(argv=tuple(argv), url=f"http://{_url_host(host)}:{port}")


EngineSpec = ReferenceEngineSpec | SGLangEngineSpec


def engine_spec(
    engines: EngineConfig, *, model_dir: str, draft_dir: str | None = None, collective_timeout_s: float | None = None
) -> EngineSpec:
    """The launch spec of one engine of `engines` serving `model_dir`. Pure."""
    if engines.kind is EngineKind.SGLANG:
        return SGLangEngineSpec(model_path=model_dir, api_key=engines.api_key, admin_api_key=engines.admin_api_key)
    return ReferenceEngineSpec(
        model_dir=model_dir,
        draft_kind=engines.draft_kind,
        draft_dir=draft_dir,
        weight_layout=engines.weight_layout,
        finalize_policy=engines.finalize_policy,
        spec_steps=engines.spec_steps,
        collective_timeout_s=collective_timeout_s,
        api_key=engines.api_key,
        admin_api_key=engines.admin_api_key,
    )


def reserve_port(host: str) -> int:
    """A port the OS reports free on `host` right now. Released before returning: for servers (SGLang) that only
    take a port number; another process could take it in between, which the health wait then reports."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EngineLauncher:
    """One engine server process at a time. Not thread-safe; `start`/`stop`/`restart` block (run them off an
    event loop). `log_dir` receives one log file per start (stdout and stderr)."""

    def __init__(
        self,
        *,
        spec: EngineSpec,
        log_dir: str | os.PathLike,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 180.0,
        stop_timeout_s: float = 15.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        problems = [
            f"{name}={value} must be positive"
            for name, value in (("startup_timeout_s", startup_timeout_s), ("stop_timeout_s", stop_timeout_s))
            if not value > 0
        ]
        if problems:
            raise ValueError("invalid EngineLauncher: " + "; ".join(problems))
        self._spec = spec
        self._log_dir = Path(log_dir)
        self._host = host
        self._startup_timeout_s = startup_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._env = {**os.environ, "OMP_NUM_THREADS": "1", **({} if env is None else dict(env))}
        for variable in (ENGINE_API_KEY_VARIABLE, ENGINE_ADMIN_API_KEY_VARIABLE):
            self._env.pop(variable, None)  # only the spec decides whether the server wants a key
        self._process: subprocess.Popen | None = None
        self._url: str | None = None
        self._log_path: Path | None = None
        self._num_starts = 0

    @property
    def url(self) -> str | None:
        """The running server's base URL (None when stopped)."""
        return self._url

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    def start(self) -> str:
        """Start the server and wait until it is healthy; returns its URL. Raises EngineStartError (the process is
        stopped then) or RuntimeError if a server is already running."""
        if self._process is not None:
            raise RuntimeError(f"engine already started at {self._url}; stop or restart it")
        command = self._spec.command(host=self._host)
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._num_starts += 1
        self._log_path = self._log_dir / f"engine-{os.getpid()}-{self._num_starts}-{time.monotonic_ns()}.log"
        deadline = time.monotonic() + self._startup_timeout_s
        with open(self._log_path, "w") as log:
            # Own session: signals to the server's group reach every process it spawned (SGLang's workers).
            self._process = subprocess.Popen(
                command.argv, stdout=subprocess.PIPE, stderr=log, text=True, env={**self._env, **command.env},
                start_new_session=True,
            )
        try:
            self._url = command.url if command.url is not None else self._read_url(deadline)
            self._wait_healthy(deadline)
        except BaseException:
            self.stop()
            raise
        return self._url

    def stop(self) -> None:
        """Stop the server: SIGTERM to its process group, SIGKILL after `stop_timeout_s`. Idempotent."""
        process, self._process, self._url = self._process, None, None
        if process is None:
            return
        try:
            if process.poll() is None:
                _signal_group(process, signal.SIGTERM)
                try:
                    process.wait(timeout=self._stop_timeout_s)
                except subprocess.TimeoutExpired:
                    _signal_group(process, signal.SIGKILL)
                    process.wait(timeout=self._stop_timeout_s)
            # Children outliving a leader that exited on SIGTERM still get the group's SIGKILL.
            _signal_group(process, signal.SIGKILL)
        finally:
            if process.stdout is not None:
                process.stdout.close()

    def kill(self) -> None:
        """SIGKILL the server's process group at once, as a crash would, and reap it. Idempotent."""
        process = self._process
        if process is not None:
            _signal_group(process, signal.SIGKILL)
            process.wait(timeout=self._stop_timeout_s)
        self.stop()

    def restart(self) -> str:
        """Stop (if running) and start again; returns the new URL (the port usually changes)."""
        self.stop()
        return self.start()

    def log_tail(self, num_chars: int = _LOG_TAIL_CHARS) -> str:
        if self._log_path is None:
            return ""
        try:
            return self._log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def _read_url(self, deadline: float) -> str:
        process = self._process
        assert process is not None and process.stdout is not None
        found: list[str] = []
        ready = threading.Event()
        log_path = self._log_path

        def read() -> None:
            # Keeps draining stdout into the log after the address line, so the server never blocks on a full pipe.
            with open(log_path, "a") as log:
                for line in process.stdout:
                    if not found and line.startswith(_LISTENING):
                        found.append(line[len(_LISTENING) :].strip())
                        ready.set()
                    log.write(line)
                    log.flush()
            ready.set()

        threading.Thread(target=read, name="engine-stdout", daemon=True).start()
        ready.wait(max(0.0, deadline - time.monotonic()))
        if not found:
            raise EngineStartError(
                f"engine did not print its address within {self._startup_timeout_s} s "
                f"(exit code {process.poll()}); log {log_path}:\n{self.log_tail()}"
            )
        return found[0]

    def _wait_healthy(self, deadline: float) -> None:
        # No proxies: the server is local, and an environment proxy must never see loopback traffic.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        last = "no answer yet"
        while True:
            if self._process is None or self._process.poll() is not None:
                code = None if self._process is None else self._process.poll()
                raise EngineStartError(f"engine exited with code {code} before it was healthy:\n{self.log_tail()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineStartError(
                    f"engine at {self._url} not healthy within {self._startup_timeout_s} s ({last}):\n{self.log_tail()}"
                )
            try:
                with opener.open(self._url + "/health_generate", timeout=max(0.5, min(remaining, 30.0))) as response:
                    if response.status == 200:
                        return
                    last = f"HTTP {response.status}"
            except urllib.error.HTTPError as error:
                last = f"HTTP {error.code}"
            except (OSError, urllib.error.URLError) as error:
                last = f"{type(error).__name__}: {error}"
            time.sleep(_HEALTH_POLL_S)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One generated completion, stamped with the weight version the engine reported for it."""

    engine_url: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    weight_version: str
    spec_accept_length: float | None = None  # mean tokens accepted per verify step; None without a draft


async def generate_samples(
    client: EngineClient, prompts: Sequence[Sequence[int]], *, sampling: SamplingParams
) -> tuple[Sample, ...]:
    """One completion per prompt from the engine behind `client`, requested concurrently (the engine batches
    them); each Sample carries the weight version the engine reported for it."""
    responses = await asyncio.gather(
        *(client.generate(GenerateRequest(input_ids=tuple(p), sampling_params=sampling)) for p in prompts)
    )
    return tuple(
        Sample(
            engine_url=client.url,
            prompt_ids=tuple(prompt),
            output_ids=tuple(r.output_ids),
            weight_version=r.meta_info.weight_version,
            spec_accept_length=r.meta_info.spec_accept_length,
        )
        for prompt, r in zip(prompts, responses)
    )


class RolloutWorker:
    """One rollout engine: launches its server and generates from it. Async, bound to the event loop it first runs
    on (a Ray async actor wraps it). `start` must come first; `restart` gives a new URL."""

    def __init__(
        self,
        *,
        spec: EngineSpec,
        log_dir: str | os.PathLike,
        host: str = "127.0.0.1",
        http_timeout_s: float = 60.0,
        startup_timeout_s: float = 180.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if not http_timeout_s > 0:
            raise ValueError(f"invalid RolloutWorker: http_timeout_s={http_timeout_s} must be positive")
        self._launcher = EngineLauncher(
            spec=spec, log_dir=log_dir, host=host, startup_timeout_s=startup_timeout_s, env=env
        )
        self._http_timeout_s = http_timeout_s
        self._client: EngineClient | None = None
        self._api_key = spec.api_key

    async def start(self) -> str:
        return await asyncio.to_thread(self._launcher.start)

    async def stop(self) -> None:
        await self._close_client()
        await asyncio.to_thread(self._launcher.stop)

    async def kill(self) -> None:
        """Crash the server (SIGKILL), e.g. to exercise a sync that loses an engine mid-broadcast."""
        await self._close_client()
        await asyncio.to_thread(self._launcher.kill)

    async def restart(self) -> str:
        await self._close_client()
        return await asyncio.to_thread(self._launcher.restart)

    def url(self) -> str | None:
        return self._launcher.url

    def pid(self) -> int | None:
        return self._launcher.pid

    def is_running(self) -> bool:
        return self._launcher.is_running

    def log_tail(self) -> str:
        return self._launcher.log_tail()

    async def generate(self, prompts: Sequence[Sequence[int]], *, sampling: SamplingParams) -> tuple[Sample, ...]:
        """Generate one completion per prompt, concurrently (the engine batches them). Raises EngineError when the
        engine refuses (e.g. stale after a failed sync) or does not answer within the HTTP timeout."""
        url = self._launcher.url
        if url is None:
            raise RuntimeError("RolloutWorker.generate before start(): no engine is running")
        return await generate_samples(self._connected_client(url), prompts, sampling=sampling)

    def _connected_client(self, url: str) -> EngineClient:
        # One client per server start: a restarted engine has a new URL.
        if self._client is None or self._client.url != url.rstrip("/"):
            self._client = EngineClient(url, timeout_s=self._http_timeout_s, api_key=self._api_key)
        return self._client

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()
