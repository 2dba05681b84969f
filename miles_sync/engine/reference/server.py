"""The reference engine's HTTP server: SGLang's paths, JSON and status codes over a `ReferenceEngine`.

Status codes: weight endpoints answer 200 {success: true, message} or 400 {success: false, message}; a malformed
body (bad JSON, unknown key, wrong type) is a 400 naming the field; 401 without the key a route needs; 503 when an
operation is busy past its timeout; 500 for an engine fault (logged, the server keeps serving). /flush_cache
answers plain text. Generation is never refused for the weights the engine holds, as SGLang never refuses it.
A request that crashes the engine as it crashes SGLang's server (`EngineCrashed`) goes to `on_crash`, which in
`serve` exits the process without answering, as SGLang's does; without one it answers 503 and the engine refuses
everything after.

Blocking engine calls (collectives, rendezvous, pause) run on a thread pool so the event loop keeps serving
generation and reads meanwhile; the engine serializes weight operations itself.

Keys, exactly as SGLang's `decide_request_auth` (`decide_auth` here), each sent as `Authorization: Bearer <key>`:
- admin routes (ADMIN_PATHS: weight updates, sessions, groups, pause, continue, flush, checker, version; SGLang's
  ADMIN_OPTIONAL level): with an admin key set, only the admin key passes (the API key does not); else with an API
  key set, the API key; else open.
- normal routes (NORMAL_PATHS: /generate, /model_info, /get_model_info, /get_server_info, /get_draft_report): with
  an API key set, only the API key passes (the admin key does not); else open.
- /health* (and /ready*, /metrics*, OPTIONS) are always open.
Like SGLang, the level comes from a FULL route match: an unknown path or a wrong method is a normal route (with an
API key set it needs that key, then answers 404/405). Keys are never logged.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from miles_sync import __version__
from miles_sync.engine.reference.backend import EngineCrashed, EngineDown
from miles_sync.engine.reference.engine import ReferenceEngine
from miles_sync.wire.api import CHECKSUM_NAMES_KEY
from miles_sync.wire.codec import WireEnum, decode, encode
from miles_sync.wire.protocol import (
    ALWAYS_OPEN_PREFIXES,
    ENDPOINTS,
    NORMAL_PATHS,
    ContinueGenerationRequest,
    FlushCacheRequest,
    GenerateRequest,
    GenerateResponse,
    LoadLoRAAdapterFromTensorsRequest,
    PauseGenerationRequest,
    SamplingParams,
    UnloadLoRAAdapterRequest,
    generate_request_fields,
    unserved_generate_keys,
)

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine

logger = logging.getLogger(__name__)

HEALTH_PATHS = frozenset({"/health", "/health_generate"})
ADMIN_PATHS = frozenset({*ENDPOINTS, "/flush_cache"} - NORMAL_PATHS - HEALTH_PATHS)


class AuthLevel(WireEnum):
    """SGLang's per-route auth levels that this server uses (it has no ADMIN_FORCE route)."""

    NORMAL = "normal"
    ADMIN_OPTIONAL = "admin_optional"


def decide_auth(
    *,
    method: str,
    path: str,
    authorization: str | None,
    api_key: str | None,
    admin_api_key: str | None,
    level: AuthLevel,
) -> str | None:
    """None when the request may pass, else the name of the key it lacks ("api key" or "admin api key").

    Pure, and SGLang's `decide_request_auth` for the NORMAL and ADMIN_OPTIONAL levels: see the module docstring.
    """
    if method == "OPTIONS" or path.startswith(ALWAYS_OPEN_PREFIXES):
        return None
    if AuthLevel(level) is AuthLevel.ADMIN_OPTIONAL and admin_api_key:
        return None if _is_bearer(authorization, admin_api_key) else "admin api key"
    if api_key:
        return None if _is_bearer(authorization, api_key) else "api key"
    return None


# SGLang sets these meta_info keys only for a return_logprob request (srt/managers/tokenizer_manager.py:2520-2530,
# 2868-2870), and the spec_* keys only with speculative decoding: otherwise they are absent, not null.
_OPTIONAL_META_KEYS = (
    "input_token_logprobs",
    "output_token_logprobs",
    "output_token_logprobs_length",
    "spec_verify_ct",
    "spec_accept_rate",
    "spec_accept_length",
)


