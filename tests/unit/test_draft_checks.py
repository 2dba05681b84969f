"""The draft guard's and the acceptance canary's pure parts: which digests the guard keeps and how it names a change,
per TP rank; how the canary judges a reading, averages its prompts and moves its baseline."""

from __future__ import annotations

import dataclasses

import pytest
from test_rl_task import stats

from miles_sync.job.run_report import format_row, unsynced_round_record
from miles_sync.sync.draft_canary import (
    CanaryMode,
    CanaryReading,
    CanarySettings,
    canary_requests,
    judge_reading,
    mean_reading,
    next_baselines,
)
from miles_sync.sync.draft_guard import draft_changes, draft_digests, guards_draft
from miles_sync.wire.protocol import ParallelismInfo, RankChecksums, Selector

pytestmark = pytest.mark.unit


def rank(tp_rank: int, checksums: dict[str, str]) -> RankChecksums:
    info = ParallelismInfo(
        role="target", tp_rank=tp_rank, tp_size=2, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, rank=0, size=2
    )
    return RankChecksums(checksums=checksums, per_gpu_checksum="x", parallelism_info=(info,))


def test_only_a_session_that_leaves_the_draft_out_is_guarded():
    assert guards_draft(Selector.TARGET)
    assert not guards_draft(Selector.ALL) and not guards_draft(Selector.DRAFT)


def test_draft_digests_keep_the_draft_roles_in_tp_rank_order():
    answer = [
        rank(1, {"model.norm.weight": "t1", "draft.model.layers.2.eh_proj.weight": "d1"}),
        rank(0, {"model.norm.weight": "t0", "draft_step_0.model.layers.2.eh_proj.weight": "d0"}),
    ]
    assert draft_digests(answer) == (
        {"draft_step_0.model.layers.2.eh_proj.weight": "d0"},
        {"draft.model.layers.2.eh_proj.weight": "d1"},
    )
    assert draft_digests([rank(0, {"model.norm.weight": "t0"})]) is None  # no draft runner: nothing to guard


def test_a_change_names_rank_role_parameter_and_selector():
    baseline = ({"draft.a": "1", "draft.b": "2"}, {"draft.a": "3", "draft.b": "4"})
    assert draft_changes(baseline=baseline, current=baseline, selector=Selector.TARGET) == []
    current = ({"draft.a": "1", "draft.b": "2"}, {"draft.a": "3", "draft.b": "5"})
    assert draft_changes(baseline=baseline, current=current, selector=Selector.TARGET) == [
        "rank 1 draft b changed although the session selected target"
    ]
    one_rank = ({"draft.a": "1"},)
    assert draft_changes(baseline=one_rank, current=({"draft.c": "1"},), selector=Selector.TARGET) == [
        "draft a vanished although the session selected target",
        "draft c appeared although the session selected target",
    ]
    (message,) = draft_changes(baseline=baseline, current=None, selector=Selector.TARGET)
    assert "answered 0 TP rank(s), 2 before the session" in message


@pytest.mark.parametrize(
    ("accept_length", "baseline", "flagged"),
    [(1.0, 3.0, True), (1.5, 3.0, False), (1.49, 3.0, True), (3.5, 3.0, False), (None, 3.0, False), (1.0, None, False)],
)
def test_a_reading_is_flagged_only_below_the_ratio_of_a_known_baseline(accept_length, baseline, flagged):
    reading = judge_reading("http://e", accept_length=accept_length, baseline=baseline, min_ratio=0.5)
    assert reading.flagged is flagged and bool(reading.message) is flagged
    if flagged:
        assert "http://e" in reading.message and f"{accept_length:.3f}" in reading.message
        assert f"baseline {baseline:.3f}" in reading.message


def test_the_baseline_follows_passing_readings_and_keeps_through_a_flagged_one():
    baselines = {"a": 3.0, "b": 3.0}
    readings = [
        CanaryReading(url="a", accept_length=2.4, baseline=3.0),  # drift: passes, becomes the baseline
        CanaryReading(url="b", accept_length=1.0, baseline=3.0, flagged=True, message="low"),  # collapse: kept out
        CanaryReading(url="c", accept_length=None, baseline=None),  # no draft: never judged
    ]
    assert next_baselines(baselines, readings) == {"a": 2.4, "b": 3.0}


def test_the_reading_averages_the_prompts_and_needs_every_answer():
    assert mean_reading([2.0, 3.0, 4.0]) == 3.0
    assert mean_reading([2.0, None]) is None and mean_reading([]) is None


def test_canary_requests_are_greedy_one_per_prompt():
    settings = CanarySettings(mode=CanaryMode.WARN, prompts=((5, 6), (7,)), max_new_tokens=16)
    requests = canary_requests(settings)
    assert [r.input_ids for r in requests] == [(5, 6), (7,)]
    assert all(r.sampling_params.temperature == 0 and r.sampling_params.max_new_tokens == 16 for r in requests)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"mode": CanaryMode.HOLD, "prompts": ()}, "mode=hold needs prompts"),
        ({"mode": CanaryMode.WARN, "prompts": ((),)}, "each with at least one token id"),
        ({"min_ratio": 0.0}, r"min_ratio=0.0 is not in \(0, 1\]"),
        ({"max_new_tokens": 0}, "max_new_tokens=0 must be positive"),
    ],
)
def test_bad_canary_settings_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        CanarySettings(**changes)


def test_the_verified_column_shows_a_low_canary():
    row = unsynced_round_record(1, version="1", loss=0.1, trainer_step=1, rollouts=stats(0.25, 0.5))
    row = dataclasses.replace(
        row, synced=True, committed=True, verified=True, verification="exact", draft_guard="draft unchanged"
    )
    assert " yes (exact, draft unchanged) " in format_row(row)
    flagged = dataclasses.replace(row, canary_flagged=("http://e",))
    assert " yes (exact, draft unchanged); canary LOW " in format_row(flagged)
    unchecked = dataclasses.replace(flagged, verified=False, verification="off", draft_guard="")
    assert " no (verify off); canary LOW " in format_row(unchecked)
