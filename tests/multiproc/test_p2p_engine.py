"""SGLang's `--custom-weight-loader` hook on reference engines at TP=1 and TP=2 (real `serve` processes over HTTP),
driven with miles_sync's p2p loader: the update's payloads are tickets (inline bytes, no shared memory), every TP
rank joins a gloo channel with two trainer ranks (threads of this test) and receives its own engine-layout tensors
point to point, each checked against the digest its source sent; the engine's checker then answers exactly the
sent tensors' digests. A load_format outside the engine's allow-list crashes it, as SGLang's scheduler dies on
`NotImplementedError: Unknown load_format` (tests/sglang/test_direct_load_sglang.py holds the real server to both)."""

from __future__ import annotations

import pytest
import torch
from p2p_session import p2p_update
from reference_server import generate, reference_server

from miles_sync.transport.p2p_loader import LOADER_PATH, TICKET_NAME, Refusal
from miles_sync.weights.engine_layout import rank_engine_digests, rank_engine_tensors
from miles_sync.wire.payload import encode_inline_named_tensors

CRASH_EXIT_CODE = 70


@pytest.fixture(scope="module")
def engines(reference_checkpoints, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("p2p-engine")
    target = reference_checkpoints / "target"
    hook = ["--custom-weight-loader", LOADER_PATH]
    with (
        reference_server(model=target, log_dir=log_dir, checksum_names="engine", extra_args=hook) as tp1,
        reference_server(model=target, log_dir=log_dir, extra_args=[*hook, "--tp-size", "2"]) as tp2,
    ):
        yield {1: tp1, 2: tp2}


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in sorted(weights.items())}


def answered_digests(server) -> list[dict[str, str]]:
    return [
        rank["checksums"]
        for rank in server.ok("/weights_checker", {"action": "checksum", "selector": "target"})["ranks"]
    ]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_every_rank_receives_its_own_tensors_point_to_point_and_serves_them(
    engines, target_runner_weights, shape, tp_size
):
    server = engines[tp_size]
    for seed in (tp_size, 10 + tp_size):  # twice: the second sync's channel is a fresh group on the same engine
        weights = perturbed(target_runner_weights, seed=seed)
        per_rank = [rank_engine_tensors(weights, shape=shape, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
        statuses = p2p_update(server.url, per_rank)
        assert all(s.refusal is Refusal.NONE for s in statuses) and sum(s.checked for s in statuses) == sum(
            len(t) for t in per_rank
        ), statuses
        assert answered_digests(server) == list(
            rank_engine_digests([("target", weights)], shape=shape, tp_size=tp_size)
        )
    status, answer = generate(server, [3, 100, 7])
    assert status == 200 and len(answer["output_ids"]) == 4, answer


def test_a_corrupted_tensor_is_refused_by_the_engine_rank_and_named(engines, target_runner_weights, shape):
    server = engines[2]
    weights = perturbed(target_runner_weights, seed=5)
    per_rank = [rank_engine_tensors(weights, shape=shape, tp_rank=r, tp_size=2) for r in range(2)]
    victim = "model.layers.0.mlp.down_proj.weight"
    statuses = p2p_update(server.url, per_rank, corrupt=victim)
    refused = [s for s in statuses if s.refusal is not Refusal.NONE]
    assert [s.refusal for s in refused] == [Refusal.DIGEST]
    assert list(per_rank[0])[refused[0].refused_index] == victim
    assert answered_digests(server) != list(rank_engine_digests([("target", weights)], shape=shape, tp_size=2))


def test_a_load_format_outside_the_allow_list_crashes_the_engine(reference_checkpoints, tmp_path):
    with reference_server(model=reference_checkpoints / "target", log_dir=tmp_path) as server:
        server.ok("/begin_weight_update", {"selector": "target"})
        ticket = encode_inline_named_tensors([(TICKET_NAME, torch.zeros(3, dtype=torch.uint8))])
        body = {"serialized_named_tensors": [ticket], "load_format": LOADER_PATH, "selector": "target"}
        with pytest.raises(OSError):  # no answer: the server is gone
            server.post("/update_weights_from_tensor", body, timeout_s=30.0)
        assert server.process.wait(timeout=30) == CRASH_EXIT_CODE
        assert f"Unknown load_format={LOADER_PATH}" in server.log_path.read_text(errors="replace")