def _generate_body(response: GenerateResponse) -> dict:
    """SGLang 0.5.23's /generate answer (tests/sglang/test_conformance.py compares the shapes): optional meta_info
    keys and finish_reason keys of another kind are absent, not null."""
    body = encode(response)
    meta = body["meta_info"]
    for key in _OPTIONAL_META_KEYS:
        if meta[key] is None:
            del meta[key]
    if meta["finish_reason"] is not None:
        meta["finish_reason"] = {k: v for k, v in meta["finish_reason"].items() if v is not None}
    return body


def _is_bearer(authorization: str | None, key: str) -> bool:
    """`Bearer <key>` (scheme case-insensitive, one space), compared in constant time."""
    if not authorization:
        return False
    scheme, space, token = authorization.partition(" ")
    if not space or scheme.lower() != "bearer":
        return False
    # Bytes: compare_digest refuses str with non-ASCII characters, which a header may carry.
    return hmac.compare_digest(token.encode(errors="surrogateescape"), key.encode(errors="surrogateescape"))


_SPECULATIVE_ALGORITHMS = {"mtp": "NEXTN", "standalone": "STANDALONE", "ngram": "NGRAM"}

# Engine methods behind a JSON POST that answers a weight-style {success, message} record.
_WEIGHT_METHODS = {
    "/init_weights_update_group": "init_weights_update_group",
    "/destroy_weights_update_group": "destroy_weights_update_group",
    "/begin_weight_update": "begin_weight_update",
    "/end_weight_update": "end_weight_update",
    "/update_weights_from_distributed": "update_weights_from_distributed",
    "/update_weights_from_tensor": "update_weights_from_tensor",
    "/update_weight_version": "update_weight_version",
    "/weights_checker": "weights_checker",
}


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """What /get_server_info reports besides the engine's live state, and the server's own waits."""

    model_path: str
    draft_kind: str
    weight_layout: str
    spec_steps: int
    generate_timeout_s: float
    health_timeout_s: float = 30.0
    # SGLang's server_args keys: the checkpoint's quantization ("fp8" for block FP8, else None) and parameter
    # dtype; `weight_block_size` is the block-FP8 block ([rows, cols]) this engine expects a sync to send.
    quantization: str | None = None
    weight_block_size: tuple[int, int] | None = None
    dtype: str | None = None


def create_app(
    engine: ReferenceEngine,
    *,
    settings: ServerSettings,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    max_body_bytes: int = 256 * 2**20,
    num_threads: int = 8,
    on_crash: Callable[[str], None] | None = None,
) -> web.Application:
    """The aiohttp application; its thread pool shuts down with the app. `on_crash(message)` runs when a request
    crashed the engine (see the module docstring); None: the request answers 503."""
    for what, key in (("api_key", api_key), ("admin_api_key", admin_api_key)):
        if key is not None and not key:
            raise ValueError(f"{what} must be None or a non-empty string")
    handlers = _Handlers(engine, settings=settings, num_threads=num_threads)
    middlewares = [_auth_middleware(api_key=api_key, admin_api_key=admin_api_key), _error_middleware]
    if on_crash is not None:
        middlewares.append(_crash_middleware(on_crash))
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    _add_routes(app.router, handlers)
    app.on_cleanup.append(handlers.shutdown)
    return app


def _add_routes(router: web.UrlDispatcher, handlers: _Handlers) -> None:
    for path, method_name in _WEIGHT_METHODS.items():
        router.add_post(path, handlers.weight_handler(path, method_name))
    router.add_post("/load_lora_adapter_from_tensors", handlers.load_lora_adapter_from_tensors)
    router.add_post("/unload_lora_adapter", handlers.unload_lora_adapter)
    router.add_post("/pause_generation", handlers.pause_generation)
    router.add_post("/continue_generation", handlers.continue_generation)
    router.add_post("/flush_cache", handlers.flush_cache)
    router.add_get("/flush_cache", handlers.flush_cache)
    router.add_post("/generate", handlers.generate)
    router.add_get("/health_generate", handlers.health_generate)
    router.add_get("/health", handlers.health)
    router.add_get("/model_info", handlers.model_info)
    router.add_get("/get_model_info", handlers.model_info)
    router.add_get("/get_server_info", handlers.server_info)
    router.add_get("/server_info", handlers.server_info)  # SGLang 0.5.23's newer name; the router asks for it first
    router.add_get("/get_draft_report", handlers.draft_report)


