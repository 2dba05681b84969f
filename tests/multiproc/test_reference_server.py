"""The reference engine as a real server process: SGLang's endpoints, JSON and status codes over loopback HTTP."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from reference_server import ServerProcess, checkpoint_tensors, checksums, generate, mtp_names, reference_server

from miles_sync.weights.checksum import role_checksums
from miles_sync.wire.api import CHECKSUM_NAMES_KEY
from miles_sync.wire.bucket import pack_bucket
from miles_sync.wire.codec import decode
from miles_sync.wire.draft import DraftKind, DraftReport
from miles_sync.wire.payload import FlattenedTensorMetadata, encode_flattened_bucket, encode_named_tensors
from miles_sync.wire.protocol import GenerateResponse

API_KEY = "test-key-1c9f"


@pytest.fixture(scope="module")
def ckpt(reference_checkpoints):
    return reference_checkpoints


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    with reference_server(
        model=ckpt / "target", draft_kind="mtp", weight_layout="aiter", log_dir=tmp_path_factory.mktemp("logs")
    ) as server:
        yield server


@pytest.fixture(scope="module")
def target_weights(ckpt) -> list[tuple[str, torch.Tensor]]:
    """The target's checkpoint tensors without the MTP layer: what a trainer that trains no MTP layer sends."""
    skip = mtp_names(ckpt / "target")
    return sorted((n, t) for n, t in checkpoint_tensors(ckpt / "target").items() if n not in skip)


def _tensor_update(server, named, *, selector="target", load_format=None, **fields):
    payload = encode_named_tensors(named)
    body = {"serialized_named_tensors": [payload], "selector": selector, "load_format": load_format, **fields}
    return server.post("/update_weights_from_tensor", body)


def _sync_target(server, named, **fields):
    server.ok("/begin_weight_update", {"selector": "target"})
    status, answer = _tensor_update(server, named, **fields)
    assert status == 200 and answer["success"], answer
    server.ok("/end_weight_update")


def test_read_endpoints(server, ckpt):
    assert server.get("/health") == (200, "ok")
    assert server.get("/health_generate") == (200, "ok")
    status, info = server.get("/model_info")
    assert status == 200 and info["weight_version"] == "default" and info["model_path"].endswith("target")
    assert server.get("/get_model_info")[1] == info
    status, server_info = server.get("/get_server_info")
    assert status == 200 and server_info["tp_size"] == 1 and server_info["speculative_algorithm"] == "NEXTN"
    assert "avg_spec_accept_length" in server_info["internal_states"][0]
    assert server_info["internal_states"][0]["last_failure"] is None
    assert server_info[CHECKSUM_NAMES_KEY] == "hf"  # the default: HF names over logical bytes
    status, report = server.get("/get_draft_report")
    report = decode(DraftReport, report)
    assert report.kind is DraftKind.MTP and set(report.owned_names) == mtp_names(ckpt / "target")


def test_generate_reports_speculative_metrics(server):
    status, answer = generate(server, [3, 32], max_new_tokens=16)
    assert status == 200, answer
    response = decode(GenerateResponse, answer)
    meta = response.meta_info
    assert len(response.output_ids) == meta.completion_tokens == 16
    assert meta.finish_reason.type.value == "length" and meta.weight_version == "default"
    assert meta.spec_verify_ct >= 1 and meta.spec_accept_length == pytest.approx(16 / meta.spec_verify_ct)
    assert 0.0 <= meta.spec_accept_rate <= 1.0
    avg = server.get("/get_server_info")[1]["internal_states"][0]["avg_spec_accept_length"]
    assert avg is not None and avg >= 1.0


def test_probe_statuses_and_malformed_bodies(server):
    assert server.get("/update_weights_from_distributed")[0] == 405  # route exists, POST only
    assert server.post("/no_such_endpoint", {})[0] == 404
    status, answer = server.post("/begin_weight_update", raw=b"{not json")
    assert status == 400 and "not valid JSON" in answer["message"]
    status, answer = server.post("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": "many"}})
    assert status == 400 and "max_new_tokens" in answer["message"]


