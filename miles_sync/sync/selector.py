"""The one place that decides which engine runners a weight update session covers.

Why it matters: SGLang post-processes, at the end of every session, every runner the session's selector covers.
Some of that processing is a non-idempotent layout transform (AITER shuffle, Marlin repack). A frozen speculative
draft that is in the session but receives no bytes gets its already-transformed weights transformed again: wrong
layout, wrong draft predictions, no error. So the selector excludes the draft exactly when the draft is frozen, and
a selector that includes a draft the export cannot feed is an error before anything is sent.
"""

from __future__ import annotations

from collections.abc import Collection

from miles_sync.export.registry import ConversionMode
from miles_sync.wire.codec import WireEnum
from miles_sync.wire.draft import DraftKind, DraftReport
from miles_sync.wire.protocol import Role, Selector, selector_roles
from miles_sync.wire.text import shorten

__all__ = ["SelectorMode", "resolve_selector", "selector_input_problems", "weight_update_selector"]

_NUM_NAMES_SHOWN = 3  # how many of a draft's parameter names an error message lists


class SelectorMode(WireEnum):
    """The user's choice: auto (weight_update_selector decides) or a fixed selector."""

    AUTO = "auto"
    TARGET = "target"
    DRAFT = "draft"
    ALL = "all"


def weight_update_selector(
    *,
    speculative_algorithm: str | None,
    num_trained_mtp_layers: int,
    conversion_mode: ConversionMode,
    draft: DraftReport | None = None,
    exported_names: Collection[str] | None = None,
) -> Selector:
    """`target` when speculative decoding is on and the draft is frozen, else `all`.

    The draft counts as frozen when no MTP layers are trained and the conversion is raw (the raw converter cannot
    emit draft weights). With a draft report: a report saying the draft is frozen, or an ngram draft (no draft
    runner), gives `target` whatever the other inputs say. If the result includes a draft runner and
    `exported_names` covers none of the draft's owned names, raises ValueError naming the draft kind and some of
    its names. `speculative_algorithm` None means speculative decoding is off.
    """
    _check_inputs(speculative_algorithm=speculative_algorithm, num_trained_mtp_layers=num_trained_mtp_layers)
    conversion_mode = ConversionMode(conversion_mode)
    is_speculative = speculative_algorithm is not None
    is_frozen_by_config = num_trained_mtp_layers == 0 and conversion_mode is ConversionMode.RAW
    # The engine's report is the ground truth about its draft, so it wins even over a config that says
    # speculative decoding is off: selecting a frozen draft runner is exactly the double-finalize bug.
    is_frozen_by_report = draft is not None and (draft.is_frozen or draft.kind is DraftKind.NGRAM)
    if is_frozen_by_report or (is_speculative and is_frozen_by_config):
        selector = Selector.TARGET
    else:
        selector = Selector.ALL
    _check_draft_coverage(selector, draft=draft, exported_names=exported_names)
    return selector


def resolve_selector(
    mode: SelectorMode,
    *,
    speculative_algorithm: str | None,
    num_trained_mtp_layers: int,
    conversion_mode: ConversionMode,
    draft: DraftReport | None = None,
    exported_names: Collection[str] | None = None,
) -> Selector:
    """The selector of a session: `auto` defers to weight_update_selector; a fixed mode is a user override.

    An override is still cross-checked: `draft` needs speculative decoding and a draft runner, and a selector that
    includes a draft runner the export cannot feed raises ValueError, whatever chose it.
    """
    mode = SelectorMode(mode)
    if mode is SelectorMode.AUTO:
        return weight_update_selector(
            speculative_algorithm=speculative_algorithm,
            num_trained_mtp_layers=num_trained_mtp_layers,
            conversion_mode=conversion_mode,
            draft=draft,
            exported_names=exported_names,
        )
    _check_inputs(speculative_algorithm=speculative_algorithm, num_trained_mtp_layers=num_trained_mtp_layers)
    selector = Selector(mode.value)
    if selector is Selector.DRAFT:
        problems = []
        if speculative_algorithm is None:
            problems.append("speculative decoding is off (speculative_algorithm is None)")
        if draft is not None and not draft.has_runner:
            problems.append(f"the engine's draft kind {draft.kind.value!r} has no draft runner")
        if problems:
            raise ValueError(f"selector 'draft' selects no runner: {'; '.join(problems)}")
    _check_draft_coverage(selector, draft=draft, exported_names=exported_names)
    return selector


def selector_input_problems(*, speculative_algorithm: str | None, num_trained_mtp_layers: int) -> list[str]:
    """What is wrong with the selector's user inputs (empty: nothing). The one check: config and trainer use it."""
    problems = []
    if speculative_algorithm is not None and not speculative_algorithm.strip():
        problems.append(f"speculative_algorithm={speculative_algorithm!r} must be None (off) or a non-empty name")
    if num_trained_mtp_layers < 0:
        problems.append(f"num_trained_mtp_layers={num_trained_mtp_layers} must be non-negative")
    return problems


def _check_inputs(*, speculative_algorithm: str | None, num_trained_mtp_layers: int) -> None:
    problems = selector_input_problems(
        speculative_algorithm=speculative_algorithm, num_trained_mtp_layers=num_trained_mtp_layers
    )
    if problems:
        raise ValueError("; ".join(problems))


def _check_draft_coverage(
    selector: Selector, *, draft: DraftReport | None, exported_names: Collection[str] | None
) -> None:
    """A selected draft runner that would receive none of its names would be finalized on stale bytes."""
    if draft is None or exported_names is None or not draft.has_runner:
        return
    if Role.DRAFT not in selector_roles(selector):
        return
    exported = exported_names if isinstance(exported_names, (set, frozenset)) else frozenset(exported_names)
    if any(name in exported for name in draft.owned_names):
        return
    if draft.owned_names:
        shown = shorten(map(repr, draft.owned_names), limit=_NUM_NAMES_SHOWN)
        problem = f"the export covers none of its parameters ({shown})"
    else:
        problem = "the engine reports no parameter names for it, so no export can feed it"
    raise ValueError(
        f"selector {selector.value!r} includes the {draft.kind.value} draft, but {problem}; a draft that receives "
        f"nothing must not be in the session (override the selector with sync.selector=target to leave the draft "
        f"out, or train and export the draft's layers)"
    )
