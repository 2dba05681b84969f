"""Generation on the trained reference checkpoints: speculative decoding, acceptance, corruption, pause modes.

The scheduler runs its own thread; the checkpoints come from the session fixture (built once by a subprocess).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from miles_sync.engine.reference.checkpoints import LanguageRecipe, next_token
from miles_sync.engine.reference.models import load_tokenizer
from miles_sync.engine.reference.runner import load_runners
from miles_sync.engine.reference.scheduler import Scheduler, choose_token
from miles_sync.engine.reference.speculative import DraftInput, NgramProposer, accept_tokens
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.protocol import FinishReasonKind, GenerateRequest, GenerateResponse, PauseMode, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

LANGUAGE = LanguageRecipe()
TIMEOUT_S = 60.0


def _greedy(prompt, max_new_tokens: int = 16) -> GenerateRequest:
    return GenerateRequest(
        input_ids=tuple(prompt), sampling_params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    )


PROMPTS = [(3, 100, 7), (250,), (1, 2, 3, 4, 5, 6, 7, 8, 9), (42, 42), (17, 200, 31, 9, 128)]


def _runners(checkpoints: Path, kind: str, *, layout=WeightLayout.NONE):
    draft_path = checkpoints / "draft" if kind == "standalone" else None
    return load_runners(checkpoints / "target", draft_kind=kind, draft_path=draft_path, layout=layout)


def _scheduler(checkpoints: Path, kind: str, *, layout=WeightLayout.NONE) -> Scheduler:
    target, draft = _runners(checkpoints, kind, layout=layout)
    return Scheduler(target=target, draft=draft, draft_kind=kind, spec_steps=3)


def _run(scheduler: Scheduler, requests) -> list[GenerateResponse]:
    futures = [scheduler.submit(r) for r in requests]
    return [f.result(timeout=TIMEOUT_S) for f in futures]


@pytest.fixture(scope="module")
def plain(reference_checkpoints: Path):
    scheduler = _scheduler(reference_checkpoints, "none")
    yield scheduler
    scheduler.shutdown()


@pytest.fixture(scope="module")
def plain_outputs(plain: Scheduler) -> list[tuple[int, ...]]:
    return [r.output_ids for r in _run(plain, [_greedy(p, 24) for p in PROMPTS])]


def test_trained_target_follows_the_language(plain_outputs, plain: Scheduler) -> None:
    for prompt, output in zip(PROMPTS, plain_outputs):
        tokens = list(prompt) + list(output)
        expected = [next_token(t, LANGUAGE) for t in tokens[len(prompt) - 1 : -1]]
        assert list(output) == expected


def test_plain_meta_info(plain: Scheduler) -> None:
    (response,) = _run(plain, [_greedy((5, 6), 7)])
    meta = response.meta_info
    assert (meta.prompt_tokens, meta.completion_tokens) == (2, 7)
    assert meta.finish_reason.type is FinishReasonKind.LENGTH and meta.finish_reason.length == 7
    assert meta.weight_version == "default" and meta.token_versions == ("default",)
    assert meta.spec_verify_ct is None and meta.spec_accept_length is None
    assert plain.avg_spec_accept_length is None


@pytest.mark.parametrize("kind", ["mtp", "standalone", "ngram"])
def test_speculative_greedy_equals_plain_greedy(reference_checkpoints: Path, plain_outputs, kind: str) -> None:
    scheduler = _scheduler(reference_checkpoints, kind)
    try:
        responses = _run(scheduler, [_greedy(p, 24) for p in PROMPTS])
    finally:
        scheduler.shutdown()
    assert [r.output_ids for r in responses] == plain_outputs
    for r in responses:
        meta = r.meta_info
        assert meta.completion_tokens == 24
        assert meta.spec_accept_length == pytest.approx(24 / meta.spec_verify_ct)
        assert 0.0 <= meta.spec_accept_rate <= 1.0
    if kind != "ngram":  # the language never repeats within 256 tokens: prompt lookup finds nothing
        assert min(r.meta_info.spec_accept_length for r in responses) >= 2.0


def test_frozen_mtp_draft_accepts_then_collapses_after_a_second_finalize(reference_checkpoints: Path) -> None:
    target, draft = _runners(reference_checkpoints, "mtp", layout=WeightLayout.AITER)
    scheduler = Scheduler(target=target, draft=draft, draft_kind="mtp", spec_steps=3)
    try:
        clean = _run(scheduler, [_greedy(p, 16) for p in PROMPTS])
        clean_mean = scheduler.avg_spec_accept_length
        # What an update session with selector "all" does to a frozen draft under SGLang's finalize: no bytes,
        # one more post-load transform.
        scheduler.pause(PauseMode.RETRACT)
        draft.reset_session()
        draft.finalize_all()
        scheduler.reset_spec_stats()
        scheduler.resume()
        corrupted = _run(scheduler, [_greedy(p, 16) for p in PROMPTS])
    finally:
        scheduler.shutdown()
    assert clean_mean >= 2.0
    assert all(r.meta_info.spec_accept_length >= 2.0 for r in clean)
    assert scheduler.avg_spec_accept_length <= 1.2
    assert all(r.meta_info.spec_accept_rate <= 0.1 for r in corrupted)
    # The target is untouched, so the output is too: corruption only costs speed.
    assert [r.output_ids for r in corrupted] == [r.output_ids for r in clean]


def test_sampling_is_seeded_and_identical_with_a_draft(reference_checkpoints: Path, plain: Scheduler) -> None:
    def request(seed: int, top_p: float = 1.0) -> GenerateRequest:
        params = SamplingParams(max_new_tokens=20, temperature=1.5, top_p=top_p, sampling_seed=seed)
        return GenerateRequest(input_ids=(9, 8, 7), sampling_params=params)

    first, again, other = _run(plain, [request(1), request(1), request(2)])
    assert first.output_ids == again.output_ids
    assert first.output_ids != other.output_ids  # T=1.5 on this language: many low-probability draws
    (nucleus,) = _run(plain, [request(3, top_p=0.05)])  # only the top token survives
    (greedy,) = _run(plain, [_greedy((9, 8, 7), 20)])
    assert nucleus.output_ids == greedy.output_ids

    scheduler = _scheduler(reference_checkpoints, "mtp")
    try:
        (speculative,) = _run(scheduler, [request(1)])
    finally:
        scheduler.shutdown()
    assert speculative.output_ids == first.output_ids


def test_choose_token_draws_once_and_respects_top_p() -> None:
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0])  # p = (.087, .644, .237, .032)
    assert choose_token(logits, params=SamplingParams(temperature=0.0), generator=None) == 1
    g = torch.Generator().manual_seed(0)
    nucleus = SamplingParams(temperature=1.0, top_p=0.7)  # .644 alone is short of 0.7; .644 + .237 reaches it
    assert {choose_token(logits, params=nucleus, generator=g) for _ in range(200)} == {1, 2}
    # Exactly one uniform draw per token: the generator ends where one float64 draw leaves a fresh one.
    used, fresh = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    choose_token(logits, params=SamplingParams(temperature=1.0), generator=used)
    torch.rand((), generator=fresh, dtype=torch.float64)
    assert torch.equal(used.get_state(), fresh.get_state())


def test_accept_tokens_keeps_the_agreeing_prefix_plus_one() -> None:
    target = [4, 5, 9, 7]
    calls: list[int] = []

    def choose(j: int) -> int:
        calls.append(j)
        return target[j]

    assert accept_tokens([4, 5, 6], choose) == ([4, 5, 9], 2)
    assert calls == [0, 1, 2]
    assert accept_tokens([4, 5, 9], lambda j: target[j]) == ([4, 5, 9, 7], 3)
    assert accept_tokens([], lambda j: target[j]) == ([4], 0)


def test_ngram_proposes_the_continuation_of_the_latest_match() -> None:
    proposer = NgramProposer(num_steps=3)
    (proposal,) = proposer.propose([DraftInput(token_ids=[1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], max_tokens=3)])
    assert proposal == [8, 5, 1]
    assert proposer.propose([DraftInput(token_ids=[1, 2, 3], max_tokens=3)]) == [[]]
    assert proposer.propose([DraftInput(token_ids=[7, 7, 7], max_tokens=1)]) == [[7]]


def _wait_until(predicate, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.005)


def _started(futures: list[Future], scheduler: Scheduler) -> bool:
    return scheduler.num_running == len(futures)


def test_pause_abort_completes_in_flight_requests_now(plain: Scheduler) -> None:
    futures = [plain.submit(_greedy(p, 400)) for p in PROMPTS]
    _wait_until(lambda: _started(futures, plain))
    plain.pause(PauseMode.ABORT)
    try:
        responses = [f.result(timeout=5) for f in futures]
        assert plain.num_running == 0 and plain.num_waiting == 0
        late = plain.submit(_greedy((1,), 2))  # waits while paused
        time.sleep(0.1)
        assert not late.done() and plain.num_waiting == 1
    finally:
        plain.resume()
    for r in responses:
        assert r.meta_info.finish_reason.type is FinishReasonKind.ABORT
        assert r.meta_info.completion_tokens < 400
    assert late.result(timeout=TIMEOUT_S).meta_info.completion_tokens == 2


@pytest.mark.parametrize("mode", [PauseMode.RETRACT, PauseMode.IN_PLACE])
def test_pause_keeps_every_request_and_tags_versions(reference_checkpoints: Path, mode: PauseMode) -> None:
    target, draft = _runners(reference_checkpoints, "mtp")
    scheduler = Scheduler(target=target, draft=draft, draft_kind="mtp", spec_steps=3)
    prompts = [(i, (7 * i) % 256, 3) for i in range(12)]
    try:
        reference = [r.output_ids for r in _run(scheduler, [_greedy(p, 40) for p in prompts])]
        scheduler.set_weight_version("v1")
        futures = [scheduler.submit(_greedy(p, 40)) for p in prompts]
        _wait_until(lambda: _started(futures, scheduler))
        scheduler.pause(mode)
        if mode is PauseMode.RETRACT:
            assert (scheduler.num_running, scheduler.num_waiting) == (0, len(prompts))
        else:
            assert (scheduler.num_running, scheduler.num_waiting) == (len(prompts), 0)
        # A weight "update" while paused: same bytes, but a new epoch, so every cached hidden state is stale.
        target.load(list(target.logical_tensors().items()))
        target.finalize(target.loaded_in_session())
        scheduler.invalidate_cache()
        scheduler.set_weight_version("v2")
        time.sleep(0.05)
        assert not any(f.done() for f in futures)
        scheduler.resume()
        responses = [f.result(timeout=TIMEOUT_S) for f in futures]
    finally:
        scheduler.shutdown()
    assert [r.output_ids for r in responses] == reference  # nothing lost, nothing duplicated
    for r in responses:
        assert r.meta_info.finish_reason.type is FinishReasonKind.LENGTH
        assert r.meta_info.weight_version == "v2"
        assert r.meta_info.token_versions in (("v1", "v2"), ("v2",))
    assert any(r.meta_info.token_versions == ("v1", "v2") for r in responses)


def test_forward_steps_hold_the_weights_lock(reference_checkpoints: Path) -> None:
    target, _ = _runners(reference_checkpoints, "none")
    scheduler = Scheduler(target=target)
    try:
        with target.weights_lock:
            future = scheduler.submit(_greedy((4, 5), 3))
            _wait_until(lambda: scheduler.num_running == 1)  # admitted: its first step now waits on the lock
            time.sleep(0.2)  # a window for a step that ignored the lock to finish the 3 tokens
            assert not future.done() and scheduler.num_running == 1
        assert future.result(timeout=TIMEOUT_S).meta_info.completion_tokens == 3
    finally:
        scheduler.shutdown()


def test_eos_stops_generation(reference_checkpoints: Path) -> None:
    target, _ = load_runners(reference_checkpoints / "target")
    target.model.config.eos_token_id = next_token(next_token(50, LANGUAGE), LANGUAGE)
    scheduler = Scheduler(target=target)
    try:
        (response,) = _run(scheduler, [_greedy((50,), 10)])
    finally:
        scheduler.shutdown()
    assert response.output_ids == (next_token(50, LANGUAGE), target.model.config.eos_token_id)
    assert response.meta_info.finish_reason.type is FinishReasonKind.STOP
    assert response.meta_info.finish_reason.matched == target.model.config.eos_token_id


def test_zero_new_tokens_and_bad_requests(plain: Scheduler) -> None:
    (empty,) = _run(plain, [_greedy((1, 2), 0)])
    assert empty.output_ids == () and empty.meta_info.finish_reason.type is FinishReasonKind.LENGTH
    with pytest.raises(ValueError, match=r"token ids \[256, -1\] are outside the vocabulary \[0, 256\)"):
        plain.submit(_greedy((1, 256, -1)))
    with pytest.raises(ValueError, match="the prompt is empty"):
        plain.submit(_greedy(()))
    with pytest.raises(ValueError, match="no tokenizer"):
        plain.submit(GenerateRequest(text="hello"))
    with pytest.raises(ValueError, match="max_position_embeddings 4096"):
        plain.submit(_greedy((1,), 5000))


def test_text_prompts_use_the_checkpoint_tokenizer(reference_checkpoints: Path) -> None:
    tokenizer = load_tokenizer(reference_checkpoints / "target")
    assert tokenizer.encode("hi!") == list(b"hi!")
    target, _ = _runners(reference_checkpoints, "none")
    scheduler = Scheduler(target=target, tokenizer=tokenizer)
    try:
        params = SamplingParams(max_new_tokens=4, temperature=0.0)
        (response,) = _run(scheduler, [GenerateRequest(text="hi!", sampling_params=params)])
    finally:
        scheduler.shutdown()
    assert response.meta_info.prompt_tokens == 3
    expected = [next_token(ord("!"), LANGUAGE)]
    for _ in range(3):
        expected.append(next_token(expected[-1], LANGUAGE))
    assert list(response.output_ids) == expected
    assert response.text == tokenizer.decode(expected)


def test_shutdown_aborts_what_is_left(reference_checkpoints: Path) -> None:
    scheduler = _scheduler(reference_checkpoints, "none")
    scheduler.pause(PauseMode.IN_PLACE)
    future = scheduler.submit(_greedy((1, 2), 5))
    scheduler.shutdown()
    assert future.result(timeout=5).meta_info.finish_reason.type is FinishReasonKind.ABORT
    with pytest.raises(RuntimeError, match="shut down"):
        scheduler.submit(_greedy((1,), 1))


def test_scheduler_validates_its_runners(reference_checkpoints: Path) -> None:
    target, draft = load_runners(reference_checkpoints / "target", draft_kind="mtp")
    with pytest.raises(ValueError, match="target runner has role 'draft'"):
        Scheduler(target=draft)
    with pytest.raises(ValueError, match="draft_kind 'none' with a draft runner"):
        Scheduler(target=target, draft=draft)
    with pytest.raises(ValueError, match="spec_steps=0"):
        Scheduler(target=target, draft=draft, draft_kind="mtp", spec_steps=0)
    with pytest.raises(ValueError, match="needs a draft runner"):
        Scheduler(target=target, draft_kind="standalone")
