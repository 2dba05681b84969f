"""Real SGLang 0.5.23 CPU servers started with `--api-key`, and with `--api-key --admin-api-key`: a sync with the keys
is verified engine-exact (every session route, update, checker call, pause/continue and version takes the key its
auth level needs: `sglang/srt/utils/auth.py`), the same routes without a key or with a wrong one are refused by
the server (401), a sync with a wrong key fails closed naming the route and leaves the server serving its version,
and no key appears in our logs, reports or errors. (SGLang's own start-up log prints its server arguments, keys
included: that log is the server's, written under the log directory the launcher names.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
import pytest
from sender_host import SenderSettings
from sglang_server import enter_together, sglang_server

from miles_sync.engine.client import EngineClient
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.report import SyncError
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.wire.api import EngineError
from miles_sync.wire.protocol import PauseMode

TIMEOUTS = SessionTimeouts(control_s=30.0, sync_s=120.0)
NO_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm=None, num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)
API_KEY = "rollout-key-0f3c9a"
ADMIN_KEY = "admin-key-7d21e4"
WRONG = "not-the-key-5b8e"
# Routes the sync uses, with a body each accepts; SGLang answers 401 before reading the body when the key is wrong.
ROUTES = {
    "/server_info": None,
    "/generate": {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
    "/pause_generation": {"mode": "abort"},
    "/weights_checker": {"action": "checksum"},
    "/update_weight_version": {"new_version": "x", "abort_all_requests": False},
    "/continue_generation": {},
}


@pytest.fixture(scope="module")
def servers(reference_checkpoints, sglang_python, tmp_path_factory):
    """{"api_key": server with --api-key, "admin_api_key": server with --api-key --admin-api-key}, with each's
    log directory."""
    log_dir = tmp_path_factory.mktemp("auth")
    model = reference_checkpoints / "target"
    with contextlib.ExitStack() as stack:
        plain, admin = enter_together(
            stack,
            sglang_server(model=model, python=sglang_python, log_dir=log_dir, api_key=API_KEY),
            sglang_server(model=model, python=sglang_python, log_dir=log_dir, api_key=API_KEY, admin_api_key=ADMIN_KEY),
        )
        yield {"api_key": plain, "admin_api_key": admin}, log_dir


def controller(url: str, source, *, api_key: str | None, admin_api_key: str | None) -> SyncController:
    return SyncController(
        engine_urls=[url],
        source=source,
        transport="distributed",
        selector_inputs=NO_DRAFT,
        pause_mode=PauseMode.RETRACT,
        verify=True,
        timeouts=TIMEOUTS,
        show_progress=False,
        api_key=api_key,
        admin_api_key=admin_api_key,
    )


async def statuses(url: str, key: str | None) -> dict[str, int]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    out = {}
    async with aiohttp.ClientSession() as session:
        for route, body in ROUTES.items():
            method = session.get if body is None else session.post
            async with method(url + route, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as r:
                out[route] = r.status
    return out


@pytest.mark.parametrize("keys", ["api_key", "admin_api_key"])
def test_syncs_into_servers_with_api_keys_verify_and_every_route_refuses_a_wrong_key(servers, source, keys, caplog):
    launchers, _ = servers
    url = launchers[keys].url
    admin_key = ADMIN_KEY if keys == "admin_api_key" else None

    async def main():
        settings = SenderSettings(
            transport="distributed",
            bucket_bytes=512 * 1024,
            include_mtp=False,
            api_key=API_KEY,
            admin_api_key=admin_key,
        )
        await source.call("configure", settings)
        ctl = controller(url, source, api_key=API_KEY, admin_api_key=admin_key)
        await ctl.connect()
        try:
            await source.call("step", 1 if admin_key is None else 2)
            good = await ctl.sync()
        finally:
            await ctl.close()
        # A wrong key for the admin routes (the rollout key stays right, so the server is reachable).
        ctl = controller(url, source, api_key=API_KEY, admin_api_key=WRONG if admin_key else None)
        wrong_error = ""
        if admin_key is not None:
            try:  # refused at connect (its checker read) or, past it, at the sync's first admin route
                await ctl.connect()
                await source.call("step", 3)
                await ctl.sync()
            except (EngineError, SyncError) as exc:
                wrong_error = str(exc)
            finally:
                await ctl.close()
        async with EngineClient(url, timeout_s=30.0, api_key=API_KEY, admin_api_key=admin_key) as client:
            served = await client.model_info()
        refused = {key: await statuses(url, key) for key in (None, WRONG)}
        return good, wrong_error, served, refused

    with caplog.at_level(logging.DEBUG):
        good, wrong_error, served, refused = asyncio.run(main())
    assert good.committed and good.verification == "engine-exact (sha256)", good.summary()
    for key, answers in refused.items():  # every route the sync uses, refused without the right key
        assert answers == dict.fromkeys(ROUTES, 401), (key, answers)
    if admin_key is not None:
        # Refused, naming the route and the status, before anything was written: the server keeps its version.
        assert "HTTP 401" in wrong_error and f"{url} /" in wrong_error, wrong_error
    assert served.weight_version == good.version
    texts = [good.summary(), repr(good), wrong_error, caplog.text]
    for text in texts:
        assert API_KEY not in text and ADMIN_KEY not in text and WRONG not in text


def test_the_server_logs_are_the_only_place_a_key_is_written(servers):
    """What docs/sglang.md says about keys and logs: SGLang prints its ServerArgs (api_key included) at start-up."""
    _, log_dir = servers
    logs = "".join(p.read_text(errors="replace") for p in log_dir.rglob("*") if p.is_file())
    assert API_KEY in logs, "SGLang no longer prints its api_key at start-up: update docs/sglang.md and this test"
