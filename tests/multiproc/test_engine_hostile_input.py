"""Hostile input at the reference engine: every malformed request is a 4xx naming the problem, the engine keeps
serving, the weights stay as they were, and no pickle can run code.

Where each kind of malformed input is covered (together they cover the issue's list):
- tests/multiproc/test_reference_errors.py: unknown key, unknown selector, wrong type (names=5), update outside a
  session, selector mismatch, unknown parameter name, draft name under selector target, shape and dtype mismatch,
  invalid base64 characters, a pickle naming builtins.exec, two payloads for TP=1, unaligned tensor bucket,
  forged shared-memory size, unaligned distributed bucket, negative dims, names/dtypes/shapes length mismatch,
  unknown dtype name, wrong group name, empty names; plus session protocol errors (second begin, end without
  session, destroying an unknown group, engine rank 0).
- tests/multiproc/test_reference_server.py: body that is not JSON, wrong-typed sampling parameter, 404/405 probes.
- this module, CASES: huge shapes (per tensor and flattened), truncated base64, truncated pickle, an inline
  storage (torch.save bytes) that is no storage, persistent ids, wrong payload structures, duplicate names, forged
  FlattenedTensorMetadata states, wrong element types, bool for int, null for a required field, non-weight dtype,
  load formats that do not apply, body that is not an object, non-UTF-8 and deeply nested bodies, bad init
  arguments (world size, port, backend, taken group name), bad checker action, missing version, bad flush timeout.
- this module, GADGETS: pickles that would run code (os.system, exec, eval, subprocess.Popen, a protocol-0 INST,
  gadgets nested inside a valid pair list and inside metadata state), at the HTTP endpoint and at the decoder.
- this module, the fuzz: hypothesis-built JSON bodies for every weight-update endpoint.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import os
import pickle
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_server import (
    ServerProcess,
    checkpoint_tensors,
    checksums,
    generate,
    joined_group,
    mtp_names,
    reference_server,
)

from miles_sync.wire.payload import (
    SGLANG_METADATA_MODULE,
    FlattenedTensorMetadata,
    PayloadError,
    decode_payload,
    encode_named_tensors,
)
from miles_sync.wire.protocol import ENDPOINTS

GROUP = "hostile-group"
TIMEOUT_S = 60.0
# Short, so a fuzzed init body that is valid fails its rendezvous (at a refused loopback port) in seconds.
FUZZ_COLLECTIVE_TIMEOUT_S = 2.0

_KEEP_ALIVE: list = []  # producers keep shared tensors alive until the receiver answered


@pytest.fixture(scope="module")
def env(reference_checkpoints, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """One engine that joined GROUP (this process is rank 0), so distributed cases reach the layout checks."""
    target = reference_checkpoints / "target"
    with (
        reference_server(
            model=target, draft_kind="mtp", weight_layout="aiter", log_dir=tmp_path_factory.mktemp("hostile")
        ) as server,
        joined_group(server, group_name=GROUP, timeout_s=TIMEOUT_S),
    ):
        draft = mtp_names(target)
        weights = {n: t for n, t in checkpoint_tensors(target).items() if n not in draft}
        yield {"server": server, "weights": weights, "baseline": checksums(server)}


def _q(env) -> tuple[str, torch.Tensor]:
    name = next(n for n in sorted(env["weights"]) if n.endswith("self_attn.q_proj.weight"))
    return name, env["weights"][name]


class _InlineStorage:
    """Pickles as `torch.storage._load_from_bytes(data)`: what a plainly pickled tensor's storage is."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self):
        return (torch.storage._load_from_bytes, (self.data,))


def _torch_saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _tensor_body(payload: Any, **fields: Any) -> dict[str, Any]:
    return {"serialized_named_tensors": [payload], "selector": "target", **fields}


def _distributed(names: Any, dtypes: Any, shapes: Any, **fields: Any) -> dict[str, Any]:
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": GROUP, "selector": "target", **fields}


