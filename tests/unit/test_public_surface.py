"""Guards the public surface: module __all__, the wire schema and the config field names.

A failure here means a deliberate change to a contract other code (engines, clients, user configs) relies on:
update the table in the same change, and the engine/client/docs that speak it.
"""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from pathlib import Path

from miles_sync import config
from miles_sync.engine import kinds, settings
from miles_sync.export import registry
from miles_sync.sync import selector
from miles_sync.transport import base as transport
from miles_sync.weights import layout
from miles_sync.wire import codec, draft, protocol
from miles_sync.wire.codec import encode

REQUIRED = "<required>"

PROTOCOL_ALL = {
    "ALWAYS_OPEN_PREFIXES",
    "DEFAULT_GROUP_NAME",
    "ENDPOINTS",
    "NORMAL_PATHS",
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
}
SELECTOR_ALL = {"SelectorMode", "resolve_selector", "selector_input_problems", "weight_update_selector"}
DRAFT_ALL = {"DraftKind", "DraftReport"}
CONFIG_ALL = {
    "DEFAULT_CONFIG_DIR",
    "ClusterConfig",
    "EngineConfig",
    "LoraSyncConfig",
    "MilesSyncConfig",
    "ModelConfig",
    "RolloutConfig",
    "SyncConfig",
    "SyncMode",
    "TrainerConfig",
    "load_config",
    "to_config",
    "to_yaml",
}
CODEC_ALL = {"WireEnum", "decode", "encode"}

ENDPOINTS = {
    "/init_weights_update_group": "InitWeightsUpdateGroupRequest",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupRequest",
    "/begin_weight_update": "BeginWeightUpdateRequest",
    "/end_weight_update": "EndWeightUpdateRequest",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedRequest",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorRequest",
    "/update_weight_version": "UpdateWeightVersionRequest",
    "/pause_generation": "PauseGenerationRequest",
    "/continue_generation": "ContinueGenerationRequest",
    "/weights_checker": "WeightsCheckerRequest",
    "/generate": "GenerateRequest",
    "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsRequest",
    "/unload_lora_adapter": "UnloadLoRAAdapterRequest",
}
QUERY_ENDPOINTS = {"/flush_cache": "FlushCacheRequest"}
RESPONSES = {
    "/init_weights_update_group": "WeightUpdateResult",
    "/destroy_weights_update_group": "WeightUpdateResult",
    "/begin_weight_update": "WeightUpdateResult",
    "/end_weight_update": "WeightUpdateResult",
    "/update_weights_from_distributed": "WeightUpdateResult",
    "/update_weights_from_tensor": "WeightUpdateResult",
    "/update_weight_version": "WeightVersionResult",
    "/pause_generation": "GenerationControlResult",
    "/continue_generation": "GenerationControlResult",
    "/weights_checker": "WeightsCheckerResult",
    "/generate": "GenerateResponse",
    "/model_info": "ModelInfo",
    "/load_lora_adapter_from_tensors": "LoRAUpdateResult",
    "/unload_lora_adapter": "LoRAUpdateResult",
}

