"""Tensor-parallel reference models over real gloo groups: every TP rank is its own process on 127.0.0.1.

One spawn of 4 processes serves both scenario sets (importing transformers costs seconds per process): ranks 0 and
1 first run TP=2 over a subgroup (target, MTP head, standalone draft, both layouts, loads), then all four run TP=4
over the default group (KV heads replicated). Each rank writes what it computed and checked to a file that the
tests below read. The TP=1 reference is the unsharded `models.CausalLM`/`MTPHead` through `runner.load_runners` on
the same cached checkpoints.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from miles_sync.engine.reference.models import CausalLM, model_family, read_config, read_safetensors
from miles_sync.engine.reference.parallel_models import ShardedCausalLM, ShardedMTPHead
from miles_sync.engine.reference.runner import load_runners
from miles_sync.engine.reference.sharded import ShardedRunner, load_sharded_runners
from miles_sync.env import adopt_bind_host
from miles_sync.transport.group import start_store_server
from miles_sync.weights.engine_layout import rank_engine_tensors, shard_tensor
from miles_sync.weights.layout import WeightLayout, layout_spec
from miles_sync.wire.protocol import Role

TIMEOUT_S = 60.0
_PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers.models.qwen3.modeling_qwen3",
    "miles_sync.engine.reference.sharded",
]
# float32 logits of the TP=1 and TP=2/4 forwards differ only by the summation order of the row-parallel all-reduce
# (measured ~1e-6 here); the bound leaves two orders of magnitude.
LOGIT_ATOL = 1e-4
IDS = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(7))
LAYOUTS = (WeightLayout.NONE, WeightLayout.AITER)
# Target (hidden 128, 4 heads x 32, 2 KV heads, intermediate 384, vocab 256) at TP=2: per rank 2 q heads (64 rows),
# 1 KV head (32 rows), 192 intermediate rows, 128 vocabulary rows, 64 o_proj input columns.
K_NAME = "model.layers.0.self_attn.k_proj.weight"
QKV_NAME = "model.layers.0.self_attn.qkv_proj.weight"
UP_NAME = "model.layers.1.mlp.up_proj.weight"
GATE_UP_NAME = "model.layers.1.mlp.gate_up_proj.weight"
O_NAME = "model.layers.1.self_attn.o_proj.weight"
EMBED_NAME = "model.embed_tokens.weight"


# ---- rank processes ---------------------------------------------------------------------------------------------


def _rank_main(rank: int, world_size: int, port: int, checkpoints: str, out_dir: str) -> None:
    adopt_bind_host("127.0.0.1")  # this process's groups bind loopback
    torch.set_num_threads(1)
    timeout = timedelta(seconds=TIMEOUT_S)
    out = Path(out_dir)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        pair = dist.new_group([0, 1], timeout=timeout)  # every rank takes part in creating it
        result = {}
        if rank < 2:
            result["tp2"] = _tp2(Path(checkpoints), tp_rank=rank, tp_size=2, group=pair)
        # Ranks 2 and 3 load their TP=4 shards meanwhile, then wait in the first collective.
        result["tp4"] = _tp4(Path(checkpoints), tp_rank=rank, tp_size=world_size)
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"error.rank{rank}.txt").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(*, world_size: int, checkpoints: Path, out_dir: Path) -> tuple[list[dict], float]:
    """Run the scenarios on `world_size` rank processes; each rank's result dict, and the wall time."""
    started = time.monotonic()
    store = start_store_server(host="127.0.0.1", timeout_s=TIMEOUT_S)
    # Fresh processes forked from a server that imported torch and transformers once (several seconds a process on
    # a small machine); none of them inherits this process's threads or distributed state.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    processes = [
        context.Process(target=_rank_main, args=(rank, world_size, store.port, str(checkpoints), str(out_dir)))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + 2 * TIMEOUT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)
    errors = "\n".join(p.read_text() for p in sorted(out_dir.glob("error.rank*.txt")))
    exit_codes = [p.exitcode for p in processes]
    assert exit_codes == [0] * world_size, f"rank exit codes {exit_codes}:\n{errors or '(no traceback written)'}"
    results = [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world_size)]
    return results, time.monotonic() - started


