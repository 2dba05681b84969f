"""The reference engine's weight-update state machine, in-process over real runners (no HTTP).

In the multi-process tier because its checkpoint fixture trains the reference checkpoints in a subprocess the
first time (then reads them from the cache).

Where safety depends on it the engine is never kinder than SGLang 0.5.23: it serves whatever its runners hold after
a failed session or a reset_tensors, resumes only on continue_generation, and fails a flushing update while
requests run. These tests pin that behaviour."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch
from safetensors.torch import load_file

from miles_sync.engine.reference.engine import ReferenceEngine
from miles_sync.engine.reference.runner import load_runners
from miles_sync.engine.reference.scheduler import Scheduler
from miles_sync.engine.reference.weights_checker import WeightsChecker
from miles_sync.engine.settings import FinalizePolicy
from miles_sync.weights.checksum import role_checksums
from miles_sync.weights.layout import shuffle_weight, unshuffle_weight
from miles_sync.wire.draft import DraftKind
from miles_sync.wire.payload import encode_named_tensors
from miles_sync.wire.protocol import (
    BeginWeightUpdateRequest,
    ChecksumNames,
    ContinueGenerationRequest,
    EndWeightUpdateRequest,
    GenerateRequest,
    PauseGenerationRequest,
    PauseMode,
    Role,
    SamplingParams,
    Selector,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightsCheckerAction,
    WeightsCheckerRequest,
)

END = EndWeightUpdateRequest()


@pytest.fixture
def make_engine(reference_checkpoints) -> Iterator:
    engines: list[ReferenceEngine] = []

    def make(
        *,
        draft_kind: str = "mtp",
        layout: str = "aiter",
        policy: str = "strict",
        checksum_names: str = "hf",
        draft_role: str = "draft",
    ) -> ReferenceEngine:
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
            checksum_names=ChecksumNames(checksum_names),
            draft_role=draft_role,
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


def _submit(engine: ReferenceEngine, *, max_new_tokens: int = 4) -> Future:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    return engine.submit_generate(GenerateRequest(input_ids=(3, 32), sampling_params=params))


def _generate(engine: ReferenceEngine) -> tuple[int, ...]:
    return _submit(engine).result(timeout=60).output_ids


def _checker(engine: ReferenceEngine, action: str, selector: str = "target", **fields):
    request = WeightsCheckerRequest(action=WeightsCheckerAction(action), selector=Selector(selector), **fields)
    return engine.weights_checker(request)


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
    # The refused payload fails the session; the failure is reported, and the engine keeps serving.
    with pytest.raises(ValueError, match="session failed"):
        engine.end_weight_update(END)
    assert "payload selector 'all' differs" in engine.last_failure
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
    # As SGLang, the failed session's bytes serve: nothing refuses generation; last_failure reports the failure.
    assert "draft runner is selected" in engine.last_failure
    _generate(engine)
    _begin(engine, "target")
    engine.update_weights_from_tensor(_tensor_update(new_target))
    engine.end_weight_update(END)
    assert engine.last_failure is None
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
        "not-covered": ([(draft_name, torch.zeros(1))], "which selector 'target' does not cover"),
        "shape": ([(name, torch.zeros(3, 3, dtype=weights[name].dtype))], "expected shape"),
        "dtype": ([(name, weights[name].to(torch.float64))], "dtype float64"),
        "duplicate": ([(name, weights[name]), (name, weights[name])], "more than once"),
    }


@pytest.mark.parametrize("case", ["not-covered", "shape", "dtype", "duplicate"])
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
    assert _checksums(engine) == before
    _generate(engine)


def test_a_name_no_runner_has_is_ignored_as_sglang_ignores_it(make_engine):
    """SGLang 0.5.23 answers 200 and loads nothing for a tensor name its model does not have (checked against a
    real server in tests/sglang/test_conformance.py); the reference engine does the same, so a sync that sends one
    must be caught by its verification, never by the engine."""
    engine = make_engine()
    before = _checksums(engine)
    _begin(engine, "target")
    result = engine.update_weights_from_tensor(
        _tensor_update([("model.layers.0.self_attn.nope.weight", torch.zeros(2))])
    )
    assert result.success
    assert _checksums(engine) == before


def test_a_standalone_draft_never_loads_target_tensors_silently(make_engine):
    engine = make_engine(draft_kind="standalone", layout="none")
    shared = sorted(set(engine.draft_report().owned_names) & {n for n, _ in _target_weights(engine)})
    assert shared
    _begin(engine, "all")
    with pytest.raises(ValueError, match="owned by both the target and the standalone draft"):
        engine.update_weights_from_tensor(_tensor_update(_target_weights(engine), selector="all"))


def test_a_failure_after_a_load_serves_the_mixed_weights(make_engine):
    """SGLang has no stale state: after a failed session the engine serves its mix of new and old tensors."""
    engine = make_engine()
    weights = _target_weights(engine)
    before = _checksums(engine)
    plain = _generate(engine)
    scaled = _target_weights(engine, scale=-3.0)
    _begin(engine, "target")
    engine.update_weights_from_tensor(_tensor_update(scaled[:3]))
    with pytest.raises(ValueError, match="expected shape"):
        engine.update_weights_from_tensor(_tensor_update([(scaled[3][0], torch.zeros(1))]))
    assert scaled[3][0] in engine.last_failure
    with pytest.raises(ValueError, match="session failed"):
        engine.end_weight_update(END)
    after = _checksums(engine)
    loaded = {name for name, _ in scaled[:3]}
    assert {n: after[n] for n in loaded} == role_checksums(scaled[:3], role="target")
    assert {n: c for n, c in after.items() if n not in loaded} == {n: c for n, c in before.items() if n not in loaded}
    mixed = _generate(engine)  # answered, on the mixed weights
    assert len(mixed) == len(plain)
    assert scaled[3][0] in engine.last_failure
    _begin(engine, "target")
    engine.update_weights_from_tensor(_tensor_update(weights))
    engine.end_weight_update(END)
    assert engine.last_failure is None and _checksums(engine) == before
    assert _generate(engine) == plain


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
    # SGLang's reset is a test hook, never a quarantine: every target tensor changed, the draft did not, and the
    # engine keeps generating (on random weights).
    reset = _checksums(engine)
    assert all(reset[n] != everything[n] for n in target_only)
    assert {n: reset[n] for n in everything if n.startswith("draft.")} == {
        n: c for n, c in everything.items() if n.startswith("draft.")
    }
    assert len(_generate(engine)) == 4 and engine.last_failure is None
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


# ---- SGLang parity: reset_tensors, resume only on continue, flush after an update -------------------------------


def test_reset_tensors_draws_sglang_random_values_in_an_open_session_and_keeps_serving(make_engine):
    engine = make_engine(layout="none")
    target = engine.runner(Role.TARGET)
    norm = "model.norm.weight"
    before = target.stored_tensors()[norm].clone()
    _begin(engine, "target")
    loaded = _target_weights(engine)[:2]
    engine.update_weights_from_tensor(_tensor_update(loaded))
    # SGLang does not refuse reset_tensors while a session is open, and the session goes on.
    _checker(engine, "reset_tensors", skip_tensor_list=("lm_head",))
    first = target.stored_tensors()[norm].clone()
    assert not torch.equal(first, before)
    assert first.min() >= 0.0 and first.max() < 1.0  # torch.rand: uniform in [0, 1)
    _checker(engine, "reset_tensors")
    assert not torch.equal(target.stored_tensors()[norm], first)  # unseeded: each call draws new values
    assert target.loaded_in_session() == {name for name, _ in loaded}
    engine.end_weight_update(END)
    assert len(_generate(engine)) == 4


def test_reset_tensors_skips_the_listed_names(make_engine):
    engine = make_engine()
    before = _checksums(engine, "all")
    _checker(engine, "reset_tensors", "all", skip_tensor_list=("mlp.", "draft_never_matches"))
    after = _checksums(engine, "all")
    kept = {n for n in before if "mlp." in n}
    assert kept and all(after[n] == before[n] for n in kept)
    assert all(after[n] != before[n] for n in before if n not in kept)
    # The random values are the PHYSICAL bytes (SGLang copies into the parameter the kernel reads): a shuffled
    # weight stores them as drawn, and the compute view decodes them.
    target = engine.runner(Role.TARGET)
    name = next(n for n in sorted(target.shuffled_names()) if "mlp." not in n)
    stored = target.stored_tensors()[name]
    assert stored.min() >= 0.0 and stored.max() < 1.0
    assert torch.equal(target.model.hf_parameters()[name].detach(), unshuffle_weight(stored))


def _wait_running(engine: ReferenceEngine, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.load_state()["num_running"] == 0:
        assert time.monotonic() < deadline, "no request started running"
        time.sleep(0.005)


def test_a_flushing_update_fails_after_loading_while_requests_run(make_engine):
    engine = make_engine(draft_kind="none", layout="none")
    running = _submit(engine, max_new_tokens=4000)
    _wait_running(engine)
    engine.pause_generation(PauseGenerationRequest(mode=PauseMode.IN_PLACE))  # in_place keeps it running
    assert engine.load_state()["num_running"] == 1
    name, tensor = next((n, t) for n, t in _target_weights(engine) if n.endswith("mlp.down_proj.weight"))
    fresh = (tensor * 0.5).to(tensor.dtype)
    _begin(engine, "target")
    with pytest.raises(ValueError, match="Weights were updated, but the cache was not flushed"):
        engine.update_weights_from_tensor(_tensor_update([(name, fresh)], weight_version="v9", flush_cache=True))
    # As SGLang: the weights (and the version) were loaded; the failed flush is not a session failure.
    assert engine.weight_version == "v9"
    engine.update_weights_from_tensor(_tensor_update([(name, fresh)], flush_cache=False))
    engine.end_weight_update(END)
    assert _checksums(engine)[name] == role_checksums([(name, fresh)], role="target")[name]
    # Retracted requests wait, and waiting ones do not block a flush while paused.
    engine.pause_generation(PauseGenerationRequest(mode=PauseMode.RETRACT))
    assert engine.load_state()["num_running"] == 0 and engine.load_state()["num_waiting"] == 1
    _begin(engine, "target")
    engine.update_weights_from_tensor(_tensor_update([(name, tensor)], flush_cache=True))
    engine.end_weight_update(END)
    engine.pause_generation(PauseGenerationRequest(mode=PauseMode.ABORT))
    assert running.result(timeout=60).meta_info.finish_reason.type.value == "abort"
    engine.continue_generation(ContinueGenerationRequest())


def test_generation_resumes_only_on_continue_generation(make_engine):
    engine = make_engine(draft_kind="none", layout="none")
    weights = _target_weights(engine)
    engine.pause_generation(PauseGenerationRequest(mode=PauseMode.ABORT))
    waiting = _submit(engine)
    # A successful session, a failed one and every checker action leave the pause in place.
    _begin(engine, "target")
    engine.update_weights_from_tensor(_tensor_update(weights))
    engine.end_weight_update(END)
    _begin(engine, "target")
    with pytest.raises(ValueError):
        engine.update_weights_from_tensor(_tensor_update([(weights[0][0], torch.zeros(1))]))  # a wrong shape
    with pytest.raises(ValueError, match="session failed"):
        engine.end_weight_update(END)
    for action in ("snapshot", "compare", "checksum"):
        _checker(engine, action)
    time.sleep(0.5)  # the scheduler loop would have finished 4 tokens by now if it were running
    assert not waiting.done() and engine.is_paused
    engine.continue_generation(ContinueGenerationRequest())
    assert len(waiting.result(timeout=60).output_ids) == 4


# ---- checksum names: SGLang's checker --------------------------------------------------------------------------


def _sglang_hash(t: torch.Tensor) -> str:
    """SGLang's CPU tensor_hash, written out: first 8 bytes of SHA-256 over the raw bytes, as a 64-bit int."""
    digest = hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).digest()
    return f"{int.from_bytes(digest[:8], byteorder='big', signed=False):016x}"


