"""The main job's plain parts, moved out of the driver: config resolution against a checkpoint, the job's placement
and feed plan, one round's requests and statistics, and when a run stops."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_rl_task import stats

from miles_sync.config import load_config
from miles_sync.engine.rollout import Sample
from miles_sync.job.placement import (
    DEFAULT_ENGINE_RESOURCES,
    PlacementLayout,
    Resources,
    job_feed_plan,
    job_placement,
)
from miles_sync.job.resolve import engine_settings, resolve_job, trainer_lora
from miles_sync.job.rl import reward
from miles_sync.job.rollouts import rollout_stats, round_requests, score_batch
from miles_sync.job.run_report import BaselineRecord, summary_line, unsynced_round_record, why_stop
from miles_sync.job.trainer import CompletionLogprobs
from miles_sync.weights.fp8 import Quantization
from miles_sync.wire.api import EngineError
from miles_sync.wire.protocol import WeightVersionSpan

pytestmark = pytest.mark.unit


def checkpoint(tmp_path, **changes) -> str:
    """A checkpoint directory with only config.json (what resolution reads): a Qwen3 of 4 layers, 128 wide."""
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 256,
        **changes,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_resolution_fills_the_fp8_block_into_a_validated_config(tmp_path):
    path = checkpoint(tmp_path)
    config = load_config(overrides=[f"model.checkpoint_dir={path}", "sync.quantization=fp8_block"])
    assert config.sync.fp8_block is None
    lines = []
    job = resolve_job(config, log=lines.append)
    assert job.checkpoint == path and job.config.sync.fp8_block is not None
    assert job.config.sync.quantization is Quantization.FP8_BLOCK and "resolves to" in lines[0]
    assert job.config.model == config.model  # nothing else is rewritten


def test_resolution_refuses_a_checkpoint_the_layout_cannot_split(tmp_path):
    path = checkpoint(tmp_path, num_hidden_layers=3)
    config = load_config(overrides=[f"model.checkpoint_dir={path}", "trainer.pp=2", "trainer.tp=1"])
    with pytest.raises(ValueError, match=f"checkpoint {path}: .*3"):
        resolve_job(config, log=print)


def test_a_model_without_a_built_in_checkpoint_needs_a_directory():
    base = load_config()
    with pytest.raises(ValueError, match="has no built-in reference checkpoint"):
        resolve_job(dataclasses.replace(base, model=dataclasses.replace(base.model, arch="mistral")), log=print)


def test_engines_serve_the_checkpoint_and_the_trainers_adapt_only_under_lora(tmp_path):
    path = checkpoint(tmp_path)
    job = resolve_job(load_config(overrides=[f"model.checkpoint_dir={path}"]), log=print)
    settings = engine_settings(job, device="cpu", sglang_python="/x/python")
    assert settings.model_dir == path and settings.lora is None and settings.server_python is None  # reference kind
    assert trainer_lora(job.config) is None
    lora = load_config(overrides=["sync.mode=lora"])
    assert trainer_lora(lora).rank == lora.sync.lora.rank


def test_the_job_places_colocated_only_where_the_transport_feeds_from_every_rank():
    assert job_placement(load_config(overrides=["engines.urls=[http://127.0.0.2:1]", "engines.count=1"])) is None
    distributed = job_placement(load_config())
    assert distributed.layout is PlacementLayout.DISAGGREGATED
    assert job_feed_plan(load_config(), distributed) is None
    colocated_config = load_config(overrides=["sync.transport=colocated"])
    colocated = job_placement(colocated_config)
    assert colocated.layout is PlacementLayout.COLOCATED
    assert job_feed_plan(colocated_config, colocated) is not None
    pinned = job_placement(load_config(overrides=["cluster.engine_node_resource=rollout_node"]))
    wanted = DEFAULT_ENGINE_RESOURCES + Resources(custom=(("rollout_node", 1.0),))
    assert {slot.resources for slot in pinned.engines} == {wanted}


def test_round_requests_cover_every_prompt_sample_and_engine_with_their_own_seeds():
    config = load_config()
    requests = round_requests(config, 3, num_engines=2)
    rollout = config.rollout
    assert [len(r) for r in requests] == [rollout.num_prompts * rollout.samples_per_prompt] * 2
    seeds = [sampling.sampling_seed for engine in requests for _, sampling in engine]
    assert len(set(seeds)) == len(seeds)
    assert requests == round_requests(config, 3, num_engines=2)  # the same run asks the same


def test_rollout_stats_compare_the_trainers_logprobs_with_the_engines():
    samples = [
        Sample(engine_url="a", prompt_ids=(1,), output_ids=(2, 3), weight_version="4", output_logprobs=(-1.0, -2.0)),
        Sample(engine_url="b", prompt_ids=(1,), output_ids=(5,), weight_version="4", output_logprobs=(-0.5,)),
    ]
    scored = CompletionLogprobs(logprobs=((-1.0, -2.25), (-0.5,)), weight_step=7)
    stats = rollout_stats(samples, scored, urls=["a", "b"], version="4")
    assert stats.logprob_diff_max == 0.25 and stats.logprob_diff_mean == pytest.approx(0.25 / 3)
    assert stats.reward_per_engine == (reward(samples[0]), reward(samples[1])) and stats.trainer_step == 7
    assert stats.samples_tagged and not rollout_stats(samples, scored, urls=["a", "b"], version="5").samples_tagged
    assert score_batch(samples, temperature=1.0).sequences == ((1, 2, 3), (1, 5))


def test_overlapped_rollouts_count_each_versions_tokens_and_compare_only_the_new_versions():
    """rollout.overlap: a sample's tokens before the sync come from the earlier version. Mutations: comparing every
    token with the trainer (the diff would be 0.5), accepting an unknown version, or spans out of order."""
    spans = (WeightVersionSpan(version="3", start=0, end=1), WeightVersionSpan(version="4", start=1, end=2))
    across = Sample(
        engine_url="a",
        prompt_ids=(1,),
        output_ids=(2, 3),
        weight_version="4",
        output_logprobs=(-1.5, -2.0),
        weight_versions=spans,
    )
    late = Sample(engine_url="b", prompt_ids=(1,), output_ids=(5,), weight_version="4", output_logprobs=(-0.5,))
    scored = CompletionLogprobs(logprobs=((-1.0, -2.25), (-0.5,)), weight_step=7)
    stats = rollout_stats([across, late], scored, urls=["a", "b"], version="4", earlier="3")
    assert stats.tokens_by_version == (("3", 1), ("4", 2))
    assert stats.logprob_diff_max == 0.25 and stats.samples_tagged
    # Without `earlier`, a token of version 3 is mistagged; with another earlier version too.
    assert not rollout_stats([across, late], scored, urls=["a", "b"], version="4").samples_tagged
    assert not rollout_stats([across, late], scored, urls=["a", "b"], version="4", earlier="2").samples_tagged
    backwards = dataclasses.replace(across, weight_versions=spans[::-1])
    assert not rollout_stats([backwards, late], scored, urls=["a", "b"], version="4", earlier="3").samples_tagged
    with pytest.raises(EngineError, match="spans cover 1 tokens, the output has 2"):
        dataclasses.replace(across, weight_versions=spans[:1]).token_versions()


def test_overlap_is_refused_with_a_pause_that_aborts_and_with_lora():
    with pytest.raises(ValueError, match="sync.pause_mode=abort would abort them"):
        load_config(overrides=["rollout.overlap=true"])
    with pytest.raises(ValueError, match="rollout.overlap with sync.mode=lora"):
        load_config(overrides=["rollout.overlap=true", "sync.pause_mode=retract", "sync.mode=lora"])
    assert load_config(overrides=["rollout.overlap=true", "sync.pause_mode=in_place"]).rollout.overlap


def test_a_run_stops_on_a_failed_sync_or_a_holding_canary():
    row = unsynced_round_record(1, version="1", loss=0.1, trainer_step=1, rollouts=stats(0.5, 1e-6))
    synced = dataclasses.replace(row, synced=True, committed=True)
    assert why_stop(synced, holds_on_canary=True) is None
    failed = dataclasses.replace(synced, committed=False, error="verify: x")
    assert why_stop(failed, holds_on_canary=False) == "the sync failed: verify: x"
    flagged = dataclasses.replace(synced, canary_flagged=("http://e",))
    assert why_stop(flagged, holds_on_canary=False) is None
    assert "the draft canary held http://e" in why_stop(flagged, holds_on_canary=True)
    baseline = BaselineRecord(version="0", accept_length=3.0, reward=0.25)
    assert summary_line(baseline, []) is None
    assert summary_line(baseline, [row]).startswith("1 rounds, 0 verified; accept length 3.000 -> 3.500")
    # Engines without a draft: no accept length to report ("None -> None" before).
    undrafted = dataclasses.replace(row, accept_length=None)
    no_draft = dataclasses.replace(baseline, accept_length=None)
    assert summary_line(no_draft, [undrafted]).startswith("1 rounds, 0 verified; no draft; mean reward 0.250")


def test_log_probs_that_do_not_cover_the_output_are_refused_naming_the_engine():
    """An engine that answers no triples, or triples for other tokens, would misalign the trainer's ratios.
    (Mutation: the checks gone; before they were tested, each raised a TypeError of its own.)"""
    from miles_sync.engine.rollout import _output_logprobs
    from miles_sync.wire.protocol import GenerateMetaInfo, GenerateResponse

    def response(triples):
        meta = GenerateMetaInfo(prompt_tokens=1, completion_tokens=2, weight_version="1", output_token_logprobs=triples)
        return GenerateResponse(output_ids=(2, 3), meta_info=meta)

    assert _output_logprobs(response(((-1.0, 2, None), (-2.0, 3, None))), url="u") == (-1.0, -2.0)
    with pytest.raises(EngineError, match="engine u /generate: HTTP 200: asked for return_logprob"):
        _output_logprobs(response(None), url="u")
    with pytest.raises(EngineError, match=r"\(1 triples\) do not match the 2 output ids"):
        _output_logprobs(response(((-1.0, 2, None),)), url="u")
