"""Rollout engines with tensor parallelism: the multi-rank reference engine over real processes, gloo and HTTP.

One fleet for the module: two TP=2 engines (each an HTTP front plus two rank processes; the first under the strict
finalize policy, the second under SGLang's) and one TP=1 engine (strict), all serving the pre-trained target with
its MTP draft in the AITER layout. Tests run in file order: the frozen-draft collapse and the killed rank come last,
on the second engine. Syncs run through
the controller class from a sender process, as in test_sync_session.py; the test recomputes every rank's expected
checker answer itself from the weights it sent (the engine's fused, sharded, post-processed parameters, hashed
with SGLang's formulas) and reads it back from each rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference_server import checkpoint_tensors, generate, mtp_names, reference_server
from sender_host import SenderSettings, load_checkpoint, weights_at_step
from sglang_fields import vendored_checker_fields

from miles_sync.engine.client import EngineClient
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.sync.verify import engine_exact_problems
from miles_sync.weights.engine_layout import rank_engine_tensors
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.payload import encode_named_tensors
from miles_sync.wire.protocol import PauseMode, Selector, WeightsCheckerAction, WeightsCheckerRequest

# Slow: the fleet (7 processes) takes about 40 s to start on 2 cores; the whole run keeps this module.
pytestmark = pytest.mark.slow

BUCKET_BYTES = 256 * 1024
COLLECTIVE_TIMEOUT_S = 15.0
TIMEOUTS = SessionTimeouts(control_s=20.0, sync_s=90.0)
ENGINE_ARGS = dict(draft_kind="mtp", weight_layout="aiter", finalize_policy="strict")
PROMPTS = [[t, (5 * t + 17) % 256, (25 * t + 102) % 256] for t in (3, 40, 77, 120, 161, 200)]
FROZEN_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)
TRAINED_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=1, conversion_mode=ConversionMode.RAW
)


def start_engine(checkpoints: Path, log_dir: Path, *, tp: int, **overrides):
    args = {**ENGINE_ARGS, **overrides}
    extra = ["--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S), "--tp-size", str(tp)]
    return reference_server(model=checkpoints / "target", log_dir=log_dir, extra_args=extra, **args)


@pytest.fixture(scope="module")
def fleet(reference_checkpoints, tmp_path_factory):
    """[TP=2 strict, TP=2 sglang, TP=1 strict] engines, started once for the module."""
    log_dir = tmp_path_factory.mktemp("tp-engines")
    policies = {0: "strict", 1: "sglang", 2: "strict"}
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(start_engine(reference_checkpoints, log_dir, tp=tp, finalize_policy=policies[i]))
            for i, tp in enumerate((2, 2, 1))
        ]


@pytest.fixture(scope="module")
def checkpoint(reference_checkpoints):
    return load_checkpoint(reference_checkpoints / "target")


def controller(
    urls, source, *, transport: str, selector_inputs: SelectorInputs, staged: bool = False
) -> SyncController:
    return SyncController(
        engine_urls=urls,
        source=source,
        transport=transport,
        selector_inputs=selector_inputs,
        pause_mode=PauseMode.RETRACT,
        verify=True,
        staged=staged,
        timeouts=TIMEOUTS,
        show_progress=False,
    )


def settings(transport: str, *, include_mtp: bool) -> SenderSettings:
    return SenderSettings(transport=transport, bucket_bytes=BUCKET_BYTES, include_mtp=include_mtp, plan_feeds=False)


def answer_ranks(server, selector: str = "all") -> list[dict]:
    return server.ok("/weights_checker", {"action": "checksum", "selector": selector})["ranks"]


def sglang_hash(t: torch.Tensor) -> str:
    """SGLang's CPU tensor_hash as its checker prints it, written out here: SHA-256 of the raw bytes, 8 bytes."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{int.from_bytes(hashlib.sha256(data).digest()[:8], 'big'):016x}"


