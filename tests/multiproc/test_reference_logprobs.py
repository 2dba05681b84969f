"""`/generate` with `return_logprob`: the reference engine answers SGLang's `meta_info.output_token_logprobs`.

Every logprob is checked against an independent recomputation: transformers' own `Qwen3ForCausalLM` loaded from the
pre-trained target checkpoint scores prompt + output in one forward, and the expected value of output token i is
float32 log_softmax(logits / T)[token] at the position that predicted it (T the request's temperature, 1 when
greedy: SGLang's default, see miles_sync.engine.reference.sampling). In-process schedulers cover TP=1 with no draft
and with each draft kind (tokens accepted by verification must get the target's logprob too); real `serve`
processes cover the HTTP shape at TP=1 and TP=2, and the rollout client's `Sample.output_logprobs`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from reference_server import reference_server

from miles_sync.engine.client import EngineClient
from miles_sync.engine.reference.models import load_tokenizer
from miles_sync.engine.reference.runner import load_runners
from miles_sync.engine.reference.scheduler import Scheduler
from miles_sync.engine.rollout import generate_samples
from miles_sync.wire.protocol import GenerateRequest, GenerateResponse, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

TIMEOUT_S = 60.0
TOLERANCE = 1e-5
PROMPTS = [(3, 100, 7), (250,), (1, 2, 3, 4, 5, 6, 7, 8, 9), (17, 200, 31, 9, 128)]
# Greedy; the brief's T=0.7; and T=1.5 with top-p, where the target often disagrees with the draft, so verify steps
# end in rejections and the bonus token is a fresh draw.
SAMPLINGS = {
    "greedy": SamplingParams(max_new_tokens=20, temperature=0.0),
    "t0.7": SamplingParams(max_new_tokens=20, temperature=0.7, sampling_seed=11),
    "t1.5-top-p": SamplingParams(max_new_tokens=20, temperature=1.5, top_p=0.9, sampling_seed=7),
}
# SGLang's meta_info keys for a return_logprob request (srt/managers/tokenizer_manager.py:2868-2870).
LOGPROB_KEYS = {"input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"}


@pytest.fixture(scope="module")
def hf_model(reference_checkpoints: Path):
    """transformers' model on the target checkpoint, independent of the engine's loaders (the MTP layer's tensors
    are unused by it)."""
    import transformers  # a dependency of the project: never skipped

    model = transformers.AutoModelForCausalLM.from_pretrained(reference_checkpoints / "target", dtype=torch.float32)
    return model.eval()


def expected_logprobs(model, prompt, output, *, params: SamplingParams) -> list[float]:
    """Independent: one forward over prompt + output, SGLang's default convention (temperature-scaled, 1 when
    greedy, before top-p)."""
    ids = torch.tensor([[*prompt, *output]])
    with torch.inference_mode():
        logits = model(ids).logits[0].float()
    temperature = params.temperature if params.temperature > 0 else 1.0
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(output)]
    logprobs = torch.log_softmax(rows / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(output).view(-1, 1)).view(-1).tolist()


def assert_matches(model, prompt, output_ids, triples, *, params: SamplingParams) -> None:
    assert [token for _, token, _ in triples] == list(output_ids)
    got = torch.tensor([logprob for logprob, _, _ in triples], dtype=torch.float64)
    want = torch.tensor(expected_logprobs(model, prompt, output_ids, params=params), dtype=torch.float64)
    assert torch.allclose(got, want, atol=TOLERANCE, rtol=0), f"max |diff| {(got - want).abs().max()}"


def _run(scheduler: Scheduler, requests) -> list[GenerateResponse]:
    futures = [scheduler.submit(r) for r in requests]
    return [f.result(timeout=TIMEOUT_S) for f in futures]


def _request(prompt, params: SamplingParams, **logprob_fields) -> GenerateRequest:
    return GenerateRequest(
        input_ids=tuple(prompt), sampling_params=params, **{"return_logprob": True, **logprob_fields}
    )


# ---- in process, TP=1 --------------------------------------------------------------------------------------------


def _scheduler(checkpoints: Path, kind: str) -> Scheduler:
    draft_path = checkpoints / "draft" if kind == "standalone" else None
    target, draft = load_runners(checkpoints / "target", draft_kind=kind, draft_path=draft_path)
    tokenizer = load_tokenizer(checkpoints / "target")
    return Scheduler(target=target, draft=draft, draft_kind=kind, spec_steps=3, tokenizer=tokenizer)


@pytest.fixture(scope="module", params=["none", "mtp", "standalone", "ngram"])
def scheduler(request, reference_checkpoints: Path):
    scheduler = _scheduler(reference_checkpoints, request.param)
    yield scheduler
    scheduler.shutdown()


@pytest.fixture(scope="module")
def plain(reference_checkpoints: Path):
    scheduler = _scheduler(reference_checkpoints, "none")
    yield scheduler
    scheduler.shutdown()


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_logprobs_equal_the_targets_distribution(scheduler: Scheduler, hf_model, sampling: str) -> None:
    params = SAMPLINGS[sampling]
    responses = _run(scheduler, [_request(p, params) for p in PROMPTS])
    for prompt, response in zip(PROMPTS, responses):
        meta = response.meta_info
        assert meta.output_token_logprobs_length == len(response.output_ids) == params.max_new_tokens
        assert meta.input_token_logprobs == ()  # logprob_start_len -1: output tokens only
        assert all(text is None for _, _, text in meta.output_token_logprobs)
        assert_matches(hf_model, prompt, response.output_ids, meta.output_token_logprobs, params=params)
    if scheduler.draft_kind in ("mtp", "standalone") and sampling == "greedy":
        # Most tokens came through verification, so the check above covers accepted draft tokens.
        assert min(r.meta_info.spec_accept_length for r in responses) >= 2.0


def test_logprobs_are_temperature_scaled_and_unfiltered(plain: Scheduler, hf_model) -> None:
    """Not SGLANG_RETURN_ORIGINAL_LOGPROB's raw distribution, and not the top-p renormalized one."""
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.5, sampling_seed=3)
    prompt = PROMPTS[0]
    (response,) = _run(plain, [_request(prompt, params)])
    got = [logprob for logprob, _, _ in response.meta_info.output_token_logprobs]
    raw = expected_logprobs(hf_model, prompt, response.output_ids, params=SamplingParams(temperature=0.0))
    assert max(abs(g - r) for g, r in zip(got, raw)) > 100 * TOLERANCE
    assert_matches(hf_model, prompt, response.output_ids, response.meta_info.output_token_logprobs, params=params)