def _forward(target: ShardedRunner, draft: ShardedRunner) -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        out = target.model(IDS)
        if draft.is_mtp:
            head = draft.model(
                IDS[:, 1:], out.hidden[:, :-1], embed_tokens=target.model.embed_tokens, lm_head=target.model.lm_head
            )
            return {"target": out.logits, "hidden": out.hidden, "mtp": head.logits}
        return {"draft": draft.model(IDS).logits}


def _shard_mismatches(runner: ShardedRunner, tensors: dict[str, torch.Tensor], layout: WeightLayout) -> list[str]:
    """Differences between the runner's stored tensors and `rank_engine_tensors` of the full checkpoint tensors."""
    expected = rank_engine_tensors(
        {name: tensors[name] for name in runner.owned_names()},
        shape=runner.shape,
        tp_rank=runner.tp_rank,
        tp_size=runner.tp_size,
        layout=layout,
    )
    stored = runner.stored_tensors()
    if expected.keys() != stored.keys():
        return [f"{runner.role.value}: names differ {sorted(expected.keys() ^ stored.keys())}"]
    return [
        f"{runner.role.value}/{layout.value}: {name}"
        for name in sorted(stored)
        if not torch.equal(expected[name], stored[name])
    ]


def _changed_rows(before: torch.Tensor, after: torch.Tensor) -> list[int]:
    return (before != after).reshape(before.shape[0], -1).any(dim=1).nonzero().flatten().tolist()


def _tp2(checkpoints: Path, *, tp_rank: int, tp_size: int, group) -> dict:
    """Forwards, shards and loads at TP=2 over `group`, in both layouts."""
    tensors = read_safetensors(checkpoints / "target")
    draft_tensors = read_safetensors(checkpoints / "draft")
    tp = {"tp_rank": tp_rank, "tp_size": tp_size}
    grouped = {**tp, "group": group}
    result: dict = {"logits": {}, "shard_mismatches": []}
    runners = {}
    for layout in LAYOUTS:
        target, mtp = load_sharded_runners(checkpoints / "target", draft_kind="mtp", layout=layout, **grouped)
        _, draft = load_sharded_runners(
            checkpoints / "target", draft_kind="standalone", draft_path=checkpoints / "draft", layout=layout, **grouped
        )
        result["logits"][layout.value] = {**_forward(target, mtp), **_forward(target, draft)}
        for runner, source in ((target, tensors), (mtp, tensors), (draft, draft_tensors)):
            result["shard_mismatches"] += _shard_mismatches(runner, source, layout)
        runners[layout] = target
        result.setdefault("shuffled", {})[layout.value] = sorted(target.shuffled_names() | mtp.shuffled_names())

    # A full tensor whose shape is this rank's slice is refused by name; nothing is written.
    target = runners[WeightLayout.NONE]
    before = {name: t.clone() for name, t in target.stored_tensors().items()}
    local_k = shard_tensor(K_NAME, tensors[K_NAME], shape=target.shape, **tp).clone()
    try:
        target.load([(K_NAME, local_k)])
        result["mismatch_error"] = None
    except ValueError as error:
        result["mismatch_error"] = str(error)
    result["untouched_after_refusal"] = all(torch.equal(before[n], t) for n, t in target.stored_tensors().items())

    # Modified full tensors: only this rank's slice of each lands, in its region of the fused parameter.
    modified = {name: tensors[name] + 1.0 for name in (K_NAME, UP_NAME, O_NAME, EMBED_NAME)}
    target.reset_session()
    epoch = target.weights_epoch
    result["loaded"] = target.load([*modified.items(), ("not.a.tensor", torch.zeros(1))])
    stored = target.stored_tensors()
    result["epoch_bumped"] = target.weights_epoch > epoch
    result["changed_rows"] = {name: _changed_rows(before[name], stored[name]) for name in stored}
    result["changed_columns"] = {
        name: (before[name] != stored[name]).any(dim=0).nonzero().flatten().tolist()
        for name in stored
        if stored[name].dim() == 2
    }
    full = {**tensors, **modified}
    result["load_mismatches"] = _shard_mismatches(target, full, WeightLayout.NONE)
    result["partially_loaded"] = target.partially_loaded()
    k_param = target.model.hf.model.layers[0].self_attn.k_proj.weight
    result["compute_view_live"] = torch.equal(k_param, shard_tensor(K_NAME, modified[K_NAME], shape=target.shape, **tp))

    # With the layout, a whole q/k/v load is shuffled once by finalize; the compute view follows only then.
    target = runners[WeightLayout.AITER]
    target.reset_session()
    qkv = [K_NAME.replace("k_proj", part) for part in ("q_proj", "k_proj", "v_proj")]
    target.load([(name, full[name]) for name in qkv])
    result["aiter_partially_loaded"] = target.partially_loaded()
    k_param = target.model.hf.model.layers[0].self_attn.k_proj.weight
    new_k = shard_tensor(K_NAME, full[K_NAME], shape=target.shape, **tp)
    result["aiter_view_before_finalize"] = torch.equal(k_param, new_k)
    target.finalize(target.loaded_in_session())
    result["aiter_view_after_finalize"] = torch.equal(k_param, new_k)
    result["aiter_load_mismatches"] = _shard_mismatches(target, {**tensors, K_NAME: full[K_NAME]}, WeightLayout.AITER)
    return result


