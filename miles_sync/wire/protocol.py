"""The HTTP wire contract between miles_sync and SGLang-compatible engines (SGLang 0.5.23 plus the session and
selector endpoints).

One frozen record per request body and per response. Field names are the JSON keys and defaults are SGLang's, so a
body encoded here is accepted by a real SGLang server, and a body that SGLang's clients send with these keys
decodes here. Sequences are tuples in records and lists on the wire; enums travel as their values.

`encode` and `decode` (re-exported from miles_sync.wire.codec) are generic over record fields: one decoder driven by the
type hints. Decode errors name the dotted path of each offending field; answers of real SGLang servers carry more
keys than these records, so clients decode them with `allow_unknown=True`.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from miles_sync.wire.codec import WireEnum, decode, encode
from miles_sync.wire.text import allowed_values, raise_if

__all__ = [
    "ALWAYS_OPEN_PREFIXES",
    "DEFAULT_GROUP_NAME",
    "ENDPOINTS",
    "QUERY_ENDPOINTS",
    "RESPONSES",
    "BeginWeightUpdateRequest",
    "ChecksumNames",
    "ContinueGenerationRequest",
    "DestroyWeightsUpdateGroupRequest",
    "EndWeightUpdateRequest",
    "FinishReason",
    "FinishReasonKind",
    "FlushCacheRequest",
    "FlushCacheResult",
    "GenerateMetaInfo",
    "GENERATE_DEFAULTS_ONLY",
    "GenerateRequest",
    "GenerateResponse",
    "GenerationControlResult",
    "InitWeightsUpdateGroupRequest",
    "LoRAUpdateResult",
    "LoadFormat",
    "LoadLoRAAdapterFromTensorsRequest",
    "ModelInfo",
    "NORMAL_PATHS",
    "ParallelismInfo",
    "PauseGenerationRequest",
    "PauseMode",
    "RankChecksums",
    "Role",
    "SamplingParams",
    "Selector",
    "TokenLogprob",
    "UnloadLoRAAdapterRequest",
    "UpdateWeightVersionRequest",
    "UpdateWeightsFromDistributedRequest",
    "UpdateWeightsFromTensorRequest",
    "WeightUpdateResult",
    "WeightVersionResult",
    "WeightVersionSpan",
    "WeightsCheckerAction",
    "WeightsCheckerRequest",
    "WeightsCheckerResult",
    "checksum_role",
    "decode",
    "encode",
    "generate_request_fields",
    "role_kind",
    "selector_roles",
    "unserved_generate_keys",
]

DEFAULT_GROUP_NAME = "weight_update_group"


class Selector(WireEnum):
    """Which runners of an engine one update session covers. begin, every payload and end carry the same one."""

    TARGET = "target"
    DRAFT = "draft"
    ALL = "all"


class Role(WireEnum):
    """The part an engine runner plays: the target model, or the speculative draft.

    On the wire a draft runner may also be named `draft_step_<i>` (SGLang's multi-layer EAGLE runs one draft runner
    per step); `role_kind` maps every reported role name onto this enum.
    """

    TARGET = "target"
    DRAFT = "draft"


_DRAFT_STEP_ROLE = re.compile(r"draft_step_(0|[1-9][0-9]{0,3})")


def role_kind(role_name: str) -> Role:
    """The Role of a reported role name: "target", "draft" or "draft_step_<i>". ValueError for anything else."""
    if role_name in (Role.TARGET.value, Role.DRAFT.value):
        return Role(role_name)
    if isinstance(role_name, str) and _DRAFT_STEP_ROLE.fullmatch(role_name):
        return Role.DRAFT
    raise ValueError(f"role {role_name!r} is not one of 'target', 'draft', 'draft_step_<i>'")


def checksum_role(reported_name: str) -> tuple[str, str]:
    """(role name, tensor name) of a name in a checksum answer. Only draft roles are prefixed ("draft.x",
    "draft_step_0.x", as SGLang merges its runners' answers); an unprefixed name is the target's."""
    head, dot, rest = reported_name.partition(".")
    if dot and head != Role.TARGET.value:
        try:
            role_kind(head)
        except ValueError:
            return Role.TARGET.value, reported_name
        return head, rest
    return Role.TARGET.value, reported_name


class ChecksumNames(WireEnum):
    """What an engine's /weights_checker checksum answer names and hashes (the reference engine reports it in
    /get_server_info as `miles_sync_checksum_names`; a server without the key answers as SGLang does, ENGINE).

    HF: the trainer's HF names in logical layout, full SHA-256 (the reference engine's default), so the trainer's
    checksums can be compared tensor by tensor. ENGINE: the engine's own parameters (fused names, its TP shard,
    after post-processing, 64-bit digests), what SGLang answers; only replicas can be compared with each other.
    """

    HF = "hf"
    ENGINE = "engine"


class PauseMode(WireEnum):
    """abort drops running requests; retract re-queues them; in_place freezes them and resumes on the new weights."""

    ABORT = "abort"
    RETRACT = "retract"
    IN_PLACE = "in_place"


class LoadFormat(WireEnum):
    DIRECT = "direct"
    FLATTENED_BUCKET = "flattened_bucket"


class WeightsCheckerAction(WireEnum):
    SNAPSHOT = "snapshot"
    RESET_TENSORS = "reset_tensors"
    COMPARE = "compare"
    CHECKSUM = "checksum"


class FinishReasonKind(WireEnum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


_SELECTOR_ROLES: Mapping[Selector, frozenset[Role]] = types.MappingProxyType(
    {
        Selector.TARGET: frozenset({Role.TARGET}),
        Selector.DRAFT: frozenset({Role.DRAFT}),
        Selector.ALL: frozenset({Role.TARGET, Role.DRAFT}),
    }
)


def selector_roles(selector: Selector) -> frozenset[Role]:
    """The roles whose runners a session with this selector loads and finalizes."""
    roles = _SELECTOR_ROLES.get(selector)  # str enums hash like their values, so "all" works too
    if roles is None:
        raise ValueError(f"selector {selector!r} is not one of {allowed_values(Selector)}")
    return roles


# ---- weight update group and session -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class InitWeightsUpdateGroupRequest:
    """Join the update group. Engine rank = rank_offset + tp_rank; the trainer source is rank 0.

    The engine blocks until the rendezvous completes, so a client issues this concurrently with the trainer's join.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.master_port < 65536:
            problems.append(f"master_port={self.master_port} is not in 1..65535")
        if self.world_size < 1:
            problems.append(f"world_size={self.world_size} must be at least 1")
        if not 0 <= self.rank_offset < max(self.world_size, 1):
            problems.append(f"rank_offset={self.rank_offset} is not in 0..world_size-1 (world_size={self.world_size})")
        raise_if(problems)


