"""Engine security: `serve` binds loopback by default; keys guard routes exactly as SGLang's `decide_request_auth`
(an API key guards every route but /health*; an admin key, when set, is the only key admin routes take, and normal
routes never take it); the keys never reach logs, info answers or reports.

Extends test_reference_server.py::test_api_key_guards_every_admin_endpoint with routes enumerated from the app
itself (every method), wrong-key variants, both keys, and leak checks. The pure decision table is in
tests/unit/test_engine_auth.py.
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
from miles_sync.engine.client import EngineClient
from miles_sync.engine.kinds import engine_spec
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.engine.reference.serve import build_engine, parse_args
from miles_sync.engine.reference.server import ADMIN_PATHS, HEALTH_PATHS, NORMAL_PATHS, ServerSettings, create_app
from miles_sync.engine.sglang import SGLangEngineSpec
from miles_sync.env import ENGINE_ADMIN_API_KEY_VARIABLE, ENGINE_API_KEY_VARIABLE
from miles_sync.job.run_report import RunReport, config_record
from miles_sync.sync.sender import SenderSettings
from miles_sync.wire.api import EngineError
from miles_sync.wire.payload import encode_named_tensors
from miles_sync.wire.protocol import Selector, UpdateWeightsFromTensorRequest

API_KEY = "sk-sec-7f3a91c2e5"
WRONG_KEY = "sk-sec-0000bad"
ADMIN_KEY = "sk-admin-5d2e8b0a41"
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


# ---- keys on every route, as SGLang decides them --------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(reference_checkpoints, tmp_path_factory) -> Iterator[ServerProcess]:
    """An API key only: it guards every route but /health*."""
    with reference_server(
        model=reference_checkpoints / "target",
        draft_kind="mtp",
        weight_layout="aiter",
        api_key=API_KEY,
        log_dir=tmp_path_factory.mktemp("keyed"),
    ) as server:
        yield server


@pytest.fixture(scope="module")
def both_keys(reference_checkpoints, tmp_path_factory) -> Iterator[ServerProcess]:
    """An API key and an admin key (passed through its environment variable)."""
    with reference_server(
        model=reference_checkpoints / "target",
        api_key=API_KEY,
        admin_api_key=ADMIN_KEY,
        log_dir=tmp_path_factory.mktemp("both-keys"),
    ) as server:
        yield server


@pytest.fixture(scope="module")
def app_routes(reference_checkpoints) -> list[tuple[str, str]]:
    """(method, path) of every route the server's app registers, read from a real app over a real engine."""
    args = parse_args(["--model", str(reference_checkpoints / "target"), "--draft-kind", "mtp", "--threads", "1"])
    engine = build_engine(args)
    try:
        settings = ServerSettings(
            model_path=args.model, draft_kind="mtp", weight_layout="none", spec_steps=3, generate_timeout_s=TIMEOUT_S
        )
        app = create_app(engine, settings=settings, api_key=API_KEY, admin_api_key=ADMIN_KEY, num_threads=1)
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


def _body_for(method: str, path: str) -> bytes | None:
    if path == "/generate":
        return json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}).encode()
    return b"{}" if method == "POST" else None


def _bearer(key: str) -> str:
    return f"Bearer {key}"


def _restore(server: ServerProcess) -> None:
    """Undo what empty-bodied admin calls did: /pause_generation {} paused, /begin_weight_update {} opened."""
    server.post("/continue_generation", {}, timeout_s=TIMEOUT_S)
    server.post("/end_weight_update", timeout_s=TIMEOUT_S)


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


def test_every_route_has_exactly_one_auth_class(app_routes):
    paths = {path for _, path in app_routes}
    classes = (ADMIN_PATHS, NORMAL_PATHS, HEALTH_PATHS)
    assert paths == ADMIN_PATHS | NORMAL_PATHS | HEALTH_PATHS, "a route the key policy does not classify"
    assert all(not a & b for i, a in enumerate(classes) for b in classes[i + 1 :])
    assert HEALTH_PATHS == {"/health_generate", "/health"}
    assert {"/generate", "/model_info", "/get_server_info"} <= NORMAL_PATHS
    assert {"/weights_checker", "/pause_generation", "/continue_generation", "/flush_cache"} <= ADMIN_PATHS


