"""Runner storage contract: owned names, validated loads, the AITER finalize hook and its non-idempotence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_sync.engine.reference.checkpoints import CheckpointRecipe, LanguageRecipe, ModelShape, build_checkpoints
from miles_sync.engine.reference.models import read_safetensors
from miles_sync.engine.reference.runner import (
    Runner,
    load_mtp_runner,
    load_runners,
    load_standalone_runner,
    load_target_runner,
)
from miles_sync.weights.layout import WeightLayout, shuffle_weight
from miles_sync.wire.bucket import TensorMeta
from miles_sync.wire.protocol import Role

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    recipe = CheckpointRecipe(
        language=LanguageRecipe(vocab_size=64),
        target=ModelShape(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        ),
        # A different width from the target: target tensors selected into it must conflict by shape.
        draft=ModelShape(
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=16,
        ),
        target_steps=2,
        draft_steps=2,
        batch_size=4,
        seq_len=8,
    )
    return build_checkpoints(tmp_path_factory.mktemp("ckpt"), recipe)


IDS = torch.tensor([[1, 5, 9, 30, 2, 17, 40]])


def _logits(runner: Runner) -> torch.Tensor:
    with torch.inference_mode():
        return runner.model(IDS).logits.clone()


def _mtp_logits(mtp: Runner, target: Runner) -> torch.Tensor:
    with torch.inference_mode():
        out = target.model(IDS)
        shared = dict(embed_tokens=target.model.hf.model.embed_tokens, lm_head=target.model.hf.lm_head)
        head = mtp.model(IDS[:, 1:], out.hidden[:, :-1], **shared)
        return head.logits.clone()


def _snapshot(runner: Runner) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in runner.stored_tensors().items()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_owned_names_split_target_and_mtp(checkpoints: Path) -> None:
    tensors = read_safetensors(checkpoints / "target")
    target = load_target_runner(checkpoints / "target")
    mtp = load_mtp_runner(checkpoints / "target", target=target)

    assert target.role is Role.TARGET and mtp.role is Role.DRAFT and mtp.is_mtp
    mtp_names = {n for n in tensors if n.startswith("model.layers.2.")}
    assert mtp.owned_names() == mtp_names
    assert target.owned_names() == set(tensors) - mtp_names
    assert mtp.weights_lock is target.weights_lock
    assert "model.layers.2.eh_proj.weight" in mtp.linear_weight_names()
    assert "lm_head.weight" in target.linear_weight_names()


def test_expected_gives_meta_and_rejects_unknown_names(checkpoints: Path) -> None:
    target = load_target_runner(checkpoints / "target")
    assert target.expected("model.layers.0.self_attn.k_proj.weight") == TensorMeta(
        name="model.layers.0.self_attn.k_proj.weight", shape=(16, 32), dtype=torch.float32
    )
    with pytest.raises(ValueError, match="does not own tensor 'model.layers.2.eh_proj.weight'"):
        target.expected("model.layers.2.eh_proj.weight")


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.zeros(16, 31), r"got shape \(16, 31\) dtype float32"),
        (torch.zeros(16, 32, dtype=torch.bfloat16), r"got shape \(16, 32\) dtype bfloat16"),
    ],
)
@pytest.mark.parametrize("layout", [WeightLayout.NONE, WeightLayout.AITER])
def test_load_validates_everything_before_writing(
    checkpoints: Path, bad: torch.Tensor, message: str, layout: WeightLayout
) -> None:
    target = load_target_runner(checkpoints / "target", layout=layout)
    before, logits = _snapshot(target), _logits(target)
    name = "model.layers.1.self_attn.k_proj.weight"
    good = ("model.layers.0.mlp.up_proj.weight", torch.ones(64, 32))  # valid, listed first: must not be written
    with pytest.raises(ValueError, match=rf"{name}: expected shape \(16, 32\) dtype float32, " + message):
        target.load([good, (name, bad)])
    _assert_same(before, _snapshot(target))
    assert target.loaded_in_session() == frozenset()
    assert torch.equal(logits, _logits(target))


def test_load_keeps_only_owned_names_and_records_the_session(checkpoints: Path) -> None:
    tensors = read_safetensors(checkpoints / "target")
    target = load_target_runner(checkpoints / "target")
    mtp = load_mtp_runner(checkpoints / "target", target=target)
    epoch = mtp.weights_epoch

    loaded = mtp.load(tensors.items())

    assert set(loaded) == mtp.owned_names() and len(loaded) == len(mtp.owned_names())
    assert mtp.loaded_in_session() == mtp.owned_names()
    assert mtp.weights_epoch > epoch
    assert target.loaded_in_session() == frozenset()
    mtp.reset_session()
    assert mtp.loaded_in_session() == frozenset()
    assert mtp.load([("lm_head.weight", tensors["lm_head.weight"])]) == []  # the target's, not the draft's


def test_load_without_layout_is_live(checkpoints: Path) -> None:
    target = load_target_runner(checkpoints / "target")
    logits = _logits(target)
    name = "model.layers.0.mlp.down_proj.weight"
    target.load([(name, torch.zeros(32, 64))])
    assert not torch.equal(logits, _logits(target))
    assert target.stored_tensors()[name].data_ptr() == target.model.hf_parameters()[name].data_ptr()


def test_startup_stores_the_physical_layout_and_undoes_it_logically(checkpoints: Path) -> None:
    tensors = read_safetensors(checkpoints / "target")
    plain = load_target_runner(checkpoints / "target")
    target = load_target_runner(checkpoints / "target", layout=WeightLayout.AITER)

    assert target.shuffled_names() == target.linear_weight_names()
    stored, logical = target.stored_tensors(), target.logical_tensors()
    for name in target.owned_names():
        assert torch.equal(logical[name], tensors[name]), name
        physical = shuffle_weight(tensors[name]) if name in target.shuffled_names() else tensors[name]
        assert torch.equal(stored[name], physical), name
    assert torch.equal(_logits(target), _logits(plain))


def test_aiter_finalize_of_fresh_bytes_keeps_output_and_a_second_one_corrupts(checkpoints: Path) -> None:
    tensors = read_safetensors(checkpoints / "target")
    target = load_target_runner(checkpoints / "target", layout=WeightLayout.AITER)
    mtp = load_mtp_runner(checkpoints / "target", target=target, layout=WeightLayout.AITER)
    target_logits, mtp_logits = _logits(target), _mtp_logits(mtp, target)

    # A session: fresh logical bytes for both runners, each finalized once.
    for runner in (target, mtp):
        runner.reset_session()
        runner.load(tensors.items())
        runner.finalize(runner.loaded_in_session())
    assert torch.equal(_logits(target), target_logits)
    assert torch.equal(_mtp_logits(mtp, target), mtp_logits)

    # A session that sends the draft nothing but still finalizes it (the public bug): the target is intact,
    # the draft reads its weights through the wrong permutation.
    mtp.reset_session()
    mtp.finalize_all()
    assert torch.equal(_logits(target), target_logits)
    assert not torch.allclose(_mtp_logits(mtp, target), mtp_logits, atol=1e-3)
    eh_proj = "model.layers.2.eh_proj.weight"
    assert torch.equal(mtp.logical_tensors()[eh_proj], shuffle_weight(tensors[eh_proj]))


def test_finalize_writes_new_fresh_values_through_the_layout(checkpoints: Path) -> None:
    target = load_target_runner(checkpoints / "target", layout=WeightLayout.AITER)
    name = "model.layers.1.mlp.gate_proj.weight"
    fresh = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    target.load([(name, fresh)])
    target.finalize([name])
    assert torch.equal(target.model.hf_parameters()[name], fresh)
    assert torch.equal(target.stored_tensors()[name], shuffle_weight(fresh))
    assert torch.equal(target.logical_tensors()[name], fresh)


def test_finalize_without_layout_is_a_no_op(checkpoints: Path) -> None:
    target = load_target_runner(checkpoints / "target")
    before, logits = _snapshot(target), _logits(target)
    target.finalize_all()
    target.finalize_all()
    _assert_same(before, _snapshot(target))
    assert torch.equal(logits, _logits(target))


def test_finalize_rejects_unknown_names_before_changing_anything(checkpoints: Path) -> None:
    target = load_target_runner(checkpoints / "target", layout=WeightLayout.AITER)
    before = _snapshot(target)
    with pytest.raises(ValueError, match="model.layers.2.hnorm.weight"):
        target.finalize(["model.layers.0.self_attn.q_proj.weight", "model.layers.2.hnorm.weight"])
    _assert_same(before, _snapshot(target))


def test_mtp_reads_the_targets_embedding_and_lm_head(checkpoints: Path) -> None:
    target = load_target_runner(checkpoints / "target")
    mtp = load_mtp_runner(checkpoints / "target", target=target)
    before = _mtp_logits(mtp, target)
    target.load([("lm_head.weight", torch.zeros(64, 32))])
    assert torch.equal(_mtp_logits(mtp, target), torch.zeros_like(before))


def test_standalone_draft_rejects_target_tensors_by_shape(checkpoints: Path) -> None:
    tensors = read_safetensors(checkpoints / "target")
    draft = load_standalone_runner(checkpoints / "draft")
    before = _snapshot(draft)
    conflict = r"model\.embed_tokens\.weight: expected shape \(64, 48\) dtype float32, got shape \(64, 32\)"
    with pytest.raises(ValueError, match=conflict):
        draft.load(tensors.items())
    _assert_same(before, _snapshot(draft))


def test_load_runners_validates_its_arguments(checkpoints: Path) -> None:
    with pytest.raises(ValueError, match="'eagle'"):
        load_runners(checkpoints / "target", draft_kind="eagle")
    with pytest.raises(ValueError, match="required for 'standalone'"):
        load_runners(checkpoints / "target", draft_kind="standalone")
    with pytest.raises(ValueError, match="has no MTP layer"):
        load_runners(checkpoints / "draft", draft_kind="mtp")
    target, draft = load_runners(checkpoints / "target", draft_kind="standalone", draft_path=checkpoints / "draft")
    assert draft.role is Role.DRAFT and draft.weights_lock is target.weights_lock
    assert load_runners(checkpoints / "target", draft_kind="ngram")[1] is None


def test_missing_checkpoint_tensors_are_named(checkpoints: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = read_safetensors(checkpoints / "target")
    del tensors["model.norm.weight"]
    (tmp_path / "config.json").write_text((checkpoints / "target" / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 tensor.*model.norm.weight"):
        load_target_runner(tmp_path)