@dataclass(frozen=True, kw_only=True)
class DestroyWeightsUpdateGroupRequest:
    group_name: str = DEFAULT_GROUP_NAME


@dataclass(frozen=True, kw_only=True)
class BeginWeightUpdateRequest:
    """Open an update session. A second begin while one is open fails."""

    selector: Selector = Selector.ALL


@dataclass(frozen=True, kw_only=True)
class EndWeightUpdateRequest:
    """Close the open session and finalize (post-process) the runners that received bytes in it."""


@dataclass(frozen=True, kw_only=True)
class UpdateWeightsFromDistributedRequest:
    """Metadata of one bucket that the trainer broadcasts right after posting this.

    With load_format flattened_bucket the receiver rebuilds the layout from names/dtypes/shapes alone: tensor i
    starts at the sum of the byte sizes of tensors 0..i-1, with no padding.
    """

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str = DEFAULT_GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: LoadFormat | None = None
    selector: Selector = Selector.ALL
    torch_empty_cache: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            problems.append(
                f"names, dtypes and shapes differ in length ({len(self.names)}, {len(self.dtypes)}, {len(self.shapes)})"
            )
        if self.load_format is LoadFormat.DIRECT:
            problems.append("load_format='direct' applies to tensor updates only; use null or 'flattened_bucket'")
        raise_if(problems)


@dataclass(frozen=True, kw_only=True)
class UpdateWeightsFromTensorRequest:
    """One bucket as per-TP-rank handles: entry i of serialized_named_tensors (base64) is for engine TP rank i.

    The producer keeps the tensors alive until the response; the receiver unpickles through an allow-list only.
    `load_format` may also be a custom weight loader's import path, which a server started with
    `--custom-weight-loader <path>` runs on every TP rank with that rank's payload (any other path ends SGLang's
    scheduler: the server exits).
    """

    serialized_named_tensors: tuple[str, ...]
    load_format: LoadFormat | str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Selector = Selector.ALL
    torch_empty_cache: bool = False