class _Handlers:
    """The route handlers over one engine, and the thread pool its blocking calls run on (`shutdown` ends it)."""

    def __init__(self, engine: ReferenceEngine, *, settings: ServerSettings, num_threads: int) -> None:
        self._engine = engine
        self._settings = settings
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="reference-http")
        # SGLang's top-level weight_version is the launch value; /model_info and generation carry the current one.
        self._launch_weight_version = engine.weight_version

    async def shutdown(self, app: web.Application) -> None:
        del app
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    # Weight updates and generation control: the engine's blocking calls, on the thread pool.

    def weight_handler(self, path: str, method_name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        request_cls = ENDPOINTS[path]
        method = getattr(self._engine, method_name)

        async def handle(request: web.Request) -> web.Response:
            body = decode(request_cls, await _json_body(request))
            return _json(encode(await self._in_thread(method, body)))

        return handle

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        body = decode(LoadLoRAAdapterFromTensorsRequest, await _json_body(request))
        result = await self._in_thread(self._engine.load_lora_adapter_from_tensors, body)
        return _json(encode(result), status=200 if result.success else 400)  # SGLang's status rule

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = decode(UnloadLoRAAdapterRequest, await _json_body(request))
        result = await self._in_thread(self._engine.unload_lora_adapter, body)
        return _json(encode(result), status=200 if result.success else 400)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = decode(PauseGenerationRequest, await _json_body(request))
        return _json(encode(await self._in_thread(self._engine.pause_generation, body)))

    async def continue_generation(self, request: web.Request) -> web.Response:
        body = decode(ContinueGenerationRequest, await _json_body(request))
        return _json(encode(await self._in_thread(self._engine.continue_generation, body)))

    async def flush_cache(self, request: web.Request) -> web.Response:
        query = dict(request.query)
        if "timeout" in query:
            try:
                query["timeout"] = float(query["timeout"])
            except ValueError:
                raise ValueError(f"flush_cache: timeout={query['timeout']!r} is not a number of seconds") from None
        # `timeout` bounds how long SGLang waits for its scheduler's answer; this engine answers at once.
        decode(FlushCacheRequest, query)
        result = self._engine.flush_cache()
        return web.Response(status=result.status_code, text=result.message)

    # Generation and health.

    async def generate(self, request: web.Request) -> web.Response:
        raw = await _json_body(request)
        if isinstance(raw, Mapping):
            # SGLang's body: keys it does not declare are dropped, its own fields this engine lacks must be at
            # their defaults (what the SGLang router sends); sampling_params and the records inside stay strict.
            unserved = unserved_generate_keys(raw)
            if unserved:
                raise ValueError(f"/generate: this engine does not implement {', '.join(unserved)}")
            raw = generate_request_fields(raw)
        body = decode(GenerateRequest, raw)
        future = self._engine.submit_generate(body)
        response = await asyncio.wait_for(asyncio.wrap_future(future), timeout=self._settings.generate_timeout_s)
        return _json(_generate_body(response))

    async def health_generate(self, request: web.Request) -> web.Response:
        del request
        engine = self._engine
        if engine.failure is not None:
            return web.Response(status=503, text=f"unhealthy: {engine.failure}")
        if not engine.is_paused:
            # One real token, as SGLang's health check does: the scheduler loop must be alive.
            probe = GenerateRequest(input_ids=(0,), sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
            await asyncio.wait_for(asyncio.wrap_future(engine.submit_generate(probe)), self._settings.health_timeout_s)
        return web.Response(text="ok")

    async def health(self, request: web.Request) -> web.Response:
        del request
        if self._engine.failure is not None:  # a TP rank died: the engine serves nothing until it is restarted
            return web.Response(status=503, text=f"unhealthy: {self._engine.failure}")
        return web.Response(text="ok")

    # Reads: the engine's live state, in SGLang's shapes.

    async def model_info(self, request: web.Request) -> web.Response:
        del request
        info = encode(self._engine.model_info())
        # SGLang's other keys, with the values a plain text-generation server answers.
        return _json(
            {
                **info,
                "served_model_name": info["model_path"],
                "preferred_sampling_params": None,
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    async def draft_report(self, request: web.Request) -> web.Response:
        del request
        return _json(encode(self._engine.draft_report()))

    async def server_info(self, request: web.Request) -> web.Response:
        del request
        engine, settings = self._engine, self._settings
        state = engine.load_state()
        if settings.draft_kind == "none":  # SGLang reports the accept length only when it decodes speculatively
            del state["avg_spec_accept_length"]
        return _json(
            {
                "model_path": settings.model_path,
                "tp_size": engine.tp_size,
                "device": "cpu",
                "speculative_algorithm": _SPECULATIVE_ALGORITHMS.get(settings.draft_kind),
                "speculative_num_steps": settings.spec_steps if settings.draft_kind != "none" else None,
                "draft_kind": settings.draft_kind,
                "weight_layout": settings.weight_layout,
                "quantization": settings.quantization,
                "weight_block_size": None if settings.weight_block_size is None else list(settings.weight_block_size),
                "dtype": settings.dtype,
                "finalize_policy": engine.finalize_policy.value,
                CHECKSUM_NAMES_KEY: engine.checksum_names.value,
                "miles_sync_tensor_hash": engine.tensor_hash.value,
                # per TP rank, bytes of tensor data received since start (benchmarks measure with it)
                "miles_sync_received_bytes": list(await asyncio.to_thread(engine.received_bytes)),
                "version": f"miles_sync-reference-{__version__}",
                "weight_version": self._launch_weight_version,
                "internal_states": [
                    {
                        **state,
                        "weight_version": engine.weight_version,
                        "is_paused": engine.is_paused,
                    }
                ],
            }
        )


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw.strip():
        return {}  # SGLang clients post no body to endpoints without fields (/end_weight_update)
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{request.path}: body is not valid JSON: {exc}") from None
    except RecursionError:  # json's decoder recurses per nesting level
        raise ValueError(f"{request.path}: body is nested too deeply to parse") from None


def _json(obj: Any, *, status: int = 200) -> web.Response:
    return web.json_response(obj, status=status)


def _failure(status: int, message: str) -> web.Response:
    return _json({"success": False, "message": message}, status=status)


def _auth_middleware(*, api_key: str | None, admin_api_key: str | None):
    @web.middleware
    async def auth(request: web.Request, handler):
        # As SGLang: the admin level only on a full match (path and method); anything else is a normal route,
        # which then answers its 404/405 to a caller holding the key it needs.
        is_matched = request.match_info.http_exception is None
        level = AuthLevel.ADMIN_OPTIONAL if is_matched and request.path in ADMIN_PATHS else AuthLevel.NORMAL
        missing = decide_auth(
            method=request.method,
            path=request.path,
            authorization=request.headers.get("Authorization"),
            api_key=api_key,
            admin_api_key=admin_api_key,
            level=level,
        )
        if missing is not None:
            return _failure(401, f"{request.path} needs 'Authorization: Bearer <{missing}>'")
        return await handler(request)

    return auth


def _crash_middleware(on_crash: Callable[[str], None]):
    @web.middleware
    async def crash(request: web.Request, handler):
        try:
            return await handler(request)
        except EngineCrashed as exc:
            on_crash(f"{request.path}: {exc}")
            raise

    return crash


@web.middleware
async def _error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except ValueError as exc:
        return _failure(400, str(exc))
    except EngineDown as exc:
        return _failure(503, f"{request.path}: {exc}")
    except (TimeoutError, asyncio.TimeoutError) as exc:
        return _failure(503, f"{request.path} timed out: {exc}")
    except Exception as exc:  # an engine fault answers 500 with its message; the server keeps serving
        logger.exception("%s failed", request.path)
        return _failure(500, f"{request.path} failed: {type(exc).__name__}: {exc}")
