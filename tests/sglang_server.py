"""Real SGLang 0.5.23 CPU servers for tests, started from the venv launch/install_sglang.sh makes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

from launch.sglang_venv import SGLANG_VENV_PYTHON as SGLANG_PYTHON
from miles_sync.engine.process import EngineLauncher
from miles_sync.engine.sglang import SGLangEngineSpec

__all__ = ["SGLANG_PYTHON", "STARTUP_TIMEOUT_S", "enter_together", "sglang_server"]
STARTUP_TIMEOUT_S = 240.0  # 18-46 s measured; more while other servers keep the cores busy


@contextlib.contextmanager
def sglang_server(
    *,
    model: Path,
    python: Path,
    log_dir: Path,
    tp_size: int = 1,
    device: str = "cpu",
    custom_weight_loaders: tuple[str, ...] = (),
    api_key: str | None = None,
    admin_api_key: str | None = None,
) -> Iterator[EngineLauncher]:
    """A real SGLang server (on the CPU unless `device` says "cuda") serving `model` on loopback; yields once
    /health_generate answers; always stopped. `custom_weight_loaders`: its `--custom-weight-loader` paths;
    `api_key` / `admin_api_key`: its `--api-key` / `--admin-api-key`."""
    spec = SGLangEngineSpec(
        model_path=str(model),
        tp_size=tp_size,
        device=device,
        python=str(python),
        custom_weight_loaders=custom_weight_loaders,
        api_key=api_key,
        admin_api_key=admin_api_key,
    )
    launcher = EngineLauncher(spec=spec, log_dir=log_dir, startup_timeout_s=STARTUP_TIMEOUT_S)
    try:
        launcher.start()
        yield launcher
    finally:
        launcher.stop()


def enter_together(stack: ExitStack, *servers: AbstractContextManager[Any]) -> list[Any]:
    """Enter every server's context at once, each on a thread of its own (a start mostly waits on its own processes:
    two one after another cost the sum of both), each registered with `stack` so it stops with it. If any fails to
    start, the first failure is raised once all have answered, and the ones that started stop with the stack."""
    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        futures = [pool.submit(server.__enter__) for server in servers]
        wait(futures)
    for server, future in zip(servers, futures):
        if future.exception() is None:
            stack.push(server.__exit__)
    failure = next((f.exception() for f in futures if f.exception() is not None), None)
    if failure is not None:
        raise failure
    return [future.result() for future in futures]
