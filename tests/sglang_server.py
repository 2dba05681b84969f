"""Real SGLang 0.5.23 CPU servers for tests, started from the venv launch/install_sglang.sh makes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from launch.sglang_venv import SGLANG_VENV_PYTHON as SGLANG_PYTHON
from miles_sync.engine.process import EngineLauncher
from miles_sync.engine.sglang import SGLangEngineSpec

__all__ = ["SGLANG_PYTHON", "STARTUP_TIMEOUT_S", "sglang_server"]
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
) -> Iterator[EngineLauncher]:
    """A real SGLang server (on the CPU unless `device` says "cuda") serving `model` on loopback; yields once
    /health_generate answers; always stopped. `custom_weight_loaders`: its `--custom-weight-loader` paths."""
    spec = SGLangEngineSpec(
        model_path=str(model),
        tp_size=tp_size,
        device=device,
        python=str(python),
        custom_weight_loaders=custom_weight_loaders,
    )
    launcher = EngineLauncher(spec=spec, log_dir=log_dir, startup_timeout_s=STARTUP_TIMEOUT_S)
    try:
        launcher.start()
        yield launcher
    finally:
        launcher.stop()
