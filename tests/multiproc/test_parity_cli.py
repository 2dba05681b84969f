"""The parity CLI end to end, as a user runs it: separate interpreter, local gloo processes, last line verdict."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from miles_sync.export.raw import SUPPORTED_ARCHS


def _parity(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "miles_sync.parity", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@pytest.mark.slow
def test_parity_cli_qwen3_moe_tp2_ep2_with_mtp() -> None:
    # Four processes: tensor and expert parallelism together, plus an MTP layer (exported, imported, exported).
    done = _parity(
        "--arch",
        "qwen3_moe",
        "--mode",
        "raw",
        "--tp",
        "2",
        "--pp",
        "1",
        "--ep",
        "2",
        "--mtp-layers",
        "1",
        timeout_s=400,
    )
    last = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.fullmatch(r"max_abs_logit_diff=(\S+) tensors=(\d+) OK", last)
    assert match is not None, last
    assert float(match[1]) <= 1e-5
    assert int(match[2]) == 60  # 35 main-model tensors + 25 of the MTP layer (4 experts)


def test_parity_cli_rejects_an_unsupported_arch() -> None:
    done = _parity("--arch", "mixtral", "--tp", "1", timeout_s=120)
    assert done.returncode == 2
    assert "'mixtral'" in done.stderr and ", ".join(SUPPORTED_ARCHS) in done.stderr
