"""The public frozen-draft bug, reproduced and prevented over real HTTP.

A frozen MTP draft with the AITER layout: every session whose selector covers the draft while only target weights
arrive makes SGLang's finalize shuffle the draft's already-shuffled weights again. Draft acceptance collapses while
the target's output stays right. Selector `target` (the fix) keeps acceptance where it was; the strict policy turns
selector `all` into an error at end_weight_update that names the draft, and never touches its weights (the engine
keeps serving after that error, as SGLang would).
"""

from __future__ import annotations

import concurrent.futures
import statistics

import pytest
from reference_server import checkpoint_tensors, checksums, generate, mtp_names, reference_server

from miles_sync.wire.codec import decode
from miles_sync.wire.payload import encode_named_tensors
from miles_sync.wire.protocol import GenerateResponse

NUM_SESSIONS = 3
PROMPTS = [[t, (5 * t + 17) % 256] for t in (3, 40, 77, 120, 161, 200)]
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def target_only(reference_checkpoints) -> list:
    """What a trainer that trains no MTP layer sends: the target's tensors, none of the draft's."""
    target = reference_checkpoints / "target"
    skip = mtp_names(target)
    return sorted((n, t) for n, t in checkpoint_tensors(target).items() if n not in skip)


def _mean_accept_length(server) -> tuple[float, list[tuple[int, ...]]]:
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: generate(server, p, max_new_tokens=MAX_NEW_TOKENS), PROMPTS))
    responses = []
    for status, answer in answers:
        assert status == 200, answer
        responses.append(decode(GenerateResponse, answer))
    return statistics.mean(r.meta_info.spec_accept_length for r in responses), [r.output_ids for r in responses]


def _session(server, named, *, selector: str) -> tuple[int, dict]:
    server.ok("/begin_weight_update", {"selector": selector})
    body = {"serialized_named_tensors": [encode_named_tensors(named)], "selector": selector}
    server.ok("/update_weights_from_tensor", body)
    return server.post("/end_weight_update")


def test_sglang_policy_reproduces_the_collapse_and_selector_target_prevents_it(
    reference_checkpoints, target_only, tmp_path
):
    with reference_server(
        model=reference_checkpoints / "target",
        draft_kind="mtp",
        weight_layout="aiter",
        finalize_policy="sglang",
        log_dir=tmp_path,
    ) as server:
        start, start_outputs = _mean_accept_length(server)
        assert start >= 2.0

        for _ in range(NUM_SESSIONS):
            assert _session(server, target_only, selector="target")[0] == 200
        with_fix, outputs = _mean_accept_length(server)
        assert abs(with_fix - start) <= 0.05 * start, (start, with_fix)
        assert outputs == start_outputs

        for _ in range(NUM_SESSIONS):
            assert _session(server, target_only, selector="all")[0] == 200  # sglang finalizes silently
        collapsed, outputs = _mean_accept_length(server)
        print(f"mean accept length: start {start:.3f}, selector target {with_fix:.3f}, selector all {collapsed:.3f}")
        assert collapsed <= 1.2, (start, collapsed)
        # Verification keeps the target's greedy output exact: only speed is lost, no error is raised.
        assert outputs == start_outputs


def test_strict_policy_refuses_selector_all_and_leaves_the_draft_untouched(
    reference_checkpoints, target_only, tmp_path
):
    with reference_server(
        model=reference_checkpoints / "target",
        draft_kind="mtp",
        weight_layout="aiter",
        finalize_policy="strict",
        log_dir=tmp_path,
    ) as server:
        start, _ = _mean_accept_length(server)
        draft_before = checksums(server, "draft")
        status, answer = _session(server, target_only, selector="all")
        assert status == 400 and not answer["success"]
        assert "draft runner" in answer["message"] and "loaded no tensor" in answer["message"]
        assert checksums(server, "draft") == draft_before
        # As SGLang, nothing refuses generation after the failed session: the target's fresh bytes (finalized once)
        # and the untouched draft serve, and the draft still accepts as before.
        during, _ = _mean_accept_length(server)
        assert abs(during - start) <= 0.05 * start, (start, during)
        assert _session(server, target_only, selector="target")[0] == 200
        after, _ = _mean_accept_length(server)
        assert abs(after - start) <= 0.05 * start, (start, after)
