"""The reference engine serving the built-in Qwen3-MoE checkpoint: parity with transformers, MTP speculative
decoding, SGLang's FusedMoE checker names, and engine-exact digests predicted from the HF tensors sent.

In the multi-process tier because its checkpoint fixture trains the MoE checkpoint in a subprocess the first time
(about 20 s, then cached); the distributed sync and the TP refusal start `serve` subprocesses (slow).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from reference_server import reference_server
from safetensors.torch import load_file

from miles_sync.engine.reference.checkpoints import LanguageRecipe, next_token
from miles_sync.engine.reference.engine import ReferenceEngine
from miles_sync.engine.reference.models import model_family, read_config
from miles_sync.engine.reference.runner import load_runners
from miles_sync.engine.reference.scheduler import Scheduler
from miles_sync.engine.settings import FinalizePolicy
from miles_sync.sync.engine_digests import EngineDigester, EngineDigestPlan, EngineLayout
from miles_sync.transport.group import create_update_group, start_store_server
from miles_sync.weights.engine_layout import TPShape, rank_engine_digests
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.draft import DraftKind
from miles_sync.wire.dtypes import dtype_name
from miles_sync.wire.payload import encode_named_tensors
from miles_sync.wire.protocol import (
    BeginWeightUpdateRequest,
    ChecksumNames,
    EndWeightUpdateRequest,
    GenerateRequest,
    Role,
    SamplingParams,
    Selector,
    UpdateWeightsFromTensorRequest,
    WeightsCheckerRequest,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

LANGUAGE = LanguageRecipe()
TIMEOUT_S = 60.0
PROMPTS = [(3, 100, 7), (250,), (1, 2, 3, 4, 5, 6, 7, 8, 9), (17, 200, 31, 9, 128)]
W13 = "model.layers.0.mlp.experts.w13_weight"


@pytest.fixture(scope="session")
def moe_target(reference_moe_checkpoint) -> Path:
    return reference_moe_checkpoint


def _greedy(prompt, max_new_tokens: int) -> GenerateRequest:
    return GenerateRequest(
        input_ids=tuple(prompt), sampling_params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    )


def _generate(scheduler: Scheduler, *, max_new_tokens: int = 12):
    # One request at a time: each forward then has the shapes of transformers' own unbatched forward.
    return [scheduler.submit(_greedy(p, max_new_tokens)).result(timeout=TIMEOUT_S) for p in PROMPTS]


def _transformers_model(path: Path):
    """transformers' own Qwen3MoeForCausalLM with the checkpoint's target tensors (the MTP layer left out)."""
    config = read_config(path)
    model = model_family("qwen3_moe").causal_lm_class(config).eval()
    own = model.state_dict().keys()
    model.load_state_dict({n: t for n, t in load_file(str(path / "model.safetensors")).items() if n in own})
    return model


def _transformers_greedy(model, prompt, max_new_tokens: int) -> tuple[int, ...]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return tuple(ids[len(prompt) :])


def test_moe_engine_computes_what_transformers_computes(moe_target):
    """Bit-exact: the engine's experts are transformers' own modules computing on views of the stacked buffers."""
    target, _ = load_runners(moe_target, layout=WeightLayout.AITER)  # the compute view undoes the shuffle
    assert target.shuffled_names() and target.expert_stacks()
    stack = target.expert_stacks()[0]
    assert stack.prefix == "model.layers.0.mlp.experts." and tuple(stack.w13.shape) == (4, 128, 64)
    reference = _transformers_model(moe_target)
    ids = torch.tensor([[3, 100, 7, 42, 1, 250]])
    with torch.no_grad():
        assert torch.equal(target.model(ids).logits, reference(ids).logits)
    scheduler = Scheduler(target=target, draft=None, draft_kind="none", spec_steps=3)
    try:
        outputs = [r.output_ids for r in _generate(scheduler)]
    finally:
        scheduler.shutdown()
    assert outputs == [_transformers_greedy(reference, p, 12) for p in PROMPTS]
    follows = [int(next_token(prev, LANGUAGE)) == tok for out in outputs for prev, tok in zip(out, out[1:])]
    assert sum(follows) / len(follows) > 0.9  # the checkpoint is trained on the language


def test_nextn_with_the_mtp_head_of_the_moe_checkpoint(moe_target):
    plain = Scheduler(target=load_runners(moe_target)[0], draft=None, draft_kind="none", spec_steps=3)
    target, draft = load_runners(moe_target, draft_kind="mtp")
    assert any("mlp.experts." in n for n in draft.owned_names())  # an MoE decoder layer in the head
    speculative = Scheduler(target=target, draft=draft, draft_kind="mtp", spec_steps=3)
    try:
        expected = [r.output_ids for r in _generate(plain)]
        responses = _generate(speculative)
    finally:
        plain.shutdown()
        speculative.shutdown()
    assert [r.output_ids for r in responses] == expected
    assert min(r.meta_info.spec_accept_length for r in responses) >= 2.0


def test_a_standalone_draft_is_refused_for_an_moe_target(moe_target, reference_checkpoints):
    with pytest.raises(ValueError, match="draft_kind 'standalone' with the qwen3_moe target"):
        load_runners(moe_target, draft_kind="standalone", draft_path=reference_checkpoints / "draft")


@pytest.fixture
def engine(moe_target):
    target, draft = load_runners(moe_target, draft_kind="mtp", layout=WeightLayout.AITER)
    scheduler = Scheduler(target=target, draft=draft, draft_kind="mtp", spec_steps=2)
    engine = ReferenceEngine(
        target=target,
        draft=draft,
        draft_kind=DraftKind.MTP,
        scheduler=scheduler,
        model_path=str(moe_target),
        finalize_policy=FinalizePolicy.STRICT,
        collective_timeout_s=10.0,
        checksum_names=ChecksumNames.ENGINE,
    )
    yield engine
    engine.shutdown()


def _shape(path: Path) -> TPShape:
    return TPShape.from_config(json.loads((path / "config.json").read_text()))


def _answer(engine, selector: Selector) -> dict[str, str]:
    return dict(engine.weights_checker(WeightsCheckerRequest(selector=selector)).ranks[0].checksums)


def test_checker_answers_fusedmoe_names_and_the_prediction_from_the_checkpoint(engine, moe_target):
    tensors = load_file(str(moe_target / "model.safetensors"))
    target, draft = engine.runner(Role.TARGET), engine.runner(Role.DRAFT)
    roles = [
        (role, {n: tensors[n] for n in runner.owned_names()}) for role, runner in (("target", target), ("draft", draft))
    ]
    (expected,) = rank_engine_digests(roles, shape=_shape(moe_target), tp_size=1, layout=WeightLayout.AITER)
    answer = _answer(engine, Selector.ALL)
    assert answer == expected
    for prefix in ("model.layers.0.", "model.layers.1.", "draft.model.layers.2."):
        assert {f"{prefix}mlp.experts.w13_weight", f"{prefix}mlp.experts.w2_weight", f"{prefix}mlp.gate.weight"} <= set(
            answer
        )
    assert not any(".experts.0." in n or "gate_proj" in n for n in answer)


def test_a_colocated_sync_in_two_buckets_matches_the_streamed_prediction(engine, moe_target):
    """Layer experts straddle the buckets: the digester keeps them until the stack is complete."""
    target = engine.runner(Role.TARGET)
    sent = {n: (t * 1.5).contiguous() for n, t in sorted(target.logical_tensors().items())}
    buckets = [[(n, t) for n, t in sent.items() if ".experts.3." not in n]]
    buckets.append([(n, t) for n, t in sent.items() if ".experts.3." in n])
    layout = EngineLayout(tp_size=1, weight_layout=WeightLayout.AITER, shape=_shape(moe_target), num_target_layers=2)
    digester = EngineDigester(EngineDigestPlan(layouts=(layout,)), names=sent, selector=Selector.TARGET)
    before = _answer(engine, Selector.TARGET)
    engine.begin_weight_update(BeginWeightUpdateRequest(selector=Selector.TARGET))
    for bucket in buckets:
        digester.add(bucket)
        engine.update_weights_from_tensor(
            UpdateWeightsFromTensorRequest(
                serialized_named_tensors=(encode_named_tensors(bucket),), selector=Selector.TARGET
            )
        )
        if bucket is buckets[0]:
            assert digester.pending_bytes > 0  # every stack waits for expert 3
    engine.end_weight_update(EndWeightUpdateRequest())
    (predicted,) = digester.finish()[layout]
    answer = _answer(engine, Selector.TARGET)
    assert answer == predicted and answer[W13] != before[W13]
    assert {n for n in predicted if n.endswith(("w13_weight", "w2_weight"))} == {
        f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("w13_weight", "w2_weight")
    }


@pytest.mark.slow
def test_a_distributed_sync_into_a_served_moe_engine_matches_the_prediction(moe_target, tmp_path):
    group_name = "moe-sync"
    with (
        reference_server(
            model=moe_target,
            draft_kind="mtp",
            weight_layout="aiter",
            checksum_names="engine",
            log_dir=tmp_path,
        ) as server,
        ThreadPoolExecutor(2) as pool,
    ):
        store = start_store_server(host="127.0.0.1", timeout_s=TIMEOUT_S)
        join = pool.submit(
            server.post,
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": store.port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": group_name,
                "backend": "gloo",
            },
        )
        group = create_update_group(
            master_address="127.0.0.1",
            master_port=store.port,
            rank=0,
            world_size=2,
            group_name=group_name,
            backend="gloo",
            timeout_s=TIMEOUT_S,
            store=store,
        )
        try:
            assert join.result(TIMEOUT_S)[0] == 200
            tensors = load_file(str(moe_target / "model.safetensors"))
            named = [(n, (t * 0.5).contiguous()) for n, t in sorted(tensors.items()) if ".layers.2." not in n]
            body = {
                "names": [n for n, _ in named],
                "dtypes": [dtype_name(t.dtype) for _, t in named],
                "shapes": [list(t.shape) for _, t in named],
                "group_name": group_name,
                "selector": "target",
            }
            server.ok("/begin_weight_update", {"selector": "target"})
            post = pool.submit(server.post, "/update_weights_from_distributed", body, timeout_s=TIMEOUT_S)
            for _, tensor in named:
                group.broadcast(tensor, src=0, timeout_s=TIMEOUT_S)
            status, answer = post.result(TIMEOUT_S)
            assert status == 200, answer
            server.ok("/end_weight_update")
            (expected,) = rank_engine_digests(
                [("target", dict(named))], shape=_shape(moe_target), tp_size=1, layout=WeightLayout.AITER
            )
            checked = server.ok("/weights_checker", {"action": "checksum", "selector": "target"})
            assert checked["ranks"][0]["checksums"] == expected
            assert W13 in expected
        finally:
            server.post("/destroy_weights_update_group", {"group_name": group_name})
            group.destroy()


@pytest.mark.slow
def test_an_moe_engine_at_tp2_is_refused_at_start_naming_family_and_size(moe_target):
    argv = [sys.executable, "-m", "miles_sync.engine.reference.serve", "--model", str(moe_target)]
    done = subprocess.run([*argv, "--tp-size", "2", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "listening on" not in done.stdout, (done.returncode, done.stderr[-2000:])
    assert "--tp-size 2" in done.stderr and "model_type qwen3_moe" in done.stderr, done.stderr[-2000:]
    assert "splitting MoE experts across TP ranks is not modeled" in done.stderr