def sglang_overall(checksums: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def expected_ranks(weights, *, shape, tp_size, num_layers, selector: Selector) -> list[dict[str, str]]:
    """Per rank, what a faithful TP engine's checker answers for these full HF weights (target unprefixed, the
    MTP layer as the "draft." role)."""
    mtp_prefix = f"model.layers.{num_layers}."
    roles = {
        "target": {n: t for n, t in weights.items() if not n.startswith(mtp_prefix)},
        "draft": {n: t for n, t in weights.items() if n.startswith(mtp_prefix)},
    }
    wanted = {"target", "draft"} if selector is Selector.ALL else {selector.value}
    answers = []
    for tp_rank in range(tp_size):
        checksums = {}
        for role, tensors in roles.items():
            if role not in wanted:
                continue
            local = rank_engine_tensors(
                tensors, shape=shape, tp_rank=tp_rank, tp_size=tp_size, layout=WeightLayout.AITER
            )
            for name, tensor in local.items():
                checksums[name if role == "target" else f"{role}.{name}"] = sglang_hash(tensor)
        answers.append(checksums)
    return answers


def test_tp2_generates_exactly_what_tp1_generates(fleet):
    tp2, _, tp1 = fleet
    assert tp2.get("/get_server_info")[1]["tp_size"] == 2 and tp1.get("/get_server_info")[1]["tp_size"] == 1
    for prompt in PROMPTS:
        outputs = []
        for server in (tp2, tp1):
            status, answer = generate(server, prompt, max_new_tokens=24)
            assert status == 200, answer
            outputs.append(answer["output_ids"])
        assert outputs[0] == outputs[1], prompt


def test_checker_answers_sglang_shape_per_rank(fleet, checkpoint, shape):
    tp2 = fleet[0]
    answer = tp2.ok("/weights_checker", {"action": "checksum", "selector": "all"})
    fields = vendored_checker_fields()
    assert set(answer) == set(fields.body_keys)
    ranks = answer["ranks"]
    assert len(ranks) == 2
    tensors, num_layers = checkpoint
    expected = expected_ranks(tensors, shape=shape, tp_size=2, num_layers=num_layers, selector=Selector.ALL)
    for tp_rank, rank in enumerate(ranks):
        assert set(rank) == set(fields.checksum_info)
        assert [info["role"] for info in rank["parallelism_info"]] == ["target", "draft"]
        for info in rank["parallelism_info"]:
            assert set(info) == set(fields.parallelism_info)
            assert (info["tp_rank"], info["tp_size"], info["rank"], info["size"]) == (tp_rank, 2, tp_rank, 2)
        assert rank["checksums"] == expected[tp_rank]
        assert rank["per_gpu_checksum"] == sglang_overall(expected[tp_rank])
        assert "model.layers.0.self_attn.qkv_proj.weight" in rank["checksums"]
    h = hashlib.sha256()
    for rank in ranks:
        h.update(rank["per_gpu_checksum"].encode())
    assert answer["per_engine_checksum"] == h.hexdigest()
    assert ranks[0]["checksums"] != ranks[1]["checksums"]  # each rank hashes its own slice


@pytest.mark.parametrize("staged", [False, True], ids=["live", "staged"])
def test_distributed_sync_into_a_mixed_fleet_commits_verified_per_rank(fleet, source, checkpoint, shape, staged):
    urls = [server.url for server in fleet]
    source.stage_results.clear()

    async def main():
        await source.call("configure", settings("distributed", include_mtp=False))
        ctl = controller(urls, source, transport="distributed", selector_inputs=FROZEN_DRAFT, staged=staged)
        await ctl.connect()
        try:
            reports = []
            for step in (1, 2):
                await source.call("step", step)
                reports.append(await ctl.sync())
            return reports, ctl.membership
        finally:
            await ctl.close()

    reports, membership = asyncio.run(main())
    # World size 1 + 2 + 2 + 1; each engine's ranks at rank_offset + tp_rank, offsets packed in engine order.
    assert membership.world_size == 6
    assert [(e.rank_offset, e.tp_size) for e in membership.engines] == [(1, 2), (3, 2), (5, 1)]
    for report in reports:
        assert report.committed and report.selector is Selector.TARGET, report.error
        assert all(e.success and e.num_verified_tensors > 0 for e in report.engines), report.engines
        # Each TP=2 engine against its per-rank prediction from the bytes sent; the TP=1 engine by HF digests.
        assert [e.verification for e in report.engines] == ["engine-exact (sha256)", "engine-exact (sha256)", "exact"]
    if staged:  # the one TP=2 layout's digests were predicted while packing ahead, before each pause
        assert [r.engine_layouts for r in source.stage_results] == [1, 1], source.stage_results
        assert all(r.digest_s > 0 for r in source.stage_results)
        assert all(report.phases.stage_s > 0 for report in reports)
    else:
        assert source.stage_results == []
    tensors, num_layers = checkpoint
    weights = weights_at_step(tensors, 2)
    expected = expected_ranks(weights, shape=shape, tp_size=2, num_layers=num_layers, selector=Selector.TARGET)
    for server in fleet[:2]:
        assert [rank["checksums"] for rank in answer_ranks(server, "target")] == expected
    outputs = [generate(server, PROMPTS[0], max_new_tokens=16)[1] for server in fleet]
    assert {a["meta_info"]["weight_version"] for a in outputs} == {reports[-1].version}
    assert outputs[0]["output_ids"] == outputs[1]["output_ids"] == outputs[2]["output_ids"]


def test_colocated_sync_posts_one_payload_per_rank_and_commits_verified(fleet, source, checkpoint, shape):
    urls = [server.url for server in fleet]

    async def main():
        await source.call("configure", settings("colocated", include_mtp=True))
        ctl = controller(urls, source, transport="colocated", selector_inputs=TRAINED_DRAFT)
        await ctl.connect()
        try:
            await source.call("step", 3)
            return await ctl.sync()
        finally:
            await ctl.close()

    report = asyncio.run(main())
    assert report.committed and report.selector is Selector.ALL, report.error
    assert [e.verification for e in report.engines] == ["engine-exact (sha256)", "engine-exact (sha256)", "exact"]
    assert len({e.num_verified_tensors for e in report.engines}) == 1  # every sent tensor, target and draft
    tensors, num_layers = checkpoint
    expected = expected_ranks(
        weights_at_step(tensors, 3), shape=shape, tp_size=2, num_layers=num_layers, selector=Selector.ALL
    )
    for server in fleet[:2]:
        assert [rank["checksums"] for rank in answer_ranks(server)] == expected


async def _checker_answer(url: str, selector: Selector):
    async with EngineClient(url, timeout_s=20.0) as client:
        return await client.weights_checker(
            WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=selector)
        )


