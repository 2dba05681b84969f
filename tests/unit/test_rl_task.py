"""The main job's RL task, pure: the reward, GRPO advantages, per-request sampling seeds, the batch, and the
per-round report rows (reward, log-prob agreement) with report.json and report.png."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from miles_sync.engine.reference.checkpoints import next_token
from miles_sync.engine.rollout import Sample
from miles_sync.job.rl import LANGUAGE, group_advantages, grpo_batch, make_prompts, reward, rule_share, sampling_seed
from miles_sync.job.run_report import (
    BaselineRecord,
    RolloutStats,
    RunReport,
    format_row,
    read_reward_curve,
    unsynced_round_record,
    write_png,
)


def sample(prompt, output, *, engine="http://e0") -> Sample:
    return Sample(engine_url=engine, prompt_ids=tuple(prompt), output_ids=tuple(output), weight_version="0")


def rule_continuation(token: int, length: int) -> list[int]:
    out = []
    for _ in range(length):
        token = int(next_token(token, LANGUAGE))
        out.append(token)
    return out


def test_the_pretraining_rule_scores_a_quarter_and_breaking_it_scores_more():
    # 5x + 17 = x + 1 (mod 4): following the rule visits each residue mod 4 in turn.
    for start in (0, 3, 101, 255):
        assert reward(sample([start], rule_continuation(start, 24))) == pytest.approx(0.25)
        assert rule_share(sample([start], rule_continuation(start, 24))) == 1.0
    assert reward(sample([1], [0, 4, 8, 12])) == 1.0
    assert rule_share(sample([1], [0, 4, 8, 12])) == 0.0
    assert reward(sample([1], [])) == 0.0


def test_group_advantages_are_relative_to_each_prompt_group():
    a, b = [1, 2], [7, 8]
    samples = [sample(a, [0, 0]), sample(a, [1, 1]), sample(b, [0, 1]), sample(b, [0, 1], engine="http://e1")]
    advantages = group_advantages(samples)
    # Group a: rewards 1 and 0, std (n-1) = sqrt(0.5); group b: equal rewards, no signal.
    assert advantages[0] == pytest.approx(0.5 / math.sqrt(0.5), rel=1e-5)
    assert advantages[1] == pytest.approx(-0.5 / math.sqrt(0.5), rel=1e-5)
    assert advantages[2:] == (0.0, 0.0)
    batch = grpo_batch(samples)
    assert batch.advantages == advantages and batch.baseline is None
    assert batch.rewards == (1.0, 0.0, 0.5, 0.5)
    assert batch.sequences[0] == (1, 2, 0, 0) and batch.num_prompt_tokens == (2, 2, 2, 2)


def test_sampling_seeds_differ_per_request_and_repeat_per_run():
    keys = [(r, e, p, k) for r in range(3) for e in range(2) for p in range(4) for k in range(4)]
    seeds = [sampling_seed(0, round_index=r, engine_index=e, prompt_index=p, sample_index=k) for r, e, p, k in keys]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**31 for s in seeds)
    assert seeds == [
        sampling_seed(0, round_index=r, engine_index=e, prompt_index=p, sample_index=k) for r, e, p, k in keys
    ]
    assert sampling_seed(1, round_index=0, engine_index=0, prompt_index=0, sample_index=0) != seeds[0]


def test_prompts_are_distinct_within_a_round():
    for index in range(10):
        prompts = make_prompts(index, num_prompts=4)
        assert len({tuple(p) for p in prompts}) == 4


def stats(reward_value: float, diff: float | None) -> RolloutStats:
    return RolloutStats(
        reward=reward_value,
        reward_per_engine=(reward_value, reward_value),
        rule_share=0.9,
        accept_length=3.5,
        logprob_diff_max=diff,
        logprob_diff_mean=None if diff is None else diff / 10,
        trainer_step=1,
        samples_tagged=True,
        num_samples=32,
    )


def test_report_rows_carry_reward_and_logprob_agreement(tmp_path):
    baseline = BaselineRecord(version="0", accept_length=3.6, reward=0.25, logprob_diff_max=2e-6)
    rows = [
        unsynced_round_record(i, version="0", loss=0.1, trainer_step=i, rollouts=stats(0.25, 0.5 * i)) for i in (1, 2)
    ]
    assert not rows[0].synced and not rows[0].committed and rows[0].selector is None
    assert "not synced" in format_row(rows[0]) and "2.0e-06" in format_row(baseline)
    report = RunReport(
        run_name="r", status="completed", config={}, packages={}, machine={}, baseline=baseline, rounds=tuple(rows)
    )
    report.write_json(tmp_path / "report.json")
    data = json.loads((tmp_path / "report.json").read_text())
    for key in ("reward", "reward_per_engine", "logprob_diff_max", "logprob_diff_mean", "accept_length", "selector"):
        assert key in data["rounds"][0], key
    assert read_reward_curve(tmp_path / "report.json") == [(0, 0.25), (1, 0.25), (2, 0.25)]
    write_png(tmp_path / "report.png", baseline=baseline, rounds=rows, title="t", control=[(0, 0.2), (1, 0.3)])
    assert (tmp_path / "report.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("committed", "verified", "verification", "cell"),
    [
        (True, True, "engine-exact", "yes (engine-exact)"),
        (True, False, "replica", "replicas agree"),
        (True, False, "unverified", "no (one replica)"),
        (True, False, "off", "no (verify off)"),
        (True, False, "engine-exact+replica", "no (engine-exact+replica)"),
        (False, False, "", "FAILED"),
    ],
)
def test_the_verified_column_says_why_a_committed_sync_is_not_verified(committed, verified, verification, cell):
    row = unsynced_round_record(1, version="0", loss=0.1, trainer_step=1, rollouts=stats(0.25, 0.5))
    row = dataclasses.replace(
        row,
        synced=True,
        committed=committed,
        verified=verified,
        verification=verification,
        sync_s=0.1,
        gbps=0.5,
        pause_s=0.01,
    )
    assert f" {cell} " in format_row(row)
