"""The frozen-draft guard: a session that leaves the draft out must leave its bytes exactly as they were.

miles_sync keeps a frozen draft out of every session with selector `target`, and the reference engine refuses a
selected runner that received nothing. On a server that ignores the selector (an older SGLang, a fork, a custom
scheduler) the draft is still in the session and its non-idempotent post-processing runs again: the bytes change,
the accept length collapses, nothing errors. So the controller keeps each engine's draft digests per TP rank and
role (`draft`, `draft_step_<i>`, as its checker names them), read at connect and after every verified sync, and
after every session whose selector excludes the draft compares the checker's draft answer with them, parameter by
parameter (`draft_changes`). Pure functions over checker answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from miles_sync.sync.verify import ranks_by_tp_rank
from miles_sync.wire.api import EngineAPI
from miles_sync.wire.protocol import (
    RankChecksums,
    Role,
    Selector,
    WeightsCheckerAction,
    WeightsCheckerRequest,
    checksum_role,
    role_kind,
    selector_roles,
)
from miles_sync.wire.text import shorten

__all__: list[str] = []  # nothing here is imported from outside miles_sync.sync

# Per engine TP rank (tp_rank order), the draft roles' entries of the checker's answer: {reported name: digest}.
DraftDigests = tuple[dict[str, str], ...]
_NUM_CHANGES_SHOWN = 4
DRAFT_UNCHANGED = "draft unchanged"  # what a report says of an engine whose guarded draft kept every digest


def guards_draft(selector: Selector) -> bool:
    """Whether a session with `selector` must leave the draft unchanged (it does not select the draft)."""
    return Role.DRAFT not in selector_roles(selector)


def draft_digests(ranks: Sequence[RankChecksums]) -> DraftDigests | None:
    """The draft entries of a checker answer per TP rank, None when the answer has none (no draft runner)."""
    # Ranks whose tp_rank values do not number 0..n-1 keep their answer order; the guard then compares by position.
    ordered = ranks_by_tp_rank(ranks) or list(ranks)
    per_rank = tuple(
        {key: digest for key, digest in rank.checksums.items() if role_kind(checksum_role(key)[0]) is Role.DRAFT}
        for rank in ordered
    )
    return per_rank if any(per_rank) else None


def draft_changes(*, baseline: DraftDigests, current: DraftDigests | None, selector: Selector) -> list[str]:
    """One line per draft parameter whose digest differs from `baseline` (or that appeared or vanished), naming
    rank, role and parameter: "rank 0 draft model.layers.2.eh_proj.weight changed although the session selected
    target". Empty when the draft is byte for byte what it was."""
    current = () if current is None else current
    why = f"although the session selected {selector.value}"
    if len(current) != len(baseline):
        return [f"the draft answered {len(current)} TP rank(s), {len(baseline)} before the session, {why}"]
    changes = []
    for index, (before, after) in enumerate(zip(baseline, current)):
        where = f"rank {index} " if len(baseline) > 1 else ""
        for key in sorted(before.keys() | after.keys()):
            role, name = checksum_role(key)
            if key not in after:
                changes.append(f"{where}{role} {name} vanished {why}")
            elif key not in before:
                changes.append(f"{where}{role} {name} appeared {why}")
            elif before[key] != after[key]:
                changes.append(f"{where}{role} {name} changed {why}")
    return changes


def summarize_changes(changes: Sequence[str]) -> str:
    return shorten(changes, limit=_NUM_CHANGES_SHOWN, sep="; ")


async def read_draft_digests(engines: Sequence[EngineAPI], *, timeout_s: float) -> list[DraftDigests | None]:
    """The draft digests each engine serves now (one checker call each, selector all), as guard baselines. None for
    an engine without a draft, and for one whose checker cannot answer now: it is not guarded until a verified sync
    records its draft, and its verification fails on the same checker first. Never raises."""
    request = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=Selector.ALL)
    answers = await asyncio.gather(
        *(e.weights_checker(request, timeout_s=timeout_s) for e in engines), return_exceptions=True
    )
    return [None if isinstance(a, BaseException) else draft_digests(a.ranks) for a in answers]