def _tp4(checkpoints: Path, *, tp_rank: int, tp_size: int) -> dict:
    """KV heads replicated at TP=4 (2 KV heads): shards in both layouts, and the forwards."""
    tensors = read_safetensors(checkpoints / "target")
    result: dict = {"shard_mismatches": []}
    for layout in LAYOUTS:
        target, mtp = load_sharded_runners(
            checkpoints / "target", draft_kind="mtp", layout=layout, tp_rank=tp_rank, tp_size=tp_size
        )
        result["shard_mismatches"] += _shard_mismatches(target, tensors, layout) + _shard_mismatches(
            mtp, tensors, layout
        )
        if layout is WeightLayout.NONE:
            result["logits"] = _forward(target, mtp)
            local_k = target.model.hf_parameters()[K_NAME]
            full_k = tensors[K_NAME]
            rows = local_k.shape[0]
            result["kv_block"] = [
                block for block in range(full_k.shape[0] // rows) if torch.equal(local_k, full_k[block * rows :][:rows])
            ]
            result["local_shapes"] = {name: tuple(p.shape) for name, p in target.model.hf_parameters().items()}
    return result


# ---- the TP=1 reference and the spawned runs --------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(reference_checkpoints: Path) -> dict[str, torch.Tensor]:
    """Logits of the unsharded models (TP=1 `runner.Runner`s)."""
    target, mtp = load_runners(reference_checkpoints / "target", draft_kind="mtp")
    _, draft = load_runners(
        reference_checkpoints / "target", draft_kind="standalone", draft_path=reference_checkpoints / "draft"
    )
    with torch.inference_mode():
        out = target.model(IDS)
        head = mtp.model(
            IDS[:, 1:],
            out.hidden[:, :-1],
            embed_tokens=target.model.hf.model.embed_tokens,
            lm_head=target.model.hf.lm_head,
        )
        return {"target": out.logits, "hidden": out.hidden, "mtp": head.logits, "draft": draft.model(IDS).logits}


@pytest.fixture(scope="module")
def ranks(reference_checkpoints: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    results, seconds = _spawn(world_size=4, checkpoints=reference_checkpoints, out_dir=tmp_path_factory.mktemp("tp"))
    print(f"4 rank processes, TP=2 then TP=4 scenarios: {seconds:.1f} s")
    return results


@pytest.fixture(scope="module")
def tp2(ranks: list[dict]) -> list[dict]:
    return [result["tp2"] for result in ranks[:2]]


@pytest.fixture(scope="module")
def tp4(ranks: list[dict]) -> list[dict]:
    return [result["tp4"] for result in ranks]


def _assert_matches(name: str, sharded: torch.Tensor, reference: torch.Tensor) -> None:
    """Within LOGIT_ATOL of the TP=1 output and, for logits, the same greedy token at every position."""
    assert sharded.shape == reference.shape, name
    diff = (sharded - reference).abs().max().item()
    print(f"{name}: max |diff| vs TP=1 = {diff:.3g}")
    assert diff < LOGIT_ATOL, f"{name}: max |diff| {diff} >= {LOGIT_ATOL}"
    if not name.endswith("hidden"):
        assert torch.equal(sharded.argmax(-1), reference.argmax(-1)), f"{name}: greedy tokens differ from TP=1"


# ---- TP=2 -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [layout.value for layout in LAYOUTS])
@pytest.mark.parametrize("model", ["target", "hidden", "mtp", "draft"])
def test_tp2_forwards_match_tp1(tp2, reference, layout: str, model: str):
    for rank, result in enumerate(tp2):
        _assert_matches(f"tp2 rank {rank} {layout} {model}", result["logits"][layout][model], reference[model])
    # Every rank computes the same full output.
    assert torch.equal(tp2[0]["logits"][layout][model], tp2[1]["logits"][layout][model])


def test_tp2_stored_tensors_are_the_engine_shards(tp2):
    for result in tp2:
        assert result["shard_mismatches"] == []
        assert result["shuffled"]["none"] == []
        # Every linear engine weight of this target and head at TP=2 has a shape the AITER shuffle takes.
        assert (
            QKV_NAME in result["shuffled"]["aiter"] and "model.layers.2.eh_proj.weight" in result["shuffled"]["aiter"]
        )


def test_tp2_load_refuses_a_rank_sized_tensor_before_writing(tp2):
    for result in tp2:
        assert f"{K_NAME}: expected shape (64, 128) dtype float32, got shape (32, 128)" in result["mismatch_error"]
        assert result["untouched_after_refusal"]


def test_tp2_load_writes_exactly_the_rank_slices(tp2):
    for rank, result in enumerate(tp2):
        assert result["loaded"] == [K_NAME, UP_NAME, O_NAME, EMBED_NAME] and result["epoch_bumped"]
        changed = {name: rows for name, rows in result["changed_rows"].items() if rows}
        # k rows follow the rank's 2 q heads (64 rows); up rows follow its 192 gate rows; o_proj's rank columns and
        # the embedding's 128 vocabulary rows are the whole local tensor.
        assert changed == {
            QKV_NAME: list(range(64, 96)),
            GATE_UP_NAME: list(range(192, 384)),
            O_NAME: list(range(128)),
            EMBED_NAME: list(range(128)),
        }, rank
        assert result["changed_columns"][O_NAME] == list(range(64))
        assert result["load_mismatches"] == []
        assert result["partially_loaded"] == [QKV_NAME, GATE_UP_NAME]
        assert result["compute_view_live"]


def test_tp2_layout_load_reaches_the_compute_view_at_finalize(tp2):
    for result in tp2:
        assert result["aiter_partially_loaded"] == []
        assert not result["aiter_view_before_finalize"] and result["aiter_view_after_finalize"]
        assert result["aiter_load_mismatches"] == []


# ---- TP=4: KV heads replicated ----------------------------------------------------------------------------------


def test_tp4_replicates_kv_heads_and_matches_tp1(tp4, reference):
    # 2 KV heads over 4 ranks: ranks 0, 1 keep head 0 and ranks 2, 3 head 1 (SGLang's replication).
    assert [result["kv_block"] for result in tp4] == [[0], [0], [1], [1]]
    for rank, result in enumerate(tp4):
        assert result["shard_mismatches"] == []
        shapes = result["local_shapes"]
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 128)
        assert shapes[K_NAME] == (32, 128) and shapes["model.embed_tokens.weight"] == (64, 128)
        for model in ("target", "hidden", "mtp"):
            _assert_matches(f"tp4 rank {rank} {model}", result["logits"][model], reference[model])


# ---- in-process: refusals and TP=1 ------------------------------------------------------------------------------


def test_load_sharded_runners_refuses_indivisible_tp_sizes(reference_checkpoints: Path):
    target, draft = reference_checkpoints / "target", reference_checkpoints / "draft"
    with pytest.raises(ValueError, match=r"target model .*num_attention_heads=4 is not divisible by tp_size=3"):
        load_sharded_runners(target, tp_rank=0, tp_size=3)
    with pytest.raises(ValueError) as refused:
        load_sharded_runners(target, draft_kind="standalone", draft_path=draft, tp_rank=0, tp_size=4)
    message = str(refused.value)
    assert "standalone draft model" in message and "num_attention_heads=2 is not divisible by tp_size=4" in message
    assert "target model" not in message  # the target splits at 4
    with pytest.raises(ValueError, match=r"tp_rank=2 must be in \[0, tp_size=2\)"):
        ShardedCausalLM(read_config(target), tp_rank=2, tp_size=2)
    # No group of 2 here (whether or not another test left a default group of 1 in this process).
    with pytest.raises(ValueError, match="needs an initialized torch.distributed process group|expected tp_size=2"):
        ShardedMTPHead(read_config(target), tp_rank=0, tp_size=2)


def test_tp1_is_the_unsharded_model_with_a_padded_vocabulary():
    """At TP=1 no collective runs: a vocabulary of 100 (padded to 128) and biased q/k/v (qwen2) match exactly."""
    config = model_family("qwen2").config_class(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    reference = CausalLM(config, seed=3).eval()
    sharded = ShardedRunner(role=Role.TARGET, model=ShardedCausalLM(config, tp_rank=0, tp_size=1))
    assert sharded.owned_names() == set(reference.hf_parameters())
    assert sharded.expected("model.embed_tokens.weight").shape == (100, 64)
    sharded.load((name, p.detach()) for name, p in reference.hf_parameters().items())
    embed = sharded.stored_tensors()["model.embed_tokens.weight"]
    assert tuple(embed.shape) == (128, 64) and not embed[100:].any()  # padding rows are zero
    assert "model.layers.0.self_attn.qkv_proj.bias" in sharded.stored_tensors()
    ids = torch.tensor([[1, 99, 42, 7, 0]])
    with torch.inference_mode():
        expected, got = reference(ids), sharded.model(ids)
    assert torch.equal(expected.logits, got.logits) and torch.equal(expected.hidden, got.hidden)


def test_runner_finalize_and_overwrite_keep_the_compute_view_decoded(reference_checkpoints: Path):
    target, _ = load_sharded_runners(reference_checkpoints / "target", layout=WeightLayout.AITER, tp_rank=0, tp_size=1)
    spec = layout_spec(WeightLayout.AITER)
    q_param = target.model.hf.model.layers[0].self_attn.q_proj.weight
    with pytest.raises(ValueError, match="cannot finalize tensors it does not own: nope"):
        target.finalize([K_NAME, "nope"])
    physical = torch.rand(target.stored_tensors()[QKV_NAME].shape)
    target.overwrite([(QKV_NAME, physical)])
    assert torch.equal(target.stored_tensors()[QKV_NAME], physical) and not target.loaded_in_session()
    assert torch.equal(q_param, spec.undo(physical)[: q_param.shape[0]])
    # finalize is not idempotent: a second shuffle of the same bytes changes the compute view.
    target.finalize([K_NAME])
    assert torch.equal(target.stored_tensors()[QKV_NAME], spec.apply(physical))
    assert not torch.equal(q_param, spec.undo(physical)[: q_param.shape[0]])
    with pytest.raises(ValueError, match="cannot overwrite: nope: not an engine parameter"):
        target.overwrite([("nope", physical)])
