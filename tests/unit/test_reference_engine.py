"""The reference engine's weight-update state machine, in-process over real runners (no HTTP)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from miles_sync.checksum import role_checksums
from miles_sync.engine.reference.engine import EngineStaleError, FinalizePolicy, ReferenceEngine
from miles_sync.engine.reference.runner import load_runners
from miles_sync.engine.reference.scheduler import Scheduler
from miles_sync.protocol import (
    BeginWeightUpdateRequest,
    EndWeightUpdateRequest,
    GenerateRequest,
    LoadFormat,
    Role,
    SamplingParams,
    Selector,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightsCheckerAction,
    WeightsCheckerRequest,
)
from miles_sync.selector import DraftKind
from miles_sync.tensor_payload import encode_named_tensors

END = EndWeightUpdateRequest()


@pytest.fixture
def make_engine(reference_checkpoints) -> Iterator:
    engines: list[ReferenceEngine] = []

    def make(*, draft_kind: str = "mtp", layout: str = "aiter", policy: str = "strict") -> ReferenceEngine:
        draft_path = reference_checkpoints / "draft" if draft_kind == "standalone" else None
        target, draft = load_runners(
            reference_checkpoints / "target", draft_kind=draft_kind, draft_path=draft_path, layout=layout
        )
        scheduler = Scheduler(target=target, draft=draft, draft_kind=draft_kind, spec_steps=2)
        engine = ReferenceEngine(
            target=target,
            draft=draft,
            draft_kind=DraftKind(draft_kind),
            scheduler=scheduler,
            model_path=str(reference_checkpoints / "target"),
            finalize_policy=FinalizePolicy(policy),
            collective_timeout_s=10.0,
        )
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def _checksums(engine: ReferenceEngine, selector: str = "all") -> dict[str, str]:
    result = engine.weights_checker(WeightsCheckerRequest(selector=Selector(selector)))
    return dict(result.ranks[0].checksums)


def _target_weights(engine: ReferenceEngine, *, scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    """What a trainer that trains no MTP layer sends: every target tensor (logical layout), optionally scaled."""
    target = engine.runner(Role.TARGET)
    return [(n, (t * scale).to(t.dtype)) for n, t in sorted(target.logical_tensors().items())]


def _tensor_update(named, *, selector: str = "target", **fields) -> UpdateWeightsFromTensorRequest:
    return UpdateWeightsFromTensorRequest(
        serialized_named_tensors=(encode_named_tensors(named),), selector=Selector(selector), **fields
    )


def _begin(engine: ReferenceEngine, selector: str) -> None:
    engine.begin_weight_update(BeginWeightUpdateRequest(selector=Selector(selector)))


def _generate(engine: ReferenceEngine) -> tuple[int, ...]:
    request = GenerateRequest(input_ids=(3, 32), sampling_params=SamplingParams(max_new_tokens=4, temperature=0.0))
    return engine.submit_generate(request).result(timeout=60).output_ids


# ---- sessions ---------------------------------------------------------------------------------------------------


def test_session_rules(make_engine):
    engine = make_engine(draft_kind="none", layout="none")
    with pytest.raises(ValueError, match="no weight update session is open"):
        engine.end_weight_update(END)
    with pytest.raises(ValueError, match="needs an open weight update session"):
        engine.update_weights_from_tensor(_tensor_update(_target_weights(engine)[:1]))
    with pytest.raises(ValueError, match="covers no runner"):
        _begin(engine, "draft")
    _begin(engine, "target")
    with pytest.raises(ValueError, match="already open"):
        _begin(engine, "all")
    with pytest.raises(ValueError, match="payload selector 'all' differs from the open session's selector 'target'"):
        engine.update_weights_from_tensor(_tensor_update(_target_weights(engine)[:1], selector="all"))
    # The refused payload fails the session, but loaded nothing: the engine keeps serving.
    with pytest.raises(ValueError, match="session failed"):
        engine.end_weight_update(END)
    assert engine.stale_reason is None
    _generate(engine)


def test_selector_all_without_a_draft_covers_the_target(make_engine):
    engine = make_engine(draft_kind="ngram", layout="none")
    _begin(engine, "all")
    engine.update_weights_from_tensor(_tensor_update(_target_weights(engine, scale=0.5), selector="all"))
    engine.end_weight_update(END)
    assert all(not name.startswith("draft.") for name in _checksums(engine))


# ---- finalize policies ------------------------------------------------------------------------------------------


def test_strict_policy_refuses_a_frozen_draft_and_never_transforms_it(make_engine):
    engine = make_engine(policy="strict")
    before = _checksums(engine)
    new_target = _target_weights(engine, scale=0.5)
    _begin(engine, "all")
    engine.update_weights_from_tensor(_tensor_update(new_target, selector="all"))
    with pytest.raises(ValueError, match="the draft runner is selected by 'all' but loaded no tensor"):
        engine.end_weight_update(END)
    after = _checksums(engine)
    draft = {n: c for n, c in before.items() if n.startswith("draft.")}
    assert draft and {n: after[n] for n in draft} == draft
    # The target's fresh bytes were finalized once: its checksums equal the sender's.
    assert {n: c for n, c in after.items() if not n.startswith("draft.")} == role_checksums(new_target, role="target")
    # A failed session that loaded bytes leaves the engine stale until a later session completes.
    with pytest.raises(EngineStaleError):
        _generate(engine)
    _begin(engine, "target")
    engine.update_weights_from_tensor(_tensor_update(new_target))
    engine.end_weight_update(END)
    assert engine.stale_reason is None
    _generate(engine)


def test_sglang_policy_transforms_the_frozen_draft_again(make_engine):
    engine = make_engine(policy="sglang")
    before = _checksums(engine)
    _begin(engine, "all")
    engine.update_weights_from_tensor(_tensor_update(_target_weights(engine), selector="all"))
    engine.end_weight_update(END)
    after = _checksums(engine)
    changed = sorted(n for n in before if before[n] != after[n])
    assert changed and all(n.startswith("draft.") for n in changed)
    assert any("eh_proj" in n or "proj" in n for n in changed)


def test_strict_policy_finalizes_only_the_names_loaded(make_engine):
    engine = make_engine(draft_kind="none")
    before = _checksums(engine)
    name, tensor = next((n, t) for n, t in _target_weights(engine) if n.endswith("mlp.down_proj.weight"))
    fresh = (tensor * 0.25).to(tensor.dtype)
    _begin(engine, "target")
    engine.update_weights_from_tensor(_tensor_update([(name, fresh)]))
    engine.end_weight_update(END)
    after = _checksums(engine)
    assert after[name] == role_checksums([(name, fresh)], role="target")[name]
    assert {n: c for n, c in after.items() if n != name} == {n: c for n, c in before.items() if n != name}


# ---- refused payloads -------------------------------------------------------------------------------------------


def _bad_payloads(engine: ReferenceEngine) -> dict[str, tuple[list, str]]:
    weights = dict(_target_weights(engine))
    name = next(n for n in weights if n.endswith("q_proj.weight"))
    draft_name = next(iter(sorted(engine.draft_report().owned_names)))
    return {
        "unknown-name": ([("model.layers.0.self_attn.nope.weight", torch.zeros(2))], "unknown parameter name"),
        "not-covered": ([(draft_name, torch.zeros(1))], "which selector 'target' does not cover"),
        "shape": ([(name, torch.zeros(3, 3, dtype=weights[name].dtype))], "expected shape"),
        "dtype": ([(name, weights[name].to(torch.float64))], "dtype float64"),
        "duplicate": ([(name, weights[name]), (name, weights[name])], "more than once"),
    }


@pytest.mark.parametrize("case", ["unknown-name", "not-covered", "shape", "dtype", "duplicate"])
def test_refused_payloads_change_no_weight(make_engine, case):
    engine = make_engine()
    before = _checksums(engine)
    named, needle = _bad_payloads(engine)[case]
    _begin(engine, "target")
    with pytest.raises(ValueError, match=needle):
        engine.update_weights_from_tensor(_tensor_update(named))
    assert _checksums(engine) == before
    with pytest.raises(ValueError):
        engine.end_weight_update(END)
    assert engine.stale_reason is None and _checksums(engine) == before
    _generate(engine)


def test_a_standalone_draft_never_loads_target_tensors_silently(make_engine):
    engine = make_engine(draft_kind="standalone", layout="none")
    shared = sorted(set(engine.draft_report().owned_names) & {n for n, _ in _target_weights(engine)})
    assert shared
    _begin(engine, "all")
    with pytest.raises(ValueError, match="owned by both the target and the standalone draft"):
        engine.update_weights_from_tensor(_tensor_update(_target_weights(engine), selector="all"))


def test_a_failure_after_a_load_marks_the_engine_stale(make_engine):
    engine = make_engine()
    weights = _target_weights(engine)
    _begin(engine, "target")
    engine.update_weights_from_tensor(_tensor_update(weights[:3]))
    with pytest.raises(ValueError, match="unknown parameter name"):
        engine.update_weights_from_tensor(_tensor_update([("bogus", torch.zeros(1))]))
    assert "bogus" in engine.stale_reason
    with pytest.raises(EngineStaleError, match="generation refused"):
        _generate(engine)
    with pytest.raises(ValueError):
        engine.end_weight_update(END)
    with pytest.raises(EngineStaleError):
        _generate(engine)
    _begin(engine, "target")
    engine.update_weights_from_tensor(_tensor_update(weights, load_format=LoadFormat.DIRECT))
    engine.end_weight_update(END)
    _generate(engine)


# ---- version, checker, report -----------------------------------------------------------------------------------


def test_weight_version(make_engine):
    engine = make_engine(draft_kind="none", layout="none")
    assert engine.model_info().weight_version == "default"
    engine.update_weight_version(UpdateWeightVersionRequest(new_version="v1"))
    _begin(engine, "target")
    engine.update_weights_from_tensor(_tensor_update(_target_weights(engine)[:1], weight_version="v2"))
    engine.end_weight_update(END)
    assert engine.model_info().weight_version == "v2"
    request = GenerateRequest(input_ids=(1,), sampling_params=SamplingParams(max_new_tokens=2, temperature=0.0))
    assert engine.submit_generate(request).result(timeout=60).meta_info.weight_version == "v2"


def test_weights_checker_snapshot_reset_compare(make_engine):
    engine = make_engine()
    target_only = _checksums(engine, "target")
    everything = _checksums(engine, "all")
    assert set(target_only) < set(everything)
    draft_names = {"draft." + n for n in engine.draft_report().owned_names}
    assert {n for n in everything if n.startswith("draft.")} == draft_names
    skipped = engine.weights_checker(WeightsCheckerRequest(selector=Selector.ALL, skip_tensor_list=("mlp.",)))
    assert skipped.ranks[0].checksums and not any("mlp." in n for n in skipped.ranks[0].checksums)
    assert skipped.per_engine_checksum == skipped.ranks[0].per_gpu_checksum

    weights = _target_weights(engine)
    engine.weights_checker(WeightsCheckerRequest(action=WeightsCheckerAction.SNAPSHOT, selector=Selector.TARGET))
    engine.weights_checker(WeightsCheckerRequest(action=WeightsCheckerAction.RESET_TENSORS, selector=Selector.TARGET))
    with pytest.raises(ValueError, match="differ from the snapshot"):
        engine.weights_checker(WeightsCheckerRequest(action=WeightsCheckerAction.COMPARE, selector=Selector.TARGET))
    with pytest.raises(EngineStaleError):
        _generate(engine)
    _begin(engine, "target")
    engine.update_weights_from_tensor(_tensor_update(weights))
    engine.end_weight_update(END)
    engine.weights_checker(WeightsCheckerRequest(action=WeightsCheckerAction.COMPARE, selector=Selector.TARGET))
    assert _checksums(engine) == everything
    _generate(engine)


def test_draft_report(make_engine):
    engine = make_engine(layout="none")
    report = engine.draft_report()
    assert report.kind is DraftKind.MTP and not report.is_frozen
    num_layers = engine.runner(Role.TARGET).model.config.num_hidden_layers
    assert report.owned_names and all(n.startswith(f"model.layers.{num_layers}.") for n in report.owned_names)
