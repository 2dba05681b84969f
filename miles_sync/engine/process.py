"""Start, watch, stop and restart one engine server as a subprocess.

The spec (`miles_sync.engine.kinds.engine_spec`) decides the command; this module never branches on the kind. It
waits for the command's `ready_path` (an engine's GET /health_generate: one real token generated) to answer 200,
with a timeout, and tears the process down if anything fails. The server runs in its own session (process group),
so `stop` reaches SGLang's child processes too: SIGTERM, then SIGKILL after `stop_timeout_s`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from miles_sync.engine.kinds import EngineSpec
from miles_sync.env import ENGINE_ADMIN_API_KEY_VARIABLE, ENGINE_API_KEY_VARIABLE, LOOPBACK_HOST
from miles_sync.wire.text import raise_if

__all__ = ["EngineLauncher"]

_LISTENING = "listening on "
_HEALTH_POLL_S = 0.1
_LOG_TAIL_CHARS = 3000


class EngineStartError(RuntimeError):
    """The server did not come up (exited, printed no address, or never answered healthy) within the timeout."""


class EngineLauncher:
    """One engine server process at a time. Not thread-safe; `start`/`stop`/`restart` block (run them off an
    event loop). `log_dir` receives one log file per start (stdout and stderr)."""

    def __init__(
        self,
        *,
        spec: EngineSpec,
        log_dir: str | os.PathLike,
        host: str = LOOPBACK_HOST,
        startup_timeout_s: float = 180.0,
        stop_timeout_s: float = 15.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        problems = [
            f"{name}={value} must be positive"
            for name, value in (("startup_timeout_s", startup_timeout_s), ("stop_timeout_s", stop_timeout_s))
            if not value > 0
        ]
        raise_if(problems, what="invalid EngineLauncher")
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
                command.argv,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**self._env, **command.env},
                start_new_session=True,
            )
        try:
            self._url = command.url if command.url is not None else self._read_url(deadline)
            self._wait_healthy(deadline, command.ready_path)
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

    def _wait_healthy(self, deadline: float, ready_path: str) -> None:
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
                with opener.open(self._url + ready_path, timeout=max(0.5, min(remaining, 30.0))) as response:
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