def test_text_in_logprobs_and_no_logprobs_unless_asked(plain: Scheduler, reference_checkpoints: Path) -> None:
    params = SAMPLINGS["greedy"]
    with_text, plain = _run(
        plain,
        [
            _request(PROMPTS[0], params, return_text_in_logprobs=True),
            GenerateRequest(input_ids=PROMPTS[0], sampling_params=params),
        ],
    )
    tokenizer = load_tokenizer(reference_checkpoints / "target")
    assert [text for _, _, text in with_text.meta_info.output_token_logprobs] == [
        tokenizer.decode([token]) for token in with_text.output_ids
    ]
    meta = plain.meta_info
    assert (meta.output_token_logprobs, meta.input_token_logprobs, meta.output_token_logprobs_length) == (None,) * 3
    assert plain.output_ids == with_text.output_ids


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"top_logprobs_num": 2}, "top_logprobs_num=2"),
        ({"token_ids_logprob": (5, 6)}, "token_ids_logprob"),
        ({"logprob_start_len": 0}, "logprob_start_len=0"),
    ],
)
def test_unimplemented_logprob_options_are_refused(plain: Scheduler, fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        plain.submit(_request(PROMPTS[0], SAMPLINGS["greedy"], **fields))
    # Without return_logprob SGLang reads none of them: accepted, and nothing is returned.
    request = GenerateRequest(input_ids=PROMPTS[0], sampling_params=SAMPLINGS["greedy"], **fields)
    (response,) = _run(plain, [request])
    assert response.meta_info.output_token_logprobs is None


# ---- over HTTP: SGLang's JSON shape, TP=1 and TP=2, the rollout client -------------------------------------------


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(request, reference_checkpoints: Path, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp(f"logprobs-tp{request.param}")
    extra = ["--tp-size", str(request.param), "--collective-timeout-s", "15"]
    with reference_server(
        model=reference_checkpoints / "target", log_dir=log_dir, draft_kind="mtp", extra_args=extra
    ) as server:
        yield server


def _body(prompt, params: SamplingParams, **fields) -> dict:
    sampling = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p}
    if params.sampling_seed is not None:
        sampling["sampling_seed"] = params.sampling_seed
    return {"input_ids": list(prompt), "sampling_params": sampling, **fields}


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["greedy", "t0.7"])
def test_http_answers_sglangs_shape(server, hf_model, sampling: str) -> None:
    params = SAMPLINGS[sampling]
    for prompt in PROMPTS[:2]:
        answer = server.ok("/generate", _body(prompt, params, return_logprob=True))
        meta = answer["meta_info"]
        assert LOGPROB_KEYS <= set(meta)
        assert meta["input_token_logprobs"] == []
        assert meta["output_token_logprobs_length"] == len(answer["output_ids"])
        for triple in meta["output_token_logprobs"]:  # [logprob, token_id, null] lists, as SGLang's JSON
            assert isinstance(triple, list) and len(triple) == 3
            assert isinstance(triple[0], float) and isinstance(triple[1], int) and triple[2] is None
        assert_matches(hf_model, prompt, answer["output_ids"], meta["output_token_logprobs"], params=params)
        if sampling == "greedy":  # accepted MTP tokens are among those checked
            assert meta["spec_accept_length"] >= 2.0
    plain = server.ok("/generate", _body(PROMPTS[0], params))
    assert not LOGPROB_KEYS & set(plain["meta_info"])  # absent, not null, as SGLang


@pytest.mark.slow
def test_http_refuses_unimplemented_options_naming_the_field(server) -> None:
    status, answer = server.post(
        "/generate", _body(PROMPTS[0], SAMPLINGS["greedy"], return_logprob=True, top_logprobs_num=3)
    )
    assert status == 400 and "top_logprobs_num=3" in str(answer)


@pytest.mark.slow
def test_rollout_samples_carry_the_logprobs(server, hf_model) -> None:
    params = SAMPLINGS["t0.7"]

    async def main():
        async with EngineClient(server.url, timeout_s=30.0) as client:
            with_logprobs = await generate_samples(client, PROMPTS, sampling=params, return_logprob=True)
            without = await generate_samples(client, PROMPTS[:1], sampling=params)
        return with_logprobs, without

    samples, (plain,) = asyncio.run(main())
    assert plain.output_logprobs is None
    for sample in samples:
        assert len(sample.output_logprobs) == len(sample.output_ids)
        triples = [(lp, token, None) for lp, token in zip(sample.output_logprobs, sample.output_ids)]
        assert_matches(hf_model, sample.prompt_ids, sample.output_ids, triples, params=params)