def test_tensor_update_lands_and_checksums_match_the_sender(server, target_weights):
    original = checksums(server)
    scaled = [(n, (t * 0.5).to(t.dtype)) for n, t in target_weights]
    try:
        _sync_target(server, scaled, weight_version="half")
        after = checksums(server)
        assert {n: after[n] for n in role_checksums(scaled, role="target")} == role_checksums(scaled, role="target")
        assert {n: c for n, c in after.items() if n.startswith("draft.")} == {
            n: c for n, c in original.items() if n.startswith("draft.")
        }
        assert server.get("/model_info")[1]["weight_version"] == "half"
    finally:
        # flattened_bucket payload restores the checkpoint weights, as Miles' colocated sender packs them
        bucket = pack_bucket(target_weights)
        metadata = [
            FlattenedTensorMetadata(
                name=e.name, shape=e.shape, dtype=e.dtype, start_idx=e.start, end_idx=e.end, numel=e.num_bytes
            )
            for e in bucket.entries
        ]
        server.ok("/begin_weight_update", {"selector": "target"})
        body = {
            "serialized_named_tensors": [encode_flattened_bucket(buffer=bucket.buffer, metadata=metadata)],
            "load_format": "flattened_bucket",
            "selector": "target",
        }
        server.ok("/update_weights_from_tensor", body)
        server.ok("/end_weight_update")
    assert checksums(server) == original


def test_weights_checker_snapshot_and_compare(server, target_weights):
    server.ok("/weights_checker", {"action": "snapshot", "selector": "target"})
    server.ok("/weights_checker", {"action": "compare", "selector": "target"})
    name, tensor = target_weights[0]
    _sync_target(server, [(name, tensor + 1)])
    status, answer = server.post("/weights_checker", {"action": "compare", "selector": "target"})
    assert status == 400 and name in answer["message"]
    _sync_target(server, [(name, tensor)])
    server.ok("/weights_checker", {"action": "compare", "selector": "target"})
    skipped = server.ok("/weights_checker", {"action": "checksum", "skip_tensor_list": ["layers.0."]})
    assert not any("layers.0." in n for n in skipped["ranks"][0]["checksums"])


def test_update_weight_version(server):
    answer = server.ok("/update_weight_version", {"new_version": "v7", "abort_all_requests": False})
    assert answer["new_version"] == "v7"
    assert decode(GenerateResponse, generate(server, [5])[1]).meta_info.weight_version == "v7"
    server.ok("/update_weight_version", {"new_version": "default"})


def test_flush_cache_pause_and_continue(server):
    assert server.post("/flush_cache") == (200, "Cache flushed.")
    server.ok("/pause_generation", {"mode": "in_place"})
    results = []
    worker = threading.Thread(target=lambda: results.append(generate(server, [7], max_new_tokens=8)))
    worker.start()
    try:
        # Paused: a waiting request does not block the flush (SGLang ignores the waiting queue while paused).
        assert server.post("/flush_cache?timeout=0.5")[0] == 200
        assert server.ok("/continue_generation", {})["status"] == "ok"
    finally:
        worker.join(60)
    assert results and results[0][0] == 200
    answer = server.ok("/pause_generation", {"mode": "abort"})
    assert answer["status"] == "ok"
    server.ok("/continue_generation", {})
    assert generate(server, [9])[0] == 200


