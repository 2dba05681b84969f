"""One round's rollouts: the requests (every prompt's samples on every engine, each with its own seed), their
generation over HTTP with the engines' log-probs, and what the samples show (`rollout_stats`, given the trainer's
recomputed log-probs of the same tokens). Plain; the driver only calls them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from miles_sync.config import MilesSyncConfig
from miles_sync.engine.client import EngineClient
from miles_sync.engine.rollout import Sample, generate_samples
from miles_sync.job.rl import make_prompts, mean_accept_length, reward, rule_share, sampling_seed
from miles_sync.job.run_report import RolloutStats
from miles_sync.job.trainer import CompletionLogprobs, ScoreBatch
from miles_sync.wire.protocol import SamplingParams

__all__ = ["generate_rollouts", "rollout_stats", "round_requests", "score_batch"]

# Per engine, its (prompt, sampling) pairs.
Requests = list[list[tuple[list[int], SamplingParams]]]


def round_requests(config: MilesSyncConfig, index: int, *, num_engines: int) -> Requests:
    """Round `index`'s requests: `samples_per_prompt` of every prompt on every engine, each with its own sampling
    seed (`rl.sampling_seed`). Engine-major, then prompt, then sample."""
    rollout = config.rollout
    prompts = make_prompts(index, num_prompts=rollout.num_prompts, length=rollout.prompt_length)
    return [
        [
            (
                prompt,
                SamplingParams(
                    max_new_tokens=rollout.max_new_tokens,
                    temperature=rollout.temperature,
                    sampling_seed=sampling_seed(
                        config.seed, round_index=index, engine_index=e, prompt_index=p, sample_index=k
                    ),
                ),
            )
            for p, prompt in enumerate(prompts)
            for k in range(rollout.samples_per_prompt)
        ]
        for e in range(num_engines)
    ]


def generate_rollouts(
    urls: Sequence[str], requests: Requests, *, api_key: str | None, timeout_s: float, lora_path: str | None = None
) -> list[Sample]:
    """`requests[e]` on engine `urls[e]`, every request of every engine at once, from this process over HTTP, with
    the engines' log-probs; the samples in request order, engine after engine."""

    async def run() -> list[Sample]:
        clients = [EngineClient(u, timeout_s=timeout_s, api_key=api_key) for u in urls]
        try:
            batches = await asyncio.gather(
                *(
                    generate_samples(client, [prompt], sampling=sampling, return_logprob=True, lora_path=lora_path)
                    for client, pairs in zip(clients, requests, strict=True)
                    for prompt, sampling in pairs
                )
            )
        finally:
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        return [s for batch in batches for s in batch]

    return asyncio.run(run())


def score_batch(samples: Sequence[Sample], *, temperature: float) -> ScoreBatch:
    """The trainer's question about `samples`: the log-prob of every sampled token under its current weights."""
    return ScoreBatch(
        sequences=tuple(s.prompt_ids + s.output_ids for s in samples),
        num_prompt_tokens=tuple(len(s.prompt_ids) for s in samples),
        temperature=temperature,
    )


def rollout_stats(
    samples: Sequence[Sample],
    scored: CompletionLogprobs,
    *,
    urls: Sequence[str],
    version: str,
    earlier: str | None = None,
) -> RolloutStats:
    """Reward, accept length and train/rollout log-prob agreement of `samples`, given the trainer's log-probs of the
    same tokens (`scored`, in sample order, computed with `version`'s weights), and how many tokens each version
    produced. `earlier`: the version the rollouts started under when they ran through the sync (rollout.overlap);
    its tokens may precede `version`'s in a sample, and only `version`'s tokens are compared with the trainer's
    (the earlier ones came from other weights by design)."""
    allowed = (version,) if earlier is None or earlier == version else (earlier, version)
    has_logprobs = all(s.output_logprobs is not None for s in samples)
    diffs: list[float] = []
    tokens: dict[str, int] = {}
    is_tagged = True
    for sample, trainer in zip(samples, scored.logprobs, strict=True):
        versions = sample.token_versions()
        for v in versions:
            tokens[v] = tokens.get(v, 0) + 1
        positions = [allowed.index(v) if v in allowed else -1 for v in versions]
        is_tagged = is_tagged and -1 not in positions and positions == sorted(positions)
        if has_logprobs:
            pairs = zip(trainer, sample.output_logprobs, versions, strict=True)
            diffs += [abs(a - b) for a, b, v in pairs if v == version]
    return RolloutStats(
        reward=mean_reward(samples),
        reward_per_engine=tuple(mean_reward([s for s in samples if s.engine_url == u]) for u in urls),
        rule_share=sum(rule_share(s) for s in samples) / len(samples),
        accept_length=mean_accept_length(samples),
        logprob_diff_max=max(diffs) if diffs else None,
        logprob_diff_mean=sum(diffs) / len(diffs) if diffs else None,
        trainer_step=scored.weight_step,
        samples_tagged=is_tagged and all(s.weight_version in allowed for s in samples),
        num_samples=len(samples),
        tokens_by_version=tuple(tokens.items()),
    )


def mean_reward(samples: Sequence[Sample]) -> float:
    return sum(reward(s) for s in samples) / len(samples) if samples else 0.0