def _sglang_expected(tensors: dict[str, torch.Tensor], *, prefix: str) -> dict[str, str]:
    """Fused engine names over the given (physical) tensors, each fused parameter hashed as one concatenation."""
    expected, fused = {}, set()
    for name in tensors:
        for first, parts, engine_name in (
            ("self_attn.q_proj.weight", ("q_proj", "k_proj", "v_proj"), "self_attn.qkv_proj.weight"),
            ("mlp.gate_proj.weight", ("gate_proj", "up_proj"), "mlp.gate_up_proj.weight"),
        ):
            if name.endswith(first):
                head = name[: -len(first)]
                module = first.split(".")[0]
                members = [f"{head}{module}.{part}.weight" for part in parts]
                expected[prefix + head + engine_name] = _sglang_hash(torch.cat([tensors[m] for m in members]))
                fused.update(members)
    expected.update({prefix + n: _sglang_hash(t) for n, t in tensors.items() if n not in fused})
    return expected


def test_engine_checksum_names_answer_what_sglang_would(make_engine, reference_checkpoints):
    engine = make_engine(layout="aiter", checksum_names="engine", draft_role="draft_step_0")
    assert engine.checksum_names is ChecksumNames.ENGINE and engine.draft_role == "draft_step_0"
    target, draft = engine.runner(Role.TARGET), engine.runner(Role.DRAFT)
    checkpoint = load_file(str(reference_checkpoints / "target" / "model.safetensors"))

    def physical(runner) -> dict[str, torch.Tensor]:
        # The bytes SGLang hashes: after post-processing, i.e. AITER-shuffled where the layout shuffles.
        return {
            n: shuffle_weight(checkpoint[n]) if n in runner.shuffled_names() else checkpoint[n]
            for n in runner.owned_names()
        }

    assert target.shuffled_names()  # the test must cover hashing of shuffled bytes
    expected = _sglang_expected(physical(target), prefix="")
    expected.update(_sglang_expected(physical(draft), prefix="draft_step_0."))
    result = engine.weights_checker(WeightsCheckerRequest(selector=Selector.ALL))
    (rank,) = result.ranks
    assert dict(rank.checksums) == expected
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= set(expected)
    step0 = "draft_step_0.model.layers.2."
    assert {f"{step0}self_attn.qkv_proj.weight", f"{step0}eh_proj.weight"} <= set(expected)
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in expected)
    overall = hashlib.sha256()
    for name in sorted(expected):
        overall.update(name.encode())
        overall.update(expected[name].encode())
    assert rank.per_gpu_checksum == overall.hexdigest()
    assert result.per_engine_checksum == hashlib.sha256(overall.hexdigest().encode()).hexdigest()
    assert [info.role for info in rank.parallelism_info] == ["target", "draft_step_0"]
    # skip_tensor_list matches the engine's names: a fused parameter is skipped whole.
    skipped = engine.weights_checker(WeightsCheckerRequest(selector=Selector.TARGET, skip_tensor_list=("qkv",)))
    assert not any("qkv" in n or "q_proj" in n for n in skipped.ranks[0].checksums)
    # After an update the answer follows the stored bytes.
    name = "model.layers.1.self_attn.k_proj.weight"
    fresh = (checkpoint[name] * 2).contiguous()
    _begin(engine, "target")
    engine.update_weights_from_tensor(_tensor_update([(name, fresh)]))
    engine.end_weight_update(END)
    updated = engine.weights_checker(WeightsCheckerRequest(selector=Selector.TARGET)).ranks[0].checksums
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    layer = physical(target)
    layer[name] = shuffle_weight(fresh)
    assert updated[qkv] == _sglang_expected(layer, prefix="")[qkv] != expected[qkv]
    assert {n: c for n, c in updated.items() if n != qkv} == {n: expected[n] for n in updated if n != qkv}


def test_hf_checksum_names_prefix_draft_names_with_the_draft_role(make_engine):
    engine = make_engine(layout="none", draft_role="draft_step_0")
    result = engine.weights_checker(WeightsCheckerRequest(selector=Selector.ALL))
    draft_names = {n for n in result.ranks[0].checksums if not n.startswith("model.") and n != "lm_head.weight"}
    assert draft_names == {"draft_step_0." + n for n in engine.draft_report().owned_names}
    assert [info.role for info in result.ranks[0].parallelism_info] == ["target", "draft_step_0"]
    for bad in ("target", "draft_step_x"):
        with pytest.raises(ValueError, match="draft_role|is not one of"):
            WeightsChecker({}, draft_role=bad)
