"""The vendored SGLang `/weights_checker` field lists: still SGLang's, and exactly what our wire records carry.

The copy (tests/data/sglang_checker_fields.json) is re-derived from the SGLang wheel it names when that wheel can
be had: one already downloaded under the temp directory, else `pip download` with a short timeout (the only test
here that reaches out; it skips, naming why, when the index cannot be reached). The other tests use the copy.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from sglang_fields import CheckerFields, derive_checker_fields, vendored_checker_fields

from miles_sync.wire.protocol import (
    ParallelismInfo,
    RankChecksums,
    WeightsCheckerResult,
    decode,
    encode,
)

DOWNLOAD_TIMEOUT_S = 90
# How SGLang's tokenizer manager turns a CheckWeightsReqOutput into the HTTP body: its per-rank `payload` lists
# become `ranks`, and it adds the hash over every rank's per_gpu_checksum.
HANDLER_RENAMES = {"payload": "ranks"}
HANDLER_ADDS = ("per_engine_checksum",)


@pytest.fixture(scope="module")
def vendored() -> CheckerFields:
    return vendored_checker_fields()


def _fetch_wheel(version: str, into: Path) -> Path:
    """A wheel of sglang==`version`: one already under the temp directory, else downloaded; skips if neither."""
    pattern = f"sglang-{version}-*.whl"
    temp = Path(tempfile.gettempdir())
    found = sorted(temp.glob(pattern)) + sorted(temp.glob(f"*/{pattern}"))
    if found:
        return found[0]
    # The wheel's source is the same on every platform; pinning the tags lets any interpreter fetch the same file.
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"sglang=={version}",
        "--no-deps",
        "--only-binary=:all:",
        "--platform=manylinux_2_34_x86_64",
        "--python-version=3.11",
        "--implementation=cp",
        "--timeout=10",
        "--retries=0",
        "--disable-pip-version-check",
        "--quiet",
        f"--dest={into}",
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip download sglang=={version} took over {DOWNLOAD_TIMEOUT_S} s; the vendored copy stands")
    wheels = sorted(into.glob(pattern))
    if done.returncode != 0 or not wheels:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"cannot fetch sglang=={version} (pip exit {done.returncode}: {reason}); the vendored copy stands")
    return wheels[0]


def test_the_vendored_copy_is_what_the_sglang_wheel_declares(vendored, tmp_path):
    wheel = _fetch_wheel(vendored.sglang_version, tmp_path)
    assert derive_checker_fields(wheel) == vendored, f"re-derive tests/data from {wheel}"


def test_the_handler_body_is_the_scheduler_output_with_ranks_and_the_engine_hash(vendored):
    from_output = tuple(HANDLER_RENAMES.get(name, name) for name in vendored.check_weights_req_output)
    assert from_output + HANDLER_ADDS == vendored.body_keys


def _names(record: type, *, with_default: bool | None = None) -> set[str]:
    return {
        f.name
        for f in dataclasses.fields(record)
        if with_default is None
        or with_default == (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
    }


def test_our_checker_records_have_exactly_sglangs_fields(vendored):
    assert _names(WeightsCheckerResult) == set(vendored.body_keys)
    # SGLang omits a key when its value is None; we can read such an answer only where the field has a default.
    assert _names(WeightsCheckerResult, with_default=True) == set(vendored.body_optional)
    assert _names(RankChecksums) == set(vendored.checksum_info)
    assert _names(ParallelismInfo) == set(vendored.parallelism_info)


def test_an_answer_with_sglangs_keys_round_trips_strictly(vendored):
    info = ParallelismInfo(
        role="target", tp_rank=1, tp_size=2, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, rank=1, size=2
    )
    rank = RankChecksums(checksums={"lm_head.weight": "00" * 8}, per_gpu_checksum="ab" * 32, parallelism_info=(info,))
    result = WeightsCheckerResult(success=True, message="ok", ranks=(rank,), per_engine_checksum="cd" * 32)
    body = encode(result)
    assert list(body) == list(vendored.body_keys)
    assert list(body["ranks"][0]) == list(vendored.checksum_info)
    assert list(body["ranks"][0]["parallelism_info"][0]) == list(vendored.parallelism_info)
    assert decode(WeightsCheckerResult, body) == result
    # An answer to a non-checksum action: SGLang sends only the keys it always sends.
    short = {key: body[key] for key in vendored.body_always}
    assert decode(WeightsCheckerResult, short) == WeightsCheckerResult(success=True, message="ok")
