"""Where launch/install_sglang.sh puts the real SGLang server's venv: beside the project's .venv. The main job's
default `engines.sglang_python`, the sglang test tier and benchmarks/bench_sglang.py all start servers with it."""

from __future__ import annotations

from pathlib import Path

__all__ = ["SGLANG_VENV_PYTHON"]

SGLANG_VENV_PYTHON = Path(__file__).resolve().parent.parent / ".venv-sglang" / "bin" / "python"
