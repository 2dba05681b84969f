"""Real SGLang 0.5.23 servers on CPU for the sglang tier, from the venv launch/install_sglang.sh makes (the test
command installs it; a missing venv fails the tier, naming the step, never skips it).

An idle CPU server keeps one core busy, so each module starts the few servers it needs once and stops them when
it ends (module scope), and no two modules' servers overlap.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang_server import SGLANG_PYTHON


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    if not SGLANG_PYTHON.is_file():
        pytest.fail(f"no SGLang server venv at {SGLANG_PYTHON.parent.parent}: run `bash launch/install_sglang.sh`")
    return SGLANG_PYTHON
