"""Differential conformance: the same requests to a real SGLang 0.5.23 CPU server and to the reference engine, both
serving the reference target checkpoint; each case compares the HTTP status and the answer's shape (keys, value
types, list vs object and list lengths, recursively). Values are compared where both must compute the same: the
greedy tokens and their log-probs on the same weights.

The reference engine runs with the SGLang finalize policy and engine checksum names, the settings under which it
claims SGLang's behaviour. Where it differs on purpose, the difference is listed in INTENTIONAL with its reason and
left out of the comparison. Every case leaves both servers as it found them: no open session, generation running.

Never sent to SGLang (each kills the server): tensor handles pickled with torch's default `file_descriptor`
strategy, an `update_weights_from_tensor` whose load_format SGLang does not know, and a tensor update of the wrong
shape (its default_weight_loader asserts the shape in the scheduler: the assertion ends the process).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from reference_server import ServerProcess, checkpoint_tensors, joined_group, reference_server
from sglang_server import enter_together, sglang_server

from miles_sync.wire.dtypes import dtype_name
from miles_sync.wire.payload import FlattenedTensorMetadata, encode_flattened_bucket, encode_named_tensors

pytestmark = pytest.mark.sglang

TIMEOUT_S = 60.0
NAME = "model.norm.weight"  # one small tensor both engines hold under the same name and shape
GROUP = "conformance-group"
PROMPT = {"input_ids": [3, 100, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
# Keys of /get_server_info that miles_sync reads (miles_sync.wire.api.ServerInfo) or that tests read.
SERVER_INFO_KEYS = (
    "tp_size",
    "speculative_algorithm",
    "model_path",
    "device",
    "quantization",
    "weight_block_size",
    "dtype",
    "weight_version",
    "internal_states",
)

# (case or "*", path in the answer, or "status") -> why the reference engine answers differently on purpose.
INTENTIONAL = {
    ("*", "$.miles_sync_checksum_names"): "reference-only: names what its checker answers (HF or engine names)",
    ("*", "$.weight_layout"): "reference-only: the post-processing it applies after a load (ServerInfo reads it)",
    ("*", "$.miles_sync_tensor_hash"): "reference-only: how its checker hashes (SGLang's follows its device)",
    ("*", "$.miles_sync_received_bytes"): "reference-only: tensor bytes each TP rank took in (benchmarks read it)",
    ("*", "$.draft_kind"): "reference-only diagnostics",
    ("*", "$.finalize_policy"): "reference-only diagnostics",
    ("get_server_info", "$.weight_block_size"): "reference-only: the FP8 block a sync must send (ServerInfo reads it)",
    ("bad-selector", "shape"): (
        "a malformed body answers 400 {success: false, message} (SGLang: 400 {object, message, type, param, code}): "
        "one record for every refusal; tests/multiproc/test_reference_errors.py asserts success false on them"
    ),
    ("end-empty-body", "status"): (
        "the reference reads an empty body as {} where SGLang refuses it (400 'Field required'); the reference's "
        "own tests post field-less endpoints without a body (tests/reference_server.py ServerProcess.post)"
    ),
    ("end-empty-body", "shape"): "as its status",
    **{
        ("*", f"$.meta_info.{key}"): (
            "SGLang's request id, counters and timings: the reference's answer decodes as GenerateResponse, which "
            "lacks them, and its tests decode it strictly"
        )
        for key in (
            "id",
            "num_retractions",
            "reasoning_tokens",
            "cached_tokens",
            "cached_tokens_details",
            "dp_rank",
            "e2e_latency",
            "response_sent_to_client_ts",
        )
    },
    ("model_info", "$.embedding"): "SGLang's embedding plan: the reference serves text generation only",
    **{
        ("get_server_info", f"$.internal_states[].{key}"): "reference-only live state the reference's tests read"
        for key in ("num_running", "num_waiting", "last_failure", "engine_failure", "tp_rank_pids", "is_paused")
    },
}

# (case or "*", path) -> why one side may answer null where the other answers a value (same shape, other value).
NULLABLE: dict[tuple[str, str], str] = {}


class Pair:
    """One request, sent the same way to both servers."""

    def __init__(self, *, sglang: ServerProcess, reference: ServerProcess, tensors: dict[str, torch.Tensor]):
        self.sglang = sglang
        self.reference = reference
        self.tensors = tensors


# ---- requests ---------------------------------------------------------------------------------------------------


def _tensor_body(payload: str, *, load_format: str | None) -> dict[str, Any]:
    return {"serialized_named_tensors": [payload], "load_format": load_format, "selector": "target"}


def _by_value(tensors: dict[str, torch.Tensor], *, load_format: str | None = None) -> dict[str, Any]:
    return _tensor_body(encode_named_tensors([(NAME, tensors[NAME])]), load_format=load_format)


def _flattened(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    tensor = tensors[NAME].contiguous()
    buffer = tensor.view(-1).view(torch.uint8)
    meta = FlattenedTensorMetadata(
        name=NAME,
        shape=tuple(tensor.shape),
        dtype=tensor.dtype,
        start_idx=0,
        end_idx=buffer.numel(),
        numel=buffer.numel(),
    )
    return _tensor_body(encode_flattened_bucket(buffer=buffer, metadata=[meta]), load_format="flattened_bucket")


def _unknown_name(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    return _tensor_body(encode_named_tensors([("model.layers.0.mlp.nope.weight", torch.zeros(3))]), load_format=None)


def _distributed(tensors: dict[str, torch.Tensor], *, group_name: str) -> dict[str, Any]:
    tensor = tensors[NAME]
    return {
        "names": [NAME],
        "dtypes": [dtype_name(tensor.dtype)],
        "shapes": [list(tensor.shape)],
        "group_name": group_name,
        "selector": "target",
    }


@contextlib.contextmanager
def _session(server: ServerProcess) -> Iterator[None]:
    """A target session; always ended (a failed session's end answers 400 on the reference: ignored here)."""
    status, answer = server.post("/begin_weight_update", {"selector": "target"})
    assert status == 200, answer
    try:
        yield
    finally:
        server.post("/end_weight_update", {})


def _in_session(path: str, body: Callable[[dict], Any]) -> Callable[[ServerProcess, dict], tuple[int, Any]]:
    def run(server: ServerProcess, tensors: dict) -> tuple[int, Any]:
        with _session(server):
            return server.post(path, body(tensors))

    return run


def _post(path: str, body: Any = None) -> Callable[[ServerProcess, dict], tuple[int, Any]]:
    return lambda server, tensors: server.post(path, body)


def _get(path: str) -> Callable[[ServerProcess, dict], tuple[int, Any]]:
    return lambda server, tensors: server.get(path)


def _then(first: Callable, *after: tuple[str, Any]) -> Callable[[ServerProcess, dict], tuple[int, Any]]:
    """`first`'s answer; the `after` requests restore the server."""

    def run(server: ServerProcess, tensors: dict) -> tuple[int, Any]:
        answer = first(server, tensors)
        for path, body in after:
            server.post(path, body)
        return answer

    return run


def _server_info(server: ServerProcess, tensors: dict) -> tuple[int, Any]:
    return server.get("/get_server_info")


def _double_begin(server: ServerProcess, tensors: dict) -> tuple[int, Any]:
    with _session(server):
        return server.post("/begin_weight_update", {"selector": "target"})


def _end(server: ServerProcess, tensors: dict) -> tuple[int, Any]:
    server.ok("/begin_weight_update", {"selector": "target"})
    return server.post("/end_weight_update", {})


def _end_empty_body(server: ServerProcess, tensors: dict) -> tuple[int, Any]:
    server.ok("/begin_weight_update", {"selector": "target"})
    return server.post("/end_weight_update")


def _init_port_in_use(server: ServerProcess, tensors: dict) -> tuple[int, Any]:
    """Engine rank 0 on a port something else listens on: SGLang's store cannot bind and fails at once (an
    unreachable master would block SGLang for its 30-minute rendezvous timeout)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        body = {
            "master_address": "127.0.0.1",
            "master_port": taken.getsockname()[1],
            "rank_offset": 0,
            "world_size": 2,
            "group_name": "conformance-unbound",
            "backend": "gloo",
        }
        return server.post("/init_weights_update_group", body, timeout_s=TIMEOUT_S)


def _distributed_update(server: ServerProcess, tensors: dict) -> tuple[int, Any]:
    """A real gloo group of two (this process is rank 0): one per-tensor broadcast of NAME in a session."""
    answers: list[tuple[int, Any]] = []
    with joined_group(server, group_name=GROUP, timeout_s=TIMEOUT_S) as group, _session(server):
        body = _distributed(tensors, group_name=GROUP)
        poster = threading.Thread(target=lambda: answers.append(server.post("/update_weights_from_distributed", body)))
        poster.start()
        group.broadcast(tensors[NAME].contiguous(), src=0, timeout_s=TIMEOUT_S)
        poster.join(TIMEOUT_S)
    server.post("/destroy_weights_update_group", {"group_name": GROUP})
    assert answers, "update_weights_from_distributed did not answer"
    return answers[0]


# case -> how to run it against one server; the answer returned is the one compared.
CASES: dict[str, Callable[[ServerProcess, dict], tuple[int, Any]]] = {
    "generate": _post("/generate", PROMPT),
    "generate-logprob": _post("/generate", {**PROMPT, "return_logprob": True}),
    "get_server_info": _server_info,
    "model_info": _get("/model_info"),
    "pause-abort": _then(_post("/pause_generation", {"mode": "abort"}), ("/continue_generation", {})),
    "pause-retract": _then(_post("/pause_generation", {"mode": "retract"}), ("/continue_generation", {})),
    "pause-in_place": _then(_post("/pause_generation", {"mode": "in_place"}), ("/continue_generation", {})),
    "continue": _post("/continue_generation", {}),
    "flush_cache": _post("/flush_cache"),
    "update_weight_version": _post("/update_weight_version", {"new_version": "conformance-1"}),
    "begin": _then(_post("/begin_weight_update", {"selector": "target"}), ("/end_weight_update", {})),
    "end": _end,
    "double-begin": _double_begin,
    "end-without-session": _post("/end_weight_update", {}),
    "end-empty-body": _then(_end_empty_body, ("/end_weight_update", {})),
    "bad-selector": _post("/begin_weight_update", {"selector": "both"}),
    "update-outside-session": lambda server, tensors: server.post("/update_weights_from_tensor", _by_value(tensors)),
    "update-by-value": _in_session("/update_weights_from_tensor", _by_value),
    "update-flattened-bucket": _in_session("/update_weights_from_tensor", _flattened),
    "update-direct": _in_session(
        "/update_weights_from_tensor", lambda tensors: _by_value(tensors, load_format="direct")
    ),
    "update-unknown-name": _in_session("/update_weights_from_tensor", _unknown_name),
    "weights_checker-checksum": _post("/weights_checker", {"action": "checksum", "selector": "target"}),
    "init-port-in-use": _init_port_in_use,
    "destroy-unknown-group": _post("/destroy_weights_update_group", {"group_name": "never-made"}),
    "distributed-unknown-group-outside-session": lambda server, tensors: server.post(
        "/update_weights_from_distributed", _distributed(tensors, group_name="never-made")
    ),
    "distributed-unknown-group": _in_session(
        "/update_weights_from_distributed", lambda tensors: _distributed(tensors, group_name="never-made")
    ),
    "distributed-update": _distributed_update,
}

# Paths whose objects are maps (keys are names, not fields): only their values' shapes are compared.
MAP_PATHS = frozenset({"$.ranks[].checksums"})


# ---- shape comparison -------------------------------------------------------------------------------------------


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "list"
    return type(value).__name__  # bool, int, float, str


def shape_differences(sglang: Any, reference: Any, *, case: str, path: str = "$") -> list[str]:
    """Every place where the two answers differ in shape, as "path: what"; empty when they have the same shape.

    Lists must be as long on both sides and compare item by item (SGLang's lists are records or [logprob, id,
    text] triples, so position matters). A null matches only a null, except where NULLABLE says why one side's
    value is null by value.
    """
    if (sglang is None) != (reference is None) and _is_listed(NULLABLE, case, path):
        return []
    if _kind(sglang) != _kind(reference):
        return [f"{path}: SGLang {_kind(sglang)} {_clip(sglang)}, reference {_kind(reference)} {_clip(reference)}"]
    if isinstance(sglang, list):
        if len(sglang) != len(reference):
            return [f"{path}: SGLang {len(sglang)} items, reference {len(reference)}"]
        pairs = zip(sglang, reference)
        return sorted({d for s, r in pairs for d in shape_differences(s, r, case=case, path=f"{path}[]")})
    if not isinstance(sglang, dict):
        return []
    if path in MAP_PATHS:
        values = [*sglang.values(), *reference.values()]
        return sorted({d for v in values[1:] for d in shape_differences(values[0], v, case=case, path=f"{path}.*")})
    found = []
    for key in sorted(sglang.keys() | reference.keys()):
        where = f"{path}.{key}"
        if _is_intentional(case, where):
            continue
        if key not in reference:
            found.append(f"{where}: only SGLang sends it ({_kind(sglang[key])} {_clip(sglang[key])})")
        elif key not in sglang:
            found.append(f"{where}: only the reference sends it ({_kind(reference[key])} {_clip(reference[key])})")
        else:
            found += shape_differences(sglang[key], reference[key], case=case, path=where)
    return found


def _server_info_slice(sglang: dict, reference: dict) -> tuple[dict, dict]:
    """Both answers cut to the keys miles_sync reads plus every key the reference sends; internal_states items cut
    to the keys the reference sends."""
    keys = {*SERVER_INFO_KEYS, *reference}
    sglang, reference = ({k: v for k, v in answer.items() if k in keys} for answer in (sglang, reference))
    state_keys = set().union(*reference.get("internal_states", [{}]))
    for answer in (sglang, reference):
        if isinstance(answer.get("internal_states"), list):
            answer["internal_states"] = [
                {k: v for k, v in s.items() if k in state_keys} for s in answer["internal_states"]
            ]
    return sglang, reference


def _is_intentional(case: str, where: str) -> bool:
    return _is_listed(INTENTIONAL, case, where)


def _is_listed(listing: dict[tuple[str, str], str], case: str, where: str) -> bool:
    return (case, where) in listing or ("*", where) in listing


def _clip(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- fixtures and the test --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(reference_checkpoints, sglang_python, tmp_path_factory) -> Iterator[Pair]:
    model = reference_checkpoints / "target"
    log_dir = tmp_path_factory.mktemp("conformance")
    # The tensors outlive every request: payloads point at their shared memory.
    tensors = checkpoint_tensors(model)
    with contextlib.ExitStack() as stack:
        launcher, ref = enter_together(
            stack,
            sglang_server(model=model, python=sglang_python, log_dir=log_dir),
            reference_server(model=model, log_dir=log_dir, finalize_policy="sglang", checksum_names="engine"),
        )
        sglang = ServerProcess(url=launcher.url, process=None, log_path=log_dir / "none", api_key=None)
        yield Pair(sglang=sglang, reference=ref, tensors=tensors)


@pytest.mark.parametrize("case", list(CASES))
def test_same_status_and_shape(pair: Pair, case: str) -> None:
    run = CASES[case]
    sglang_status, sglang_answer = run(pair.sglang, pair.tensors)
    reference_status, reference_answer = run(pair.reference, pair.tensors)
    if case == "get_server_info":  # SGLang's is every server arg: compare what the reference and miles_sync use
        sglang_answer, reference_answer = _server_info_slice(sglang_answer, reference_answer)
    differences = (
        [] if _is_intentional(case, "shape") else shape_differences(sglang_answer, reference_answer, case=case)
    )
    if sglang_status != reference_status and not _is_intentional(case, "status"):
        differences.insert(0, f"status: SGLang {sglang_status}, reference {reference_status}")
    assert not differences, (
        f"{case}: SGLang {sglang_status} {_clip(sglang_answer, 1500)}\n reference {reference_status} "
        f"{_clip(reference_answer, 1500)}\n" + "\n".join(differences)
    )


def test_intentional_differences_name_real_cases() -> None:
    unknown = sorted({case for case, _ in INTENTIONAL} - {"*", *CASES})
    assert not unknown, f"INTENTIONAL names cases that do not exist: {unknown}"


VALUE_PROMPTS = [[3, 100, 7], [11, 12, 13, 14, 15, 16, 17, 18], [250, 4, 90, 33, 2]]
GREEDY_TOKENS = 12
LOGPROB_BOUND = 1e-4  # |SGLang - reference| per token (float32 on both; the measured gap is printed)


def test_same_greedy_tokens_and_logprobs_on_the_same_weights(pair: Pair) -> None:
    """Both serve the checkpoint (every case above leaves its values: the updates send the checkpoint's own
    tensor): the same prompts, greedy, give the same tokens, and each token's log-prob agrees within
    LOGPROB_BOUND, prompt and output alike."""
    worst = 0.0
    for prompt in VALUE_PROMPTS:
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": GREEDY_TOKENS, "temperature": 0.0},
            "return_logprob": True,
        }
        answers = []
        for server in (pair.sglang, pair.reference):
            status, answer = server.post("/generate", body)
            assert status == 200, answer
            answers.append(answer)
        sglang, reference = answers
        assert sglang["output_ids"] == reference["output_ids"] and len(sglang["output_ids"]) == GREEDY_TOKENS
        for key in ("output_token_logprobs", "input_token_logprobs"):
            ours, theirs = reference["meta_info"][key], sglang["meta_info"][key]
            assert [entry[1] for entry in ours] == [entry[1] for entry in theirs], key  # the same token ids
            pairs = [(a[0], b[0]) for a, b in zip(ours, theirs) if a[0] is not None or b[0] is not None]
            assert all(a is not None and b is not None for a, b in pairs), (key, ours, theirs)
            worst = max([worst, *(abs(a - b) for a, b in pairs)])
    print(f"max |SGLang - reference| log-prob: {worst:.2e}")
    assert worst <= LOGPROB_BOUND