@dataclass(frozen=True, kw_only=True)
class UpdateWeightVersionRequest:
    new_version: str
    abort_all_requests: bool = True


@dataclass(frozen=True, kw_only=True)
class WeightsCheckerRequest:
    action: WeightsCheckerAction = WeightsCheckerAction.CHECKSUM
    allow_quant_error: bool = False
    skip_tensor_list: tuple[str, ...] | None = None  # substrings of names to leave out
    selector: Selector = Selector.ALL


# ---- LoRA adapters ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LoadLoRAAdapterFromTensorsRequest:
    """SGLang 0.5.23's `LoadLoRAAdapterFromTensorsReqInput`: an adapter sent as tensors, outside any update session
    (it carries no selector; SGLang loads it into the target's LoRA manager only, never into a draft).

    `serialized_named_tensors`: one base64 payload per engine TP rank, each holding the FULL adapter tensors in
    PEFT names (SGLang's TP worker deserializes entry tp_rank and slices A/B itself). `config_dict`: the PEFT
    adapter_config.json. `expected_checksums`: {tensor name: SHA-256 hex of its raw bytes}; every TP rank checks
    the tensors it received (names must match exactly: missing and extra names fail too) before loading.
    SGLang assigns `lora_id` itself; a name already loaded is refused ("already loaded"): unload it first.
    """

    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: tuple[str, ...]
    pinned: bool = False
    added_tokens_config: dict[str, int] | None = None
    lora_id: str | None = None
    load_format: LoadFormat | None = None
    expected_checksums: dict[str, str] | None = None

    def __post_init__(self) -> None:
        problems = []
        if not self.lora_name:
            problems.append("lora_name is empty")
        if self.load_format is LoadFormat.DIRECT:
            problems.append("load_format='direct' is not an adapter format; use null or 'flattened_bucket'")
        raise_if(problems)


@dataclass(frozen=True, kw_only=True)
class UnloadLoRAAdapterRequest:
    """SGLang 0.5.23's `UnloadLoRAAdapterReqInput`."""

    lora_name: str
    lora_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class LoRAUpdateResult:
    """SGLang 0.5.23's `LoRAUpdateOutput`, the answer of both adapter endpoints (HTTP 200, or 400 when `success` is
    false). `loaded_adapters`: {lora_name: lora_path} of the adapters loaded after the call ("__tensor__" for
    adapters loaded from tensors)."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None


# ---- generation control ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PauseGenerationRequest:
    mode: PauseMode = PauseMode.ABORT


@dataclass(frozen=True, kw_only=True)
class ContinueGenerationRequest:
    torch_empty_cache: bool = True


@dataclass(frozen=True, kw_only=True)
class FlushCacheRequest:
    """Travels as query parameters of /flush_cache, not as a JSON body."""

    timeout: float | None = None  # seconds


# ---- responses ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WeightUpdateResult:
    """Answer of every weight endpoint: HTTP 200 with success true, or 400 with success false."""

    success: bool
    message: str


@dataclass(frozen=True, kw_only=True)
class WeightVersionResult:
    success: bool
    message: str
    new_version: str | None = None  # absent on failure


@dataclass(frozen=True, kw_only=True)
class GenerationControlResult:
    """Answer of /pause_generation and /continue_generation."""

    message: str
    status: str  # "ok"


@dataclass(frozen=True, kw_only=True)
class FlushCacheResult:
    """/flush_cache answers plain text; 400 while requests are running (waiting ones are ignored while paused)."""

    status_code: int
    message: str

    @property
    def success(self) -> bool:
        return 200 <= self.status_code < 300


@dataclass(frozen=True, kw_only=True)
class ParallelismInfo:
    role: str  # "target", "draft" or "draft_step_<i>" (see role_kind)
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int
    rank: int
    size: int

    def __post_init__(self) -> None:
        role_kind(self.role)


@dataclass(frozen=True, kw_only=True)
class RankChecksums:
    """Checksums of one engine TP rank; draft-role names carry their role as prefix ("draft.", "draft_step_0.")."""

    checksums: dict[str, str]  # name -> hex digest
    per_gpu_checksum: str
    parallelism_info: tuple[ParallelismInfo, ...]


@dataclass(frozen=True, kw_only=True)
class WeightsCheckerResult:
    success: bool
    message: str
    ranks: tuple[RankChecksums, ...] = ()  # filled for action "checksum"
    per_engine_checksum: str | None = None


# ---- generation -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    sampling_seed: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.max_new_tokens < 0:
            problems.append(f"max_new_tokens={self.max_new_tokens} must be non-negative")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} must be non-negative")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} is not in (0, 1]")
        raise_if(problems)


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One prompt, given either as token ids or as text (exactly one of the two).

    Logprob fields are SGLang 0.5.23's `GenerateReqInput` (srt/managers/io_struct.py:229-247; defaults applied at
    io_struct.py:565-572): `return_logprob` (False) asks for `meta_info.output_token_logprobs`; `logprob_start_len`
    (-1) is where prompt logprobs start, and -1 with `token_ids_logprob` None means output tokens only
    (srt/managers/scheduler.py:3260-3264); `top_logprobs_num` (0) asks for the k best alternatives per position;
    `token_ids_logprob` (None) for the logprobs of given ids; `return_text_in_logprobs` (False) fills the third
    element of each triple with the token's text. The record carries them as SGLang does; an engine that does not
    implement one refuses a non-default value (the reference engine: top_logprobs_num, token_ids_logprob and
    logprob_start_len other than -1).
    """

    input_ids: tuple[int, ...] | None = None
    text: str | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    return_text_in_logprobs: bool = False
    # SGLang's GenerateReqInput.lora_path: the name of a loaded adapter to serve this request with (None: the base).
    lora_path: str | None = None

    def __post_init__(self) -> None:
        if (self.input_ids is None) == (self.text is None):
            given = "both" if self.text is not None else "neither"
            raise ValueError(f"exactly one of input_ids and text must be given, got {given}")


