"""Engine security: `serve` binds loopback by default; with an API key every admin route refuses a missing or wrong
key with 401 while the health and rollout routes stay open; the key never reaches logs, info answers or reports.

Extends test_reference_server.py::test_api_key_guards_every_admin_endpoint (missing key, POST, the ADMIN_PATHS
list) with routes enumerated from the app itself (every method), wrong-key variants, and leak checks.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from reference_server import ServerProcess, checkpoint_tensors, mtp_names, reference_server

from miles_sync.config import EngineConfig, MilesSyncConfig
from miles_sync.engine.client import EngineClient, EngineError
from miles_sync.engine.launcher import ReferenceEngineSpec, SGLangEngineSpec
from miles_sync.engine.reference.server import ADMIN_PATHS, OPEN_PATHS, ServerSettings, create_app
from miles_sync.engine.reference.serve import build_engine, parse_args
from miles_sync.env import ENGINE_API_KEY_VARIABLE
from miles_sync.protocol import Selector, UpdateWeightsFromTensorRequest
from miles_sync.run_report import RunReport, config_record
from miles_sync.tensor_payload import encode_named_tensors
from miles_sync.trainer import SenderSettings

API_KEY = "sk-sec-7f3a91c2e5"
WRONG_KEY = "sk-sec-0000bad"
TIMEOUT_S = 60.0
_LOOPBACK_HOSTS = ("127.0.0.1", "[::1]")

# ---- default bind address -----------------------------------------------------------------------------------------


def test_serve_defaults_to_loopback_without_the_host_variable(monkeypatch):
    monkeypatch.delenv("MILES_SYNC_HOST", raising=False)
    assert parse_args(["--model", "unused"]).host == "127.0.0.1"


def _process_tree(pid: int) -> set[int]:
    """`pid` and every descendant, from /proc (children of every thread)."""
    tree, todo = set(), [pid]
    while todo:
        current = todo.pop()
        tree.add(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{current}/task/{task}/children") as children:
                    todo.extend(int(child) for child in children.read().split())
            except FileNotFoundError:
                continue
    return tree


def _listening_addresses(pids: set[int]) -> list[str]:
    """Local address:port of every listening TCP socket the processes hold, as `ss -ltnp` reports them."""
    table = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, timeout=30, check=True).stdout
    addresses = []
    for line in table.splitlines():
        fields = line.split()
        if any(f"pid={pid}," in line for pid in pids):
            addresses.append(fields[3])
    return addresses


def test_serve_without_a_host_argument_listens_on_loopback_only(reference_checkpoints, tmp_path, monkeypatch):
    monkeypatch.delenv("MILES_SYNC_HOST", raising=False)  # the server inherits this process's environment
    with reference_server(model=reference_checkpoints / "target", log_dir=tmp_path, host=None) as server:
        url = server.url
        assert url.startswith("http://127.0.0.1:"), url
        addresses = _listening_addresses(_process_tree(server.process.pid))
        assert addresses, "ss reports no listening socket for the server"
        assert all(address.rsplit(":", 1)[0] in _LOOPBACK_HOSTS for address in addresses), addresses
        assert any(address.endswith(":" + url.rsplit(":", 1)[1]) for address in addresses), (url, addresses)


# ---- API key on every route ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(reference_checkpoints, tmp_path_factory) -> Iterator[ServerProcess]:
    with reference_server(
        model=reference_checkpoints / "target", draft_kind="mtp", weight_layout="aiter", api_key=API_KEY,
        log_dir=tmp_path_factory.mktemp("keyed"),
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def app_routes(reference_checkpoints) -> list[tuple[str, str]]:
    """(method, path) of every route the server's app registers, read from a real app over a real engine."""
    args = parse_args(["--model", str(reference_checkpoints / "target"), "--draft-kind", "mtp", "--threads", "1"])
    engine = build_engine(args)
    try:
        settings = ServerSettings(model_path=args.model, draft_kind="mtp", weight_layout="none", spec_steps=3,
                                  generate_timeout_s=TIMEOUT_S)  # fmt: skip
        app = create_app(engine, settings=settings, api_key=API_KEY, num_threads=1)
        return sorted({(route.method, route.resource.canonical) for route in app.router.routes()})
    finally:
        engine.shutdown()