def test_32_concurrent_requests_survive_a_retract_pause_and_an_update(server, target_weights):
    prompts = [[(11 * i + 3) % 256, (5 * ((11 * i + 3) % 256) + 17) % 256] for i in range(32)]
    max_new_tokens = 24
    server.ok("/update_weight_version", {"new_version": "v1", "abort_all_requests": False})
    baseline = {}
    for i, prompt in enumerate(prompts[:4]):
        baseline[i] = decode(GenerateResponse, generate(server, prompt, max_new_tokens=max_new_tokens)[1]).output_ids
    answers: dict[int, list] = {i: [] for i in range(32)}

    def run(i: int) -> None:
        answers[i].append(generate(server, prompts[i], max_new_tokens=max_new_tokens, timeout_s=300))

    workers = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for worker in workers:
        worker.start()
    try:
        _wait_for_running(server)
        server.ok("/pause_generation", {"mode": "retract"})
        state = server.get("/get_server_info")[1]["internal_states"][0]
        assert state["num_running"] == 0 and state["is_paused"]
        # The same values the engine holds: greedy outputs must not change, so any lost or repeated token shows.
        _sync_target(server, target_weights)
        server.ok("/update_weight_version", {"new_version": "v2", "abort_all_requests": False})
        server.ok("/continue_generation", {})
    finally:
        for worker in workers:
            worker.join(300)
    responses = {}
    for i, results in answers.items():
        assert len(results) == 1, f"request {i} answered {len(results)} times"
        status, answer = results[0]
        assert status == 200, answer
        responses[i] = decode(GenerateResponse, answer)
    for i, response in responses.items():
        meta = response.meta_info
        assert meta.finish_reason.type.value == "length"
        assert len(response.output_ids) == meta.completion_tokens == max_new_tokens
        assert meta.token_versions and set(meta.token_versions) <= {"v1", "v2"} and meta.weight_version == "v2"
        if i in baseline:
            assert response.output_ids == baseline[i]
    spanning = [r for r in responses.values() if r.meta_info.token_versions == ("v1", "v2")]
    assert spanning, "no request was in flight across the update"
    server.ok("/update_weight_version", {"new_version": "default"})


def _wait_for_running(server, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.get("/get_server_info")[1]["internal_states"][0]["num_running"] > 0:
            return
        time.sleep(0.01)
    raise AssertionError("no request started running")


def test_api_key_guards_every_admin_endpoint(ckpt, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("auth")
    with reference_server(model=ckpt / "target", api_key=API_KEY, log_dir=log_dir) as server:
        from miles_sync.engine.reference.server import ADMIN_PATHS

        for path in sorted(ADMIN_PATHS):
            status, answer = server.post(path, {}, auth=False)
            assert status == 401, (path, status, answer)
        wrong = ServerProcess(url=server.url, process=server.process, log_path=server.log_path, api_key="wrong-key")
        assert wrong.post("/begin_weight_update", {})[0] == 401
        for path in ("/health", "/health_generate"):
            assert server.get(path, auth=False)[0] == 200, path
        # As SGLang: an API key guards the normal routes too (rollout and info), not only the admin ones.
        for path in ("/model_info", "/get_server_info", "/get_draft_report"):
            assert server.get(path, auth=False)[0] == 401, path
            assert server.get(path)[0] == 200, path
        assert generate(wrong, [1])[0] == 401
        assert generate(server, [1])[0] == 200
        # With the key the same endpoints work.
        assert server.ok("/begin_weight_update", {"selector": "target"})["success"]
        assert server.post("/end_weight_update")[0] == 400  # nothing loaded: strict refuses, but authorized
        assert API_KEY not in server.log_tail(10**6)


def test_server_stops_when_its_launcher_dies_without_stopping_it(ckpt, tmp_path):
    """A launcher SIGKILLed (a crashed Ray node, a killed driver) leaves its engine re-parented: the engine notices
    and shuts down instead of holding its memory and port for ever."""
    import os
    import signal
    import subprocess
    import sys

    pid_file = tmp_path / "server.pid"
    launcher = (
        "import subprocess, sys, time\n"
        f"server = subprocess.Popen([sys.executable, '-m', 'miles_sync.engine.reference.serve', '--model', "
        f"{str(ckpt / 'target')!r}, '--port', '0', '--draft-kind', 'none'], stdout=subprocess.PIPE, text=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(server.pid))\n"
        "print(server.stdout.readline(), flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    try:
        assert "listening on" in parent.stdout.readline()  # the server is up
        server_pid = int(pid_file.read_text())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _is_running(server_pid):
            time.sleep(0.2)
        assert not _is_running(server_pid), "the orphaned engine kept running"
    finally:
        if parent.poll() is None:
            parent.kill()
        if pid_file.exists() and _is_running(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _is_running(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as stopped.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"
