"""Real SGLang 0.5.23 servers on CPU for the sglang tier, from the venv launch/install_sglang.sh makes (the test
command installs it; a missing venv fails the tier, naming the step, never skips it).

An idle CPU server keeps one core busy, so each module starts the few servers it needs once and stops them when
it ends (module scope), and no two modules' servers overlap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_sync.engine.process import EngineLauncher
from miles_sync.engine.sglang import SGLangEngineSpec

SGLANG_PYTHON = Path(__file__).resolve().parents[2] / ".venv-sglang" / "bin" / "python"
STARTUP_TIMEOUT_S = 240.0  # 18-46 s measured; more while other servers keep the cores busy


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    if not SGLANG_PYTHON.is_file():
        pytest.fail(f"no SGLang server venv at {SGLANG_PYTHON.parent.parent}: run `bash launch/install_sglang.sh`")
    return SGLANG_PYTHON


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