@pytest.mark.parametrize("authorization", sorted(_BAD_AUTHORIZATIONS))
def test_with_an_api_key_every_route_but_health_refuses_a_missing_or_wrong_key(keyed, app_routes, authorization):
    header = _BAD_AUTHORIZATIONS[authorization]
    guarded = [(method, path) for method, path in app_routes if path not in HEALTH_PATHS]
    assert {path for _, path in guarded} == ADMIN_PATHS | NORMAL_PATHS
    for method, path in guarded:
        status, text = _send(keyed.url, method, path, authorization=header, body=_body_for(method, path))
        assert status == 401, (method, path, status, text)
        if method != "HEAD":
            assert "needs 'Authorization: Bearer <api key>'" in json.loads(text)["message"], text
        assert API_KEY not in text and WRONG_KEY not in text
    for path in sorted(HEALTH_PATHS):
        assert _send(keyed.url, "GET", path, authorization=header)[0] == 200, path


def test_with_an_api_key_the_key_opens_every_route_and_probes_keep_404_405(keyed, app_routes):
    try:
        for method, path in app_routes:
            body = _body_for(method, path)
            status, text = _send(keyed.url, method, path, authorization=_bearer(API_KEY), body=body)
            assert status != 401, (method, path, text)
            if path in NORMAL_PATHS:
                assert status == 200, (method, path, status, text)
    finally:
        _restore(keyed)
    # Unknown paths and wrong methods are SGLang's NORMAL level: the API key, then their 404/405.
    assert _send(keyed.url, "POST", "/no_such_endpoint", authorization=None, body=b"{}")[0] == 401
    assert _send(keyed.url, "POST", "/no_such_endpoint", authorization=_bearer(API_KEY), body=b"{}")[0] == 404
    assert _send(keyed.url, "GET", "/update_weights_from_tensor", authorization=None)[0] == 401
    assert _send(keyed.url, "GET", "/update_weights_from_tensor", authorization=_bearer(API_KEY))[0] == 405
    assert _send(keyed.url, "GET", "/healthz", authorization=None)[0] == 404  # /health* is open by prefix


def test_with_an_admin_key_admin_routes_take_only_it_and_normal_routes_only_the_api_key(both_keys, app_routes):
    try:
        for method, path in app_routes:
            body = _body_for(method, path)
            api = _send(both_keys.url, method, path, authorization=_bearer(API_KEY), body=body)
            admin = _send(both_keys.url, method, path, authorization=_bearer(ADMIN_KEY), body=body)
            if path in ADMIN_PATHS:
                assert api[0] == 401 and admin[0] != 401, (method, path, api, admin)
                if method != "HEAD":
                    assert "needs 'Authorization: Bearer <admin api key>'" in json.loads(api[1])["message"]
            elif path in NORMAL_PATHS:
                assert api[0] == 200 and admin[0] == 401, (method, path, api, admin)
                if method != "HEAD":
                    assert "needs 'Authorization: Bearer <api key>'" in json.loads(admin[1])["message"]
            else:
                assert api[0] == admin[0] == 200, (method, path, api, admin)
            for text in (api[1], admin[1]):
                assert API_KEY not in text and ADMIN_KEY not in text
    finally:
        _restore(both_keys)
    # A wrong method never reaches the admin level: the admin key does not open it, the API key gets its 405.
    assert _send(both_keys.url, "GET", "/begin_weight_update", authorization=_bearer(ADMIN_KEY))[0] == 401
    assert _send(both_keys.url, "GET", "/begin_weight_update", authorization=_bearer(API_KEY))[0] == 405


def test_with_only_an_admin_key_normal_routes_are_open(reference_checkpoints, tmp_path):
    with reference_server(model=reference_checkpoints / "target", admin_api_key=ADMIN_KEY, log_dir=tmp_path) as server:
        for path in sorted(NORMAL_PATHS - {"/generate"}):
            assert server.get(path, auth=False)[0] == 200, path
        assert _send(server.url, "POST", "/generate", authorization=None, body=_body_for("POST", "/generate"))[0] == 200
        status, answer = server.post("/begin_weight_update", {"selector": "target"}, auth=False)
        assert status == 401 and "<admin api key>" in answer["message"]
        assert server.ok("/weights_checker", {"action": "checksum"})["success"]  # with the admin key
        assert _send(server.url, "GET", "/begin_weight_update", authorization=None)[0] == 405
        assert _send(server.url, "POST", "/nope", authorization=None, body=b"{}")[0] == 404
        assert ADMIN_KEY not in server.log_tail(10**6)


