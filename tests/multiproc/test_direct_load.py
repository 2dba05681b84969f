"""`update_weights_from_tensor` with `load_format: "direct"` on reference engines at TP=1 and TP=2 (real `serve`
processes over HTTP), held to what SGLang 0.5.23 does (tests/sglang/test_direct_load_sglang.py compares the two):
payload i carries TP rank i's own engine-named tensors (fused qkv_proj / gate_up_proj, this rank's shards), every
selected runner stores them as physical bytes (never finalized: the engines serve the AITER layout, so a finalize
would shuffle the sent bytes again), a dtype is cast silently, and a name or shape the runner does not have kills
the whole server without an answer.

One TP=1 and one TP=2 engine for the module (target with its MTP draft, AITER layout, strict finalize policy); the
tests that crash an engine come last, each on the engine it kills or its own.
"""

from __future__ import annotations

import pytest
import torch
from reference_server import generate, reference_server

from miles_sync.engine.reference.runner import load_target_runner
from miles_sync.engine.reference.sharded import load_sharded_runners
from miles_sync.weights.checksum import sglang_parameter_names
from miles_sync.weights.engine_layout import rank_engine_digests, rank_engine_tensors
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.payload import encode_named_tensors

# Slow: 20 s on a clean clone at 2d21038 (engines started per test or per TP size); the quick loop skips it.
pytestmark = pytest.mark.slow

ENGINE_ARGS = dict(draft_kind="mtp", weight_layout="aiter", finalize_policy="strict")
PROMPT = [3, 100, 7]
CRASH_EXIT_CODE = 70  # serve's exit status when a request crashed the engine
NORM = "model.norm.weight"
QKV = "model.layers.0.self_attn.qkv_proj.weight"


@pytest.fixture(scope="module")
def engines(reference_checkpoints, tmp_path_factory):
    """{tp_size: engine}: TP=1 answering SGLang's checker names, TP=2; started once for the module."""
    log_dir = tmp_path_factory.mktemp("direct-load")
    target = reference_checkpoints / "target"
    with (
        reference_server(model=target, log_dir=log_dir, checksum_names="engine", **ENGINE_ARGS) as tp1,
        reference_server(model=target, log_dir=log_dir, extra_args=["--tp-size", "2"], **ENGINE_ARGS) as tp2,
    ):
        yield {1: tp1, 2: tp2}


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in sorted(weights.items())}


