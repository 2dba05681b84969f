"""The vendored SGLang `/weights_checker` field lists: still SGLang's, and exactly what our wire records carry.

The copy (tests/data/sglang_checker_fields.json) is re-derived from the source of the SGLang version it names (the
`sglang_source` fixture: the package the test command installs into .venv-sglang, read, never imported). The other
tests use the copy.
"""

from __future__ import annotations

import dataclasses

import pytest
from sglang_fields import CheckerFields, derive_checker_fields, vendored_checker_fields

from miles_sync.wire.protocol import (
    ParallelismInfo,
    RankChecksums,
    WeightsCheckerResult,
    decode,
    encode,
)

# How SGLang's tokenizer manager turns a CheckWeightsReqOutput into the HTTP body: its per-rank `payload` lists
# become `ranks`, and it adds the hash over every rank's per_gpu_checksum.
HANDLER_RENAMES = {"payload": "ranks"}
HANDLER_ADDS = ("per_engine_checksum",)


@pytest.fixture(scope="module")
def vendored() -> CheckerFields:
    return vendored_checker_fields()


def test_the_vendored_copy_is_what_sglangs_source_declares(vendored, sglang_source):
    source = sglang_source(vendored.sglang_version)
    assert derive_checker_fields(source) == vendored, f"re-derive tests/data from {source}"


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
