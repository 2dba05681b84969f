"""What a sync can prove from checksum answers: the exact check over HF names, the engine-exact check of engine
names against predicted digests, replica agreement over engine names without a prediction."""

from __future__ import annotations

import pytest

from miles_sync.sync.verify import (
    ENGINE_EXACT,
    EXACT,
    REPLICA,
    UNVERIFIED,
    checksum_problems,
    engine_exact,
    engine_exact_problems,
    fleet_verdicts,
    replica_verdicts,
    weights_digest,
)
from miles_sync.wire.protocol import ParallelismInfo, RankChecksums, Selector

pytestmark = pytest.mark.unit


def rank(
    checksums: dict[str, str], *, tp_rank: int = 0, tp_size: int = 1, roles: tuple[str, ...] = ("target",)
) -> RankChecksums:
    infos = tuple(
        ParallelismInfo(
            role=role,
            tp_rank=tp_rank,
            tp_size=tp_size,
            dp_rank=0,
            dp_size=1,
            pp_rank=0,
            pp_size=1,
            rank=tp_rank,
            size=tp_size,
        )
        for role in roles
    )
    return RankChecksums(checksums=checksums, per_gpu_checksum="x", parallelism_info=infos)


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


# ---- TP=2-shaped answers: one dict per rank -------------------------------------------------------------------

QKV = "model.layers.0.self_attn.qkv_proj.weight"
GATE_UP = "model.layers.0.mlp.gate_up_proj.weight"
EH = "model.layers.1.eh_proj.weight"
# The trainer's prediction: target unprefixed, draft under the role "draft".
PREDICTED = (
    {QKV: "00000000000000a0", GATE_UP: "00000000000000b0", f"draft.{EH}": "00000000000000c0"},
    {QKV: "00000000000000a1", GATE_UP: "00000000000000b1", f"draft.{EH}": "00000000000000c0"},
)
SENT = {
    name: "sha"
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        EH,
    )
}


def tp2(per_rank=PREDICTED, *, draft_role: str = "draft_step_0") -> list[RankChecksums]:
    """An engine's answer at TP=2: its own draft role's prefix, both roles in each rank's parallelism_info."""
    return [
        rank(
            {k.replace("draft.", f"{draft_role}.", 1): d for k, d in checksums.items()},
            tp_rank=i,
            tp_size=2,
            roles=("target", draft_role),
        )
        for i, checksums in enumerate(per_rank)
    ]


def test_engine_exact_maps_the_answers_draft_role_and_counts_sent_tensors():
    problems, num_verified = engine_exact_problems(
        expected=PREDICTED, ranks=tp2(), selector=Selector.ALL, sent_names=SENT
    )
    assert problems == [] and num_verified == len(SENT)
    # Ranks are matched by their tp_rank, not their position in the answer.
    problems, _ = engine_exact_problems(expected=PREDICTED, ranks=tp2()[::-1], selector=Selector.ALL, sent_names=SENT)
    assert problems == []
    assert ENGINE_EXACT == "engine-exact"


def test_engine_exact_names_rank_role_and_parameter():
    corrupt = (PREDICTED[0], {**PREDICTED[1], QKV: "ffffffffffffffff"})
    problems, num_verified = engine_exact_problems(
        expected=PREDICTED, ranks=tp2(corrupt), selector=Selector.ALL, sent_names=SENT
    )
    assert problems == [f"rank 1 target {QKV} differs: expected 00000000000000a1, got ffffffffffffffff"]
    assert num_verified == len(SENT) - 3  # q, k and v are in the differing parameter
    draft_bad = (PREDICTED[0], {**PREDICTED[1], f"draft.{EH}": "0000000000000000"})
    problems, _ = engine_exact_problems(
        expected=PREDICTED, ranks=tp2(draft_bad), selector=Selector.ALL, sent_names=SENT
    )
    assert problems == [f"rank 1 draft_step_0 {EH} differs: expected 00000000000000c0, got 0000000000000000"]


def test_engine_exact_reports_missing_extra_unheld_and_a_wrong_rank_count():
    missing = ({QKV: PREDICTED[0][QKV], f"draft.{EH}": "00000000000000c0", "model.rotary.inv_freq": "1"}, PREDICTED[1])
    problems, _ = engine_exact_problems(expected=PREDICTED, ranks=tp2(missing), selector=Selector.ALL, sent_names=SENT)
    assert problems == [
        f"rank 0 target {GATE_UP} missing: expected 00000000000000b0, not reported",
        "rank 0 target model.rotary.inv_freq extra: reported 1, not predicted from what was sent",
    ]
    problems, _ = engine_exact_problems(
        expected=PREDICTED, ranks=tp2(), selector=Selector.ALL, sent_names={**SENT, "lm_head.weight": "sha"}
    )
    assert problems == ["sent lm_head.weight: no runner covered by selector 'all' holds it"]
    problems, num_verified = engine_exact_problems(
        expected=PREDICTED, ranks=tp2()[:1], selector=Selector.ALL, sent_names=SENT
    )
    assert problems == ["answered 1 TP rank(s); its layout has 2"] and num_verified == 0


def test_engine_exact_under_target_leaves_the_draft_unread():
    other_draft = tuple({**c, f"draft.{EH}": "0000000000000000"} for c in PREDICTED)
    target_sent = {n: d for n, d in SENT.items() if n != EH}
    problems, num_verified = engine_exact_problems(
        expected=PREDICTED, ranks=tp2(other_draft), selector=Selector.TARGET, sent_names=target_sent
    )
    assert problems == [] and num_verified == len(target_sent)


def test_the_replica_fallback_finds_one_diverging_engine_among_three_tp2_engines():
    diverging = (PREDICTED[0], {**PREDICTED[1], GATE_UP: "ffffffffffffffff"})
    answers = {"http://a": tp2(), "http://b": tp2(), "http://c": tp2(diverging)}
    verdicts = fleet_verdicts(
        answers=answers,
        selector=Selector.TARGET,
        sent=SENT,
        hf_named=(),
        predicted={},
        fallbacks={url: "the server does not report its weight_layout" for url in answers},
    )
    assert [verdicts[u].method for u in answers] == [REPLICA, REPLICA, REPLICA]
    assert verdicts["http://a"].passed and verdicts["http://b"].passed
    assert verdicts["http://a"].num_verified == 4  # 2 target parameters on each of 2 ranks
    bad = verdicts["http://c"]
    assert not bad.passed and "2 of them agree" in bad.message and f"rank 1: {GATE_UP}" in bad.message
    assert "no engine-exact check: the server does not report its weight_layout" in bad.message


def test_fleet_verdicts_pick_the_strongest_check_each_answer_allows():
    answers = {"http://hf": [rank(dict(SENT))], "http://predicted": tp2(), "http://lone": tp2()}
    verdicts = fleet_verdicts(
        answers=answers,
        selector=Selector.ALL,
        sent=SENT,
        hf_named={"http://hf"},
        predicted={"http://predicted": PREDICTED},
    )
    assert verdicts["http://hf"].method == EXACT and verdicts["http://hf"].passed
    assert verdicts["http://predicted"].method == engine_exact("sha256") and verdicts["http://predicted"].passed
    assert verdicts["http://lone"].method == UNVERIFIED and verdicts["http://lone"].passed
