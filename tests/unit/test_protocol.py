"""The wire records: JSON round trips, SGLang's defaults, and decode errors that name the offending field."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_sync.wire import protocol as p

# One non-default instance per record, so a round trip exercises every field with a value that differs from its
# default (a field that encode forgot, or decode dropped, shows up as an inequality).
SAMPLES: dict[type, object] = {
    p.InitWeightsUpdateGroupRequest: p.InitWeightsUpdateGroupRequest(
        master_address="127.0.0.1", master_port=29511, rank_offset=1, world_size=3, group_name="g1", backend="gloo"
    ),
    p.DestroyWeightsUpdateGroupRequest: p.DestroyWeightsUpdateGroupRequest(group_name="g1"),
    p.BeginWeightUpdateRequest: p.BeginWeightUpdateRequest(selector=p.Selector.TARGET),
    p.EndWeightUpdateRequest: p.EndWeightUpdateRequest(),
    p.UpdateWeightsFromDistributedRequest: p.UpdateWeightsFromDistributedRequest(
        names=("model.embed_tokens.weight", "model.norm.weight"),
        dtypes=("bfloat16", "float32"),
        shapes=((16, 8), (8,)),
        group_name="g1",
        flush_cache=False,
        abort_all_requests=True,
        weight_version="3",
        load_format=p.LoadFormat.FLATTENED_BUCKET,
        selector=p.Selector.DRAFT,
        torch_empty_cache=True,
    ),
    p.UpdateWeightsFromTensorRequest: p.UpdateWeightsFromTensorRequest(
        serialized_named_tensors=("AAEC", "AwQF"),
        load_format=p.LoadFormat.DIRECT,
        flush_cache=False,
        abort_all_requests=True,
        weight_version="4",
        selector=p.Selector.TARGET,
        torch_empty_cache=True,
    ),
    p.UpdateWeightVersionRequest: p.UpdateWeightVersionRequest(new_version="5", abort_all_requests=False),
    p.PauseGenerationRequest: p.PauseGenerationRequest(mode=p.PauseMode.IN_PLACE),
    p.ContinueGenerationRequest: p.ContinueGenerationRequest(torch_empty_cache=False),
    p.FlushCacheRequest: p.FlushCacheRequest(timeout=2.5),
    p.WeightsCheckerRequest: p.WeightsCheckerRequest(
        action=p.WeightsCheckerAction.COMPARE,
        allow_quant_error=True,
        skip_tensor_list=("rotary_emb", "lm_head"),
        selector=p.Selector.DRAFT,
    ),
    p.WeightUpdateResult: p.WeightUpdateResult(success=False, message="no open session"),
    p.WeightVersionResult: p.WeightVersionResult(success=True, message="ok", new_version="7"),
    p.WeightVersionSpan: p.WeightVersionSpan(version="3", start=2, end=5),
    p.GenerationControlResult: p.GenerationControlResult(message="paused", status="ok"),
    p.FlushCacheResult: p.FlushCacheResult(status_code=400, message="requests running"),
    p.WeightsCheckerResult: p.WeightsCheckerResult(
        success=True,
        message="",
        ranks=(
            p.RankChecksums(
                checksums={"model.norm.weight": "ab12", "draft.model.norm.weight": "cd34"},
                per_gpu_checksum="ef56",
                parallelism_info=(
                    p.ParallelismInfo(
                        role=p.Role.TARGET,
                        tp_rank=1,
                        tp_size=2,
                        dp_rank=0,
                        dp_size=1,
                        pp_rank=0,
                        pp_size=1,
                        rank=1,
                        size=2,
                    ),
                    p.ParallelismInfo(
                        role=p.Role.DRAFT,
                        tp_rank=1,
                        tp_size=2,
                        dp_rank=0,
                        dp_size=1,
                        pp_rank=0,
                        pp_size=1,
                        rank=1,
                        size=2,
                    ),
                ),
            ),
        ),
        per_engine_checksum="9f",
    ),
    p.SamplingParams: p.SamplingParams(max_new_tokens=7, temperature=0.0, top_p=0.5, sampling_seed=0),
    p.GenerateRequest: p.GenerateRequest(
        input_ids=(1, 2, 3),
        sampling_params=p.SamplingParams(max_new_tokens=4, temperature=0.0),
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
        token_ids_logprob=(5, 6),
        return_text_in_logprobs=True,
        lora_path="policy",
    ),
    p.LoadLoRAAdapterFromTensorsRequest: p.LoadLoRAAdapterFromTensorsRequest(
        lora_name="policy",
        config_dict={"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "rank_pattern": {}},
        serialized_named_tensors=("AAEC", "AwQF"),
        pinned=True,
        added_tokens_config={"<x>": 7},
        lora_id="id-1",
        load_format=p.LoadFormat.FLATTENED_BUCKET,
        expected_checksums={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": "ab" * 32},
    ),
    p.UnloadLoRAAdapterRequest: p.UnloadLoRAAdapterRequest(lora_name="policy", lora_id="id-1"),
    p.LoRAUpdateResult: p.LoRAUpdateResult(
        success=False, error_message="[LORA-CHECK] mismatch", loaded_adapters={"policy": "__tensor__"}
    ),
    p.FinishReason: p.FinishReason(type=p.FinishReasonKind.STOP, length=3, matched="</s>", message="m"),
    p.GenerateMetaInfo: p.GenerateMetaInfo(
        prompt_tokens=3,
        completion_tokens=4,
        weight_version="2",
        finish_reason=p.FinishReason(type=p.FinishReasonKind.STOP, matched=7),
        spec_verify_ct=2,
        spec_accept_rate=0.75,
        spec_accept_length=2.5,
        weight_versions=(
            p.WeightVersionSpan(version="1", start=0, end=3),
            p.WeightVersionSpan(version="2", start=3, end=4),
        ),
        input_token_logprobs=((None, 1, "a"), (-0.5, 2, None)),
        output_token_logprobs=((-0.25, 7, "x"), (-1.5, 8, None)),
        output_token_logprobs_length=2,
    ),
    p.GenerateResponse: p.GenerateResponse(
        output_ids=(4, 5),
        text="ab",
        meta_info=p.GenerateMetaInfo(prompt_tokens=1, completion_tokens=2, weight_version="0"),
    ),
    p.ModelInfo: p.ModelInfo(
        model_path="/ckpt",
        weight_version="3",
        tokenizer_path="/tok",
        is_generation=False,
        model_type="qwen2",
        architectures=("Qwen2ForCausalLM",),
    ),
}
SAMPLES[p.RankChecksums] = SAMPLES[p.WeightsCheckerResult].ranks[0]
SAMPLES[p.ParallelismInfo] = SAMPLES[p.RankChecksums].parallelism_info[1]


def _record_classes() -> set[type]:
    return {getattr(p, name) for name in p.__all__ if dataclasses.is_dataclass(getattr(p, name))}


# GenerateRequest takes input_ids or text, never both: its text form is covered by the test below.
_EXCLUSIVE_FIELDS = {(p.GenerateRequest, "text")}


def test_samples_cover_every_record_and_differ_from_defaults():
    assert set(SAMPLES) == _record_classes()
    for cls, sample in SAMPLES.items():
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING and (cls, f.name) not in _EXCLUSIVE_FIELDS:
                assert getattr(sample, f.name) != f.default, f"{cls.__name__}.{f.name} sample equals its default"


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
def test_json_round_trip(cls):
    sample = SAMPLES[cls]
    wire = json.loads(json.dumps(p.encode(sample)))  # must be JSON-safe as is
    assert set(wire) == {f.name for f in dataclasses.fields(cls)}
    decoded = p.decode(cls, wire)
    assert decoded == sample
    assert type(decoded) is cls


def test_text_generate_request_round_trip():
    request = p.GenerateRequest(text="The capital of France is", sampling_params=p.SamplingParams(sampling_seed=3))
    wire = json.loads(json.dumps(p.encode(request)))
    assert wire["input_ids"] is None and wire["sampling_params"]["sampling_seed"] == 3
    assert p.decode(p.GenerateRequest, wire) == request


def test_encode_writes_enum_values_and_lists():
    wire = p.encode(SAMPLES[p.UpdateWeightsFromDistributedRequest])
    assert wire["selector"] == "draft" and type(wire["selector"]) is str
    assert wire["load_format"] == "flattened_bucket" and type(wire["load_format"]) is str
    assert wire["shapes"] == [[16, 8], [8]]
    assert wire["weight_version"] == "3"


def test_encode_accepts_lists_and_torch_sizes_built_by_callers():
    request = p.UpdateWeightsFromDistributedRequest(names=["w"], dtypes=["float32"], shapes=[torch.Size([2, 3])])
    assert p.encode(request)["shapes"] == [[2, 3]]


def test_decode_fills_sglang_defaults():
    request = p.decode(p.UpdateWeightsFromDistributedRequest, {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2]]})
    assert request.group_name == "weight_update_group"
    assert request.flush_cache is True
    assert request.abort_all_requests is False
    assert request.weight_version is None
    assert request.load_format is None
    assert request.selector is p.Selector.ALL
    assert request.torch_empty_cache is False
    assert p.decode(p.PauseGenerationRequest, {}).mode is p.PauseMode.ABORT
    assert p.decode(p.ContinueGenerationRequest, {}).torch_empty_cache is True
    assert p.decode(p.UpdateWeightVersionRequest, {"new_version": "1"}).abort_all_requests is True
    checker = p.decode(p.WeightsCheckerRequest, {})
    assert checker.action is p.WeightsCheckerAction.CHECKSUM and checker.skip_tensor_list is None


def test_decoded_sequences_are_tuples():
    request = p.decode(p.UpdateWeightsFromDistributedRequest, {"names": ["w"], "dtypes": ["f"], "shapes": [[2, 3]]})
    assert request.names == ("w",) and request.shapes == ((2, 3),)
    hash(request)  # frozen and made of tuples: usable as a key


def test_ints_are_accepted_for_floats_and_become_floats():
    params = p.decode(p.SamplingParams, {"temperature": 0, "top_p": 1})
    assert params.temperature == 0.0 and type(params.temperature) is float
    assert type(params.top_p) is float


@pytest.mark.parametrize(
    ("cls", "body", "expected"),
    [
        (p.SamplingParams, {"max_new_tokens": True}, "max_new_tokens: expected int, got bool True"),
        (p.SamplingParams, {"max_new_tokens": 2.0}, "max_new_tokens: expected int, got float 2.0"),
        (p.SamplingParams, {"temperature": False}, "temperature: expected float, got bool False"),
        (p.SamplingParams, {"temperature": "0.5"}, "temperature: expected float, got str '0.5'"),
        (p.ContinueGenerationRequest, {"torch_empty_cache": 1}, "torch_empty_cache: expected bool, got int 1"),
        (p.UpdateWeightVersionRequest, {"new_version": 3}, "new_version: expected str, got int 3"),
        (p.BeginWeightUpdateRequest, {"selector": "both"}, "selector: 'both' is not one of 'target', 'draft', 'all'"),
        (p.BeginWeightUpdateRequest, {"selector": "ALL"}, "selector: 'ALL' is not one of 'target', 'draft', 'all'"),
        (p.PauseGenerationRequest, {"mode": None}, "mode: None is not one of 'abort', 'retract', 'in_place'"),
        (p.WeightsCheckerRequest, {"skip_tensor_list": "x"}, "skip_tensor_list: expected a list of str, got str 'x'"),
    ],
)
def test_wrong_types_and_enum_values_name_the_field(cls, body, expected):
    with pytest.raises(ValueError) as info:
        p.decode(cls, body)
    assert expected in str(info.value)
    assert str(info.value).startswith(f"invalid {cls.__name__}: ")


def test_nested_errors_use_dotted_paths_with_indices():
    body = p.encode(SAMPLES[p.WeightsCheckerResult])
    body["ranks"][0]["parallelism_info"][1]["role"] = "drafter"
    body["ranks"][0]["parallelism_info"][0]["tp_rank"] = "1"
    body["ranks"][0]["checksums"]["model.norm.weight"] = 12
    message = _decode_error(p.WeightsCheckerResult, body)
    assert "ranks[0].parallelism_info[1]: role 'drafter' is not one of 'target', 'draft', 'draft_step_<i>'" in message
    assert "ranks[0].parallelism_info[0].tp_rank: expected int, got str '1'" in message
    assert "ranks[0].checksums['model.norm.weight']: expected str, got int 12" in message


def test_union_field_reports_every_alternative():
    body = p.encode(SAMPLES[p.GenerateResponse])
    body["meta_info"]["finish_reason"] = {"type": "stop", "matched": True}
    message = _decode_error(p.GenerateResponse, body)
    assert "meta_info.finish_reason.matched: expected int | str | null, got bool True" in message


def test_unknown_and_missing_keys_are_all_named_at_once():
    message = _decode_error(p.InitWeightsUpdateGroupRequest, {"master_address": "127.0.0.1", "port": 1, "rank": 0})
    assert "unknown key(s) 'port', 'rank'" in message
    assert "missing required key(s) 'master_port', 'rank_offset', 'world_size'" in message


def test_nested_unknown_key_names_its_path():
    body = p.encode(SAMPLES[p.GenerateRequest])
    body["sampling_params"]["top_k"] = 5
    assert "sampling_params: unknown key(s) 'top_k'" in _decode_error(p.GenerateRequest, body)


def test_allow_unknown_reads_a_real_sglang_generate_answer():
    # A real SGLang 0.5.23 /generate answer (CPU server, return_logprob), as it came back: more meta_info keys than
    # we read, and weight_versions as a list of {version, start, end} objects.
    answer = {
        "text": " ab",
        "output_ids": [32, 177],
        "meta_info": {
            "id": "5a930ed845e841a2b656bb8b8350dba7",
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": 3,
            "weight_version": "default",
            "num_retractions": 0,
            "input_token_logprobs": [],
            "output_token_logprobs": [[-0.05584270507097244, 32, None], [-0.057970110327005386, 177, None]],
            "output_token_logprobs_length": 2,
            "reasoning_tokens": 0,
            "completion_tokens": 2,
            "cached_tokens": 0,
            "weight_versions": [{"version": "default", "start": 0, "end": 2}],
            "cached_tokens_details": None,
            "dp_rank": None,
            "e2e_latency": 0.019588119999752962,
            "response_sent_to_client_ts": 1796458713.1240873,
        },
    }
    with pytest.raises(ValueError, match="meta_info: unknown key\\(s\\) 'id', 'num_retractions'"):
        p.decode(p.GenerateResponse, answer)
    response = p.decode(p.GenerateResponse, answer, allow_unknown=True)
    assert response.meta_info.finish_reason == p.FinishReason(type=p.FinishReasonKind.LENGTH, length=2)
    assert response.meta_info.weight_versions == (p.WeightVersionSpan(version="default", start=0, end=2),)
    assert response.meta_info.token_versions == ("default",)
    assert response.meta_info.output_token_logprobs[1] == (-0.057970110327005386, 177, None)


def test_record_validation_runs_on_decode_with_path_prefix():
    message = _decode_error(p.GenerateRequest, {"input_ids": [1], "sampling_params": {"top_p": 0}})
    assert "sampling_params: top_p=0.0 is not in (0, 1]" in message
    assert "neither" in _decode_error(p.GenerateRequest, {})
    assert "both" in _decode_error(p.GenerateRequest, {"input_ids": [1], "text": "a"})


def test_record_validation_names_every_bad_value():
    with pytest.raises(ValueError) as info:
        p.InitWeightsUpdateGroupRequest(master_address="127.0.0.1", master_port=0, rank_offset=3, world_size=0)
    message = str(info.value)
    assert "master_port=0" in message and "world_size=0" in message and "rank_offset=3" in message
    with pytest.raises(ValueError, match="differ in length \\(2, 1, 2\\)"):
        p.UpdateWeightsFromDistributedRequest(names=("a", "b"), dtypes=("f",), shapes=((1,), (2,)))
    with pytest.raises(ValueError, match="load_format='direct' applies to tensor updates only"):
        p.UpdateWeightsFromDistributedRequest(names=(), dtypes=(), shapes=(), load_format=p.LoadFormat.DIRECT)


def test_non_object_bodies_are_rejected():
    assert "expected an object (EndWeightUpdateRequest), got a list of length 0" in _decode_error(
        p.EndWeightUpdateRequest, []
    )
    assert "unknown key(s) 'selector' (allowed: none)" in _decode_error(p.EndWeightUpdateRequest, {"selector": "all"})
    with pytest.raises(TypeError):
        p.decode(dict, {})
    with pytest.raises(TypeError):
        p.encode({"a": 1})


def test_draft_step_roles_decode_and_map_to_the_draft():
    info = dict(tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, rank=0, size=1)
    body = {
        "success": True,
        "message": "Success.",
        "ranks": [
            {
                "checksums": {"w": "00ff00ff00ff00ff", "draft_step_0.w": "0123456789abcdef"},
                "per_gpu_checksum": "x",
                "parallelism_info": [{"role": "target", **info}, {"role": "draft_step_0", **info}],
            }
        ],
    }
    result = p.decode(p.WeightsCheckerResult, body)
    assert [i.role for i in result.ranks[0].parallelism_info] == ["target", "draft_step_0"]
    assert [p.role_kind(i.role) for i in result.ranks[0].parallelism_info] == [p.Role.TARGET, p.Role.DRAFT]
    assert p.checksum_role("draft_step_12.model.layers.0.w") == ("draft_step_12", "model.layers.0.w")
    assert p.checksum_role("draft.eh_proj.weight") == ("draft", "eh_proj.weight")
    assert p.checksum_role("model.layers.0.w") == ("target", "model.layers.0.w")
    for bad in ("draft_step_", "draft_step_01", "draft_stepx", "drafter", ""):
        with pytest.raises(ValueError, match="is not one of"):
            p.role_kind(bad)


def test_selector_roles():
    assert p.selector_roles(p.Selector.TARGET) == frozenset({p.Role.TARGET})
    assert p.selector_roles(p.Selector.DRAFT) == frozenset({p.Role.DRAFT})
    assert p.selector_roles(p.Selector.ALL) == frozenset({p.Role.TARGET, p.Role.DRAFT})
    assert p.selector_roles("all") == p.selector_roles(p.Selector.ALL)
    with pytest.raises(ValueError, match="'both' is not one of 'target', 'draft', 'all'"):
        p.selector_roles("both")


def test_enums_print_as_their_wire_values():
    assert str(p.Selector.ALL) == "all" and f"{p.PauseMode.IN_PLACE}" == "in_place"
    assert p.Selector("target") is p.Selector.TARGET


def test_endpoint_tables():
    for table in (p.ENDPOINTS, p.QUERY_ENDPOINTS, p.RESPONSES):
        for path, cls in table.items():
            assert path.startswith("/") and dataclasses.is_dataclass(cls)
        with pytest.raises(TypeError):
            table["/x"] = p.EndWeightUpdateRequest  # read-only
    assert set(p.ENDPOINTS) <= set(p.RESPONSES)


def test_flush_cache_result_success_follows_status_code():
    assert p.FlushCacheResult(status_code=200, message="").success
    assert not p.FlushCacheResult(status_code=400, message="running").success


_names = st.text(alphabet="abcdefghij._0123456789", min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(
    entries=st.lists(
        st.tuples(
            _names, st.sampled_from(["bfloat16", "float32", "float8_e4m3fn"]), st.lists(st.integers(0, 9), max_size=3)
        ),
        max_size=6,
    ),
    version=st.none() | st.text(max_size=5),
    selector=st.sampled_from(list(p.Selector)),
)
def test_distributed_request_round_trip_property(entries, version, selector):
    request = p.UpdateWeightsFromDistributedRequest(
        names=tuple(e[0] for e in entries),
        dtypes=tuple(e[1] for e in entries),
        shapes=tuple(tuple(e[2]) for e in entries),
        weight_version=version,
        selector=selector,
    )
    assert p.decode(p.UpdateWeightsFromDistributedRequest, json.loads(json.dumps(p.encode(request)))) == request


def _decode_error(cls: type, body: object) -> str:
    with pytest.raises(ValueError) as info:
        p.decode(cls, body)
    return str(info.value)


def test_checksum_names_key_is_the_server_info_field_the_client_decodes():
    from miles_sync.wire.api import CHECKSUM_NAMES_KEY, ServerInfo
    from miles_sync.wire.protocol import ChecksumNames

    assert CHECKSUM_NAMES_KEY in {f.name for f in dataclasses.fields(ServerInfo)}
    info = p.decode(ServerInfo, {"tp_size": 2, CHECKSUM_NAMES_KEY: "hf", "other": 1}, allow_unknown=True)
    assert info.miles_sync_checksum_names is ChecksumNames.HF
