"""Every malformed weight request gets a 4xx naming the problem; the weights stay as they were and generation goes
on. One server and one update group (this process is rank 0) serve the whole module."""

from __future__ import annotations

import base64
import io
import os
import pickle
import threading

import pytest
import torch
from reference_server import checkpoint_tensors, checksums, generate, joined_group, mtp_names, reference_server

from miles_sync.wire.payload import FlattenedTensorMetadata, _PayloadPickler, encode_named_tensors

GROUP = "errors-group"
TIMEOUT_S = 60.0
_FOREIGN_SEGMENT = "/torch_999999_1_424242"  # a name torch could give a segment on another host
_FOREIGN_MANAGER = "/tmp/torch-shm-dir-on-another-host/manager.sock"


@pytest.fixture(scope="module")
def env(reference_checkpoints, tmp_path_factory):
    target = reference_checkpoints / "target"
    with (
        reference_server(
            model=target, draft_kind="mtp", weight_layout="aiter", log_dir=tmp_path_factory.mktemp("errors")
        ) as server,
        joined_group(server, group_name=GROUP, timeout_s=TIMEOUT_S) as group,
    ):
        tensors = checkpoint_tensors(target)
        draft = mtp_names(target)
        weights = {n: t for n, t in tensors.items() if n not in draft}
        baseline = checksums(server)
        yield {"server": server, "group": group, "weights": weights, "draft": sorted(draft), "baseline": baseline}


def _q(env) -> tuple[str, torch.Tensor]:
    name = next(n for n in sorted(env["weights"]) if n.endswith("self_attn.q_proj.weight"))
    return name, env["weights"][name]


def _distributed(names, dtypes, shapes, **fields):
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": GROUP, "selector": "target", **fields}


def _tensor_body(payload, **fields):
    return {"serialized_named_tensors": [payload], "selector": "target", **fields}


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


class _RunsCode:
    def __reduce__(self):
        return (exec, ("import os; os.system('touch /tmp/pwned')",))


# name -> (open a session first?, endpoint, body builder(env), needle in the message)
CASES = {
    "unknown-key": (False, "/begin_weight_update", lambda env: {"selector": "target", "bogus": 1}, "bogus"),
    "unknown-selector": (False, "/begin_weight_update", lambda env: {"selector": "both"}, "'target'"),
    "wrong-type": (True, "/update_weights_from_distributed", lambda env: _distributed(5, [], []), "names"),
    "outside-session": (
        False,
        "/update_weights_from_tensor",
        lambda env: _tensor_body(encode_named_tensors([_q(env)])),
        "needs an open weight update session",
    ),
    "selector-mismatch": (
        True,
        "/update_weights_from_tensor",
        lambda env: _tensor_body(encode_named_tensors([_q(env)]), selector="all"),
        "payload selector 'all' differs from the open session's selector 'target'",
    ),
    "draft-name-under-target": (
        True,
        "/update_weights_from_tensor",
        lambda env: _tensor_body(encode_named_tensors([(env["draft"][0], torch.zeros(1))])),
        "which selector 'target' does not cover",
    ),
    "shape-mismatch": (
        True,
        "/update_weights_from_tensor",
        lambda env: _tensor_body(encode_named_tensors([(_q(env)[0], torch.zeros(2, 2))])),
        "expected shape",
    ),
    "dtype-mismatch": (
        True,
        "/update_weights_from_tensor",
        lambda env: _tensor_body(encode_named_tensors([(_q(env)[0], _q(env)[1].to(torch.bfloat16))])),
        "dtype bfloat16",
    ),
    "bad-base64": (True, "/update_weights_from_tensor", lambda env: _tensor_body("%%% not base64"), "not valid base64"),
    "pickle-outside-allow-list": (
        True,
        "/update_weights_from_tensor",
        lambda env: _tensor_body(_b64(pickle.dumps([("a", _RunsCode())]))),
        "builtins.exec, which is outside the allow-list",
    ),
    "two-payloads-for-tp1": (
        True,
        "/update_weights_from_tensor",
        lambda env: {**_tensor_body("x"), "serialized_named_tensors": ["x", "y"]},
        "takes exactly 1 (one per TP rank)",
    ),
    "unaligned-tensor-bucket": (
        True,
        "/update_weights_from_tensor",
        lambda env: _tensor_body(_unaligned_tensor_bucket(env), load_format="flattened_bucket"),
        "Unaligned received tensor",
    ),
    "forged-shared-memory-size": (
        True,
        "/update_weights_from_tensor",
        lambda env: _tensor_body(_forged_size_payload()),
        "payload claims",
    ),
    # A handle this host cannot open (another host's segment, or one its producer already freed): refused naming
    # the handle, as SGLang refuses a CUDA IPC handle of a GPU it cannot see ("Invalid device_uuid").
    "shared-memory-segment-not-on-this-host": (
        True,
        "/update_weights_from_tensor",
        lambda env: _tensor_body(_foreign_segment_payload(env)),
        f"shared-memory segment b'{_FOREIGN_SEGMENT}' cannot be opened: No such file or directory",
    ),
    "shared-memory-manager-not-on-this-host": (
        True,
        "/update_weights_from_tensor",
        lambda env: _tensor_body(_foreign_manager_payload(env)),
        f"shared-memory manager b'{_FOREIGN_MANAGER}' is not reachable",
    ),
    "unaligned-distributed-bucket": (
        True,
        "/update_weights_from_distributed",
        lambda env: _distributed(["a", "b"], ["bfloat16", "float32"], [[3], [2]], load_format="flattened_bucket"),
        "Unaligned received tensor b",
    ),
    "negative-dims": (
        True,
        "/update_weights_from_distributed",
        lambda env: _distributed([_q(env)[0]], ["float32"], [[-1, 128]]),
        "Negative dimension",
    ),
    "length-mismatch": (
        True,
        "/update_weights_from_distributed",
        lambda env: _distributed([_q(env)[0], "x"], ["float32"], [[1]]),
        "differ in length",
    ),
    "unknown-dtype": (
        True,
        "/update_weights_from_distributed",
        lambda env: _distributed([_q(env)[0]], ["float33"], [list(_q(env)[1].shape)]),
        "float33",
    ),
    "wrong-group-name": (
        True,
        "/update_weights_from_distributed",
        lambda env: {**_distributed([_q(env)[0]], ["float32"], [list(_q(env)[1].shape)]), "group_name": "other"},
        "no update group named 'other'",
    ),
    "empty-names": (True, "/update_weights_from_distributed", lambda env: _distributed([], [], []), "names is empty"),
}

