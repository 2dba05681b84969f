"""SGLang 0.5.23's sampling and logprob rules for one row of logits, as the reference scheduler applies them.

Greedy means a temperature below 1e-6 (SGLang normalizes it to temperature 1.0, top_k 1). Sampling draws once per
token (temperature, then top-p) so a seeded request is reproducible. The returned logprob is SGLang's default
quantity: log_softmax of the temperature-scaled logits, before top-p / top-k, on the plain and the speculative path.
"""

from __future__ import annotations

import torch

from miles_sync.wire.protocol import GenerateRequest, SamplingParams

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine

# SGLang's srt/sampling/sampling_params.py:42,245-248: a temperature in [0, 1e-6) is greedy, normalized to
# temperature 1.0 with top_k 1.
_SAMPLING_EPS = 1e-6


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _SAMPLING_EPS


def choose_token(logits: torch.Tensor, *, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from one row of logits: argmax when greedy (`is_greedy`), else temperature + top-p sampling
    with exactly one uniform draw from `generator` (inverse CDF), so a seeded request is reproducible."""
    if is_greedy(params):
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is below top_p.
        keep = (sorted_probs.cumsum(0) - sorted_probs) < params.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    cdf = probs.cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u.reshape(1), right=True).clamp(max=probs.numel() - 1))


def token_logprob(logits: torch.Tensor, token: int, *, params: SamplingParams) -> float:
    """The logprob SGLang 0.5.23 returns for `token` drawn from one row of logits (its default, environment
    variable SGLANG_RETURN_ORIGINAL_LOGPROB unset: srt/environ.py:1508).

    float32 log_softmax(logits / T)[token], T the request's temperature, or 1.0 for a greedy request (SGLang's
    normalized temperature; its all-greedy batches take log_softmax of the raw logits, srt/layers/sampler.py:220-223,
    the same number). Taken before top-p / top-k filtering: SGLang's top-k/top-p samplers work on a sorted copy, and
    `torch.log(probs)` reads the unfiltered temperature-scaled softmax (sampler.py:297-318, 821-825). Clamped to
    float32's most negative finite value, as SGLang clamps (srt/layers/logprob_processor.py:428), so JSON never
    carries -inf.
    """
    temperature = 1.0 if is_greedy(params) else params.temperature
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return float(logprobs[token].clamp(min=torch.finfo(torch.float32).min))


def logprob_problems(request: GenerateRequest) -> list[str]:
    """Problems with the logprob options this engine does not implement, when return_logprob asks for them
    (without it SGLang reads none of them: srt/managers/tokenizer_manager.py:2520, srt/managers/scheduler.py:
    3256-3258). Refused with a 400 naming the field, never ignored."""
    if not request.return_logprob:
        return []
    problems = []
    if request.top_logprobs_num != 0:
        problems.append(f"top_logprobs_num={request.top_logprobs_num} is not supported by the reference engine; send 0")
    if request.token_ids_logprob:  # SGLang treats [] as None (srt/managers/io_struct.py:571)
        problems.append("token_ids_logprob is not supported by the reference engine; send null")
    if request.logprob_start_len != -1:
        problems.append(
            f"logprob_start_len={request.logprob_start_len} is not supported by the reference engine (it returns "
            f"output token logprobs only); send -1"
        )
    return problems