def rank_tensors(weights, *, shape, tp_size: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Per rank, the (engine name, physical local tensor) pairs a faithful engine stores for these weights."""
    return [
        sorted(rank_engine_tensors(weights, shape=shape, tp_rank=r, tp_size=tp_size, layout=WeightLayout.AITER).items())
        for r in range(tp_size)
    ]


def expected_digests(weights, *, shape, tp_size: int) -> list[dict[str, str]]:
    return list(rank_engine_digests([("target", weights)], shape=shape, tp_size=tp_size, layout=WeightLayout.AITER))


def answered_digests(server, selector: str = "target") -> list[dict[str, str]]:
    ranks = server.ok("/weights_checker", {"action": "checksum", "selector": selector})["ranks"]
    return [rank["checksums"] for rank in ranks]


def direct_session(server, payloads: list[str], *, selector: str = "target") -> tuple[int, object]:
    """begin, one direct update, end (only if the update answered); returns the update's (status, body)."""
    server.ok("/begin_weight_update", {"selector": selector})
    body = {"serialized_named_tensors": payloads, "load_format": "direct", "flush_cache": True, "selector": selector}
    answer = server.post("/update_weights_from_tensor", body)
    server.ok("/end_weight_update")
    return answer


@pytest.fixture(scope="module")
def draft_at_start(engines) -> dict[int, list[dict[str, str]]]:
    """{tp_size: per rank, the draft's digests} before any test loaded anything (no test here loads the draft)."""
    return {tp: [draft_digests(rank) for rank in answered_digests(server, "all")] for tp, server in engines.items()}


def draft_digests(checksums: dict[str, str]) -> dict[str, str]:
    return {name: digest for name, digest in checksums.items() if name.startswith("draft.")}


def shared_storage_payload(named: list[tuple[str, torch.Tensor]], keep: list) -> str:
    """A payload whose tensors are all views of ONE storage, as a packed producer sends them."""
    flat = torch.cat([t.reshape(-1) for _, t in named])
    views, offset = [], 0
    for name, t in named:
        views.append((name, flat[offset : offset + t.numel()].view(t.shape)))
        offset += t.numel()
    keep.append(flat)  # alive until the engine answered
    return encode_named_tensors(views)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_direct_load_stores_each_ranks_bytes_as_sent_and_keeps_serving(
    engines, target_runner_weights, shape, draft_at_start, tp_size
):
    server = engines[tp_size]
    before = answered_digests(server)
    weights = perturbed(target_runner_weights, seed=tp_size)
    keep: list = []
    payloads = [shared_storage_payload(named, keep) for named in rank_tensors(weights, shape=shape, tp_size=tp_size)]
    status, body = direct_session(server, payloads)
    assert status == 200 and body["success"], body
    expected = expected_digests(weights, shape=shape, tp_size=tp_size)
    assert answered_digests(server) == expected
    assert all(e != b for e, b in zip(expected, before))  # the perturbation reached every rank's answer
    # The draft was not selected and keeps its weights; generation runs on the new ones.
    assert [draft_digests(rank) for rank in answered_digests(server, "all")] == draft_at_start[tp_size]
    status, answer = generate(server, PROMPT)
    assert status == 200 and len(answer["output_ids"]) == 4, answer


def test_payload_i_is_loaded_by_rank_i(engines, target_runner_weights, shape):
    server = engines[2]
    weights = perturbed(target_runner_weights, seed=7)
    payloads = [encode_named_tensors(named) for named in rank_tensors(weights, shape=shape, tp_size=2)]
    status, body = direct_session(server, payloads[::-1])
    assert status == 200 and body["success"], body
    expected = expected_digests(weights, shape=shape, tp_size=2)
    # SGLang too stores whatever payload i holds on rank i: the ranks swapped their sharded parameters.
    assert answered_digests(server) == expected[::-1]
    assert expected[0] != expected[1]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_dtype_other_than_the_parameters_is_cast_silently(engines, target_runner_weights, shape, tp_size):
    server = engines[tp_size]
    weights = perturbed(target_runner_weights, seed=20 + tp_size)
    weights[NORM] = weights[NORM] + 1.0
    ranks = rank_tensors(weights, shape=shape, tp_size=tp_size)
    sent = [[(NORM, dict(n)[NORM].to(torch.bfloat16)), (QKV, dict(n)[QKV].to(torch.float64))] for n in ranks]
    # Everything else first, at its own dtype, so the whole engine holds known bytes.
    rest = [[(name, t) for name, t in n if name not in (NORM, QKV)] for n in ranks]
    payloads = [encode_named_tensors(r + s) for r, s in zip(rest, sent)]
    status, body = direct_session(server, payloads)
    assert status == 200 and body["success"], body
    # float64 -> float32 is exact for float32 values; the norm holds its bfloat16 rounding.
    cast = {**weights, NORM: weights[NORM].to(torch.bfloat16).float()}
    assert answered_digests(server) == expected_digests(cast, shape=shape, tp_size=tp_size)
    assert expected_digests(cast, shape=shape, tp_size=tp_size) != expected_digests(
        weights, shape=shape, tp_size=tp_size
    )


@pytest.mark.parametrize("kind", ["hf-storage", "sharded"])
def test_a_direct_load_is_never_finalized_and_serves_what_a_logical_load_serves(
    reference_checkpoints, target_runner_weights, shape, kind
):
    """In process, both runner kinds in the AITER layout: after a direct load of the physical (shuffled) bytes,
    even SGLang's finalize-everything (`finalize_all`) leaves them as sent, and the model computes what a runner
    loaded with the same weights logically (then finalized) computes."""
    path = reference_checkpoints / "target"
    weights = perturbed(target_runner_weights, seed=41)
    physical = rank_tensors(weights, shape=shape, tp_size=1)[0]

    def runner():
        if kind == "sharded":
            return load_sharded_runners(path, layout=WeightLayout.AITER, tp_rank=0, tp_size=1)[0]
        return load_target_runner(path, layout=WeightLayout.AITER)

    direct, logical = runner(), runner()
    direct.reset_session()
    assert direct.load_direct(physical) == [name for name, _ in physical]
    assert direct.loaded_direct_in_session() == direct.owned_names() and not direct.loaded_in_session()
    direct.finalize_all()
    logical.reset_session()
    logical.finalize(logical.load(weights.items()))
    stored = direct.stored_tensors()
    parts = {name: (name,) for name in stored} if kind == "sharded" else sglang_parameter_names(stored)
    for name, sent in physical:
        held = torch.cat([stored[part].reshape(-1) for part in parts[name]])
        assert torch.equal(held, sent.reshape(-1)), name
    input_ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        assert torch.equal(direct.model(input_ids).logits, logical.model(input_ids).logits)


def assert_crashed(server, answer_or_error, *, names: list[str]) -> None:
    """The engine died as SGLang's server does: no answer to the request, the process gone, nothing listening."""
    assert isinstance(answer_or_error, OSError), answer_or_error  # not an HTTP answer
    assert server.process.wait(timeout=30) == CRASH_EXIT_CODE
    with pytest.raises(OSError):
        server.get("/health_generate", timeout_s=5.0)
    log = server.log_path.read_text(errors="replace")
    for name in names:
        assert name in log, log[-3000:]


def post_direct(server, payloads: list[str], *, selector: str = "target"):
    """begin, then one direct update; returns its (status, body), or the error when it got no answer."""
    server.ok("/begin_weight_update", {"selector": selector})
    body = {"serialized_named_tensors": payloads, "load_format": "direct", "flush_cache": False, "selector": selector}
    try:
        return server.post("/update_weights_from_tensor", body, timeout_s=30.0)
    except OSError as exc:
        return exc


def test_selector_all_crashes_when_the_draft_lacks_a_target_parameter(
    reference_checkpoints, target_runner_weights, shape, tmp_path
):
    """Every selected runner loads the whole payload: the MTP draft has no target layer-0 parameter (KeyError)."""
    with reference_server(
        model=reference_checkpoints / "target", log_dir=tmp_path, checksum_names="engine", **ENGINE_ARGS
    ) as server:
        named = [(NORM, target_runner_weights[NORM]), (QKV, torch.zeros(256, 128))]
        result = post_direct(server, [encode_named_tensors(named)], selector="all")
        assert_crashed(server, result, names=[f"draft runner: KeyError: {NORM!r}"])


def test_an_unknown_name_crashes_the_engine(engines, target_runner_weights, shape):
    server = engines[1]
    name = "model.layers.0.self_attn.q_proj.weight"  # an HF name: the engine's parameter is qkv_proj
    result = post_direct(server, [encode_named_tensors([(name, target_runner_weights[name])])])
    assert_crashed(server, result, names=[f"KeyError: {name!r}"])


def test_a_wrong_shape_on_one_rank_crashes_the_whole_engine(engines, target_runner_weights, shape):
    server = engines[2]
    good, other = rank_tensors(target_runner_weights, shape=shape, tp_size=2)
    down = "model.layers.0.mlp.down_proj.weight"
    bad = [(n, torch.zeros(3, 5) if n == down else t) for n, t in other]
    result = post_direct(server, [encode_named_tensors(good), encode_named_tensors(bad)])
    assert_crashed(server, result, names=["TP rank 1", down, "torch.Size([3, 5])"])
