"""The main job's RL task on the reference language: prompts, a verifiable reward and the policy-gradient batch.

The reference checkpoints are pre-trained on a synthetic language whose next token is a fixed function of the
previous one (`miles_sync.engine.reference.checkpoints.next_token`), so a completion can be scored exactly: the
reward is the share of its tokens that follow the rule. All pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from miles_sync.engine.reference.checkpoints import LanguageRecipe, next_token
from miles_sync.engine.rollout import Sample
from miles_sync.job.trainer import TrainBatch

__all__ = ["LANGUAGE", "make_prompts", "mean_accept_length", "reward", "train_batch"]

LANGUAGE = LanguageRecipe()


def make_prompts(round_index: int, *, num_prompts: int = 4, length: int = 4) -> list[list[int]]:
    """Deterministic prompts in the language: a different start token per prompt and round, continued by the rule."""
    if num_prompts < 1 or length < 1:
        raise ValueError(f"num_prompts={num_prompts} and length={length} must both be at least 1")
    result = []
    for i in range(num_prompts):
        token = (37 * round_index + 61 * i + 5) % LANGUAGE.vocab_size
        prompt = [token]
        for _ in range(length - 1):
            prompt.append(int(next_token(prompt[-1], LANGUAGE)))
        result.append(prompt)
    return result


def reward(sample: Sample) -> float:
    """Share of completion tokens that follow the language's rule from the token before them (0 when empty)."""
    previous = sample.prompt_ids[-1]
    hits = 0
    for token in sample.output_ids:
        hits += int(token == next_token(previous, LANGUAGE))
        previous = token
    return hits / max(1, len(sample.output_ids))


def train_batch(samples: Sequence[Sample], *, baseline: float = 0.0) -> TrainBatch:
    """REINFORCE: each sample's completion log-likelihood weighted by (reward - baseline). With the default zero
    baseline every sample pulls the policy toward itself in proportion to its reward, so the weights move every
    step even when all rewards are equal."""
    if not samples:
        raise ValueError("train_batch needs at least one sample")
    return TrainBatch(
        sequences=tuple(s.prompt_ids + s.output_ids for s in samples),
        num_prompt_tokens=tuple(len(s.prompt_ids) for s in samples),
        rewards=tuple(reward(s) for s in samples),
        baseline=baseline,
    )


def mean_accept_length(samples: Sequence[Sample]) -> float | None:
    """Mean speculative accept length over `samples`; None when the engines run no draft."""
    values = [s.spec_accept_length for s in samples if s.spec_accept_length is not None]
    if not values:
        return None
    if len(values) != len(samples):
        raise ValueError(f"{len(samples) - len(values)} of {len(samples)} samples report no accept length")
    return sum(values) / len(values)
