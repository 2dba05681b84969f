"""What a sync can prove from each engine's `/weights_checker` checksum answer. Pure functions over records.

Each engine passes the strongest check its answer allows (`fleet_verdicts`); `Verdict.method` says which ran:
- "exact" (HF-named digests, the reference engine's default at TP=1, `protocol.ChecksumNames.HF`): the trainer's
  own checksums of what it sent, compared tensor by tensor.
- "engine-exact (sha256)" / "engine-exact (gpu-hash)" (engine-parameter digests, what SGLang answers: fused
  names, its TP shard, after post-processing, SGLang's 16-hex tensor hash: SHA-256 on a CPU server, its Triton
  kernel on a GPU one), when a layout model of the engine exists (miles_sync.sync.engine_digests): the source
  predicted each rank's digests, with the engine's hash, from the HF tensors it sent, and they are compared per
  rank, role and parameter.
- "replica" (engine-parameter digests without a layout model: no weight_layout or device reported, config
  unreadable, an unmodeled family or quantization, or digests that are not 16 hex digits): the engines
  that share a layout (same TP size, same names per rank) are compared with each other; an engine passes when its
  answer equals that of a strict majority of its layout group. Two replicas that disagree both fail, since
  nothing says which one is right. Agreement proves the replicas hold the same bytes, not that those are the
  trainer's: a payload corrupted identically for every engine passes.
- "unverified": a replica group of one; nothing to compare with.

Only the roles the session's selector covers are compared here. A frozen draft left out of the session is checked
by the draft guard (miles_sync.sync.draft_guard): its digests must not change at all.
"""

from __future__ import annotations

import collections
import hashlib
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from miles_sync.sync.engine_digests import EngineLayout, FleetLayouts
from miles_sync.weights.checksum import compare_checksums, sglang_parameter_names, sglang_reported_name
from miles_sync.wire.protocol import RankChecksums, Role, Selector, checksum_role, role_kind, selector_roles
from miles_sync.wire.text import shorten

__all__: list[str] = []  # nothing here is imported from outside miles_sync.sync

EXACT = "exact"
ENGINE_EXACT = "engine-exact"  # the method family; a verdict names its hash too (`engine_exact`)
REPLICA = "replica"
UNVERIFIED = "unverified"
DRAFT_GUARD = "draft guard"  # a frozen draft's digests changed in a session that left it out (draft_guard)
_NUM_NAMES_SHOWN = 4
_NUM_PROBLEMS_SHOWN = 6
_HEX_DIGEST = re.compile(r"[0-9a-f]{16}")  # SGLang's tensor_hash (CPU or GPU) as its checker prints it


def engine_exact(tensor_hash: str) -> str:
    """The method of an engine-exact verdict over digests computed with `tensor_hash` ("sha256", "gpu-hash")."""
    return f"{ENGINE_EXACT} ({tensor_hash})"


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """One engine's verification outcome: `method` is the check that ran (EXACT, ENGINE_EXACT, REPLICA or
    UNVERIFIED); `num_verified` counts the sent HF tensors that matched (exact, engine-exact) or the compared
    engine parameters (replica)."""

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


def has_hex_digests(ranks: Sequence[RankChecksums]) -> bool:
    """Whether the answer has ranks and every digest in it has the form of SGLang's `tensor_hash` (16 lowercase hex
    digits, CPU and GPU alike: which hash it is follows from the server's device, not from the answer)."""
    return bool(ranks) and all(_HEX_DIGEST.fullmatch(d) for rank in ranks for d in rank.checksums.values())