def _send(url: str, method: str, path: str, *, authorization: str | None, body: bytes | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    request = urllib.request.Request(url + path, data=body, method=method, headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback traffic never goes to a proxy
    try:
        with opener.open(request, timeout=TIMEOUT_S) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def _body_for(method: str) -> bytes | None:
    return b"{}" if method == "POST" else None


# Authorization headers that must not pass: none, wrong key, the key altered, the key without the Bearer scheme.
_BAD_AUTHORIZATIONS = {
    "missing": None,
    "wrong-key": f"Bearer {WRONG_KEY}",
    "key-with-suffix": f"Bearer {API_KEY}x",
    "key-prefix": f"Bearer {API_KEY[:-1]}",
    "bare-key": API_KEY,
    "other-scheme": f"Basic {API_KEY}",
    "empty-bearer": "Bearer ",
}


def test_every_route_is_either_admin_or_deliberately_open(app_routes):
    paths = {path for _, path in app_routes}
    assert paths - (ADMIN_PATHS | OPEN_PATHS) == set(), "a route the key policy does not classify"
    assert ADMIN_PATHS <= paths and OPEN_PATHS <= paths
    assert {"/health_generate", "/health"} <= OPEN_PATHS and not {"/health_generate", "/health"} & ADMIN_PATHS


@pytest.mark.parametrize("authorization", sorted(_BAD_AUTHORIZATIONS))
def test_every_admin_route_refuses_a_missing_or_wrong_key(keyed, app_routes, authorization):
    header = _BAD_AUTHORIZATIONS[authorization]
    admin = [(method, path) for method, path in app_routes if path in ADMIN_PATHS]
    assert admin
    for method, path in admin:
        status, text = _send(keyed.url, method, path, authorization=header, body=_body_for(method))
        assert status == 401, (method, path, status, text)
        if method != "HEAD":
            assert "needs 'Authorization: Bearer <api key>'" in json.loads(text)["message"], text
        assert API_KEY not in text and WRONG_KEY not in text


def test_open_routes_answer_without_a_key_and_admin_routes_accept_the_key(keyed, app_routes):
    for method, path in app_routes:
        if path not in OPEN_PATHS:
            continue
        body = _body_for(method)
        if path == "/generate":
            body = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}).encode()
        status, text = _send(keyed.url, method, path, authorization=None, body=body)
        assert status == 200, (method, path, status, text)
    # The refusals above are about the key: with it, no admin route answers 401 (empty bodies: no weight changes).
    try:
        for method, path in app_routes:
            if path in ADMIN_PATHS:
                status, text = _send(keyed.url, method, path, authorization=f"Bearer {API_KEY}", body=_body_for(method))
                assert status != 401, (method, path, text)
    finally:
        keyed.post("/continue_generation", {})  # /pause_generation {} paused it
        keyed.post("/end_weight_update")  # /begin_weight_update {} opened a session


# ---- the key never leaks ------------------------------------------------------------------------------------------


async def _full_session(url: str, weights: list) -> EngineError:
    """A wrong-key call, then a complete session with the right key, through the library's client."""
    async with EngineClient(url, timeout_s=TIMEOUT_S, api_key=WRONG_KEY) as wrong:
        try:
            await wrong.begin_weight_update(Selector.TARGET)
        except EngineError as error:
            refused = error
        else:
            raise AssertionError("a wrong key opened a session")
    async with EngineClient(url, timeout_s=TIMEOUT_S, api_key=API_KEY) as client:
        await client.begin_weight_update(Selector.TARGET)
        request = UpdateWeightsFromTensorRequest(
            serialized_named_tensors=(encode_named_tensors(weights),), selector=Selector.TARGET
        )
        await client.update_weights_from_tensor(request)
        await client.end_weight_update()
    return refused


def test_the_key_never_reaches_the_log_or_info_answers(keyed, reference_checkpoints):
    target = reference_checkpoints / "target"
    skip = mtp_names(target)
    weights = sorted((n, t) for n, t in checkpoint_tensors(target).items() if n not in skip)
    refused = asyncio.run(_full_session(keyed.url, weights))
    assert refused.status == 401
    assert API_KEY not in str(refused) and WRONG_KEY not in str(refused)
    info_paths = ("/get_server_info", "/model_info", "/get_model_info", "/get_draft_report")
    answers = [keyed.get(path)[1] for path in info_paths]
    answers.append(keyed.ok("/weights_checker", {"action": "checksum"}))
    for answer in answers:
        text = json.dumps(answer)
        assert API_KEY not in text and WRONG_KEY not in text, text
    log = keyed.log_path.read_text(errors="replace")
    assert "api key set" in log  # the log is the server's: it does say a key is configured
    assert API_KEY not in log and WRONG_KEY not in log


def test_run_report_masks_the_key(tmp_path):
    config = MilesSyncConfig(engines=EngineConfig(api_key=API_KEY))
    record = config_record(config)
    assert record["engines"]["api_key"] == "***"
    report = RunReport(run_name="r", status="completed", config=record, packages={}, machine={}, baseline=None,
                       rounds=())  # fmt: skip
    path = tmp_path / "report.json"
    report.write_json(path)
    assert API_KEY not in path.read_text()


def test_engine_config_repr_hides_the_key():  # frozen dataclasses print every field unless told not to
    config = MilesSyncConfig(engines=EngineConfig(api_key=API_KEY))
    assert API_KEY not in repr(config.engines) and API_KEY not in repr(config) and API_KEY not in str(config)


def test_engine_spec_repr_hides_the_key():
    specs = [ReferenceEngineSpec(model_dir="m", api_key=API_KEY), SGLangEngineSpec(model_path="m", api_key=API_KEY)]
    assert all(API_KEY not in repr(spec) for spec in specs)


def test_sender_settings_repr_hides_the_key():
    settings = SenderSettings(transport="distributed", bucket_bytes=1, bucket_timeout_s=1.0, open_timeout_s=1.0,
                              http_timeout_s=1.0, call_timeout_s=1.0, api_key=API_KEY)  # fmt: skip
    assert API_KEY not in repr(settings)


def test_launcher_passes_the_reference_engines_key_outside_its_command_line():
    command = ReferenceEngineSpec(model_dir="m", api_key=API_KEY).command(host="127.0.0.1")
    assert API_KEY not in " ".join(command.argv)  # /proc/PID/cmdline is readable by every local user
    assert command.env == {ENGINE_API_KEY_VARIABLE: API_KEY} and API_KEY not in repr(command)