def _shared_payload(named: list[tuple[str, torch.Tensor]]) -> str:
    """A well-formed payload; its tensors stay alive until the case has been answered."""
    _KEEP_ALIVE.extend(t for _, t in named)
    return encode_named_tensors(named)


def _metadata_pickle(**state: Any) -> str:
    """A flattened-bucket payload whose metadata record carries `state`, pickled under SGLang's class name.

    FlattenedTensorMetadata itself does not validate (its unpickling does), so any state pickles; protocol 2 names
    the class with a text GLOBAL opcode, which is renamed to SGLang's module as real producers write it.
    """
    fields = {"name": "w", "shape": torch.Size([2]), "dtype": torch.float32, "start_idx": 0, "end_idx": 8, "numel": 8}
    meta = FlattenedTensorMetadata(**{**fields, **state})
    return _b64(_sglang_class_name(pickle.dumps({"flattened_tensor": 0, "metadata": [meta]}, protocol=2)))


def _sglang_class_name(raw: bytes) -> bytes:
    ours = f"c{FlattenedTensorMetadata.__module__}\nFlattenedTensorMetadata\n".encode()
    assert raw.count(ours) == 1, "the metadata class is no longer pickled by one GLOBAL opcode"
    return raw.replace(ours, f"c{SGLANG_METADATA_MODULE}\nFlattenedTensorMetadata\n".encode())


def _persistent_id_pickle() -> str:
    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return "external-object" if obj == "by-reference" else None

    buf = io.BytesIO()
    _Pickler(buf, protocol=4).dump([("w", "by-reference")])
    return _b64(buf.getvalue())


def _deeply_nested_json() -> bytes:
    depth = 100_000  # far past the JSON decoder's recursion limit
    return b"[" * depth + b"]" * depth


@dataclass(frozen=True, kw_only=True)
class HostileCase:
    """One malformed request: where it goes, its body (JSON value, or raw bytes), and what the answer must name."""

    endpoint: str
    body: Callable[[dict[str, Any]], Any]
    needle: str
    opens_session: bool = False


