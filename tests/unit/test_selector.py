"""The selector decision, table-tested over every combination of its inputs.

The expectation below is written from the rule as stated in the design (a truth table of "who says the draft is
frozen"), not from the implementation, so a slip in either shows up as a mismatch.
"""

from __future__ import annotations

import itertools
import json

import pytest

from miles_sync.export.registry import ConversionMode
from miles_sync.sync.selector import SelectorMode, resolve_selector, weight_update_selector
from miles_sync.wire import protocol
from miles_sync.wire.draft import DraftKind, DraftReport
from miles_sync.wire.protocol import Selector

DRAFT_NAMES = ("model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "x")
ALGORITHMS = [None, "EAGLE", "NGRAM"]
LAYERS = [0, 1, 2]
MODES = list(ConversionMode)
DRAFTS = [None] + [
    DraftReport(kind=kind, owned_names=names, is_frozen=frozen)
    for kind in DraftKind
    for names in ((), DRAFT_NAMES)
    for frozen in (False, True)
]
EXPORTS = [None, frozenset({"model.norm.weight", DRAFT_NAMES[1]}), ("model.norm.weight", "lm_head.weight")]

ERROR = "error"


def _expected(algorithm, layers, mode, draft, exported):
    """Target iff someone can prove the draft frozen; a selected draft runner that gets no bytes is an error."""
    spec_on = algorithm is not None
    frozen_by_config = {
        (True, "raw", True): True,  # spec on, raw, no MTP layers trained: the Miles frozen-draft case
    }.get((spec_on, str(mode), layers == 0), False)
    frozen_by_report = draft is not None and (draft.is_frozen or draft.kind == "ngram")
    selector = "target" if (frozen_by_config or frozen_by_report) else "all"
    draft_runner_selected = selector == "all" and draft is not None and draft.kind in ("mtp", "standalone")
    if draft_runner_selected and exported is not None and not set(exported) & set(draft.owned_names):
        return ERROR
    return selector


def _call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs).value
    except ValueError:
        return ERROR


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_weight_update_selector_table(algorithm):
    rows = list(itertools.product([algorithm], LAYERS, MODES, DRAFTS, EXPORTS))
    mismatches = []
    for algorithm, layers, mode, draft, exported in rows:
        got = _call(
            weight_update_selector,
            speculative_algorithm=algorithm,
            num_trained_mtp_layers=layers,
            conversion_mode=mode,
            draft=draft,
            exported_names=exported,
        )
        want = _expected(algorithm, layers, mode, draft, exported)
        if got != want:
            mismatches.append((algorithm, layers, mode.value, draft, exported, got, want))
    assert not mismatches, mismatches[:5]
    outcomes = {_expected(*row) for row in rows}
    assert outcomes == {"target", "all", ERROR}  # the table exercises every outcome


@pytest.mark.parametrize(
    ("algorithm", "layers", "mode", "expected"),
    [
        ("EAGLE", 0, ConversionMode.RAW, Selector.TARGET),  # frozen draft: the public bug report's setup
        ("EAGLE", 1, ConversionMode.RAW, Selector.ALL),  # MTP trained: the draft receives its layers
        ("EAGLE", 0, ConversionMode.BRIDGE, Selector.ALL),  # the bridge can emit draft weights
        (None, 0, ConversionMode.RAW, Selector.ALL),  # no speculative decoding: nothing to exclude
    ],
)
def test_config_only_rows(algorithm, layers, mode, expected):
    got = weight_update_selector(speculative_algorithm=algorithm, num_trained_mtp_layers=layers, conversion_mode=mode)
    assert got is expected


def test_mode_given_as_string_is_accepted():
    got = weight_update_selector(speculative_algorithm="EAGLE", num_trained_mtp_layers=0, conversion_mode="raw")
    assert got is Selector.TARGET


def test_uncovered_draft_error_names_kind_and_some_names():
    draft = DraftReport(kind=DraftKind.MTP, owned_names=DRAFT_NAMES)
    with pytest.raises(ValueError) as info:
        weight_update_selector(
            speculative_algorithm="EAGLE",
            num_trained_mtp_layers=1,
            conversion_mode=ConversionMode.RAW,
            draft=draft,
            exported_names=["model.norm.weight"],
        )
    message = str(info.value)
    assert "'all' includes the mtp draft" in message
    assert all(repr(name) in message for name in DRAFT_NAMES[:3])
    assert "and 1 more" in message and "'x'" not in message


def test_draft_without_names_cannot_be_fed():
    draft = DraftReport(kind=DraftKind.STANDALONE)
    with pytest.raises(ValueError, match="standalone draft, but the engine reports no parameter names for it"):
        weight_update_selector(
            speculative_algorithm="STANDALONE",
            num_trained_mtp_layers=0,
            conversion_mode=ConversionMode.BRIDGE,
            draft=draft,
            exported_names=["model.norm.weight"],
        )