def _tensor_session(server, payloads: list[str], *, selector: str = "target") -> tuple[int, dict]:
    """One colocated session; each payload is encoded on its own (a shared-memory handle is opened once)."""
    server.ok("/begin_weight_update", {"selector": selector})
    try:
        return server.post("/update_weights_from_tensor", {"serialized_named_tensors": payloads, "selector": selector})
    finally:
        server.post("/end_weight_update")


def test_payload_count_mismatch_is_refused_naming_the_count_and_changes_nothing(fleet, reference_checkpoints):
    tp2 = fleet[0]
    before = answer_ranks(tp2)
    name = "model.norm.weight"
    tensor = checkpoint_tensors(reference_checkpoints / "target")[name] + 1.0
    for count in (1, 3):
        status, answer = _tensor_session(tp2, [encode_named_tensors([(name, tensor)]) for _ in range(count)])
        assert 400 <= status < 500 and answer["success"] is False, answer
        assert f"has {count} payloads" in answer["message"] and "takes exactly 2" in answer["message"], answer
    assert answer_ranks(tp2) == before


def test_a_corrupted_shard_on_one_rank_is_named(fleet, reference_checkpoints):
    """Rank 1 of a TP=2 engine loads a different q_proj than rank 0 (its own payload): against the answer to the
    same payload sent intact, only rank 1's fused qkv_proj of that layer differs."""
    tp2 = fleet[0]
    tensors = checkpoint_tensors(reference_checkpoints / "target")
    prefix = "model.layers.1.self_attn."
    good = [(prefix + f"{p}_proj.weight", tensors[prefix + f"{p}_proj.weight"]) for p in "qkv"]
    bad = [(name, t.clone()) for name, t in good]
    bad[0][1][-1, 0] += 1.0  # the last row of q belongs to rank 1's slice
    assert _tensor_session(tp2, [encode_named_tensors(good) for _ in range(2)])[0] == 200
    baseline = [rank["checksums"] for rank in answer_ranks(tp2, "target")]
    try:
        status, answer = _tensor_session(tp2, [encode_named_tensors(good), encode_named_tensors(bad)])
        assert status == 200, answer
        held = [rank["checksums"] for rank in answer_ranks(tp2, "target")]
        differing = [(r, n) for r in range(2) for n in baseline[r] if held[r][n] != baseline[r][n]]
        assert differing == [(1, prefix + "qkv_proj.weight")]
        # What a sync's engine-exact check reports for it: engine (the session adds the URL), rank, role, parameter.
        answer = asyncio.run(_checker_answer(tp2.url, Selector.TARGET))
        problems, _ = engine_exact_problems(
            expected=baseline, ranks=answer.ranks, selector=Selector.TARGET, sent_names=()
        )
        assert len(problems) == 1 and problems[0].startswith(f"rank 1 target {prefix}qkv_proj.weight differs"), problems
    finally:
        assert _tensor_session(tp2, [encode_named_tensors(good) for _ in range(2)])[0] == 200