CASES: dict[str, HostileCase] = {
    # ---- tensor path: base64, pickle and payload structure
    "truncated-base64": HostileCase(
        endpoint="/update_weights_from_tensor",
        opens_session=True,
        needle="not valid base64",
        body=lambda env: _tensor_body(_shared_payload([_q(env)])[:-1]),
    ),
    "truncated-pickle": HostileCase(
        endpoint="/update_weights_from_tensor",
        opens_session=True,
        needle="payload does not unpickle",
        body=lambda env: _tensor_body(_b64(pickle.dumps([("w", list(range(64)))])[:40])),
    ),
    # A plainly pickled tensor (torch.save bytes inline) loads, as in SGLang's unpickler (the p2p ticket is one);
    # its storage bytes must load as a storage with weights_only, as SGLang's `_safe_load_torch_storage` requires.
    "inline-storage-that-is-no-storage": HostileCase(
        endpoint="/update_weights_from_tensor",
        opens_session=True,
        needle="an inline storage must load as a typed storage, got dict",
        body=lambda env: _tensor_body(_b64(pickle.dumps([("w", _InlineStorage(_torch_saved({"not": "a storage"})))]))),
    ),
    "persistent-id": HostileCase(
        endpoint="/update_weights_from_tensor",
        opens_session=True,
        needle="persistent ids",
        body=lambda env: _tensor_body(_persistent_id_pickle()),
    ),
    "payload-not-a-list": HostileCase(
        endpoint="/update_weights_from_tensor",
        opens_session=True,
        needle="list of (name, tensor) pairs, got dict",
        body=lambda env: _tensor_body(_b64(pickle.dumps({"w": 1}))),
    ),
    "entry-not-a-pair": HostileCase(
        endpoint="/update_weights_from_tensor",
        opens_session=True,
        needle="entry 0 is not a (name, tensor) pair",
        body=lambda env: _tensor_body(_b64(pickle.dumps([("only-a-name",)]))),
    ),
    "duplicate-names": HostileCase(
        endpoint="/update_weights_from_tensor",
        opens_session=True,
        needle="names tensors more than once",
        body=lambda env: _tensor_body(_shared_payload([_q(env), (_q(env)[0], _q(env)[1].clone())])),
    ),
    "flattened-payload-not-a-dict": HostileCase(
        endpoint="/update_weights_from_tensor",
        opens_session=True,
        needle="must be a dict with 'flattened_tensor' and 'metadata'",
        body=lambda env: _tensor_body(_shared_payload([_q(env)]), load_format="flattened_bucket"),
    ),
    "flattened-buffer-not-a-tensor": HostileCase(
        endpoint="/update_weights_from_tensor",
        opens_session=True,
        needle="flattened_tensor must be a 1-D uint8",
        body=lambda env: _tensor_body(
            _b64(pickle.dumps({"flattened_tensor": [0] * 8, "metadata": []})), load_format="flattened_bucket"
        ),
    ),
    "metadata-negative-start": HostileCase(
        endpoint="/update_weights_from_tensor",
        opens_session=True,
        needle="start_idx must be an int >= 0, got -8",
        body=lambda env: _tensor_body(_metadata_pickle(start_idx=-8), load_format="flattened_bucket"),
    ),
    "metadata-dtype-not-a-dtype": HostileCase(
        endpoint="/update_weights_from_tensor",
        opens_session=True,
        needle="dtype must be a torch.dtype",
        body=lambda env: _tensor_body(_metadata_pickle(dtype="float32"), load_format="flattened_bucket"),
    ),
    "metadata-too-many-dims": HostileCase(
        endpoint="/update_weights_from_tensor",
        opens_session=True,
        needle="at most 16 ints",
        body=lambda env: _tensor_body(_metadata_pickle(shape=torch.Size([1] * 17)), load_format="flattened_bucket"),
    ),
    # ---- tensor path: request fields
    "no-payload": HostileCase(
        endpoint="/update_weights_from_tensor",
        opens_session=True,
        needle="has 0 payloads",
        body=lambda env: {**_tensor_body("x"), "serialized_named_tensors": []},
    ),
    "payload-not-a-string": HostileCase(
        endpoint="/update_weights_from_tensor",
        needle="serialized_named_tensors[0]: expected str, got int 123",
        body=lambda env: _tensor_body(123),
    ),
    # Any string is a load_format (a custom loader's import path); one the engine was not started with crashes it
    # inside a session, as it crashes SGLang (tests/sglang/test_direct_load_sglang.py). A non-string is refused.
    "load-format-of-another-type": HostileCase(
        endpoint="/update_weights_from_tensor",
        needle="load_format: expected",
        body=lambda env: _tensor_body("x", load_format=5),
    ),
    # ---- distributed path
    "huge-shape": HostileCase(
        endpoint="/update_weights_from_distributed",
        opens_session=True,
        needle="more than a tensor can hold",
        body=lambda env: _distributed([_q(env)[0]], ["float32"], [[2**62]]),
    ),
    "huge-shape-flattened": HostileCase(
        endpoint="/update_weights_from_distributed",
        opens_session=True,
        needle="more than a tensor can hold",
        body=lambda env: _distributed([_q(env)[0]], ["float32"], [[2**40, 2**40]], load_format="flattened_bucket"),
    ),
    "dim-not-an-int": HostileCase(
        endpoint="/update_weights_from_distributed",
        needle="shapes[0][1]: expected int, got str 'wide'",
        body=lambda env: _distributed([_q(env)[0]], ["float32"], [[4, "wide"]]),
    ),
    "bool-for-int": HostileCase(
        endpoint="/update_weights_from_distributed",
        needle="shapes[0][0]: expected int, got bool True",
        body=lambda env: _distributed([_q(env)[0]], ["float32"], [[True]]),
    ),
    "null-required-field": HostileCase(
        endpoint="/update_weights_from_distributed",
        needle="names: expected a list of str, got null",
        body=lambda env: _distributed(None, ["float32"], [[1]]),
    ),
    "non-weight-dtype": HostileCase(
        endpoint="/update_weights_from_distributed",
        opens_session=True,
        needle="Unsupported dtype name 'complex64'",
        body=lambda env: _distributed([_q(env)[0]], ["complex64"], [list(_q(env)[1].shape)]),
    ),
    "direct-format-on-distributed": HostileCase(
        endpoint="/update_weights_from_distributed",
        needle="load_format='direct' applies to tensor updates only",
        body=lambda env: _distributed([_q(env)[0]], ["float32"], [[1]], load_format="direct"),
    ),
    # ---- bodies
    "body-not-an-object": HostileCase(
        endpoint="/begin_weight_update",
        needle="expected an object (BeginWeightUpdateRequest), got a list",
        body=lambda env: ["target"],
    ),
    "non-utf8-body": HostileCase(
        endpoint="/begin_weight_update", needle="not valid JSON", body=lambda env: b'{"selector": "\xff"}'
    ),
    "deeply-nested-body": HostileCase(
        endpoint="/begin_weight_update",
        needle="nested too deeply",
        body=lambda env: _deeply_nested_json(),
    ),
    # ---- update group
    "init-world-size-zero": HostileCase(
        endpoint="/init_weights_update_group",
        needle="world_size=0 must be at least 1",
        body=lambda env: _init_body(world_size=0, rank_offset=0),
    ),
    "init-port-out-of-range": HostileCase(
        endpoint="/init_weights_update_group",
        needle="master_port=70000 is not in 1..65535",
        body=lambda env: _init_body(master_port=70000),
    ),
    "init-unknown-backend": HostileCase(
        endpoint="/init_weights_update_group",
        needle="backend 'mpi' is not one of",
        body=lambda env: _init_body(backend="mpi"),
    ),
    "init-group-name-taken": HostileCase(
        endpoint="/init_weights_update_group",
        needle=f"update group '{GROUP}' already exists",
        body=lambda env: _init_body(group_name=GROUP),
    ),
    # ---- checker, version, flush
    "checker-unknown-action": HostileCase(
        endpoint="/weights_checker", needle="action: 'explode' is not one of", body=lambda env: {"action": "explode"}
    ),
    "version-missing": HostileCase(
        endpoint="/update_weight_version", needle="missing required key(s) 'new_version'", body=lambda env: {}
    ),
    "flush-timeout-not-a-number": HostileCase(
        endpoint="/flush_cache?timeout=soon", needle="timeout='soon' is not a number", body=lambda env: b""
    ),
}


