"""The vendored SGLang adapter records (tests/data/sglang_lora_fields.json): still SGLang's, and field for field what
our wire records carry.

The copy is re-derived from the source of the sglang version it names (the `sglang_source` fixture: the package the
test command installs into .venv-sglang, read, never imported).
"""

from __future__ import annotations

import dataclasses

import pytest
from sglang_fields import LoraFields, derive_lora_fields, vendored_lora_fields

from miles_sync.wire import protocol
from miles_sync.wire.protocol import (
    LoadFormat,
    LoadLoRAAdapterFromTensorsRequest,
    LoRAUpdateResult,
    UnloadLoRAAdapterRequest,
    decode,
    encode,
)

OURS = {
    "load_from_tensors": LoadLoRAAdapterFromTensorsRequest,
    "unload": UnloadLoRAAdapterRequest,
    "update_output": LoRAUpdateResult,
}


@pytest.fixture(scope="module")
def vendored() -> LoraFields:
    return vendored_lora_fields()


def test_the_vendored_copy_is_what_sglangs_source_declares(vendored, sglang_source):
    source = sglang_source(vendored.sglang_version)
    assert derive_lora_fields(source) == vendored, f"re-derive tests/data/sglang_lora_fields.json from {source}"


def test_our_records_have_sglangs_fields_in_sglangs_order(vendored):
    for key, record in OURS.items():
        assert tuple(f.name for f in dataclasses.fields(record)) == getattr(vendored, key), record.__name__
    assert vendored.generate_has_lora_path
    assert "lora_path" in {f.name for f in dataclasses.fields(protocol.GenerateRequest)}


def test_our_routes_take_the_records_sglang_routes_take(vendored):
    names = {"LoadLoRAAdapterFromTensorsReqInput": LoadLoRAAdapterFromTensorsRequest}
    names["UnloadLoRAAdapterReqInput"] = UnloadLoRAAdapterRequest
    for path, sglang_record in vendored.routes.items():
        assert protocol.ENDPOINTS[path] is names[sglang_record]
        assert protocol.RESPONSES[path] is LoRAUpdateResult


def test_a_body_with_sglangs_keys_round_trips_strictly(vendored):
    request = LoadLoRAAdapterFromTensorsRequest(
        lora_name="policy",
        config_dict={"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]},
        serialized_named_tensors=("AA==",),
        load_format=LoadFormat.FLATTENED_BUCKET,
        expected_checksums={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": "0" * 64},
    )
    body = encode(request)
    assert list(body) == list(vendored.load_from_tensors)
    assert decode(LoadLoRAAdapterFromTensorsRequest, body) == request
    # SGLang's answer to a failed load: success false, the message, the adapters still loaded.
    answer = {"success": False, "error_message": "already loaded", "loaded_adapters": {"policy": "__tensor__"}}
    assert list(answer) == list(vendored.update_output)
    assert decode(LoRAUpdateResult, answer).loaded_adapters == {"policy": "__tensor__"}
    assert list(encode(UnloadLoRAAdapterRequest(lora_name="policy"))) == list(vendored.unload)
