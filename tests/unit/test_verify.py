"""What a sync can prove from checksum answers: the exact check over HF names, replica agreement over engine names."""

from __future__ import annotations

import pytest

from miles_sync.sync.verify import EXACT, REPLICA, UNVERIFIED, checksum_problems, replica_verdicts, weights_digest
from miles_sync.wire.protocol import ParallelismInfo, RankChecksums, Selector

pytestmark = pytest.mark.unit


def rank(checksums: dict[str, str], *, tp_rank: int = 0, tp_size: int = 1) -> RankChecksums:
    info = ParallelismInfo(
        role="target",
        tp_rank=tp_rank,
        tp_size=tp_size,
        dp_rank=0,
        dp_size=1,
        pp_rank=0,
        pp_size=1,
        rank=tp_rank,
        size=tp_size,
    )
    return RankChecksums(checksums=checksums, per_gpu_checksum="x", parallelism_info=(info,))


# What SGLang answers: fused engine names, 64-bit digests, draft roles as prefixes.
GOOD = {
    "model.layers.0.self_attn.qkv_proj.weight": "00000000000000a1",
    "model.layers.0.mlp.gate_up_proj.weight": "00000000000000b2",
    "draft_step_0.model.layers.0.eh_proj.weight": "00000000000000c3",
}
CORRUPT = {**GOOD, "model.layers.0.mlp.gate_up_proj.weight": "ffffffffffffffff"}


def test_replicas_that_agree_pass_and_a_corrupted_one_is_named():
    answers = {"http://a": [rank(GOOD)], "http://b": [rank(GOOD)], "http://c": [rank(CORRUPT)]}
    verdicts = replica_verdicts(answers, selector=Selector.TARGET)
    assert verdicts["http://a"].passed and verdicts["http://a"].method == REPLICA
    assert verdicts["http://a"].num_verified == 2  # the frozen draft's entry is not compared under 'target'
    assert verdicts["http://b"].passed
    bad = verdicts["http://c"]
    assert not bad.passed and bad.method == REPLICA
    assert "2 of them agree" in bad.message and "model.layers.0.mlp.gate_up_proj.weight" in bad.message


def test_two_replicas_that_disagree_both_fail():
    verdicts = replica_verdicts({"http://a": [rank(GOOD)], "http://b": [rank(CORRUPT)]}, selector=Selector.ALL)
    assert [v.passed for v in verdicts.values()] == [False, False]
    assert all("no majority of them agrees" in v.message for v in verdicts.values())


def test_a_frozen_draft_that_differs_is_not_read_under_target():
    other_draft = {**GOOD, "draft_step_0.model.layers.0.eh_proj.weight": "0000000000000000"}
    answers = {"http://a": [rank(GOOD)], "http://b": [rank(other_draft)]}
    assert all(v.passed for v in replica_verdicts(answers, selector=Selector.TARGET).values())
    assert not any(v.passed for v in replica_verdicts(answers, selector=Selector.ALL).values())


def test_layouts_are_compared_only_within_their_group():
    # Engine c runs TP=2 (other names per rank): it has no replica, so nothing can be proven about it.
    half = {"model.layers.0.self_attn.qkv_proj.weight": "0000000000000011"}
    answers = {
        "http://a": [rank(GOOD)],
        "http://b": [rank(GOOD)],
        "http://c": [rank(half, tp_rank=0, tp_size=2), rank(half, tp_rank=1, tp_size=2)],
    }
    verdicts = replica_verdicts(answers, selector=Selector.TARGET)
    assert verdicts["http://a"].method == REPLICA and verdicts["http://a"].passed
    assert verdicts["http://c"].method == UNVERIFIED and verdicts["http://c"].passed
    assert "no other engine with its layout" in verdicts["http://c"].message


def test_an_empty_answer_fails():
    verdicts = replica_verdicts({"http://a": [], "http://b": [rank({})]}, selector=Selector.TARGET)
    assert not verdicts["http://a"].passed and not verdicts["http://b"].passed


def test_weights_digest_reads_only_the_selected_roles_and_keeps_rank_order():
    assert weights_digest([rank(GOOD)], selector=Selector.TARGET) == weights_digest(
        [rank({k: v for k, v in GOOD.items() if not k.startswith("draft")})], selector=Selector.TARGET
    )
    assert weights_digest([rank(GOOD)], selector=Selector.TARGET) != weights_digest(
        [rank(CORRUPT)], selector=Selector.TARGET
    )
    a, b = rank({"w": "1"}), rank({"w": "2"})
    assert weights_digest([a, b], selector=Selector.ALL) != weights_digest([b, a], selector=Selector.ALL)


def test_exact_check_matches_draft_step_roles():
    held = {"embed": "e1", "draft_step_0.mtp.eh_proj": "m1", "draft_step_1.mtp.eh_proj": "m1"}
    problems, num_verified = checksum_problems(
        sent={"embed": "e1", "mtp.eh_proj": "m1"}, ranks=[rank(held)], selector=Selector.ALL
    )
    assert problems == [] and num_verified == 3
    problems, _ = checksum_problems(sent={"embed": "e1"}, ranks=[rank(held)], selector=Selector.ALL)
    assert problems == [
        "extra draft_step_0.mtp.eh_proj: reported m1, not expected",
        "extra draft_step_1.mtp.eh_proj: reported m1, not expected",
    ]
    assert EXACT == "exact"