# record -> [(JSON key, annotation, default as it goes on the wire)]; defaults are SGLang 0.5.23's.
WIRE_SCHEMA = {
    "BeginWeightUpdateRequest": [
        ("selector", "Selector", "all"),
    ],
    "ContinueGenerationRequest": [
        ("torch_empty_cache", "bool", True),
    ],
    "DestroyWeightsUpdateGroupRequest": [
        ("group_name", "str", "weight_update_group"),
    ],
    "EndWeightUpdateRequest": [],
    "FinishReason": [
        ("type", "FinishReasonKind", REQUIRED),
        ("length", "int | None", None),
        ("matched", "int | str | None", None),
        ("message", "str | None", None),
    ],
    "FlushCacheRequest": [
        ("timeout", "float | None", None),
    ],
    "FlushCacheResult": [
        ("status_code", "int", REQUIRED),
        ("message", "str", REQUIRED),
    ],
    "GenerateMetaInfo": [
        ("prompt_tokens", "int", REQUIRED),
        ("completion_tokens", "int", REQUIRED),
        ("weight_version", "str", REQUIRED),
        ("finish_reason", "FinishReason | None", None),
        ("spec_verify_ct", "int | None", None),
        ("spec_accept_rate", "float | None", None),
        ("spec_accept_length", "float | None", None),
        ("weight_versions", "tuple[WeightVersionSpan, ...]", ()),
        ("input_token_logprobs", "tuple[TokenLogprob, ...] | None", None),
        ("output_token_logprobs", "tuple[TokenLogprob, ...] | None", None),
        ("output_token_logprobs_length", "int | None", None),
    ],
    "GenerateRequest": [
        ("input_ids", "tuple[int, ...] | None", None),
        ("text", "str | None", None),
        (
            "sampling_params",
            "SamplingParams",
            {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "sampling_seed": None},
        ),
        ("return_logprob", "bool", False),
        ("logprob_start_len", "int", -1),
        ("top_logprobs_num", "int", 0),
        ("token_ids_logprob", "tuple[int, ...] | None", None),
        ("return_text_in_logprobs", "bool", False),
        ("lora_path", "str | None", None),
    ],
    "GenerateResponse": [
        ("output_ids", "tuple[int, ...]", REQUIRED),
        ("meta_info", "GenerateMetaInfo", REQUIRED),
        ("text", "str", ""),
    ],
    "GenerationControlResult": [
        ("message", "str", REQUIRED),
        ("status", "str", REQUIRED),
    ],
    "InitWeightsUpdateGroupRequest": [
        ("master_address", "str", REQUIRED),
        ("master_port", "int", REQUIRED),
        ("rank_offset", "int", REQUIRED),
        ("world_size", "int", REQUIRED),
        ("group_name", "str", "weight_update_group"),
        ("backend", "str", "nccl"),
    ],
    "LoRAUpdateResult": [
        ("success", "bool", REQUIRED),
        ("error_message", "str | None", None),
        ("loaded_adapters", "dict[str, str] | None", None),
    ],
    "LoadLoRAAdapterFromTensorsRequest": [
        ("lora_name", "str", REQUIRED),
        ("config_dict", "dict[str, Any]", REQUIRED),
        ("serialized_named_tensors", "tuple[str, ...]", REQUIRED),
        ("pinned", "bool", False),
        ("added_tokens_config", "dict[str, int] | None", None),
        ("lora_id", "str | None", None),
        ("load_format", "LoadFormat | None", None),
        ("expected_checksums", "dict[str, str] | None", None),
    ],
    "ModelInfo": [
        ("model_path", "str", REQUIRED),
        ("weight_version", "str", REQUIRED),
        ("tokenizer_path", "str | None", None),
        ("is_generation", "bool", True),
        ("model_type", "str | None", None),
        ("architectures", "tuple[str, ...] | None", None),
    ],
    "ParallelismInfo": [
        ("role", "str", REQUIRED),
        ("tp_rank", "int", REQUIRED),
        ("tp_size", "int", REQUIRED),
        ("dp_rank", "int", REQUIRED),
        ("dp_size", "int", REQUIRED),
        ("pp_rank", "int", REQUIRED),
        ("pp_size", "int", REQUIRED),
        ("rank", "int", REQUIRED),
        ("size", "int", REQUIRED),
    ],
    "PauseGenerationRequest": [
        ("mode", "PauseMode", "abort"),
    ],
    "RankChecksums": [
        ("checksums", "dict[str, str]", REQUIRED),
        ("per_gpu_checksum", "str", REQUIRED),
        ("parallelism_info", "tuple[ParallelismInfo, ...]", REQUIRED),
    ],
    "SamplingParams": [
        ("max_new_tokens", "int", 128),
        ("temperature", "float", 1.0),
        ("top_p", "float", 1.0),
        ("sampling_seed", "int | None", None),
    ],
    "UnloadLoRAAdapterRequest": [
        ("lora_name", "str", REQUIRED),
        ("lora_id", "str | None", None),
    ],
    "UpdateWeightVersionRequest": [
        ("new_version", "str", REQUIRED),
        ("abort_all_requests", "bool", True),
    ],
    "UpdateWeightsFromDistributedRequest": [
        ("names", "tuple[str, ...]", REQUIRED),
        ("dtypes", "tuple[str, ...]", REQUIRED),
        ("shapes", "tuple[tuple[int, ...], ...]", REQUIRED),
        ("group_name", "str", "weight_update_group"),
        ("flush_cache", "bool", True),
        ("abort_all_requests", "bool", False),
        ("weight_version", "str | None", None),
        ("load_format", "LoadFormat | None", None),
        ("selector", "Selector", "all"),
        ("torch_empty_cache", "bool", False),
    ],
    "UpdateWeightsFromTensorRequest": [
        ("serialized_named_tensors", "tuple[str, ...]", REQUIRED),
        ("load_format", "LoadFormat | str | None", None),  # a str: a custom weight loader's import path
        ("flush_cache", "bool", True),
        ("abort_all_requests", "bool", False),
        ("weight_version", "str | None", None),
        ("selector", "Selector", "all"),
        ("torch_empty_cache", "bool", False),
    ],
    "WeightUpdateResult": [
        ("success", "bool", REQUIRED),
        ("message", "str", REQUIRED),
    ],
    "WeightVersionResult": [
        ("success", "bool", REQUIRED),
        ("message", "str", REQUIRED),
        ("new_version", "str | None", None),
    ],
    "WeightVersionSpan": [
        ("version", "str", REQUIRED),
        ("start", "int", REQUIRED),
        ("end", "int", REQUIRED),
    ],
    "WeightsCheckerRequest": [
        ("action", "WeightsCheckerAction", "checksum"),
        ("allow_quant_error", "bool", False),
        ("skip_tensor_list", "tuple[str, ...] | None", None),
        ("selector", "Selector", "all"),
    ],
    "WeightsCheckerResult": [
        ("success", "bool", REQUIRED),
        ("message", "str", REQUIRED),
        ("ranks", "tuple[RankChecksums, ...]", ()),
        ("per_engine_checksum", "str | None", None),
    ],
}