# ---- the frozen draft at TP=2 ---------------------------------------------------------------------------------

SESSIONS_TO_COLLAPSE = 3  # the AITER shuffle of these weights has order 2: the third re-shuffle shows


def _mean_accept_length(server) -> tuple[float, list[list[int]]]:
    answers = [generate(server, p, max_new_tokens=32) for p in PROMPTS]
    assert all(status == 200 for status, _ in answers), answers
    lengths = [a["meta_info"]["spec_accept_length"] for _, a in answers]
    return sum(lengths) / len(lengths), [a["output_ids"] for _, a in answers]


def _payloads(named, tp: int = 2) -> list[str]:
    return [encode_named_tensors(named) for _ in range(tp)]


@pytest.fixture(scope="module")
def checkpoint_named(reference_checkpoints):
    """(target-only, all) named tensors of the checkpoint: what a trainer without / with MTP training sends."""
    target = reference_checkpoints / "target"
    skip = mtp_names(target)
    everything = sorted(checkpoint_tensors(target).items())
    return [(n, t) for n, t in everything if n not in skip], everything


def test_frozen_draft_collapses_under_selector_all_and_selector_target_prevents_it(fleet, checkpoint_named):
    target_only, everything = checkpoint_named
    server = fleet[1]  # the sglang policy
    assert _tensor_session(server, _payloads(everything), selector="all")[0] == 200  # back to the checkpoint
    start, start_outputs = _mean_accept_length(server)
    assert start >= 2.0
    for _ in range(SESSIONS_TO_COLLAPSE):
        assert _tensor_session(server, _payloads(target_only), selector="target")[0] == 200
    with_fix, outputs = _mean_accept_length(server)
    assert abs(with_fix - start) <= 0.05 * start and outputs == start_outputs, (start, with_fix)
    for _ in range(SESSIONS_TO_COLLAPSE):
        assert _tensor_session(server, _payloads(target_only), selector="all")[0] == 200  # finalizes silently
    collapsed, outputs = _mean_accept_length(server)
    print(f"TP=2 mean accept length: start {start:.3f}, selector target {with_fix:.3f}, selector all {collapsed:.3f}")
    assert collapsed <= 1.2, (start, collapsed)
    assert outputs == start_outputs  # verification keeps the target's greedy output exact