def _init_body(**fields: Any) -> dict[str, Any]:
    """Valid except for `fields`; the port is never contacted because every case fails before the rendezvous."""
    base = {
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "hostile-init",
        "backend": "gloo",
    }
    return {**base, **fields}


def _post(server: ServerProcess, endpoint: str, body: Any) -> tuple[int, Any]:
    if isinstance(body, bytes):
        return server.post(endpoint, raw=body)
    return server.post(endpoint, body)


def _assert_still_serving(server: ServerProcess, baseline: dict[str, str]) -> None:
    assert server.process.poll() is None, server.log_tail()
    assert server.get("/health_generate") == (200, "ok")
    assert generate(server, [3, 32])[0] == 200
    assert checksums(server) == baseline


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_request_is_a_4xx_naming_the_problem_and_changes_nothing(env, case):
    server, spec = env["server"], CASES[case]
    if spec.opens_session:
        server.ok("/begin_weight_update", {"selector": "target"})
    try:
        status, answer = _post(server, spec.endpoint, spec.body(env))
    finally:
        server.post("/end_weight_update")  # 400 without a session or after a failed one: both fine here
        _KEEP_ALIVE.clear()
    assert 400 <= status < 500, (status, answer)
    message = answer if isinstance(answer, str) else answer["message"]
    assert isinstance(answer, str) or answer["success"] is False, answer
    assert spec.needle in message, message
    _assert_still_serving(server, env["baseline"])