_KEEP_ALIVE: list = []  # producers keep shared tensors alive until the receiver answered


def _unaligned_tensor_bucket(env) -> str:
    buffer = torch.zeros(4 + 8, dtype=torch.uint8)
    metadata = [
        FlattenedTensorMetadata(name="odd", shape=(2,), dtype=torch.int16, start_idx=0, end_idx=4, numel=4),
        FlattenedTensorMetadata(name=_q(env)[0], shape=(2,), dtype=torch.float32, start_idx=2, end_idx=10, numel=8),
    ]
    buf = io.BytesIO()
    # The public encoder refuses unaligned metadata, so this pickles it the same way without the check.
    _PayloadPickler(buf, protocol=4).dump({"flattened_tensor": buffer, "metadata": metadata})
    _KEEP_ALIVE.append(buffer)
    return _b64(buf.getvalue())


def _forged_size_payload() -> str:
    """A real shared-memory segment whose handle claims far more bytes than it holds (mapping it would fault)."""
    storage = torch.ones(4).untyped_storage()
    manager, handle, size = storage._share_filename_cpu_()
    _KEEP_ALIVE.append(storage)

    class Forged:
        def __reduce__(self):
            forged = (torch.UntypedStorage, manager, handle, size * 10**6)
            return (torch.multiprocessing.reductions.rebuild_storage_filename, forged)

    return _b64(pickle.dumps([("a", Forged())]))


def _handle_payload(env, *, manager: bytes | None = None, handle: bytes | None = None) -> str:
    """A real shared-memory tensor for the q projection whose handle names another segment or manager."""
    name, tensor = _q(env)
    storage = tensor.clone().untyped_storage()
    real_manager, real_handle, size = storage._share_filename_cpu_()
    _KEEP_ALIVE.append(storage)
    rebuild_args = (torch.UntypedStorage, manager or real_manager, handle or real_handle, size)

    class ForeignStorage:
        def __reduce__(self):
            return (torch.multiprocessing.reductions.rebuild_storage_filename, rebuild_args)

    class ForeignTensor:
        def __reduce__(self):
            typed = (torch.multiprocessing.reductions.rebuild_typed_storage, (ForeignStorage(), tensor.dtype))
            metadata = (0, tensor.shape, tensor.stride(), False)
            return (torch.multiprocessing.reductions.rebuild_tensor, (torch.Tensor, _Rebuilt(*typed), metadata))

    return _b64(pickle.dumps([(name, ForeignTensor())]))


class _Rebuilt:
    """Pickles as `fn(*args)`: a nested call of a rebuild function, as torch's reducers emit."""

    def __init__(self, fn, args) -> None:
        self._call = (fn, args)

    def __reduce__(self):
        return self._call


def _foreign_segment_payload(env) -> str:
    assert not os.path.exists("/dev/shm" + _FOREIGN_SEGMENT)
    return _handle_payload(env, handle=_FOREIGN_SEGMENT.encode())


def _foreign_manager_payload(env) -> str:
    assert not os.path.exists(_FOREIGN_MANAGER)
    return _handle_payload(env, manager=_FOREIGN_MANAGER.encode())


