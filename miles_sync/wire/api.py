"""The engine API the sync side talks to, whatever the engine kind: `EngineAPI`, `ServerInfo`, `EngineError`.

`miles_sync.engine.client.EngineClient` (SGLang's HTTP contract, spoken by SGLang and by the reference engine)
implements it; transports and the session are typed against this Protocol, so they never import the engine layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from miles_sync.wire.draft import DraftReport
from miles_sync.wire.protocol import (
    ChecksumNames,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterFromTensorsRequest,
    LoRAUpdateResult,
    PauseMode,
    Selector,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    WeightsCheckerRequest,
    WeightsCheckerResult,
)

__all__ = ["CHECKSUM_NAMES_KEY", "EngineAPI", "EngineError", "ServerInfo"]

# The /get_server_info key through which the reference engine says what its checker answers (ServerInfo field).
CHECKSUM_NAMES_KEY = "miles_sync_checksum_names"
_MAX_MESSAGE_CHARS = 2000  # server messages are surfaced in exceptions; cap what a broken server can inject


class EngineError(RuntimeError):
    """An engine call failed. `status` is the HTTP status, None when no answer came (timeout, refused)."""

    def __init__(self, *, url: str, endpoint: str, status: int | None, message: str) -> None:
        message = message if len(message) <= _MAX_MESSAGE_CHARS else message[:_MAX_MESSAGE_CHARS] + "..."
        self.url = url
        self.endpoint = endpoint
        self.status = status
        self.message = message
        answer = "no answer" if status is None else f"HTTP {status}"
        super().__init__(f"engine {url} {endpoint}: {answer}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only __init__: rebuild explicitly so the error pickles across Ray and process boundaries.
        return (_rebuild_engine_error, (self.url, self.endpoint, self.status, self.message))


def _rebuild_engine_error(url: str, endpoint: str, status: int | None, message: str) -> EngineError:
    return EngineError(url=url, endpoint=endpoint, status=status, message=message)


@dataclass(frozen=True, kw_only=True)
class ServerInfo:
    """The part of /get_server_info a sync needs; real servers send many more keys, which are ignored.

    `miles_sync_checksum_names` is sent by the reference engine only; a server without it (SGLang) answers
    engine-parameter digests. `model_path` (SGLang and the reference engine send it) locates the config.json that
    decides the engine's TP split. `weight_layout` is the post-processing the engine applies after loading, the
    wire value of `miles_sync.weights.layout.WeightLayout` ("none", "aiter"; a string here, since this layer sits
    below the weights layer); only the reference engine sends it. A real SGLang server does not: its layout is
    inferred from `device` (SGLang's `--device`; "cpu" for a CPU server) in `miles_sync.sync.engine_digests`.
    """

    tp_size: int = 1
    speculative_algorithm: str | None = None
    miles_sync_checksum_names: ChecksumNames = ChecksumNames.ENGINE
    model_path: str | None = None
    weight_layout: str | None = None
    device: str | None = None
    # The digest its checker computes ("sha256", "gpu-hash"; miles_sync.weights.checksum.TensorHash), reference
    # engine only: a real SGLang server's follows from `device`.
    miles_sync_tensor_hash: str | None = None
    # The served quantization, as SGLang's server_args name it ("fp8"; None: the checkpoint's dtype), the
    # parameter dtype (a torch name; SGLang may answer "auto") and, for block FP8, the block [rows, cols] the
    # engine expects (reference engine only). A sync checks its own quantization against them before the pause.
    quantization: str | None = None
    weight_block_size: tuple[int, ...] | None = None
    dtype: str | None = None


class EngineAPI(Protocol):
    """One engine as a sync sees it. Every call has a deadline (`timeout_s`, None: the client's default) and raises
    EngineError on a refusal or no answer. Control calls to one engine are serialized by the implementation.

    Order within a session: pause_generation -> begin_weight_update -> update_weights_from_* (per bucket) ->
    end_weight_update -> weights_checker / update_weight_version -> continue_generation. `connect()` runs once
    before the first session and fills `info`.
    """

    url: str
    info: ServerInfo | None

    async def connect(self, *, required: Sequence[str] = ...) -> ServerInfo: ...
    async def close(self) -> None: ...
    async def draft_report(self, *, timeout_s: float | None = None) -> DraftReport | None: ...
    async def init_weights_update_group(
        self, request: InitWeightsUpdateGroupRequest, *, timeout_s: float | None = None
    ) -> None: ...
    async def destroy_weights_update_group(
        self, request: DestroyWeightsUpdateGroupRequest, *, timeout_s: float | None = None
    ) -> None: ...
    async def begin_weight_update(self, selector: Selector, *, timeout_s: float | None = None) -> None: ...
    async def end_weight_update(self, *, timeout_s: float | None = None) -> None: ...
    async def update_weights_from_distributed(
        self, request: UpdateWeightsFromDistributedRequest, *, timeout_s: float | None = None
    ) -> None: ...
    async def update_weights_from_tensor(
        self, request: UpdateWeightsFromTensorRequest, *, timeout_s: float | None = None
    ) -> None: ...
    async def update_weight_version(
        self, new_version: str, *, abort_all_requests: bool = False, timeout_s: float | None = None
    ) -> None: ...
    async def weights_checker(
        self, request: WeightsCheckerRequest, *, timeout_s: float | None = None
    ) -> WeightsCheckerResult: ...
    async def pause_generation(self, mode: PauseMode, *, timeout_s: float | None = None) -> None: ...
    async def continue_generation(self, *, torch_empty_cache: bool = True, timeout_s: float | None = None) -> None: ...
    async def flush_cache(
        self, *, server_wait_s: float | None = None, drain_s: float | None = None, timeout_s: float | None = None
    ) -> None: ...
    # LoRA adapters, outside any session (miles_sync.sync.lora): EngineError with the engine's error_message on refusal.
    async def load_lora_adapter_from_tensors(
        self, request: LoadLoRAAdapterFromTensorsRequest, *, timeout_s: float | None = None
    ) -> LoRAUpdateResult: ...
    async def unload_lora_adapter(
        self, request: UnloadLoRAAdapterRequest, *, timeout_s: float | None = None
    ) -> LoRAUpdateResult: ...
