"""Typed config: conf/default.yaml mirrors the records, overrides apply, and bad input names its key path."""

from __future__ import annotations

import dataclasses
import shutil
import typing

import pytest
import yaml
from omegaconf import OmegaConf

from miles_sync.config import (
    DEFAULT_CONFIG_DIR,
    ClusterConfig,
    EngineConfig,
    MilesSyncConfig,
    ModelConfig,
    SyncConfig,
    TrainerConfig,
    load_config,
    to_config,
    to_yaml,
)
from miles_sync.engine.kinds import EngineKind
from miles_sync.engine.settings import FinalizePolicy
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.draft_canary import CanaryMode
from miles_sync.sync.selector import SelectorMode
from miles_sync.transport.base import TransportKind
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.draft import DraftKind
from miles_sync.wire.protocol import PauseMode


def _record_keys(cls: type) -> dict:
    """Field names of a record, nested records expanded; leaves map to None."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: _record_keys(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else None
        for f in dataclasses.fields(cls)
    }


def _yaml_keys(node: object) -> dict | None:
    return {k: _yaml_keys(v) for k, v in node.items()} if isinstance(node, dict) else None


def test_default_yaml_mirrors_the_records_key_for_key():
    with open(DEFAULT_CONFIG_DIR / "default.yaml") as f:
        raw = yaml.safe_load(f)
    assert raw.pop("defaults") == ["_self_", {"demo": "none"}]  # Hydra's list of config groups
    assert _yaml_keys(raw) == _record_keys(MilesSyncConfig)


def test_default_yaml_values_equal_the_code_defaults():
    assert load_config() == MilesSyncConfig()


def test_overrides_apply_with_their_types():
    config = load_config(overrides=["sync.transport=colocated", "engines.count=2"])
    assert config.sync.transport is TransportKind.COLOCATED
    assert config.engines.count == 2
    assert config.sync.conversion is ConversionMode.RAW  # untouched keys keep the file's values


def test_overrides_cover_lists_nulls_floats_and_enums():
    config = load_config(
        overrides=[
            "engines.count=2",
            "engines.urls=[http://127.0.0.1:30000,http://127.0.0.1:30001]",
            "engines.kind=sglang",
            "engines.weight_layout=aiter",
            "engines.finalize_policy=sglang",
            "engines.draft_kind=mtp",
            "model.speculative_algorithm=EAGLE",
            "model.checkpoint_dir=/tmp/ckpt",
            "sync.http_timeout_s=5",
            "sync.selector=target",
            "sync.pause_mode=in_place",
            "cluster.num_cpus=2",
            "cluster.address=null",
        ]
    )
    assert config.engines.urls == ("http://127.0.0.1:30000", "http://127.0.0.1:30001")
    assert config.engines.kind is EngineKind.SGLANG
    assert config.engines.weight_layout is WeightLayout.AITER
    assert config.engines.finalize_policy is FinalizePolicy.SGLANG
    assert config.engines.draft_kind is DraftKind.MTP
    assert config.sync.http_timeout_s == 5.0 and type(config.sync.http_timeout_s) is float
    assert config.sync.selector is SelectorMode.TARGET and config.sync.pause_mode is PauseMode.IN_PLACE
    assert config.cluster == ClusterConfig(address=None, num_cpus=2)
    assert config.model.checkpoint_dir == "/tmp/ckpt"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("sync.bogus=1", "unknown config key 'sync.bogus' (allowed under sync: transport, conversion,"),
        ("bogus=1", "unknown config key 'bogus' (allowed under the top level: model, trainer,"),
        ("engines.draft.kind=mtp", "unknown config key 'engines.draft'"),
    ],
)
def test_unknown_key_names_its_path_and_the_allowed_keys(override, expected):
    with pytest.raises(ValueError) as info:
        load_config(overrides=[override])
    assert expected in str(info.value)
    assert str(info.value).startswith(f"override {override!r}: ")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("sync.bucket_bytes=lots", "config key 'sync.bucket_bytes': Value 'lots' of type 'str' could not be"),
        ("trainer.tp=true", "config key 'trainer.tp': Value 'True' of type 'bool' could not be converted"),
        ("sync.verify=maybe", "config key 'sync.verify': Value 'maybe' is not a valid bool"),
        ("trainer.lr=fast", "config key 'trainer.lr': Value 'fast' of type 'str' could not be converted to Float"),
        ("sync=3", "config key 'sync': "),
        ("sync.transport=udp", "sync.transport: 'udp' is not one of 'distributed', 'colocated'"),
        ("sync.transport=COLOCATED", "sync.transport: 'COLOCATED' is not one of 'distributed', 'colocated'"),
        ("engines.kind=vllm", "engines.kind: 'vllm' is not one of 'reference', 'sglang'"),
        ("sync.transport=carrier_pigeon", "sync.transport: 'carrier_pigeon' is not one of 'distributed'"),
        ("engines.finalize_policy=loose", "engines.finalize_policy: 'loose' is not one of"),
        ("sync.selector=both", "sync.selector: 'both' is not one of 'auto', 'target', 'draft', 'all'"),
    ],
)
def test_wrong_type_names_its_path(override, expected):
    with pytest.raises(ValueError) as info:
        load_config(overrides=[override])
    assert expected in str(info.value)


def test_every_invalid_value_is_named_at_once():
    with pytest.raises(ValueError) as info:
        load_config(overrides=["sync.bucket_bytes=0", "sync.sync_timeout_s=-1", "trainer.ep=3", "num_rounds=0"])
    message = str(info.value)
    assert message.startswith("invalid config: ")
    for part in (
        "sync: bucket_bytes=0 must be positive",
        "sync_timeout_s=-1.0 must be a positive number",
        "trainer: etp*ep=1*3=3 does not divide tp*dp=2*1=2",
    ):
        assert part in message
    # The root's own checks run once its parts are valid.
    with pytest.raises(ValueError, match="num_rounds=0 must be at least 1"):
        load_config(overrides=["num_rounds=0"])


@pytest.mark.parametrize(
    ("make", "parts"),
    [
        (
            lambda: SyncConfig(bucket_bytes=-1, http_timeout_s=0.0, collective_timeout_s=float("inf")),
            ["bucket_bytes=-1", "http_timeout_s=0.0", "collective_timeout_s=inf"],
        ),
        (lambda: EngineConfig(count=0, spec_steps=0, tp=0), ["count=0", "spec_steps=0", "tp=0"]),
        (
            lambda: EngineConfig(count=3, urls=("http://127.0.0.1:1", "127.0.0.1:2")),
            ["urls has 2 entries but count=3", "'127.0.0.1:2'"],
        ),
        (lambda: EngineConfig(count=2, urls=("http://127.0.0.1:1", "http://127.0.0.1:1")), ["repeat a server"]),
        (lambda: TrainerConfig(tp=0, pp=-1, lr=0.0), ["tp=0", "pp=-1", "lr=0.0"]),
        (lambda: TrainerConfig(tp=2, dp=2, ep=3), ["etp*ep=1*3=3 does not divide tp*dp=2*2=4"]),
        (lambda: TrainerConfig(tp=2, dp=2, ep=2, etp=2, pp=0), ["pp=0 must be at least 1"]),
        (lambda: TrainerConfig(tp=1, dp=2, ep=2, etp=2), ["etp*ep=2*2=4 does not divide tp*dp=1*2=2"]),
        (
            lambda: ModelConfig(arch=" ", speculative_algorithm="", num_trained_mtp_layers=-2),
            ["arch must not be empty", "speculative_algorithm", "num_trained_mtp_layers=-2"],
        ),
        (lambda: ClusterConfig(num_cpus=0), ["num_cpus=0"]),
        (lambda: MilesSyncConfig(seed=-1, num_rounds=0, run_name="a/b"), ["seed=-1", "num_rounds=0", "'a/b'"]),
        (
            lambda: MilesSyncConfig(engines=EngineConfig(draft_kind=DraftKind.NONE)),
            ["model.speculative_algorithm='NEXTN' and engines.draft_kind='none' disagree"],
        ),
    ],
)
def test_records_validate_at_construction(make, parts):
    with pytest.raises(ValueError) as info:
        make()
    for part in parts:
        assert part in str(info.value)


def test_valid_parallel_layouts():
    assert TrainerConfig(tp=2, pp=2, dp=2, ep=4).world_size == 8
    assert TrainerConfig(tp=2, dp=1, ep=2).world_size == 2  # expert parallel across the tensor-parallel ranks
    assert TrainerConfig(tp=2, pp=1, ep=1).world_size == 2
    assert TrainerConfig(tp=1, pp=2).world_size == 2
    assert TrainerConfig(tp=2, dp=2, ep=2, etp=1).world_size == 4
    assert TrainerConfig(tp=2, dp=2, ep=2, etp=2).world_size == 4  # the expert grid fills the stage


def test_invalid_trainer_layout_is_refused_at_load_naming_each_factor():
    with pytest.raises(ValueError) as info:
        load_config(overrides=["trainer.tp=2", "trainer.dp=1", "trainer.ep=2", "trainer.etp=2"])
    message = str(info.value)
    assert message.startswith("invalid config: trainer: ")
    assert "etp*ep=2*2=4 does not divide tp*dp=2*1=2" in message
    assert "world_size=2 divisible by etp*ep*pp=4" in message
    with pytest.raises(ValueError, match="trainer: etp=0 must be at least 1"):
        load_config(overrides=["trainer.etp=0"])
    config = load_config(overrides=["trainer.dp=2", "trainer.ep=4", "trainer.etp=1"])
    assert (config.trainer.ep, config.trainer.etp, config.trainer.world_size) == (4, 1, 4)


def test_speculative_config_with_matching_draft_is_accepted():
    config = load_config(overrides=["model.speculative_algorithm=NGRAM", "engines.draft_kind=ngram"])
    assert config.model.speculative_algorithm == "NGRAM"


def test_the_draft_canary_is_refused_where_it_cannot_measure():
    config = load_config(overrides=["sync.draft_canary=hold", "sync.draft_canary_min_ratio=0.4"])
    assert config.sync.draft_canary is CanaryMode.HOLD and config.sync.draft_canary_min_ratio == 0.4
    with pytest.raises(ValueError, match="sync.draft_canary=warn measures a draft's accept length"):
        load_config(overrides=["sync.draft_canary=warn", "engines.draft_kind=none", "model.speculative_algorithm=null"])
    with pytest.raises(ValueError, match="mode=lora has no draft canary"):
        load_config(overrides=["sync.draft_canary=warn", "sync.mode=lora"])
    with pytest.raises(ValueError, match=r"draft_canary_min_ratio=1.5 is not in \(0, 1\]"):
        load_config(overrides=["sync.draft_canary_min_ratio=1.5"])


def test_records_are_frozen():
    config = MilesSyncConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sync.bucket_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        SyncConfig(TransportKind.COLOCATED)  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize(
    "overrides",
    [["+sync.extra=1"], ["~sync.verify"], ["sync.verify"], "sync.verify=false"],
)
def test_malformed_overrides_are_rejected(overrides):
    with pytest.raises(ValueError, match="overrides"):
        load_config(overrides=overrides)


def test_yaml_round_trip_through_a_file(tmp_path):
    config = load_config(
        overrides=[
            "sync.transport=colocated",
            "engines.count=2",
            "engines.urls=[http://127.0.0.1:1,http://127.0.0.1:2]",
            "model.speculative_algorithm=EAGLE",
            "engines.draft_kind=mtp",
            "trainer.lr=0.002",
            "run_name=round_trip",
        ]
    )
    (tmp_path / "saved.yaml").write_text(to_yaml(config))
    assert load_config(tmp_path, "saved") == config


def test_interpolation_is_resolved(tmp_path):
    text = (DEFAULT_CONFIG_DIR / "default.yaml").read_text().replace("run_name: default", "run_name: run_${seed}")
    (tmp_path / "interp.yaml").write_text(text)
    shutil.copytree(DEFAULT_CONFIG_DIR / "demo", tmp_path / "demo")
    assert load_config(tmp_path, "interp", overrides=["seed=7"]).run_name == "run_7"


def test_the_demo_group_overrides_the_defaults():
    demo = load_config(overrides=["demo=frozen_draft_bug", "num_rounds=3"])
    assert demo.sync.selector is SelectorMode.ALL and demo.engines.finalize_policy is FinalizePolicy.SGLANG
    assert not demo.sync.check_selector and not demo.sync.verify
    assert demo.run_name == "frozen_draft_bug" and demo.num_rounds == 3
    assert load_config(overrides=["demo=none"]) == load_config()
    ignored = load_config(overrides=["demo=selector_ignored"])
    assert ignored.engines.finalize_policy is FinalizePolicy.NO_SELECTOR and ignored.sync.verify
    assert ignored.sync.selector is SelectorMode.AUTO and ignored.sync.check_selector
    with pytest.raises(
        ValueError, match=r"demo=nope \(choices: \['frozen_draft_bug', 'none', 'selector_ignored'\]\) not found"
    ):
        load_config(overrides=["demo=nope"])


def test_file_errors(tmp_path):
    with pytest.raises(ValueError, match="config 'absent' not found"):
        load_config(tmp_path, "absent")
    (tmp_path / "broken.yaml").write_text("sync: [unclosed\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_config(tmp_path, "broken")
    (tmp_path / "listy.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config(tmp_path, "listy")
    (tmp_path / "typo.yaml").write_text("sync:\n  bucket_byte: 1\n")
    with pytest.raises(ValueError, match="unknown config key 'sync.bucket_byte'"):
        load_config(tmp_path, "typo")


def test_a_partial_file_takes_the_remaining_defaults(tmp_path):
    (tmp_path / "small.yaml").write_text("engines:\n  count: 4\n")
    assert load_config(tmp_path, "small") == MilesSyncConfig(engines=EngineConfig(count=4))


def test_to_config_accepts_a_hydra_composed_config():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(DEFAULT_CONFIG_DIR), version_base=None):
        cfg = compose(config_name="default", overrides=["sync.transport=colocated", "engines.count=2"])
    config = to_config(cfg)
    assert config.sync.transport is TransportKind.COLOCATED and config.engines.count == 2
    assert to_config(OmegaConf.to_container(cfg)) == config  # a plain mapping works too


def test_engine_tp_defaults_to_one_and_reaches_the_launch_settings(tmp_path):
    config = load_config()
    assert config.engines.tp == 1
    assert config.engines.launch_settings(model_dir="m").tp_size == 1
    config = load_config(overrides=["engines.tp=4", "engines.count=1"])
    assert config.engines.tp == 4
    assert config.engines.launch_settings(model_dir="m").tp_size == 4
    (tmp_path / "tp.yaml").write_text(to_yaml(config))
    assert load_config(tmp_path, "tp") == config


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("engines.tp=0", "invalid config: engines: tp=0 must be at least 1"),
        ("engines.tp=-2", "invalid config: engines: tp=-2 must be at least 1"),
        ("engines.tp=two", "config key 'engines.tp': Value 'two' of type 'str' could not be converted"),
    ],
)
def test_invalid_engine_tp_names_its_key(override, expected):
    with pytest.raises(ValueError) as info:
        load_config(overrides=[override])
    assert expected in str(info.value)


def test_the_run_report_records_the_engine_tp():
    from miles_sync.job.run_report import config_record

    assert config_record(load_config(overrides=["engines.tp=2"]))["engines"]["tp"] == 2


def test_raw_conversion_exports_every_family():
    sync = SyncConfig(conversion=ConversionMode.RAW)
    assert sync.conversion_problems(arch="qwen3_moe", num_trained_mtp_layers=1, num_experts=8) == []
    assert load_config(overrides=["model.num_trained_mtp_layers=1"]).sync.conversion is ConversionMode.RAW


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bridge_conversion_accepts_the_dense_families(arch):
    config = load_config(overrides=["sync.conversion=bridge", f"model.arch={arch}"])
    assert config.sync.conversion is ConversionMode.BRIDGE
    assert config.sync.conversion_problems(arch=arch, num_trained_mtp_layers=0) == []


@pytest.mark.parametrize(
    ("overrides", "feature"),
    [
        (["model.num_trained_mtp_layers=1"], "the MTP layer of qwen3 (model.num_trained_mtp_layers=1)"),
        (["model.arch=qwen3_moe"], "the MoE experts of qwen3_moe"),
        (["model.arch=deepseek_v3"], "the deepseek_v3 family (bridge mode covers llama, qwen2, qwen3)"),
    ],
)
def test_bridge_conversion_refuses_what_it_cannot_export_naming_feature_and_mode(overrides, feature):
    from importlib import metadata

    with pytest.raises(ValueError) as info:
        load_config(overrides=["sync.conversion=bridge", *overrides])
    message = str(info.value)
    assert f"sync.conversion=bridge cannot export {feature} on megatron-bridge " in message, message
    assert metadata.version("megatron-bridge") in message and "use sync.conversion=raw" in message


def test_bridge_conversion_reads_the_checkpoint_config():
    sync = SyncConfig(conversion=ConversionMode.BRIDGE)
    dense = {"model_type": "qwen3", "num_nextn_predict_layers": 1}
    assert sync.checkpoint_problems(dense, num_trained_mtp_layers=0) == []
    (mtp,) = sync.checkpoint_problems(dense, num_trained_mtp_layers=1)
    assert "the MTP layer of qwen3" in mtp
    for moe in ({"model_type": "qwen3_moe", "num_experts": 8}, {"model_type": "mixtral", "num_local_experts": 4}):
        (problem,) = sync.checkpoint_problems(moe, num_trained_mtp_layers=0)
        assert f"the MoE experts of {moe['model_type']} (" in problem and "experts per layer)" in problem
    assert (
        SyncConfig().checkpoint_problems({"model_type": "qwen3_moe", "num_experts": 8}, num_trained_mtp_layers=1) == []
    )


def test_trainer_layout_is_checked_against_the_checkpoint_model():
    """Layers per pipeline stage and experts per expert-parallel rank are known only from the checkpoint's
    config.json: the driver asks the trainer config before anything is placed, each problem naming its factors."""
    dense = {"model_type": "qwen3", "num_hidden_layers": 3}
    assert TrainerConfig(tp=2).checkpoint_problems(dense) == []
    (problem,) = TrainerConfig(tp=1, pp=2, dp=1).checkpoint_problems(dense)
    assert problem == "num_layers=3 is not divisible by pp=2"
    moe = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 6}
    assert TrainerConfig(tp=2, ep=2).checkpoint_problems(moe) == []
    (problem,) = TrainerConfig(tp=2, dp=2, ep=4).checkpoint_problems(moe)
    assert problem == "num_experts=6 is not divisible by ep=4"
