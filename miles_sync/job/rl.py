"""The main job's RL task on the reference language: prompts, a verifiable reward, GRPO advantages and the
policy-gradient batch. All pure.

The reference checkpoints are pre-trained on a synthetic language whose next token is a fixed function of the
previous one (`miles_sync.engine.reference.checkpoints.next_token`): x -> (5x + 17) mod 256. The task rewards what
that pre-training never taught: the reward is the share of completion tokens that are multiples of 4
(`TARGET_RESIDUE` mod `REWARD_MODULUS`). The rule steps every token's residue mod 4 by one (5x + 17 = x + 1 mod
4), so a policy that follows it scores 1/4, and only breaking the rule raises the reward. The pre-training's 5%
of uniformly random tokens leaves the policy enough mass off the rule for sampled rollouts to explore.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from miles_sync.engine.reference.checkpoints import LanguageRecipe, next_token
from miles_sync.engine.rollout import Sample
from miles_sync.job.trainer import TrainBatch

__all__ = ["grpo_batch", "make_prompts"]

LANGUAGE = LanguageRecipe()
REWARD_MODULUS = 4
TARGET_RESIDUE = 0
_ADVANTAGE_EPS = 1e-6  # keeps a group whose rewards barely differ from blowing its advantages up


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
    """Share of completion tokens that are multiples of `REWARD_MODULUS` (0 when empty)."""
    hits = sum(token % REWARD_MODULUS == TARGET_RESIDUE for token in sample.output_ids)
    return hits / max(1, len(sample.output_ids))


def rule_share(sample: Sample) -> float:
    """Share of completion tokens that follow the pre-training rule from the token before them (0 when empty): how
    far the policy has moved off the language it was pre-trained on (and off what a frozen draft predicts)."""
    previous = sample.prompt_ids[-1]
    hits = 0
    for token in sample.output_ids:
        hits += int(token == next_token(previous, LANGUAGE))
        previous = token
    return hits / max(1, len(sample.output_ids))


def sampling_seed(seed: int, *, round_index: int, engine_index: int, prompt_index: int, sample_index: int) -> int:
    """The sampling seed of one rollout request: distinct per (round, engine, prompt, sample), so the samples of a
    group differ, and the same for the same run seed, so a run is reproducible. A 31-bit non-negative int."""
    key = f"{seed}/{round_index}/{engine_index}/{prompt_index}/{sample_index}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little") & 0x7FFFFFFF


def group_advantages(samples: Sequence[Sample]) -> tuple[float, ...]:
    """GRPO advantages: each sample's reward minus its group's mean, over the group's standard deviation (+ eps).
    A group is every sample of the same prompt (across engines). A group whose rewards are all equal gets zeros:
    it says nothing about which completion is better. Order follows `samples`."""
    groups: dict[tuple[int, ...], list[float]] = {}
    rewards = [reward(s) for s in samples]
    for s, r in zip(samples, rewards):
        groups.setdefault(s.prompt_ids, []).append(r)
    stats = {}
    for prompt, values in groups.items():
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1))
        stats[prompt] = (mean, std)
    return tuple(
        (r - stats[s.prompt_ids][0]) / (stats[s.prompt_ids][1] + _ADVANTAGE_EPS) for s, r in zip(samples, rewards)
    )


def grpo_batch(samples: Sequence[Sample]) -> TrainBatch:
    """The GRPO batch of these rollouts: each sample's completion log-likelihood weighted by its group-relative
    advantage (`group_advantages`). One on-policy step per batch, so the PPO ratio is 1 and clipping never binds:
    the step is the plain GRPO policy gradient."""
    if not samples:
        raise ValueError("train_batch needs at least one sample")
    return TrainBatch(
        sequences=tuple(s.prompt_ids + s.output_ids for s in samples),
        num_prompt_tokens=tuple(len(s.prompt_ids) for s in samples),
        rewards=tuple(reward(s) for s in samples),
        advantages=group_advantages(samples),
    )


def train_batch(samples: Sequence[Sample], *, baseline: float = 0.0) -> TrainBatch:
    """REINFORCE: each sample's completion log-likelihood weighted by (reward - baseline). With the default zero
    baseline every sample pulls the policy toward itself in proportion to its reward, so the weights move every
    step even when all rewards are equal (what the sync tests need from greedy rollouts; the main job takes
    `grpo_batch`)."""
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