@pytest.mark.parametrize(
    ("algorithm", "layers", "message"),
    [
        ("", 0, "speculative_algorithm='' must be None"),
        ("  ", 0, "speculative_algorithm='  ' must be None"),
        ("EAGLE", -1, "num_trained_mtp_layers=-1 must be non-negative"),
    ],
)
def test_bad_inputs_are_named(algorithm, layers, message):
    for mode in SelectorMode:
        with pytest.raises(ValueError, match=message):
            resolve_selector(
                mode, speculative_algorithm=algorithm, num_trained_mtp_layers=layers, conversion_mode="raw"
            )


def test_auto_mode_equals_weight_update_selector():
    rows = itertools.product(ALGORITHMS[:2], LAYERS[:2], MODES, DRAFTS, EXPORTS)
    for algorithm, layers, mode, draft, exported in rows:
        kwargs = dict(
            speculative_algorithm=algorithm,
            num_trained_mtp_layers=layers,
            conversion_mode=mode,
            draft=draft,
            exported_names=exported,
        )
        assert _call(resolve_selector, SelectorMode.AUTO, **kwargs) == _call(weight_update_selector, **kwargs)


def _expected_override(mode, algorithm, draft, exported):
    """A fixed selector is taken as given, except where it selects no runner or a runner that gets no bytes."""
    has_runner = draft is None or draft.kind in ("mtp", "standalone")
    if mode == "draft" and (algorithm is None or not has_runner):
        return ERROR
    includes_draft = mode in ("draft", "all")
    if includes_draft and draft is not None and has_runner and exported is not None:
        if not set(exported) & set(draft.owned_names):
            return ERROR
    return mode


def test_override_table():
    modes = [SelectorMode.TARGET, SelectorMode.DRAFT, SelectorMode.ALL]
    mismatches = []
    for mode, algorithm, layers, conv, draft, exported in itertools.product(
        modes, ALGORITHMS[:2], LAYERS[:2], MODES, DRAFTS, EXPORTS
    ):
        got = _call(
            resolve_selector,
            mode,
            speculative_algorithm=algorithm,
            num_trained_mtp_layers=layers,
            conversion_mode=conv,
            draft=draft,
            exported_names=exported,
        )
        want = _expected_override(mode.value, algorithm, draft, exported)
        if got != want:
            mismatches.append((mode.value, algorithm, layers, conv.value, draft, exported, got, want))
    assert not mismatches, mismatches[:5]


def test_draft_override_errors_name_each_reason():
    with pytest.raises(ValueError) as info:
        resolve_selector(
            SelectorMode.DRAFT,
            speculative_algorithm=None,
            num_trained_mtp_layers=0,
            conversion_mode=ConversionMode.RAW,
            draft=DraftReport(kind=DraftKind.NGRAM),
        )
    message = str(info.value)
    assert "speculative decoding is off" in message and "'ngram' has no draft runner" in message


def test_draft_report_round_trips_through_the_wire_codec():
    report = DraftReport(kind=DraftKind.MTP, owned_names=DRAFT_NAMES[:2], is_frozen=True)
    wire = json.loads(json.dumps(protocol.encode(report)))
    assert wire == {"kind": "mtp", "owned_names": list(DRAFT_NAMES[:2]), "is_frozen": True}
    assert protocol.decode(DraftReport, wire) == report
    with pytest.raises(ValueError, match="kind: 'eagle' is not one of 'none', 'standalone', 'mtp', 'ngram'"):
        protocol.decode(DraftReport, {"kind": "eagle"})


def test_has_runner():
    assert {k for k in DraftKind if DraftReport(kind=k).has_runner} == {DraftKind.MTP, DraftKind.STANDALONE}


@pytest.mark.parametrize("mode", [SelectorMode.AUTO, SelectorMode.ALL])
def test_frozen_draft_in_bridge_mode_is_refused_naming_the_override(mode):
    # Bridge mode could emit draft weights, so `auto` resolves `all`; an export without the draft's names is then
    # refused, and the message names the config override that leaves the draft out.
    draft = DraftReport(kind=DraftKind.MTP, owned_names=DRAFT_NAMES)
    with pytest.raises(ValueError) as info:
        resolve_selector(
            mode,
            speculative_algorithm="NEXTN",
            num_trained_mtp_layers=0,
            conversion_mode=ConversionMode.BRIDGE,
            draft=draft,
            exported_names=["model.norm.weight"],
        )
    assert "'all' includes the mtp draft" in str(info.value)
    assert "sync.selector=target" in str(info.value)
    got = resolve_selector(
        SelectorMode.TARGET,
        speculative_algorithm="NEXTN",
        num_trained_mtp_layers=0,
        conversion_mode=ConversionMode.BRIDGE,
        draft=draft,
        exported_names=["model.norm.weight"],
    )
    assert got is Selector.TARGET