# SGLang 0.5.23's GenerateReqInput fields (srt/managers/io_struct.py:177) that change what /generate does or answers
# and that GenerateRequest does not carry -> their defaults. SGLang's /generate body is that dataclass under FastAPI,
# which ignores keys it does not know; the SGLang router (sglang-router 0.3.2) posts every request with `model`
# (not a field: ignored) and `stream`, `log_metrics`, `return_hidden_states`, `background`, `no_logs`,
# `return_bytes`, `return_entropy` at these defaults. An engine that implements none of them takes a body whose
# values are these defaults and refuses any other value (`unserved_generate_keys`), never silently ignoring one.
GENERATE_DEFAULTS_ONLY: Mapping[str, object] = types.MappingProxyType(
    {
        "stream": False,
        "return_hidden_states": False,
        "return_routed_experts": False,
        "return_indexer_topk": False,
        "return_entropy": False,
        "return_bytes": False,
        "return_prompt_token_ids": False,
        "return_sampling_mask": None,
        "background": False,
        "input_embeds": None,
        "image_data": None,
        "video_data": None,
        "audio_data": None,
        "session_params": None,
        "custom_logit_processor": None,
        "require_reasoning": False,
        "max_thinking_tokens": None,
    }
)


def unserved_generate_keys(body: Mapping[str, object]) -> list[str]:
    """`key=value` for each GENERATE_DEFAULTS_ONLY key of a /generate body whose value is not its default."""
    return [f"{k}={body[k]!r}" for k, default in GENERATE_DEFAULTS_ONLY.items() if k in body and body[k] != default]


def generate_request_fields(body: Mapping[str, object]) -> dict[str, object]:
    """The keys of a /generate body that GenerateRequest carries; every other key is dropped, as SGLang's FastAPI
    body drops keys its dataclass does not declare (check `unserved_generate_keys` first)."""
    names = {f.name for f in dataclasses.fields(GenerateRequest)}
    return {k: v for k, v in body.items() if k in names}


@dataclass(frozen=True, kw_only=True)
class FinishReason:
    type: FinishReasonKind
    length: int | None = None  # for "length"
    matched: int | str | None = None  # for "stop": the matched token id or stop string
    message: str | None = None  # for "abort"


# SGLang's per-token logprob triple: (logprob, token_id, text or None). The prompt's first token has no logprob
# (None) when logprob_start_len is 0 (SGLang's logprob_result_processor.py:38).
TokenLogprob = tuple[float | None, int, str | None]


@dataclass(frozen=True, kw_only=True)
class WeightVersionSpan:
    """The output tokens [start, end) one weight version produced (SGLang 0.5.23's `meta_info.weight_versions`
    entries, srt/utils/weight_versions.py)."""

    version: str
    start: int
    end: int