async def _refused_then_session(url: str, weights: list, *, refused_keys: dict, keys: dict) -> EngineError:
    """Through the library's client: a client with `refused_keys` cannot open a session (its error is returned,
    after a normal route answered it); a client with `keys` runs a whole session."""
    async with EngineClient(url, timeout_s=TIMEOUT_S, **refused_keys) as refused_client:
        if refused_keys.get("api_key") == API_KEY:
            await refused_client.server_info()  # a normal route: the API key is the one it takes
        try:
            await refused_client.begin_weight_update(Selector.TARGET)
        except EngineError as error:
            refused = error
        else:
            raise AssertionError(f"a client with the wrong key for admin routes opened a session on {url}")
    async with EngineClient(url, timeout_s=TIMEOUT_S, **keys) as client:
        await client.connect()
        await client.begin_weight_update(Selector.TARGET)
        request = UpdateWeightsFromTensorRequest(
            serialized_named_tensors=(encode_named_tensors(weights),), selector=Selector.TARGET
        )
        await client.update_weights_from_tensor(request)
        await client.end_weight_update()
    return refused


def test_the_client_syncs_with_both_keys_and_never_leaks_them(both_keys, reference_checkpoints):
    target = reference_checkpoints / "target"
    skip = mtp_names(target)
    weights = sorted((n, t) for n, t in checkpoint_tensors(target).items() if n not in skip)
    refused = asyncio.run(
        _refused_then_session(
            both_keys.url,
            weights,
            refused_keys={"api_key": API_KEY},
            keys={"api_key": API_KEY, "admin_api_key": ADMIN_KEY},
        )
    )
    assert refused.status == 401 and API_KEY not in str(refused) and ADMIN_KEY not in str(refused)
    log = both_keys.log_path.read_text(errors="replace")
    assert "api key set, admin api key set" in log
    assert API_KEY not in log and ADMIN_KEY not in log


# ---- the key never leaks ------------------------------------------------------------------------------------------


def test_the_key_never_reaches_the_log_or_info_answers(keyed, reference_checkpoints):
    target = reference_checkpoints / "target"
    skip = mtp_names(target)
    weights = sorted((n, t) for n, t in checkpoint_tensors(target).items() if n not in skip)
    refused = asyncio.run(
        _refused_then_session(keyed.url, weights, refused_keys={"api_key": WRONG_KEY}, keys={"api_key": API_KEY})
    )
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
    report = RunReport(
        run_name="r", status="completed", config=record, packages={}, machine={}, baseline=None, rounds=()
    )
    path = tmp_path / "report.json"
    report.write_json(path)
    assert API_KEY not in path.read_text()


def test_engine_config_repr_hides_the_key():  # frozen dataclasses print every field unless told not to
    config = MilesSyncConfig(engines=EngineConfig(api_key=API_KEY))
    assert API_KEY not in repr(config.engines) and API_KEY not in repr(config) and API_KEY not in str(config)


def test_engine_spec_repr_hides_the_keys():
    specs = [
        ReferenceEngineSpec(model_dir="m", api_key=API_KEY, admin_api_key=ADMIN_KEY),
        SGLangEngineSpec(model_path="m", api_key=API_KEY, admin_api_key=ADMIN_KEY),
    ]
    assert all(API_KEY not in repr(spec) and ADMIN_KEY not in repr(spec) for spec in specs)


def test_sender_settings_repr_hides_the_key():
    settings = SenderSettings(
        transport="distributed",
        bucket_bytes=1,
        bucket_timeout_s=1.0,
        open_timeout_s=1.0,
        http_timeout_s=1.0,
        call_timeout_s=1.0,
        api_key=API_KEY,
    )
    assert API_KEY not in repr(settings)


def test_launcher_passes_the_reference_engines_keys_outside_its_command_line():
    command = ReferenceEngineSpec(model_dir="m", api_key=API_KEY, admin_api_key=ADMIN_KEY).command(host="127.0.0.1")
    argv = " ".join(command.argv)
    assert API_KEY not in argv and ADMIN_KEY not in argv  # /proc/PID/cmdline is readable by every local user
    assert command.env == {ENGINE_API_KEY_VARIABLE: API_KEY, ENGINE_ADMIN_API_KEY_VARIABLE: ADMIN_KEY}
    assert API_KEY not in repr(command) and ADMIN_KEY not in repr(command)
    admin_only = ReferenceEngineSpec(model_dir="m", admin_api_key=ADMIN_KEY).command(host="127.0.0.1")
    assert admin_only.env == {ENGINE_ADMIN_API_KEY_VARIABLE: ADMIN_KEY}


def test_engine_spec_takes_the_admin_key_from_the_config():
    engines = EngineConfig(api_key=API_KEY, admin_api_key=ADMIN_KEY)
    spec = engine_spec(engines.kind, engines.launch_settings(model_dir="m"))
    assert spec.api_key == API_KEY and spec.admin_api_key == ADMIN_KEY