def _close_session(server) -> None:
    server.post("/end_weight_update")  # 400 when no session or when the session failed: both fine here


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_request_is_refused_and_changes_nothing(env, case):
    server = env["server"]
    opens_session, endpoint, build, needle = CASES[case]
    if opens_session:
        server.ok("/begin_weight_update", {"selector": "target"})
    try:
        status, answer = server.post(endpoint, build(env))
    finally:
        _close_session(server)
        _KEEP_ALIVE.clear()
    assert 400 <= status < 500 and answer["success"] is False, (status, answer)
    assert needle in answer["message"], answer["message"]
    assert checksums(server) == env["baseline"]
    assert generate(server, [3, 32])[0] == 200


def _post_and_broadcast(env, body, tensors) -> tuple[int, dict]:
    server, group = env["server"], env["group"]
    result: list = []
    poster = threading.Thread(target=lambda: result.append(server.post("/update_weights_from_distributed", body)))
    poster.start()
    for tensor in tensors:
        group.broadcast(tensor.contiguous(), src=0, timeout_s=TIMEOUT_S)
    poster.join(TIMEOUT_S)
    return result[0]


@pytest.mark.parametrize("flattened", [False, True], ids=["per-tensor", "flattened"])
def test_received_but_refused_payload_keeps_the_group_in_step(env, flattened):
    """Metadata that describes the bytes but not this model: the bytes are received, refused, and the group works."""
    server = env["server"]
    name, tensor = _q(env)
    bad = torch.zeros(3, 5)
    server.ok("/begin_weight_update", {"selector": "target"})
    try:
        load_format = "flattened_bucket" if flattened else None
        body = _distributed([name], ["float32"], [[3, 5]], load_format=load_format)
        sent = [bad.reshape(-1).view(torch.uint8)] if flattened else [bad]
        status, answer = _post_and_broadcast(env, body, sent)
    finally:
        _close_session(server)
    assert status == 400 and "expected shape" in answer["message"], answer
    assert checksums(server) == env["baseline"]
    # The same group carries the next, valid update.
    server.ok("/begin_weight_update", {"selector": "target"})
    status, answer = _post_and_broadcast(env, _distributed([name], ["float32"], [list(tensor.shape)]), [tensor])
    assert status == 200, answer
    server.ok("/end_weight_update")
    assert checksums(server) == env["baseline"]
    assert generate(server, [3, 32])[0] == 200


def test_session_protocol_errors(env):
    server = env["server"]
    status, answer = server.post("/end_weight_update")
    assert status == 400 and "no weight update session is open" in answer["message"]
    server.ok("/begin_weight_update", {"selector": "target"})
    try:
        status, answer = server.post("/begin_weight_update", {"selector": "target"})
        assert status == 400 and "already open" in answer["message"]
    finally:
        _close_session(server)
    status, answer = server.post("/destroy_weights_update_group", {"group_name": "never-made"})
    assert status == 400 and "never-made" in answer["message"]
    status, answer = server.post("/init_weights_update_group", {**_init_body(), "rank_offset": 0})
    assert status == 400 and "rank 0 is the trainer's source" in answer["message"]


def _init_body() -> dict:
    return {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "group_name": "x"}


def _last_failure(server) -> str | None:
    return server.get("/get_server_info", timeout_s=TIMEOUT_S)[1]["internal_states"][0]["last_failure"]


def test_a_failure_after_bytes_landed_keeps_serving_the_mixed_weights(env):
    """SGLang has no stale state: the engine serves what it holds; only the diagnostic reports the failure."""
    server = env["server"]
    weights = sorted(env["weights"].items())
    halved = [(n, (t * 0.5).to(t.dtype)) for n, t in weights[:4]]
    server.ok("/begin_weight_update", {"selector": "target"})
    server.ok("/update_weights_from_tensor", _tensor_body(encode_named_tensors(halved)))
    misshapen = weights[4][0]
    bad = _tensor_body(encode_named_tensors([(misshapen, torch.zeros(1))]))
    status, _ = server.post("/update_weights_from_tensor", bad)
    assert status == 400
    status, answer = generate(server, [3, 32])
    assert status == 200, answer
    assert server.get("/health_generate", timeout_s=TIMEOUT_S) == (200, "ok")
    assert server.post("/end_weight_update")[0] == 400
    assert misshapen in _last_failure(server)
    mixed = checksums(server)
    assert {n for n in mixed if mixed[n] != env["baseline"][n]} == {n for n, _ in halved}
    assert generate(server, [3, 32])[0] == 200
    server.ok("/begin_weight_update", {"selector": "target"})
    server.ok("/update_weights_from_tensor", _tensor_body(encode_named_tensors(weights)))
    server.ok("/end_weight_update")
    assert _last_failure(server) is None
    assert generate(server, [3, 32])[0] == 200
    assert checksums(server) == env["baseline"]
