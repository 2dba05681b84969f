"""The reference engine behaves like SGLang 0.5.23 over real HTTP wherever safety depends on it.

- reset_tensors writes random values and the server keeps serving them (open session or not);
- a failed session never stops generation, and a pause holds until /continue_generation;
- an update with flush_cache true fails (400, success false) AFTER loading while requests run;
- `--checksum-names engine` answers what SGLang's checker answers, `--draft-role draft_step_0` names the draft as
  multi-layer EAGLE does, and /get_server_info tells a client which names it will get.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from reference_server import ServerProcess, checkpoint_tensors, checksums, generate, mtp_names, reference_server

from miles_sync.engine.client import EngineClient
from miles_sync.engine.reference.server import CHECKSUM_NAMES_KEY
from miles_sync.wire.payload import encode_named_tensors
from miles_sync.wire.protocol import ChecksumNames

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def target_weights(reference_checkpoints) -> list[tuple[str, torch.Tensor]]:
    target = reference_checkpoints / "target"
    skip = mtp_names(target)
    return sorted((n, t) for n, t in checkpoint_tensors(target).items() if n not in skip)


@pytest.fixture(scope="module")
def server(reference_checkpoints, tmp_path_factory) -> Iterator[ServerProcess]:
    with reference_server(
        model=reference_checkpoints / "target",
        draft_kind="mtp",
        weight_layout="aiter",
        log_dir=tmp_path_factory.mktemp("parity"),
    ) as server:
        yield server


def _update(server: ServerProcess, named, **fields) -> tuple[int, dict]:
    body = {"serialized_named_tensors": [encode_named_tensors(named)], "selector": "target", **fields}
    return server.post("/update_weights_from_tensor", body, timeout_s=TIMEOUT_S)


def _restore(server: ServerProcess, weights) -> None:
    server.ok("/begin_weight_update", {"selector": "target"})
    status, answer = _update(server, weights)
    assert status == 200, answer
    server.ok("/end_weight_update")


def _state(server: ServerProcess) -> dict:
    return server.get("/get_server_info", timeout_s=TIMEOUT_S)[1]["internal_states"][0]


def _in_thread(fn) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    return thread, result


def test_reset_tensors_keeps_serving_random_weights(server, target_weights):
    baseline = checksums(server)
    norm = [(n, t) for n, t in target_weights if n == "model.norm.weight"]
    server.ok("/begin_weight_update", {"selector": "target"})
    try:
        assert _update(server, norm)[0] == 200
        # Not refused in an open session (SGLang does not refuse it either), and the session goes on.
        assert server.ok("/weights_checker", {"action": "reset_tensors", "selector": "target"})["success"]
    finally:
        status, answer = server.post("/end_weight_update")
    assert status == 200, answer
    reset = checksums(server)
    draft = {n for n in baseline if n.startswith("draft.")}
    assert draft and all(reset[n] == baseline[n] for n in draft)
    assert all(reset[n] != baseline[n] for n in baseline if n not in draft)
    status, answer = generate(server, [3, 32], max_new_tokens=8)
    assert status == 200 and len(answer["output_ids"]) == 8, answer
    assert server.get("/health_generate", timeout_s=TIMEOUT_S) == (200, "ok")
    assert _state(server)["last_failure"] is None
    _restore(server, target_weights)
    assert checksums(server) == baseline


def test_a_pause_holds_through_failed_and_successful_sessions_until_continue(server, target_weights):
    server.ok("/pause_generation", {"mode": "abort"})
    try:
        thread, result = _in_thread(lambda: generate(server, [3, 32], max_new_tokens=4, timeout_s=TIMEOUT_S))
        server.ok("/begin_weight_update", {"selector": "target"})
        misshapen = target_weights[0][0]  # a wrong shape fails the session (an unknown name is ignored, as SGLang)
        assert _update(server, [(misshapen, torch.zeros(1))])[0] == 400
        assert server.post("/end_weight_update")[0] == 400
        assert misshapen in _state(server)["last_failure"]
        _restore(server, target_weights)
        assert server.get("/health_generate", timeout_s=TIMEOUT_S) == (200, "ok")  # paused: no probe token
        time.sleep(0.5)
        assert not result and _state(server)["is_paused"] and _state(server)["num_waiting"] == 1
    finally:
        server.ok("/continue_generation", {})
    thread.join(TIMEOUT_S)
    assert result and result[0][0] == 200, result


def test_a_flushing_update_fails_after_loading_while_a_request_runs(server, target_weights):
    name, tensor = next((n, t) for n, t in target_weights if n.endswith("mlp.down_proj.weight"))
    halved = (tensor * 0.5).to(tensor.dtype)
    baseline = checksums(server)
    thread, result = _in_thread(lambda: generate(server, [3, 32], max_new_tokens=4000, timeout_s=300))
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while _state(server)["num_running"] == 0:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.01)
        server.ok("/pause_generation", {"mode": "in_place"})  # in_place keeps the request running
        server.ok("/begin_weight_update", {"selector": "target"})
        status, answer = _update(server, [(name, halved)])  # flush_cache defaults to true
        assert status == 400 and answer["success"] is False, answer
        assert "Weights were updated, but the cache was not flushed" in answer["message"]
        server.ok("/end_weight_update")  # the loaded tensor is finalized: a failed flush fails no session
        assert {n for n, c in checksums(server).items() if c != baseline[n]} == {name}
        assert server.post("/flush_cache")[0] == 400  # still running
    finally:
        server.post("/end_weight_update")
        server.ok("/pause_generation", {"mode": "abort"})
        server.ok("/continue_generation", {})
        thread.join(300)
    assert result and result[0][0] == 200 and result[0][1]["meta_info"]["finish_reason"]["type"] == "abort"
    _restore(server, target_weights)
    assert checksums(server) == baseline


def test_engine_checksum_names_and_draft_step_roles(reference_checkpoints, tmp_path, server):
    with reference_server(
        model=reference_checkpoints / "target",
        draft_kind="mtp",
        weight_layout="aiter",
        checksum_names="engine",
        draft_role="draft_step_0",
        log_dir=tmp_path,
    ) as engine_names:
        status, info = engine_names.get("/get_server_info", timeout_s=TIMEOUT_S)
        assert status == 200 and info[CHECKSUM_NAMES_KEY] == "engine"
        answer = engine_names.ok("/weights_checker", {"action": "checksum", "selector": "all"})
        (rank,) = answer["ranks"]
        names = set(rank["checksums"])
        assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.1.mlp.gate_up_proj.weight" in names
        assert "draft_step_0.model.layers.2.self_attn.qkv_proj.weight" in names
        assert not any(n.endswith(("q_proj.weight", "up_proj.weight")) and "gate_up" not in n for n in names)
        assert all(len(digest) == 16 and int(digest, 16) >= 0 for digest in rank["checksums"].values())
        assert [i["role"] for i in rank["parallelism_info"]] == ["target", "draft_step_0"]
        assert answer["per_engine_checksum"] != rank["per_gpu_checksum"]  # SGLang hashes the per-rank digests again
        # The same weights and layout: the default server answers HF names over the same tensors.
        assert server.get("/get_server_info", timeout_s=TIMEOUT_S)[1][CHECKSUM_NAMES_KEY] == "hf"
        hf_names = set(checksums(server))
        assert {"model.layers.0.self_attn.q_proj.weight", "draft.model.layers.2.eh_proj.weight"} <= hf_names
        assert asyncio.run(_client_checksum_names(engine_names.url)) is ChecksumNames.ENGINE
        assert asyncio.run(_client_checksum_names(server.url)) is ChecksumNames.HF


async def _client_checksum_names(url: str) -> ChecksumNames:
    async with EngineClient(url, timeout_s=TIMEOUT_S) as client:
        return (await client.server_info()).miles_sync_checksum_names
