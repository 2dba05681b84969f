"""Speculative decoding: draft proposers and the verification rule.

A proposer suggests up to K tokens per sequence; the target scores sequence + proposal in one forward and
`accept_tokens` keeps the longest prefix the target agrees with plus one token of its own (the bonus), so each
verify step emits between 1 and K + 1 tokens. Drafts propose greedily. Verification asks the target for its own
choice at each position in turn and stops at the first disagreement, so the emitted tokens are exactly what the
target alone would have produced, greedy or sampled (one random draw per emitted token, in order).

Proposers (`create_proposer`):
- `mtp`: the MTP head reads (x_{i+1}, h_i) for every position, h being the target's final hidden state, and runs
  recurrently with its own hidden state for steps 2..K. It needs the target hidden states of the sequence,
  which the scheduler keeps from the previous verify step; a sequence without them gets no proposal.
- `standalone`: a smaller causal LM of the same vocabulary, K greedy steps.
- `ngram`: prompt lookup; the continuation of the most recent earlier occurrence of the sequence's last n tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from miles_sync.engine.reference.runner_api import ServedRunner

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine

PROPOSER_KINDS = ("mtp", "standalone", "ngram")


@dataclass(frozen=True, kw_only=True)
class DraftInput:
    """One sequence to draft for: its tokens, its proposal budget and, for MTP, the target hidden states of
    positions 0..len(token_ids)-2 ([len - 1, hidden]; None when not computed with the current weights)."""

    token_ids: Sequence[int]
    max_tokens: int
    target_hidden: torch.Tensor | None = None


class Proposer(Protocol):
    """Proposes draft tokens for a batch of sequences. Called under the weights lock, in inference mode."""

    num_steps: int  # K, the most tokens proposed per sequence and step
    needs_target_hidden: bool  # whether the scheduler must keep each sequence's target hidden states

    def propose(self, inputs: Sequence[DraftInput]) -> list[list[int]]:
        """One list per input, at most min(num_steps, max_tokens) tokens each (possibly empty)."""
        ...


def pad_right(rows: Sequence[Sequence[int]], *, pad_id: int = 0) -> torch.Tensor:
    """[B, max_len] int64 batch, right-padded. Causal models are exact at real positions under right padding."""
    width = max(len(r) for r in rows)
    batch = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
    return batch


def accept_tokens(proposal: Sequence[int], choose: Callable[[int], int]) -> tuple[list[int], int]:
    """The tokens one verify step emits, and how many of them are accepted draft tokens.

    `choose(j)` is the target's token at proposal position j (j = 0..len(proposal)); it is called lazily, in
    order, and only until the first disagreement, so a sampled `choose` draws exactly once per emitted token.
    """
    emitted = []
    for j, drafted in enumerate(proposal):
        token = choose(j)
        emitted.append(token)
        if token != drafted:
            return emitted, j
    emitted.append(choose(len(proposal)))
    return emitted, len(proposal)


class MTPProposer:
    """Recurrent MTP drafting: step 1 reads the target's hidden state, steps 2..K the head's own."""

    needs_target_hidden = True

    def __init__(self, *, draft: ServedRunner, target: ServedRunner, num_steps: int) -> None:
        if not draft.is_mtp or target.is_mtp:
            raise ValueError(f"MTP drafting needs an MTP draft runner and a causal LM target; got {draft}, {target}")
        self.num_steps = num_steps
        self._head = draft.model
        self._shared = target.model.shared_modules()  # empty for a multi-rank engine: each rank passes its own

    def propose(self, inputs: Sequence[DraftInput]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in inputs]
        # Per active row: the head's inputs so far (x_{i+1} ids and h_i rows) and its budget.
        active = [
            i for i, x in enumerate(inputs) if x.target_hidden is not None and min(self.num_steps, x.max_tokens) > 0
        ]
        if not active:
            return proposals
        next_ids = {i: list(inputs[i].token_ids[1:]) for i in active}
        hiddens = {i: inputs[i].target_hidden for i in active}
        budget = {i: min(self.num_steps, inputs[i].max_tokens) for i in active}
        for _ in range(self.num_steps):
            rows = [i for i in active if len(proposals[i]) < budget[i]]
            if not rows:
                break
            ids = pad_right([next_ids[i] for i in rows])
            hidden = torch.zeros(len(rows), ids.shape[1], hiddens[rows[0]].shape[-1], dtype=hiddens[rows[0]].dtype)
            for b, i in enumerate(rows):
                hidden[b, : hiddens[i].shape[0]] = hiddens[i]
            out = self._head(ids, hidden, **self._shared)
            for b, i in enumerate(rows):
                last = len(next_ids[i]) - 1
                token = int(out.logits[b, last].argmax())
                proposals[i].append(token)
                next_ids[i].append(token)
                hiddens[i] = torch.cat([hiddens[i], out.hidden[b, last : last + 1]])
        return proposals


class StandaloneProposer:
    """K greedy steps of a separate, smaller causal LM (full recompute per step: these models are tiny)."""

    needs_target_hidden = False

    def __init__(self, *, draft: ServedRunner, target: ServedRunner, num_steps: int) -> None:
        if draft.is_mtp:
            raise ValueError(f"standalone drafting needs a causal LM draft runner; got {draft}")
        draft_vocab, target_vocab = draft.model.config.vocab_size, target.model.config.vocab_size
        if draft_vocab != target_vocab:
            raise ValueError(f"draft vocab_size={draft_vocab} differs from target vocab_size={target_vocab}")
        self.num_steps = num_steps
        self._model = draft.model

    def propose(self, inputs: Sequence[DraftInput]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in inputs]
        budget = [min(self.num_steps, x.max_tokens) for x in inputs]
        for _ in range(self.num_steps):
            rows = [i for i in range(len(inputs)) if len(proposals[i]) < budget[i]]
            if not rows:
                break
            seqs = [list(inputs[i].token_ids) + proposals[i] for i in rows]
            logits = self._model(pad_right(seqs)).logits
            for b, i in enumerate(rows):
                proposals[i].append(int(logits[b, len(seqs[b]) - 1].argmax()))
        return proposals


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = max_ngram..1), propose what
    followed it. No model; proposals are empty when nothing repeats."""

    needs_target_hidden = False

    def __init__(self, *, num_steps: int, max_ngram: int = 3) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram={max_ngram} must be at least 1")
        self.num_steps = num_steps
        self.max_ngram = max_ngram

    def propose(self, inputs: Sequence[DraftInput]) -> list[list[int]]:
        return [self._lookup(list(x.token_ids), min(self.num_steps, x.max_tokens)) for x in inputs]

    def _lookup(self, tokens: list[int], budget: int) -> list[int]:
        if budget <= 0:
            return []
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + budget]
        return []


def create_proposer(kind: str, *, target: ServedRunner, draft: ServedRunner | None, num_steps: int) -> Proposer:
    """The proposer for a draft kind ("mtp", "standalone", "ngram"); mtp and standalone need a draft runner."""
    kind = str(getattr(kind, "value", kind))
    if kind not in PROPOSER_KINDS:
        raise ValueError(f"draft kind {kind!r} is not one of {', '.join(PROPOSER_KINDS)}")
    if num_steps < 1:
        raise ValueError(f"spec_steps={num_steps} must be at least 1")
    if kind == "ngram":
        if draft is not None:
            raise ValueError("the ngram draft has no draft runner; got one")
        return NgramProposer(num_steps=num_steps)
    if draft is None:
        raise ValueError(f"draft kind {kind!r} needs a draft runner")
    factory = MTPProposer if kind == "mtp" else StandaloneProposer
    return factory(draft=draft, target=target, num_steps=num_steps)