def engine_exact_problems(
    *,
    expected: Sequence[Mapping[str, str]],
    ranks: Sequence[RankChecksums],
    selector: Selector,
    sent_names: Collection[str],
) -> tuple[list[str], int]:
    """The engine-exact check of one engine's engine-parameter answer against the digests predicted for its layout.

    `expected`: per TP rank, {name: digest} with draft names under the role "draft" (`engine_digests`); an answer's
    own draft role ("draft_step_0", ...) is mapped onto them. Ranks are matched by their parallelism_info tp_rank.
    Per rank and selected role, every predicted parameter must be reported with its digest ("differs",
    "missing"), every reported one must be predicted ("extra": held but not sent), and every sent tensor
    (`sent_names`, when known) must be part of some predicted parameter. Returns (problem lines, each naming rank,
    role and parameter; number of sent tensors whose parameters all matched).
    """
    if len(ranks) != len(expected):
        return [f"answered {len(ranks)} TP rank(s); its layout has {len(expected)}"], 0
    ordered = ranks_by_tp_rank(ranks)
    if ordered is None:
        return [f"its ranks' parallelism_info tp_rank values do not number 0..{len(ranks) - 1}"], 0
    roles = selector_roles(selector)
    parts = sglang_parameter_names(sent_names)  # engine parameter -> the sent HF tensors it concatenates
    matched: set[str] = set()
    failed: set[str] = set()
    problems: list[str] = []
    for tp_rank, (rank, held, predicted) in enumerate(
        zip(ordered, selected_checksums(ordered, selector=selector), expected)
    ):
        wanted = _reported_expectation(predicted, roles=roles, draft_roles=_draft_roles(rank, held))
        differs, missing, extra = [], [], []
        for key in sorted(wanted.keys() | held.keys()):
            role, name = checksum_role(key)
            covered = parts.get(name, (name,))
            if held.get(key) == wanted.get(key):
                matched.update(covered)
                continue
            failed.update(covered)
            where = f"rank {tp_rank} {role} {name}"
            if key not in held:
                missing.append(f"{where} missing: expected {wanted[key]}, not reported")
            elif key not in wanted:
                extra.append(f"{where} extra: reported {held[key]}, not predicted from what was sent")
            else:
                differs.append(f"{where} differs: expected {wanted[key]}, got {held[key]}")
        problems += differs + missing + extra
    unheld = sorted(set(sent_names) - matched - failed)
    problems += [f"sent {name}: no runner covered by selector {selector.value!r} holds it" for name in unheld]
    return problems, len((matched - failed) & set(sent_names))


def ranks_by_tp_rank(ranks: Sequence[RankChecksums]) -> list[RankChecksums] | None:
    """The ranks in tp_rank order (their position where a rank has no parallelism_info); None if not 0..n-1."""
    numbers = [r.parallelism_info[0].tp_rank if r.parallelism_info else i for i, r in enumerate(ranks)]
    if sorted(numbers) != list(range(len(ranks))):
        return None
    return [rank for _, rank in sorted(zip(numbers, ranks), key=lambda pair: pair[0])]


def _draft_roles(rank: RankChecksums, held: Mapping[str, str]) -> list[str]:
    """The draft role names a rank answers for ("draft", "draft_step_<i>"), "draft" when it names none."""
    named = {info.role for info in rank.parallelism_info} | {checksum_role(key)[0] for key in held}
    return sorted(r for r in named if role_kind(r) is Role.DRAFT) or [Role.DRAFT.value]


def _reported_expectation(
    predicted: Mapping[str, str], *, roles: Collection[Role], draft_roles: Sequence[str]
) -> dict[str, str]:
    wanted = {}
    for key, digest in predicted.items():
        role, name = checksum_role(key)
        kind = role_kind(role)
        if kind in roles:
            for role_name in draft_roles if kind is Role.DRAFT else (role,):
                wanted[sglang_reported_name(role_name, name)] = digest
    return wanted