# ---- pickles that would run code ----------------------------------------------------------------------------------


class _Gadget:
    """Unpickles as `fn(*args)`: the classic way a pickle runs code in a plain `pickle.loads`."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _touch_script(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()"


def _inst_opcode_pickle(marker: Path) -> bytes:
    """Protocol 0 by hand: MARK, the argument, INST os system (INST resolves its class through find_class too)."""
    return b"(S" + repr(f"touch {marker}").encode() + b"\nios\nsystem\n."


def _metadata_state_gadget(marker: Path, *, sglang_name: bool = True) -> bytes:
    """The gadget inside the state of an allow-listed class: the class resolves, its state must not.

    With `sglang_name=False` the class keeps our own importable module name, so a plain unpickler reaches the
    state (the control); the record's own check then refuses the result, after the command already ran.
    """
    meta = FlattenedTensorMetadata(
        name=_Gadget(os.system, f"touch {marker}"), shape=(1,), dtype=torch.uint8, start_idx=0, end_idx=1, numel=1
    )
    raw = pickle.dumps({"flattened_tensor": 0, "metadata": [meta]}, protocol=2)
    return _sglang_class_name(raw) if sglang_name else raw


# name -> (pickle bytes that create `marker` when plainly unpickled, the global the allow-list must refuse)
GADGETS: dict[str, tuple[Callable[[Path], bytes], str]] = {
    "os-system": (lambda m: pickle.dumps([("w", _Gadget(os.system, f"touch {m}"))]), "posix.system"),
    "builtins-exec": (lambda m: pickle.dumps(_Gadget(exec, _touch_script(m))), "builtins.exec"),
    "builtins-eval": (lambda m: pickle.dumps(_Gadget(eval, f"exec({_touch_script(m)!r})")), "builtins.eval"),
    "subprocess-popen": (lambda m: pickle.dumps(_Gadget(subprocess.Popen, ["touch", str(m)])), "subprocess.Popen"),
    "protocol-0-inst": (_inst_opcode_pickle, "os.system"),
    "inside-metadata-state": (_metadata_state_gadget, "posix.system"),
}
# What a plain unpickler runs to show each gadget is live, where that differs from the gadget itself.
_CONTROLS: dict[str, Callable[[Path], bytes]] = {
    "inside-metadata-state": lambda m: _metadata_state_gadget(m, sglang_name=False),
}


def _reap(obj: Any) -> None:
    if isinstance(obj, subprocess.Popen):
        obj.wait(timeout=30)


def _wait_for(path: Path, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("gadget", sorted(GADGETS))
@pytest.mark.parametrize("load_format", [None, "flattened_bucket"], ids=["pairs", "flattened"])
def test_decoder_refuses_code_running_pickles(gadget, load_format, tmp_path):
    build, refused = GADGETS[gadget]
    control, marker = tmp_path / "control", tmp_path / "marker"
    # The same bytes do run code under a plain unpickler, so a refusal below is the allow-list's doing.
    with contextlib.suppress(PayloadError):
        _reap(pickle.loads(_CONTROLS.get(gadget, build)(control)))
    assert _wait_for(control), f"gadget {gadget} is not live: the control unpickle did not create its marker"
    with pytest.raises(PayloadError, match="outside the allow-list") as refusal:
        decode_payload(_b64(build(marker)), load_format=load_format)
    assert f"names {refused}," in str(refusal.value)
    time.sleep(0.2)  # a spawned process would have created the marker by now
    assert not marker.exists()


@pytest.mark.parametrize("gadget", sorted(GADGETS))
def test_engine_refuses_code_running_pickles(env, gadget, tmp_path):
    server = env["server"]
    build, refused = GADGETS[gadget]
    marker = tmp_path / "marker"
    server.ok("/begin_weight_update", {"selector": "target"})
    try:
        status, answer = server.post("/update_weights_from_tensor", _tensor_body(_b64(build(marker))))
    finally:
        server.post("/end_weight_update")
    assert 400 <= status < 500 and answer["success"] is False, (status, answer)
    assert f"names {refused}, which is outside the allow-list" in answer["message"], answer["message"]
    time.sleep(0.2)
    assert not marker.exists()
    _assert_still_serving(server, env["baseline"])


# ---- fuzz ---------------------------------------------------------------------------------------------------------

FUZZ_PATHS = (
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/update_weight_version",
    "/weights_checker",
)
_FIELDS_BY_PATH = {path: tuple(f.name for f in dataclasses.fields(ENDPOINTS[path])) for path in FUZZ_PATHS}
_ALL_FIELDS = frozenset(name for names in _FIELDS_BY_PATH.values() for name in names)

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


# Plain Python structures, pickled at any protocol: well-formed pickles without globals reach the payload checks.
_PICKLED_STRUCTURES = st.builds(
    lambda obj, protocol: _b64(pickle.dumps(obj, protocol=protocol)),
    st.recursive(
        st.none() | st.integers() | st.text(max_size=8) | st.binary(max_size=8),
        lambda children: (
            st.lists(children, max_size=3)
            | st.tuples(children, children)
            | st.dictionaries(st.sampled_from(["flattened_tensor", "metadata", "w"]), children, max_size=2)
        ),
        max_leaves=8,
    ),
    st.integers(0, pickle.HIGHEST_PROTOCOL),
)


def _near_valid_values(names: list[str], closed_port: int) -> dict[str, st.SearchStrategy]:
    """Per field, values a client might plausibly send (valid ones included). Addresses and ports never leave one
    refused loopback port, and no checker action overwrites the weights (reset_tensors, valid, does)."""
    return {
        "selector": st.sampled_from(["target", "draft", "all", "both", ""]),
        "names": st.lists(st.sampled_from([*names, "nope", ""]), max_size=3),
        "dtypes": st.lists(st.sampled_from(["float32", "bfloat16", "uint8", "float33", "complex64", ""]), max_size=3),
        "shapes": st.lists(st.lists(st.integers(-3, 8) | st.integers(-(2**64), 2**64), max_size=3), max_size=3),
        "serialized_named_tensors": st.lists(
            _PICKLED_STRUCTURES | st.binary(max_size=48).map(_b64) | st.text(max_size=12), max_size=2
        ),
        "load_format": st.sampled_from(KNOWN_LOAD_FORMATS),
        "group_name": st.sampled_from(["weight_update_group", "fuzz", ""]) | st.text(max_size=8),
        "master_address": st.just("127.0.0.1"),
        "master_port": st.sampled_from([closed_port, 0, -1, 2**16]),
        "rank_offset": st.integers(-2, 3),
        "world_size": st.integers(-1, 3),
        "backend": st.sampled_from(["gloo", "nccl", "mpi", ""]),
        "action": st.sampled_from(["snapshot", "compare", "checksum", "explode"]),
        "new_version": st.text(max_size=8),
        "weight_version": st.none() | st.text(max_size=8),
        "skip_tensor_list": st.none() | st.lists(st.text(max_size=6), max_size=2),
        **{
            flag: st.booleans()
            for flag in ("flush_cache", "abort_all_requests", "torch_empty_cache", "allow_quant_error")
        },
    }


# An update naming any other load_format ends SGLang's scheduler, and the reference engine's as it does (the crash
# case of tests/sglang/test_direct_load_sglang.py): a crash by design, so the fuzz never names one.
KNOWN_LOAD_FORMATS = (None, "direct", "flattened_bucket")


def _is_safe_junk(name: str, value: Any) -> bool:
    """Any JSON, except a string address (name resolution leaves loopback), a usable port (some other
    process's) or a string load_format no loader serves (it crashes the engine by design)."""
    if name == "load_format":
        return not isinstance(value, str) or value in KNOWN_LOAD_FORMATS
    if name == "master_address":
        return not isinstance(value, str)
    if name == "master_port":
        return not (isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**16)
    return not (name == "action" and value == "reset_tensors")


@st.composite
def _fuzz_requests(draw, near: dict[str, st.SearchStrategy]) -> tuple[str, Any, str | None]:
    """(path, body, selector of a session to open first or None). Bodies: near-valid with one field replaced by
    any JSON and maybe one dropped, plus random extra keys; or any JSON at all; or raw bytes."""
    path = draw(st.sampled_from(FUZZ_PATHS))
    session = draw(st.none() | st.sampled_from(["target", "all"]))
    form = draw(st.sampled_from(["near-valid", "near-valid", "near-valid", "with-extras", "any-json", "raw-bytes"]))
    if form == "any-json":
        return path, draw(JSON_VALUES), session
    if form == "raw-bytes":
        return path, draw(st.binary(max_size=40)), session
    fields = _FIELDS_BY_PATH[path]
    body = {name: draw(near.get(name, JSON_VALUES)) for name in fields}
    if fields and draw(st.booleans()):
        name = draw(st.sampled_from(fields))
        body[name] = draw(JSON_VALUES.filter(lambda v: _is_safe_junk(name, v)))
    if fields and draw(st.booleans()):
        del body[draw(st.sampled_from(fields))]
    if form == "with-extras":
        extra_keys = st.text(max_size=10).filter(lambda k: k not in _ALL_FIELDS)
        body.update(draw(st.dictionaries(extra_keys, JSON_VALUES, min_size=1, max_size=3)))
    return path, body, session


@pytest.fixture(scope="module")
def fuzz_engine(reference_checkpoints, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """An engine in no update group, so no fuzzed body can start a receive; a short rendezvous timeout."""
    target = reference_checkpoints / "target"
    with (
        reference_server(
            model=target,
            draft_kind="mtp",
            weight_layout="aiter",
            log_dir=tmp_path_factory.mktemp("fuzz"),
            extra_args=["--collective-timeout-s", str(FUZZ_COLLECTIVE_TIMEOUT_S)],
        ) as server,
        socket.socket() as closed,
    ):
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused, and no one else has it
        names = sorted(n for n in checkpoint_tensors(target) if n not in mtp_names(target))
        yield {"server": server, "baseline": checksums(server), "names": names, "closed_port": closed.getsockname()[1]}


def test_fuzzed_weight_update_bodies_never_fail_the_engine(fuzz_engine):
    server = fuzz_engine["server"]
    near = _near_valid_values(fuzz_engine["names"][:4], fuzz_engine["closed_port"])

    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(request=_fuzz_requests(near))
    def check(request: tuple[str, Any, str | None]) -> None:
        path, body, session = request
        if session is not None:
            server.ok("/begin_weight_update", {"selector": session})
        try:
            status, answer = _post(server, path, body)  # a dropped connection raises here
        finally:
            server.post("/end_weight_update")  # closes whatever session is open; 400 when none is
        assert 200 <= status < 300 or (400 <= status < 500 and status != 401), (path, body, status, answer)
        assert isinstance(answer, dict) and isinstance(answer.get("message"), str), (path, body, answer)
        assert (status < 300) == (answer.get("success") is not False), (path, body, status, answer)

    check()
    _assert_still_serving(server, fuzz_engine["baseline"])
    assert "Traceback" not in server.log_tail(10**6), server.log_tail()
