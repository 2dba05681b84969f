"""What a sync can prove from each engine's `/weights_checker` checksum answer. Pure functions over records.

Two kinds of answers, told apart at connect (`protocol.ChecksumNames`):
- HF-named digests (the reference engine's default): the trainer's own checksums of what it sent are compared
  tensor by tensor ("exact").
- Engine-parameter digests (what SGLang answers: fused names, its TP shard, after post-processing): no trainer-side
  number predicts them, so the engines that share a layout (same TP size, same names per rank) are compared with
  each other ("replica"): an engine passes when its answer equals that of a strict majority of its layout group.
  A group of one cannot be checked ("unverified"); two replicas that disagree both fail, since nothing says which
  one is right. Agreement proves the replicas hold the same bytes, not that those are the trainer's: a payload
  corrupted identically for every engine passes; the exact check needs HF-named digests.

Only the roles the session's selector covers are compared: a frozen draft's digests are never read.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from miles_sync.weights.checksum import compare_checksums
from miles_sync.wire.protocol import RankChecksums, Selector, checksum_role, role_kind, selector_roles
from miles_sync.wire.text import shorten

__all__ = [
    "EXACT",
    "REPLICA",
    "UNVERIFIED",
    "Verdict",
    "checksum_problems",
    "replica_verdicts",
    "selected_checksums",
    "weights_digest",
]

EXACT = "exact"
REPLICA = "replica"
UNVERIFIED = "unverified"
_NUM_NAMES_SHOWN = 4


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """One engine's verification outcome: `method` is the check that ran (EXACT, REPLICA or UNVERIFIED)."""

    passed: bool
    method: str
    message: str = ""
    num_verified: int = 0


def selected_checksums(ranks: Sequence[RankChecksums], *, selector: Selector) -> tuple[dict[str, str], ...]:
    """Per engine rank, the reported (role-prefixed) name -> digest entries of the roles `selector` covers."""
    roles = selector_roles(selector)
    return tuple(
        {name: d for name, d in rank.checksums.items() if role_kind(checksum_role(name)[0]) in roles} for rank in ranks
    )


def weights_digest(ranks: Sequence[RankChecksums], *, selector: Selector) -> str:
    """One SHA-256 over every rank's selected entries (rank order kept, names sorted): equal iff the engine
    reported the same digests under the same names on every rank."""
    h = hashlib.sha256()
    for index, checksums in enumerate(selected_checksums(ranks, selector=selector)):
        h.update(f"rank {index}\n".encode())
        for name in sorted(checksums):
            h.update(f"{len(name)}:{name}{checksums[name]}\n".encode())
    return h.hexdigest()


def checksum_problems(
    *, sent: Mapping[str, str], ranks: Sequence[RankChecksums], selector: Selector
) -> tuple[list[str], int]:
    """The exact check of one engine's HF-named answer against the trainer's checksums of what it sent.

    Per engine rank, restricted to the roles `selector` covers (draft names carry their role as prefix, e.g.
    "draft." or "draft_step_0."): every tensor a selected runner holds must have been sent with the same checksum
    ("differs" / "extra": held but not sent), and every sent tensor must be held by some selected runner.
    Returns (problem lines, number of tensors that matched).
    """
    problems: list[str] = [] if ranks else ["the engine reported no checksums"]
    num_verified = 0
    for index, held in enumerate(selected_checksums(ranks, selector=selector)):
        where = f"rank {index}: " if len(ranks) > 1 else ""
        keys_by_name: dict[str, list[str]] = collections.defaultdict(list)
        for key in held:
            keys_by_name[checksum_role(key)[1]].append(key)
        expected: dict[str, str] = {}
        for name, checksum in sent.items():
            keys = keys_by_name.get(name, [])
            if not keys:
                problems.append(f"{where}sent {name}: no runner covered by selector {selector.value!r} holds it")
            expected.update((key, checksum) for key in keys)
        problems.extend(where + line for line in compare_checksums(expected, held))
        num_verified += sum(1 for key, checksum in expected.items() if held.get(key) == checksum)
    return problems, num_verified


def replica_verdicts(answers: Mapping[str, Sequence[RankChecksums]], *, selector: Selector) -> dict[str, Verdict]:
    """The replica check over engines answering engine-parameter digests (see the module docstring)."""
    groups: dict[tuple, list[str]] = collections.defaultdict(list)
    selected = {url: selected_checksums(ranks, selector=selector) for url, ranks in answers.items()}
    for url, per_rank in selected.items():
        groups[tuple(frozenset(checksums) for checksums in per_rank)].append(url)
    verdicts: dict[str, Verdict] = {}
    for layout, urls in groups.items():
        if not layout or not any(layout):
            verdicts.update((u, Verdict(passed=False, method=REPLICA, message="reported no checksums")) for u in urls)
            continue
        if len(urls) == 1:
            verdicts[urls[0]] = Verdict(
                passed=True, method=UNVERIFIED, message="no other engine with its layout to compare with"
            )
            continue
        digests = {u: weights_digest(answers[u], selector=selector) for u in urls}
        (majority, count), *_ = collections.Counter(digests.values()).most_common(1)
        num_tensors = sum(len(names) for names in layout)
        for url in urls:
            if 2 * count > len(urls) and digests[url] == majority:
                verdicts[url] = Verdict(passed=True, method=REPLICA, num_verified=num_tensors)
                continue
            # Not all agree (else this one would pass): some replica answered differently.
            reference = next(u for u in urls if digests[u] != digests[url])
            differing = _differing(selected[url], selected[reference])
            agree = "no majority of them agrees" if 2 * count <= len(urls) else f"{count} of them agree"
            verdicts[url] = Verdict(
                passed=False,
                method=REPLICA,
                message=f"its digests differ from those of the replicas with its layout ({len(urls)} engines, "
                f"{agree}); differing vs {reference}: {differing}",
            )
    return verdicts


def _differing(ours: Sequence[Mapping[str, str]], theirs: Sequence[Mapping[str, str]]) -> str:
    names = [
        (f"rank {i}: " if len(ours) > 1 else "") + name
        for i, (a, b) in enumerate(zip(ours, theirs))
        for name in sorted(a)
        if a[name] != b.get(name)
    ]
    return shorten(names, limit=_NUM_NAMES_SHOWN)