ENUMS = {
    protocol.Selector: ["target", "draft", "all"],
    protocol.Role: ["target", "draft"],
    protocol.PauseMode: ["abort", "retract", "in_place"],
    protocol.LoadFormat: ["direct", "flattened_bucket"],
    protocol.WeightsCheckerAction: ["snapshot", "reset_tensors", "compare", "checksum"],
    protocol.FinishReasonKind: ["length", "stop", "abort"],
    draft.DraftKind: ["none", "standalone", "mtp", "ngram"],
    registry.ConversionMode: ["raw", "bridge"],
    selector.SelectorMode: ["auto", "target", "draft", "all"],
    transport.TransportKind: ["distributed", "colocated", "shard_direct", "p2p"],
    kinds.EngineKind: ["reference", "sglang"],
    layout.WeightLayout: ["none", "aiter"],
    settings.FinalizePolicy: ["strict", "sglang", "no_selector"],
    config.SyncMode: ["full", "lora"],
}

CONFIG_FIELDS = {
    "model": {"arch": None, "checkpoint_dir": None, "speculative_algorithm": None, "num_trained_mtp_layers": None},
    "trainer": {"tp": None, "pp": None, "dp": None, "ep": None, "etp": None, "lr": None},
    "engines": {
        "count": None,
        "tp": None,
        "kind": None,
        "urls": None,
        "weight_layout": None,
        "finalize_policy": None,
        "draft_kind": None,
        "spec_steps": None,
        "api_key": None,
        "admin_api_key": None,
        "device": None,
        "sglang_python": None,
        "join_at_round": None,
    },
    "sync": {
        "transport": None,
        "conversion": None,
        "bucket_bytes": None,
        "selector": None,
        "pause_mode": None,
        "verify": None,
        "http_timeout_s": None,
        "collective_timeout_s": None,
        "sync_timeout_s": None,
        "in_place_flush_s": None,
        "check_selector": None,
        "staged": None,
        "mechanism_check": None,
        "enabled": None,
        "version_file": None,
        "quantization": None,
        "fp8_block": None,
        "mode": None,
        "lora": {"rank": None, "alpha": None, "target_modules": None, "name": None, "flatten_min_bytes": None},
        "draft_canary": None,
        "draft_canary_min_ratio": None,
    },
    "cluster": {
        "address": None,
        "num_cpus": None,
        "bind_host": None,
        "trainer_node_resource": None,
        "engine_node_resource": None,
        "trainer_strategy": None,
        "engine_strategy": None,
    },
    "rollout": {
        "num_prompts": None,
        "prompt_length": None,
        "samples_per_prompt": None,
        "max_new_tokens": None,
        "temperature": None,
        "router": None,
        "router_url": None,
        "router_policy": None,
        "overlap": None,
    },
    "seed": None,
    "num_rounds": None,
    "run_name": None,
    "output_dir": None,
    "control_report": None,
}


# The front door (miles_sync.api): every name the README documents, each the object of the module that defines it.
API_NAMES = {
    "CanarySettings": "miles_sync.sync.draft_canary",
    "ControllerStatus": "miles_sync.sync.controller",
    "EngineClient": "miles_sync.engine.client",
    "EngineLauncher": "miles_sync.engine.process",
    "EngineResult": "miles_sync.sync.report",
    "GroupSettings": "miles_sync.sync.update_group",
    "MilesSyncConfig": "miles_sync.config",
    "ModelConfig": "miles_sync.config",
    "PipelineSource": "miles_sync.sync.pipeline",
    "Selector": "miles_sync.wire.protocol",
    "SelectorInputs": "miles_sync.sync.session",
    "SessionTimeouts": "miles_sync.sync.session",
    "SyncConfig": "miles_sync.config",
    "SyncController": "miles_sync.sync.controller",
    "SyncError": "miles_sync.sync.report",
    "SyncReport": "miles_sync.sync.report",
    "WeightSource": "miles_sync.sync.weight_source",
    "attach_model": "miles_sync.sync.attach",
    "load_config": "miles_sync.config",
    "weight_update_selector": "miles_sync.sync.selector",
}


