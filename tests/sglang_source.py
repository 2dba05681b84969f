"""SGLang's released source as text, read (never imported) from the package launch/install_sglang.sh installs into
.venv-sglang. The test command always makes that venv, so the tests that re-derive a vendored copy from SGLang's
source cannot skip: a missing venv or another SGLang version fails them, naming the step that fixes it.

    read = source_reader(installed_sglang("0.5.23"))
    read("sglang/srt/server_args.py")  # the file's text
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from launch.sglang_venv import SGLANG_VENV_PYTHON

__all__ = ["installed_sglang", "source_reader"]

INSTALL_STEP = "bash launch/install_sglang.sh"


def installed_sglang(version: str) -> Path:
    """The site-packages directory of .venv-sglang holding `sglang/` at `version`; fails the calling test, naming
    the install step, when the venv is missing or holds another version."""
    venv = SGLANG_VENV_PYTHON.parent.parent
    installed = sorted(venv.glob("lib/python*/site-packages/sglang-*.dist-info"))
    if not installed:
        pytest.fail(f"no sglang in {venv}: run `{INSTALL_STEP}`")
    names = [path.name.removesuffix(".dist-info").removeprefix("sglang-") for path in installed]
    if version not in names:
        pytest.fail(f"{venv} holds sglang {', '.join(names)}, not {version}: run `{INSTALL_STEP}`")
    return installed[names.index(version)].parent


def source_reader(source: Path) -> Callable[[str], str]:
    """Text of a file of SGLang's source by its path in the package (`sglang/...`): from a wheel, or from a
    directory holding `sglang/` (or that directory itself)."""
    if source.is_file():
        wheel = zipfile.ZipFile(source)
        return lambda path: wheel.read(path).decode()
    root = source if (source / "sglang").is_dir() else source.parent
    return lambda path: (root / path).read_text()
