"""Real SGLang 0.5.23 CPU servers for tests, started from the venv launch/install_sglang.sh makes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from miles_sync.engine.process import EngineLauncher
from miles_sync.engine.sglang import SGLangEngineSpec

SGLANG_PYTHON = Path(__file__).resolve().parents[1] / ".venv-sglang" / "bin" / "python"
STARTUP_TIMEOUT_S = 240.0  # 18-46 s measured; more while other servers keep the cores busy


@contextlib.contextmanager
def sglang_server(*, model: Path, python: Path, log_dir: Path, tp_size: int = 1) -> Iterator[EngineLauncher]:
    """A real SGLang CPU server serving `model` on loopback; yields once /health_generate answers; always stopped."""
    spec = SGLangEngineSpec(model_path=str(model), tp_size=tp_size, device="cpu", python=str(python))
    launcher = EngineLauncher(spec=spec, log_dir=log_dir, startup_timeout_s=STARTUP_TIMEOUT_S)
    try:
        launcher.start()
        yield launcher
    finally:
        launcher.stop()