def test_the_front_door_names_what_the_readme_documents_and_nothing_else():
    import importlib

    from miles_sync import api

    assert sorted(api.__all__) == sorted(API_NAMES) and len(api.__all__) <= 20
    for name, module in API_NAMES.items():
        assert getattr(api, name) is getattr(importlib.import_module(module), name), name
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    undocumented = [name for name in API_NAMES if f"`{name}`" not in readme]
    assert not undocumented, f"front-door names the README does not mention: {undocumented}"


def test_module_all():
    tables = (
        (protocol, PROTOCOL_ALL),
        (selector, SELECTOR_ALL),
        (draft, DRAFT_ALL),
        (config, CONFIG_ALL),
        (codec, CODEC_ALL),
    )
    for module, expected in tables:
        assert set(module.__all__) == expected, module.__name__
        assert len(module.__all__) == len(expected), f"{module.__name__}.__all__ repeats a name"
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_endpoint_tables():
    assert {k: v.__name__ for k, v in protocol.ENDPOINTS.items()} == ENDPOINTS
    assert {k: v.__name__ for k, v in protocol.QUERY_ENDPOINTS.items()} == QUERY_ENDPOINTS
    assert {k: v.__name__ for k, v in protocol.RESPONSES.items()} == RESPONSES


def test_wire_schema():
    records = {n: getattr(protocol, n) for n in protocol.__all__ if dataclasses.is_dataclass(getattr(protocol, n))}
    assert set(records) == set(WIRE_SCHEMA)
    for name, cls in records.items():
        assert _schema_of(cls) == WIRE_SCHEMA[name], name


def test_draft_report_schema():
    assert _schema_of(draft.DraftReport) == [
        ("kind", "DraftKind", REQUIRED),
        ("owned_names", "tuple[str, ...]", ()),
        ("is_frozen", "bool", False),
    ]


def test_enum_values():
    for enum_cls, values in ENUMS.items():
        assert [m.value for m in enum_cls] == values, enum_cls.__name__
        assert issubclass(enum_cls, str)


def test_config_field_names():
    assert _field_tree(config.MilesSyncConfig) == CONFIG_FIELDS


def test_every_record_is_frozen_and_keyword_only():
    modules = (protocol, selector, config)
    records = [getattr(m, n) for m in modules for n in m.__all__ if dataclasses.is_dataclass(getattr(m, n))]
    for cls in records:
        params = cls.__dataclass_params__
        assert params.frozen, cls.__name__
        assert all(f.kw_only for f in dataclasses.fields(cls)), cls.__name__


def _schema_of(cls: type) -> list[tuple]:
    rows = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            rows.append((f.name, f.type, REQUIRED))
            continue
        if isinstance(default, Enum):
            default = default.value
        elif dataclasses.is_dataclass(default):
            default = encode(default)
        rows.append((f.name, f.type, default))
    return rows


def _field_tree(cls: type) -> dict:
    hints = typing.get_type_hints(cls)
    return {
        f.name: _field_tree(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else None
        for f in dataclasses.fields(cls)
    }


# Modules whose __all__ is a contract pinned above (wire schema, config, selector): they list every public name.
_PINNED_ALL = {"miles_sync.wire.protocol", "miles_sync.sync.selector", "miles_sync.wire.draft", "miles_sync.config"}
_PINNED_ALL |= {"miles_sync.wire.codec", "miles_sync.api", "miles_sync.embedding"}


def test_internal_all_lists_only_what_another_package_imports():
    """An internal module's __all__ names what code outside its package (miles_sync.<package>, actors, launch)
    imports from it, and nothing else: the list is the module's real interface, not its inventory."""
    import ast

    repo = Path(__file__).resolve().parents[2]

    def package_of(module: str) -> str:
        return ".".join(module.split(".")[:2]) if module.startswith("miles_sync.") else module.split(".")[0]

    declared: dict[str, list[str]] = {}
    imported: dict[tuple[str, str], set[str]] = {}
    for path in [p for top in ("miles_sync", "actors", "launch") for p in (repo / top).rglob("*.py")]:
        parts = path.relative_to(repo).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    imported.setdefault((node.module, alias.name), set()).add(package_of(module))
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(target, ast.Name):
                if target.id == "__all__" and path.name != "__init__.py" and module.startswith("miles_sync."):
                    declared[module] = [element.value for element in node.value.elts]
    assert len(declared) > 50, "the scan found too few modules"
    unused = {
        module: [n for n in names if not imported.get((module, n), set()) - {package_of(module)}]
        for module, names in declared.items()
        if module not in _PINNED_ALL
    }
    offenders = {module: names for module, names in unused.items() if names}
    assert not offenders, f"names no other package imports (drop them from __all__): {offenders}"