def fleet_verdicts(
    *,
    answers: Mapping[str, Sequence[RankChecksums]],
    selector: Selector,
    sent: Mapping[str, str],
    hf_named: Collection[str],
    predicted: Mapping[str, Sequence[Mapping[str, str]]],
    fallbacks: Mapping[str, str] | None = None,
    hashes: Mapping[str, str] | None = None,
    sent_names: Collection[str] | None = None,
) -> dict[str, Verdict]:
    """Every engine's verdict by the strongest check its answer allows (see the module docstring).

    `answers`: per engine URL, its checksum answer. `sent`: the trainer's HF checksums of what it sent. `hf_named`:
    URLs answering HF-named digests (exact). `predicted`: per URL with a layout model, the expected per-rank engine
    digests (engine-exact, when its answer holds 16-hex digests), computed with `hashes[url]` (default "sha256"),
    which the verdict names. Every other engine goes to the replica check; `fallbacks` says why it had no layout
    model, and a failure message carries that reason. `sent_names`: every HF tensor sent, where `sent` does not
    name them all (default: `sent`'s names).
    """
    reasons = dict(fallbacks or {})
    verdicts: dict[str, Verdict] = {}
    for url in hf_named:
        problems, num_verified = checksum_problems(sent=sent, ranks=answers[url], selector=selector)
        message = shorten(problems, limit=_NUM_PROBLEMS_SHOWN, sep="; ")
        verdicts[url] = Verdict(passed=not problems, method=EXACT, message=message, num_verified=num_verified)
    for url, expected in predicted.items():
        if url in verdicts:
            continue
        if not has_hex_digests(answers[url]):
            reasons[url] = "its digests are not 16-hex tensor hashes"
            continue
        problems, num_verified = engine_exact_problems(
            expected=expected,
            ranks=answers[url],
            selector=selector,
            sent_names=sent.keys() if sent_names is None else sent_names,
        )
        message = shorten(problems, limit=_NUM_PROBLEMS_SHOWN, sep="; ")
        method = engine_exact((hashes or {}).get(url, "sha256"))
        verdicts[url] = Verdict(passed=not problems, method=method, message=message, num_verified=num_verified)
    rest = {url: ranks for url, ranks in answers.items() if url not in verdicts}
    for url, verdict in replica_verdicts(rest, selector=selector).items():
        if url in reasons and not verdict.passed:
            verdict = Verdict(
                passed=False,
                method=verdict.method,
                message=f"{verdict.message} (no engine-exact check: {reasons[url]})",
                num_verified=verdict.num_verified,
            )
        verdicts[url] = verdict
    return verdicts


def sent_verdicts(
    *,
    answers: Mapping[str, Sequence[RankChecksums]],
    selector: Selector,
    checksums: Mapping[str, str],
    engine_checksums: Mapping[EngineLayout, Sequence[Mapping[str, str]]],
    layouts: FleetLayouts,
    hf_named: Collection[str],
    sent_names: Collection[str] | None = None,
) -> dict[str, Verdict]:
    """`fleet_verdicts` for what the source sent (or would send): its HF `checksums` (and `sent_names`, every HF
    tensor sent, where the checksums do not name them all) and, per layout, its predicted `engine_checksums`; an
    engine whose layout the source did not predict goes to the replica check, saying so."""
    predicted = {url: engine_checksums[layout] for url, layout in layouts.by_url.items() if layout in engine_checksums}
    unpredicted = {url: "the source sent no digests for its layout" for url in layouts.by_url if url not in predicted}
    return fleet_verdicts(
        answers=answers,
        selector=selector,
        sent=checksums,
        hf_named=hf_named,
        predicted=predicted,
        fallbacks={**layouts.fallbacks, **unpredicted},
        hashes={url: layout.tensor_hash.value for url, layout in layouts.by_url.items()},
        sent_names=sent_names,
    )


def is_against_trainer(verdict: Verdict) -> bool:
    """Whether a verdict compared the engine with the trainer's own bytes (exact or engine-exact), not only with
    other engines (replica) or with nothing (unverified)."""
    return verdict.method == EXACT or verdict.method.startswith(ENGINE_EXACT)


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
