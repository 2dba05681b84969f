"""Real SGLang 0.5.23 CPU servers for tests, started from the venv launch/install_sglang.sh makes: one at a time
(`sglang_server`), several together (`enter_together`), or kept by the tier's `ServerPool` for the next module
that serves the same model the same way."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch.sglang_venv import SGLANG_VENV_PYTHON as SGLANG_PYTHON
from miles_sync.engine.process import EngineLauncher
from miles_sync.engine.sglang import SGLangEngineSpec

__all__ = [
    "SGLANG_PYTHON",
    "STARTING_VERSION",
    "STARTUP_TIMEOUT_S",
    "ServerKind",
    "ServerPool",
    "enter_together",
    "server_launcher",
    "sglang_server",
]
STARTUP_TIMEOUT_S = 240.0  # 18-46 s measured; more while other servers keep the cores busy
STARTING_VERSION = "default"  # the weight version a freshly launched SGLang server reports
RESET_TIMEOUT_S = 120.0


@contextlib.contextmanager
def sglang_server(**options: Any) -> Iterator[EngineLauncher]:
    """A real SGLang server started from `server_launcher(**options)`; yields once /health_generate answers;
    always stopped."""
    launcher = server_launcher(**options)
    try:
        launcher.start()
        yield launcher
    finally:
        launcher.stop()


def server_launcher(
    *,
    model: Path,
    python: Path,
    log_dir: Path,
    tp_size: int = 1,
    device: str = "cpu",
    custom_weight_loaders: tuple[str, ...] = (),
    api_key: str | None = None,
    admin_api_key: str | None = None,
) -> EngineLauncher:
    """The launcher (not started) of a real SGLang server, on the CPU unless `device` says "cuda", serving `model`
    on loopback. `custom_weight_loaders`: its `--custom-weight-loader` paths; `api_key` / `admin_api_key`: its
    `--api-key` / `--admin-api-key`."""
    spec = SGLangEngineSpec(
        model_path=str(model),
        tp_size=tp_size,
        device=device,
        python=str(python),
        custom_weight_loaders=custom_weight_loaders,
        api_key=api_key,
        admin_api_key=admin_api_key,
    )
    return EngineLauncher(spec=spec, log_dir=log_dir, startup_timeout_s=STARTUP_TIMEOUT_S)


def enter_together(stack: ExitStack, *servers: AbstractContextManager[Any]) -> list[Any]:
    """Enter every server's context at once, each on a thread of its own (a start mostly waits on its own processes:
    two one after another cost the sum of both), each registered with `stack` so it stops with it. If any fails to
    start, the first failure is raised once all have answered, and the ones that started stop with the stack."""
    futures = _run_together([server.__enter__ for server in servers])
    for server, future in zip(servers, futures):
        if future.exception() is None:
            stack.push(server.__exit__)
    _raise_first_failure(futures)
    return [future.result() for future in futures]


def _run_together(calls: Sequence[Callable[[], Any]]) -> list[Future]:
    """Run every call on a thread of its own and wait until all have answered: their futures, in order."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        wait(futures)
    return futures


def _raise_first_failure(futures: Sequence[Future]) -> None:
    failure = next((f.exception() for f in futures if f.exception() is not None), None)
    if failure is not None:
        raise failure


@dataclass(frozen=True)
class ServerKind:
    """What makes two servers interchangeable between test modules: the model they serve, their TP size and
    their `--custom-weight-loader` paths."""

    model: Path
    tp_size: int = 1
    custom_weight_loaders: tuple[str, ...] = ()


class ServerPool:
    """Real servers kept from one test module to the next of the same kind: a start costs 18-46 s, a reset about
    one. `get(kind, count)` returns `count` running servers of `kind`: the live ones it kept, each reset to what a
    fresh server holds (resumed, the model's own weights reloaded from disk, weight version STARTING_VERSION,
    prefix cache flushed), plus new ones started together. Servers a test killed are found dead and replaced;
    servers of another kind are stopped first, so the tier never runs more servers than one module needs (an
    idle CPU server keeps a core busy). `release()` stops every server (tests/sglang/conftest.py calls it before a
    module that starts its own).

    Decided: only modules without fault drills share pooled servers. TP=1 servers reused after a module's drills
    (a server killed mid-broadcast, a rendezvous that never completed, conformance's failed group inits), even
    reset, were seen to stop answering HTTP for good in the next module (/get_server_info, then a route probe,
    each past its 30 s timeout, at 2d21038); fresh servers never did. The cause was not found.
    """

    def __init__(self, *, python: Path, log_dir: Path) -> None:
        self._python = python
        self._log_dir = log_dir
        self._kind: ServerKind | None = None
        self._launchers: list[EngineLauncher] = []

    @property
    def python(self) -> Path:
        """The SGLang venv's interpreter the pool starts its servers with."""
        return self._python

    def get(self, kind: ServerKind, count: int) -> list[EngineLauncher]:
        if kind != self._kind:
            self.release()
            self._kind = kind
        live = [launcher for launcher in self._launchers if launcher.is_running]
        for launcher in [*live[count:], *(launcher for launcher in self._launchers if not launcher.is_running)]:
            launcher.stop()  # reaps what a killed server left
        self._launchers = live[:count]
        for launcher in self._launchers:
            _reset(launcher.url, model=kind.model)
        new = [
            server_launcher(
                model=kind.model,
                python=self._python,
                log_dir=self._log_dir,
                tp_size=kind.tp_size,
                custom_weight_loaders=kind.custom_weight_loaders,
            )
            for _ in range(count - len(self._launchers))
        ]
        if new:
            # Started together (a start mostly waits on its own processes); any that started joins the pool, so a
            # failed start stops with the pool.
            futures = _run_together([launcher.start for launcher in new])
            self._launchers += [launcher for launcher, future in zip(new, futures) if future.exception() is None]
            _raise_first_failure(futures)
        return list(self._launchers)

    def release(self) -> None:
        for launcher in self._launchers:
            launcher.stop()
        self._launchers, self._kind = [], None


def _reset(url: str, *, model: Path) -> None:
    """What a fresh server of `model` holds: generation resumed, the checkpoint's weights (reloaded from disk),
    version STARTING_VERSION, the prefix cache flushed (the reload flushes it)."""
    for path, body in (
        ("/continue_generation", {}),
        ("/update_weights_from_disk", {"model_path": str(model), "weight_version": STARTING_VERSION}),
    ):
        request = urllib.request.Request(
            url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=RESET_TIMEOUT_S) as answer:
            assert answer.status == 200, (url, path, answer.read()[:500])
