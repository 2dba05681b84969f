"""The layering contracts in pyproject.toml hold on the tree, and `lint-imports` refuses an import that breaks them.

Each check runs the real `lint-imports` on a copy of the packages, so a contract that could never fail (a typo in a
layer name, a missing root package) fails here instead of passing silently.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("miles_sync", "actors", "launch")
LINT_TIMEOUT_S = 300


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    # The copy goes first on the path, ahead of the editable install's finder, so the copy is what gets analysed.
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"]
    return subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=LINT_TIMEOUT_S)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _add_import(tree: Path, module: str, statement: str) -> None:
    path = tree / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{statement}  # deliberate violation\n")


def test_the_tree_keeps_every_contract(tree: Path):
    result = _lint_imports(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in result.stdout


@pytest.mark.parametrize(
    ("module", "statement", "broken"),
    [
        # the wire contract importing the driver: an upward import across every layer
        ("miles_sync.wire.codec", "import launch.job", "miles_sync.wire is not allowed to import launch"),
        # the session reaching up into the config it must not know about
        (
            "miles_sync.sync.session",
            "import miles_sync.config",
            "miles_sync.sync is not allowed to import miles_sync.config",
        ),
        # siblings of one layer stay independent: the engine layer may not use the export layer
        (
            "miles_sync.engine.client",
            "import miles_sync.export.units",
            "miles_sync.engine is not allowed to import miles_sync.export",
        ),
        # Ray stays in the shells
        ("miles_sync.sync.controller", "import ray", "miles_sync is not allowed to import ray"),
        # the p2p loader runs in SGLang's venv: nothing heavy, not even through a light module it imports
        (
            "miles_sync.transport.group",
            "import miles_sync.weights.checksum",
            "miles_sync.transport.p2p_loader is not allowed to import miles_sync.weights",
        ),
    ],
)
def test_a_deliberate_violation_fails(tree: Path, module: str, statement: str, broken: str):
    _add_import(tree, module, statement)
    result = _lint_imports(tree)
    assert result.returncode != 0
    assert broken in result.stdout, result.stdout