@dataclass(frozen=True, kw_only=True)
class GenerateMetaInfo:
    prompt_tokens: int
    completion_tokens: int
    weight_version: str  # the version that produced the last output token (SGLang: the last span's version)
    finish_reason: FinishReason | None = None
    spec_verify_ct: int | None = None  # speculative decoding only
    spec_accept_rate: float | None = None
    spec_accept_length: float | None = None  # mean tokens accepted per verify step
    # The versions that produced the output tokens, oldest first, as token spans; more than one only when weights
    # changed under a running request (an in_place pause). SGLang 0.5.23 always sends at least one span.
    weight_versions: tuple[WeightVersionSpan, ...] = ()
    # Only with return_logprob (SGLang's tokenizer_manager.py:2868-2870 sets all three then; absent otherwise):
    # one [logprob, token_id, text-or-null] triple per output token (tokenizer_manager.py:3098-3116), and the
    # prompt's triples from logprob_start_len on (empty by default).
    input_token_logprobs: tuple[TokenLogprob, ...] | None = None
    output_token_logprobs: tuple[TokenLogprob, ...] | None = None
    output_token_logprobs_length: int | None = None

    @property
    def token_versions(self) -> tuple[str, ...]:
        """The versions that produced at least one output token, oldest first."""
        return tuple(span.version for span in self.weight_versions if span.end > span.start)


@dataclass(frozen=True, kw_only=True)
class GenerateResponse:
    output_ids: tuple[int, ...]
    meta_info: GenerateMetaInfo
    text: str = ""


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    model_path: str
    weight_version: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    model_type: str | None = None
    architectures: tuple[str, ...] | None = None


# POST paths with a JSON body -> the record of that body.
ENDPOINTS: Mapping[str, type] = types.MappingProxyType(
    {
        "/init_weights_update_group": InitWeightsUpdateGroupRequest,
        "/destroy_weights_update_group": DestroyWeightsUpdateGroupRequest,
        "/begin_weight_update": BeginWeightUpdateRequest,
        "/end_weight_update": EndWeightUpdateRequest,
        "/update_weights_from_distributed": UpdateWeightsFromDistributedRequest,
        "/update_weights_from_tensor": UpdateWeightsFromTensorRequest,
        "/update_weight_version": UpdateWeightVersionRequest,
        "/pause_generation": PauseGenerationRequest,
        "/continue_generation": ContinueGenerationRequest,
        "/weights_checker": WeightsCheckerRequest,
        "/generate": GenerateRequest,
        "/load_lora_adapter_from_tensors": LoadLoRAAdapterFromTensorsRequest,
        "/unload_lora_adapter": UnloadLoRAAdapterRequest,
    }
)

# Paths whose parameters travel in the query string -> the record of those parameters.
QUERY_ENDPOINTS: Mapping[str, type] = types.MappingProxyType({"/flush_cache": FlushCacheRequest})

# SGLang's auth levels (srt/utils/auth.py): these rollout and info routes are NORMAL (the API key, when the server
# has one); paths under these prefixes are never guarded (probes, scrapers); every other route miles_sync calls is
# ADMIN_OPTIONAL (the admin key when the server has one, else the API key).
NORMAL_PATHS = frozenset(
    {"/generate", "/model_info", "/get_model_info", "/get_server_info", "/server_info", "/get_draft_report"}
)
ALWAYS_OPEN_PREFIXES = ("/health", "/ready", "/metrics")

# Paths answering JSON -> the record of the answer. /flush_cache answers plain text (FlushCacheResult).
RESPONSES: Mapping[str, type] = types.MappingProxyType(
    {
        "/init_weights_update_group": WeightUpdateResult,
        "/destroy_weights_update_group": WeightUpdateResult,
        "/begin_weight_update": WeightUpdateResult,
        "/end_weight_update": WeightUpdateResult,
        "/update_weights_from_distributed": WeightUpdateResult,
        "/update_weights_from_tensor": WeightUpdateResult,
        "/update_weight_version": WeightVersionResult,
        "/pause_generation": GenerationControlResult,
        "/continue_generation": GenerationControlResult,
        "/weights_checker": WeightsCheckerResult,
        "/generate": GenerateResponse,
        "/model_info": ModelInfo,
        "/load_lora_adapter_from_tensors": LoRAUpdateResult,
        "/unload_lora_adapter": LoRAUpdateResult,
    }
)