def test_strict_policy_refuses_selector_all_at_tp2_and_leaves_the_draft_untouched(fleet, checkpoint_named):
    target_only, everything = checkpoint_named
    server = fleet[0]  # strict
    assert _tensor_session(server, _payloads(everything), selector="all")[0] == 200
    start, _ = _mean_accept_length(server)
    draft_before = answer_ranks(server, "draft")
    server.ok("/begin_weight_update", {"selector": "all"})
    body = {"serialized_named_tensors": _payloads(target_only), "selector": "all"}
    server.ok("/update_weights_from_tensor", body)
    status, answer = server.post("/end_weight_update")
    assert status == 400 and "draft runner" in answer["message"] and "loaded no tensor" in answer["message"], answer
    assert answer_ranks(server, "draft") == draft_before
    after, _ = _mean_accept_length(server)
    assert abs(after - start) <= 0.05 * start, (start, after)


# ---- a rank dies mid-sync ---------------------------------------------------------------------------------------


def _rank_pids(server) -> list[int]:
    return server.get("/get_server_info")[1]["internal_states"][0]["tp_rank_pids"]


def test_a_rank_killed_mid_sync_fails_the_fleet_closed_and_a_restarted_engine_rejoins(
    fleet, source, reference_checkpoints, tmp_path
):
    """Every engine shares the broadcast group, so one dead rank fails the whole sync: nothing is committed, the
    dead rank's engine stops serving as a whole (its health says why), the others either still hold the committed
    version (and serve it) or are held paused. A restarted engine in its place rejoins; the next sync commits."""
    victim = fleet[1]
    pid = _rank_pids(victim)[1]

    async def main():
        await source.call("configure", settings("distributed", include_mtp=True))
        ctl = controller([s.url for s in fleet], source, transport="distributed", selector_inputs=TRAINED_DRAFT)
        await ctl.connect()
        try:
            await source.call("step", 4)
            committed = await ctl.sync()
            await source.call("step", 5)
            sync = asyncio.ensure_future(ctl.sync(raise_on_failure=False))
            while not sync.done():  # until this sync's first bucket arrived everywhere: the send is under way
                progress = ctl.progress
                if progress is not None and progress.version != committed.version and progress.buckets:
                    break
                await asyncio.sleep(0.005)
            assert not sync.done()
            os.kill(pid, signal.SIGKILL)
            failed = await asyncio.wait_for(sync, timeout=120)
            state = (ctl.version, ctl.serving_engines, ctl.stale_engines, ctl.held_engines)
            with start_engine(reference_checkpoints, tmp_path, tp=2) as restarted:
                await ctl.replace_engine(victim.url, restarted.url)
                await source.call("step", 6)
                recovered = await ctl.sync()
                outputs = generate(restarted, PROMPTS[0], max_new_tokens=8)
            return committed, failed, state, recovered, outputs
        finally:
            await ctl.close()

    committed, failed, (version, serving, stale, held), recovered, outputs = asyncio.run(main())
    assert committed.committed and not failed.committed and failed.error
    assert version == int(committed.version)
    status, text = victim.get("/health")
    assert status == 503 and "TP rank 1" in text, (status, text)
    status, answer = generate(victim, PROMPTS[0])
    assert status == 503, answer
    assert "broadcast of bucket" in failed.error or "the engine is down: TP rank 1" in failed.error, failed.error
    for server in (fleet[0], fleet[2]):
        assert server.url in serving or server.url in held, (server.url, serving, held)
    assert recovered.committed and all(e.success for e in recovered.engines), recovered.engines
    assert outputs[0] == 200 and outputs[1]["meta_info"]["weight_version"] == recovered.version


# ---- start-up refusals ------------------------------------------------------------------------------------------


def test_a_tp_size_a_dimension_does_not_divide_is_refused_at_start_naming_it(reference_checkpoints):
    """As SGLang refuses it: the target's 4 attention heads and 2 KV heads do not split over 3 ranks. The server
    exits with status 2 before any rank process starts, naming each dimension."""
    argv = [sys.executable, "-m", "miles_sync.engine.reference.serve", "--model", str(reference_checkpoints / "target")]
    done = subprocess.run([*argv, "--tp-size", "3", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "listening on" not in done.stdout, (done.returncode, done.stderr[-2000:])
    assert "num_attention_heads=4 is not divisible by tp_size=3" in done.stderr, done.stderr[-2000:]
    assert "num_key_value_heads=2" in done.stderr
