"""SyncReport: exact round trip through JSON, derived figures, validation of decoded reports, the progress bar."""

from __future__ import annotations

import io
import json

import pytest

from miles_sync.sync.report import (
    BucketProgress,
    EngineResult,
    InIndexOrder,
    PhaseTimes,
    ProgressBar,
    SyncReport,
    decode_report,
    encode_report,
)
from miles_sync.wire.protocol import Selector


def report(**changes) -> SyncReport:
    values = dict(
        version="7",
        previous_version="6",
        committed=True,
        selector=Selector.TARGET,
        transport="distributed",
        num_bytes=3_000_000_000,
        num_buckets=12,
        num_tensors=321,
        phases=PhaseTimes(pause_s=0.25, export_s=0.5, send_s=1.5, finalize_s=0.125, verify_s=0.0625, resume_s=0.03125),
        total_s=2.5,
        engines=(
            EngineResult(
                url="http://127.0.0.1:1",
                success=True,
                is_stale=False,
                num_verified_tensors=321,
                weight_version="7",
                call_s={"pause": 0.002, "begin": 0.0035},
            ),
            EngineResult(url="http://127.0.0.1:2", success=False, is_stale=True, message="end: runner loaded nothing"),
        ),
        error=None,
    )
    values.update(changes)
    return SyncReport(**values)


@pytest.mark.parametrize(
    "original",
    [
        report(),
        report(committed=False, selector=None, error="pause failed", num_bytes=0, phases=PhaseTimes()),
        report(selector=Selector.ALL, engines=()),
    ],
)
def test_round_trip_is_exact(original):
    encoded = encode_report(original)
    assert decode_report(encoded) == original
    text = json.dumps(encoded)
    assert decode_report(text) == original
    assert json.loads(text)["selector"] == (None if original.selector is None else original.selector.value)


def test_derived_figures():
    r = report()
    assert r.gb_per_s == pytest.approx(2.0)
    assert encode_report(r)["gb_per_s"] == pytest.approx(2.0)
    assert r.stale_engines == ("http://127.0.0.1:2",)
    assert report(phases=PhaseTimes(send_s=0.0)).gb_per_s == 0.0


def test_summary_names_outcome_version_and_phases():
    line = report().summary()
    assert line.startswith("sync v7 committed (verification: off): ")
    for word in (
        "12 buckets",
        "321 tensors",
        "selector target",
        "distributed",
        "2.00 GB/s",
        "pause 0.250s",
        "send 1.500s",
        "verify 0.062s",
        "total 2.500s",
    ):
        assert word in line, (word, line)
    failed = report(committed=False, error="verification failed on http://x").summary()
    assert "FAILED (verification failed on http://x)" in failed


def test_decode_names_the_bad_field():
    encoded = encode_report(report())
    encoded["engines"][1]["is_stale"] = "yes"
    with pytest.raises(ValueError, match=r"engines\[1\]\.is_stale"):
        decode_report(encoded)
    encoded = encode_report(report())
    encoded["selector"] = "both"
    with pytest.raises(ValueError, match=r"selector.*'target', 'draft', 'all'"):
        decode_report(encoded)
    encoded = encode_report(report())
    encoded["bytes_per_engine"] = 1
    with pytest.raises(ValueError, match="unknown key.*bytes_per_engine"):
        decode_report(encoded)


def test_progress_bar_counts_buckets():
    out = io.StringIO()
    bar = ProgressBar(description="sync v3", file=out)
    for i in range(3):
        bar.update(BucketProgress(index=i, num_bytes=2**20, num_tensors=4, total_bytes=(i + 1) * 2**20, elapsed_s=0.5))
    assert bar.num_updates == 3
    bar.close()
    shown = out.getvalue()
    assert "sync v3" in shown and "3bucket" in shown and "3.0 MiB" in shown


def test_disabled_progress_bar_writes_nothing():
    out = io.StringIO()
    bar = ProgressBar(description="sync v3", is_enabled=False, file=out)
    bar.update(BucketProgress(index=0, num_bytes=1, num_tensors=1, total_bytes=1, elapsed_s=0.0))
    bar.close()
    assert out.getvalue() == "" and bar.num_updates == 1


def test_bucket_events_pass_on_once_each_in_index_order():
    def event(i: int) -> BucketProgress:
        return BucketProgress(index=i, num_bytes=1, num_tensors=1, total_bytes=i + 1, elapsed_s=0.0)

    passed: list[int] = []
    receive = InIndexOrder(lambda e: passed.append(e.index))
    for i in (0, 1, 3, 2):  # a push overtook its predecessor
        receive(event(i))
    assert passed == [0, 1, 2, 3]
    for i in (5, 2):  # 5 waits for 4; 2 is a repeat
        receive(event(i))
    assert passed == [0, 1, 2, 3] and receive.next_index == 4
    for i in range(6):  # the rank's result repeats every event at the end
        receive(event(i))
    assert passed == [0, 1, 2, 3, 4, 5]
