"""One HTTP client for SGLang-compatible engines: SGLang servers and the built-in reference engine alike.

Contract (every method):
- a timeout on every call (the client default, or a per-call override); nothing waits forever;
- weight endpoints answer {success, message}: success false or a non-2xx status raises EngineError carrying the
  engine URL, endpoint, HTTP status and the server's message (400 bodies are surfaced, not swallowed);
- control calls to one engine are serialized by a per-client lock, because responses carry no operation id and an
  engine applies control operations in arrival order; generate and read-only GETs are not serialized;
- `connect()` probes the endpoints a sync needs, so a server without the session endpoints fails at connect with
  the missing endpoint named, not at the first sync.

The client is bound to the event loop it first runs on (aiohttp's session is); create it where it is used.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import aiohttp

from miles_sync.wire.api import EngineError, ServerInfo
from miles_sync.wire.codec import decode, encode
from miles_sync.wire.draft import DraftReport
from miles_sync.wire.protocol import (
    ALWAYS_OPEN_PREFIXES,
    NORMAL_PATHS,
    BeginWeightUpdateRequest,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    GenerateRequest,
    GenerateResponse,
    GenerationControlResult,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterFromTensorsRequest,
    LoRAUpdateResult,
    ModelInfo,
    PauseGenerationRequest,
    PauseMode,
    Selector,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightsCheckerRequest,
    WeightsCheckerResult,
    WeightUpdateResult,
    WeightVersionResult,
)

__all__ = ["CONTROL_ENDPOINTS", "EngineClient"]

R = TypeVar("R")

# Paths SGLang also serves on GET (a GET runs the handler): probed with a body its validation refuses instead.
_SERVED_ON_GET = frozenset({"/weights_checker"})

# Added to SGLang 0.5.23 for update sessions; older servers lack them and would finalize on every payload.
SESSION_ENDPOINTS: tuple[str, ...] = ("/begin_weight_update", "/end_weight_update")
# Endpoints every sync uses; each transport adds its own (transport.base.TRANSPORTS). /flush_cache is left out of
# the probe on purpose: SGLang also serves it on GET and runs it for any body, so any probe would flush the cache.
CONTROL_ENDPOINTS: tuple[str, ...] = (
    *SESSION_ENDPOINTS,
    "/update_weight_version",
    "/pause_generation",
    "/continue_generation",
    "/weights_checker",
)


class EngineClient:
    """HTTP client of one engine. Async; bound to one event loop; `close()` when done (or use `async with`).

    `flush_drain_s`: how long `flush_cache` keeps retrying while the engine answers 400 (requests still draining).
    `api_key` / `admin_api_key`: SGLang's `--api-key` / `--admin-api-key`; each route gets the key its auth level
    takes. `info` is the server info read by `connect()`.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        flush_drain_s: float = 30.0,
        flush_backoff_s: tuple[float, float] = (0.02, 1.0),
    ) -> None:
        problems = []
        if not url.startswith(("http://", "https://")):
            problems.append(f"url={url!r} must start with http:// or https://")
        if not timeout_s > 0:
            problems.append(f"timeout_s={timeout_s} must be positive")
        if flush_drain_s < 0:
            problems.append(f"flush_drain_s={flush_drain_s} must be non-negative")
        if not 0 < flush_backoff_s[0] <= flush_backoff_s[1]:
            problems.append(f"flush_backoff_s={flush_backoff_s} must be (first, max) with 0 < first <= max")
        if problems:
            raise ValueError("; ".join(problems))
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        # SGLang's auth: rollout routes take the API key; admin routes take the admin key when the server has one
        # (the plain key is refused there), else the API key; health routes take none.
        self._headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        admin_key = api_key if admin_api_key is None else admin_api_key
        self._admin_headers = {} if admin_key is None else {"Authorization": f"Bearer {admin_key}"}
        self.info: ServerInfo | None = None  # set by connect()
        self._flush_drain_s = flush_drain_s
        self._flush_backoff_s = flush_backoff_s
        self._session: aiohttp.ClientSession | None = None
        self._control_lock: asyncio.Lock | None = None

    def __repr__(self) -> str:
        return f"EngineClient({self.url!r})"  # never the API key

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    # ---- connect --------------------------------------------------------------------------------------------

    async def connect(self, *, required: Sequence[str] = CONTROL_ENDPOINTS) -> ServerInfo:
        """Check the server answers and serves every `required` POST endpoint; return its server info.

        The probe never runs a handler: a GET to a POST-only path answers 405 (method not allowed) for a route the
        server has and 404 for one it lacks. SGLang also serves /weights_checker on GET, where a GET would run a
        full checksum; that path is probed with a POST whose body is not an object, which SGLang's validation
        answers 422 (the reference engine 400) before any handler runs. Raises EngineError naming every missing
        endpoint.
        """
        info = await self.server_info()
        statuses = await asyncio.gather(*(self._probe(path) for path in required))
        missing = [path for path, status in zip(required, statuses) if status == 404]
        if missing:
            raise EngineError(
                url=self.url,
                endpoint=missing[0],
                status=404,
                message=f"server lacks the endpoint(s) {', '.join(missing)} that weight sync needs "
                f"(SGLang with update sessions and selectors, or the miles_sync reference engine)",
            )
        self.info = info
        return info

    async def _probe(self, path: str) -> int:
        if path in _SERVED_ON_GET:
            status, body = await self._request("POST", path, json_body=[], timeout_s=None)
        else:
            # A method SGLang's route does not match resolves to the NORMAL auth level: the API key, if any.
            status, body = await self._request("GET", path, timeout_s=None, headers=self._headers)
        if status in (401, 403):
            raise EngineError(url=self.url, endpoint=path, status=status, message=f"not authorized: {body}")
        return status

    # ---- read-only ------------------------------------------------------------------------------------------

    async def server_info(self, *, timeout_s: float | None = None) -> ServerInfo:
        return decode(ServerInfo, await self._get_json("/get_server_info", timeout_s=timeout_s), allow_unknown=True)

    async def model_info(self, *, timeout_s: float | None = None) -> ModelInfo:
        return decode(ModelInfo, await self._get_json("/model_info", timeout_s=timeout_s), allow_unknown=True)

    async def draft_report(self, *, timeout_s: float | None = None) -> DraftReport | None:
        """The engine's report about its draft; None when the server has no /get_draft_report (plain SGLang)."""
        status, body = await self._request("GET", "/get_draft_report", timeout_s=timeout_s)
        if status == 404:
            return None
        return decode(DraftReport, self._json_or_raise("/get_draft_report", status, body), allow_unknown=True)

    async def health_generate(self, *, timeout_s: float | None = None) -> None:
        status, body = await self._request("GET", "/health_generate", timeout_s=timeout_s)
        if not 200 <= status < 300:
            raise EngineError(url=self.url, endpoint="/health_generate", status=status, message=body)

    async def generate(self, request: GenerateRequest, *, timeout_s: float | None = None) -> GenerateResponse:
        status, body = await self._request("POST", "/generate", json_body=encode(request), timeout_s=timeout_s)
        return decode(GenerateResponse, self._json_or_raise("/generate", status, body), allow_unknown=True)

    # ---- control (serialized per engine) --------------------------------------------------------------------

    async def init_weights_update_group(
        self, request: InitWeightsUpdateGroupRequest, *, timeout_s: float | None = None
    ) -> None:
        """Blocks until every member joined: issue it concurrently with the trainer's own join."""
        await self._weight_call("/init_weights_update_group", request, timeout_s=timeout_s)

    async def destroy_weights_update_group(
        self, request: DestroyWeightsUpdateGroupRequest, *, timeout_s: float | None = None
    ) -> None:
        await self._weight_call("/destroy_weights_update_group", request, timeout_s=timeout_s)

    async def begin_weight_update(self, selector: Selector, *, timeout_s: float | None = None) -> None:
        request = BeginWeightUpdateRequest(selector=selector)
        await self._weight_call("/begin_weight_update", request, timeout_s=timeout_s)

    async def end_weight_update(self, *, timeout_s: float | None = None) -> None:
        await self._weight_call("/end_weight_update", EndWeightUpdateRequest(), timeout_s=timeout_s)

    async def update_weights_from_distributed(
        self, request: UpdateWeightsFromDistributedRequest, *, timeout_s: float | None = None
    ) -> None:
        """Answers after the engine received the broadcast that follows this request."""
        await self._weight_call("/update_weights_from_distributed", request, timeout_s=timeout_s)

    async def update_weights_from_tensor(
        self, request: UpdateWeightsFromTensorRequest, *, timeout_s: float | None = None
    ) -> None:
        await self._weight_call("/update_weights_from_tensor", request, timeout_s=timeout_s)

    async def update_weight_version(
        self, new_version: str, *, abort_all_requests: bool = False, timeout_s: float | None = None
    ) -> None:
        """Tag the engine's weights with `new_version`. `abort_all_requests` is False here, unlike the endpoint's
        default: a sync has already handled in-flight requests by its pause mode, and aborting at this point would
        throw away every request a retract pause kept queued (and every one that arrived during the pause)."""
        request = UpdateWeightVersionRequest(new_version=new_version, abort_all_requests=abort_all_requests)
        result = await self._control("/update_weight_version", request, WeightVersionResult, timeout_s=timeout_s)
        self._check_success("/update_weight_version", result.success, result.message)

    async def weights_checker(
        self, request: WeightsCheckerRequest, *, timeout_s: float | None = None
    ) -> WeightsCheckerResult:
        result = await self._control("/weights_checker", request, WeightsCheckerResult, timeout_s=timeout_s)
        self._check_success("/weights_checker", result.success, result.message)
        return result

    async def pause_generation(self, mode: PauseMode, *, timeout_s: float | None = None) -> None:
        request = PauseGenerationRequest(mode=mode)
        result = await self._control("/pause_generation", request, GenerationControlResult, timeout_s=timeout_s)
        self._check_status_ok("/pause_generation", result)

    async def continue_generation(self, *, torch_empty_cache: bool = True, timeout_s: float | None = None) -> None:
        request = ContinueGenerationRequest(torch_empty_cache=torch_empty_cache)
        result = await self._control("/continue_generation", request, GenerationControlResult, timeout_s=timeout_s)
        self._check_status_ok("/continue_generation", result)

    async def flush_cache(
        self, *, server_wait_s: float | None = None, drain_s: float | None = None, timeout_s: float | None = None
    ) -> None:
        """Flush the KV/prefix cache, retrying with back-off only while the engine answers 400 (requests still
        running, which drain after a pause) and for at most `drain_s` (None: the client's `flush_drain_s`; 0: one
        attempt); any other failure raises at once.

        `server_wait_s`: how long the engine itself may wait for running requests per call (its `timeout` query
        parameter; None: the engine's default, an immediate answer). Each call is bounded by `timeout_s` on top.
        """
        call_s = self.timeout_s if timeout_s is None else timeout_s
        call_s += 0.0 if server_wait_s is None else server_wait_s
        params = {} if server_wait_s is None else {"timeout": str(server_wait_s)}
        drain_s = self._flush_drain_s if drain_s is None else drain_s
        deadline = time.monotonic() + drain_s
        delay_s, max_delay_s = self._flush_backoff_s
        while True:
            async with self._lock():
                status, body = await self._request("POST", "/flush_cache", params=params, timeout_s=call_s)
            if 200 <= status < 300:
                return
            remaining_s = deadline - time.monotonic()
            if status != 400 or remaining_s <= 0:
                drained = f" (requests still running after {drain_s:g} s)" if drain_s else " (requests running)"
                drained = drained if status == 400 else ""
                raise EngineError(url=self.url, endpoint="/flush_cache", status=status, message=body.strip() + drained)
            await asyncio.sleep(min(delay_s, remaining_s))
            delay_s = min(delay_s * 2, max_delay_s)

    # ---- plumbing -------------------------------------------------------------------------------------------

    def _lock(self) -> asyncio.Lock:
        # Created on first use so that it belongs to the running loop.
        if self._control_lock is None:
            self._control_lock = asyncio.Lock()
        return self._control_lock

    async def load_lora_adapter_from_tensors(
        self, request: LoadLoRAAdapterFromTensorsRequest, *, timeout_s: float | None = None
    ) -> LoRAUpdateResult:
        """Load a named adapter outside any update session; EngineError with the engine's error_message when it
        refuses (SGLang answers 400 with success false: a checksum mismatch, a name already loaded, ...)."""
        return await self._lora_call("/load_lora_adapter_from_tensors", request, timeout_s=timeout_s)

    async def unload_lora_adapter(
        self, request: UnloadLoRAAdapterRequest, *, timeout_s: float | None = None
    ) -> LoRAUpdateResult:
        return await self._lora_call("/unload_lora_adapter", request, timeout_s=timeout_s)

    async def _lora_call(self, endpoint: str, request: object, *, timeout_s: float | None) -> LoRAUpdateResult:
        async with self._lock():
            status, body = await self._request("POST", endpoint, json_body=encode(request), timeout_s=timeout_s)
        try:
            result = decode(LoRAUpdateResult, json.loads(body), allow_unknown=True)
        except ValueError:  # not SGLang's answer shape (e.g. a malformed request, 400 {success, message})
            self._json_or_raise(endpoint, status, body)
            raise EngineError(url=self.url, endpoint=endpoint, status=status, message=body) from None
        if not result.success or not 200 <= status < 300:
            raise EngineError(url=self.url, endpoint=endpoint, status=status, message=result.error_message or body)
        return result

    async def _weight_call(self, endpoint: str, request: object, *, timeout_s: float | None) -> None:
        result = await self._control(endpoint, request, WeightUpdateResult, timeout_s=timeout_s)
        self._check_success(endpoint, result.success, result.message)

    async def _control(self, endpoint: str, request: object, result_cls: type[R], *, timeout_s: float | None) -> R:
        async with self._lock():
            status, body = await self._request("POST", endpoint, json_body=encode(request), timeout_s=timeout_s)
        return decode(result_cls, self._json_or_raise(endpoint, status, body), allow_unknown=True)

    def _json_or_raise(self, endpoint: str, status: int, body: str) -> Any:
        """Parsed JSON of a 2xx answer; EngineError with the server's message for anything else."""
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not 200 <= status < 300:
            message = data.get("message") if isinstance(data, dict) else None
            message = message if isinstance(message, str) and message else body
            raise EngineError(url=self.url, endpoint=endpoint, status=status, message=message)
        if data is None:
            raise EngineError(url=self.url, endpoint=endpoint, status=status, message=f"answer is not JSON: {body}")
        return data

    def _check_success(self, endpoint: str, success: bool, message: str) -> None:
        if not success:
            raise EngineError(url=self.url, endpoint=endpoint, status=200, message=message)

    def _check_status_ok(self, endpoint: str, result: GenerationControlResult) -> None:
        if result.status != "ok":
            raise EngineError(url=self.url, endpoint=endpoint, status=200, message=f"{result.status}: {result.message}")

    def _headers_for(self, endpoint: str) -> dict[str, str]:
        if endpoint.startswith(ALWAYS_OPEN_PREFIXES):
            return {}
        return self._headers if endpoint in NORMAL_PATHS else self._admin_headers

    async def _get_json(self, endpoint: str, *, timeout_s: float | None) -> Any:
        status, body = await self._request("GET", endpoint, timeout_s=timeout_s)
        return self._json_or_raise(endpoint, status, body)

    async def _request(
        self,
        method: str,
        endpoint: str,
        *,
        timeout_s: float | None,
        json_body: Any = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, str]:
        """(status, body text) of one call; EngineError(status=None) when no answer came within the timeout."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.request(
                method,
                self.url + endpoint,
                json=json_body,
                params=params,
                headers=self._headers_for(endpoint) if headers is None else headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                return response.status, await response.text()
        except asyncio.TimeoutError:
            raise EngineError(
                url=self.url, endpoint=endpoint, status=None, message=f"timed out after {timeout_s} s"
            ) from None
        except aiohttp.ClientError as e:
            raise EngineError(
                url=self.url, endpoint=endpoint, status=None, message=f"{type(e).__name__}: {e}"
            ) from None
