"""`TrainerWorker` on tp x pp x dp x ep layouts over real gloo groups: every layout takes the same steps as one rank.

One set of 4 rank processes runs every scenario in turn (importing megatron-core and transformers costs seconds a
process): for each, the first `world_size` ranks build TrainerWorkers (rank 0 hosts the store and hands its port to
the others), take two REINFORCE steps on one fixed batch, and export their stage's full HF tensors (every rank,
`source_rank_only=False`, so each data-parallel replica is checked, not only the source). The reference of each
model is the same run on one rank. Models: the cached dense reference checkpoint (qwen3, 2 layers; its MTP layer is
not trained) and a tiny random qwen3_moe checkpoint made here (2 MoE layers, 4 experts, top-2). MoE layouts with
tp > 1 train with sequence parallelism (and the batch's longest sequence, 12 tokens, has 11 labels, so they also
pad the sequence to a multiple of tp).
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from miles_sync.config import TrainerConfig

TIMEOUT_S = 90.0
NUM_PROCESSES = 4
NUM_STEPS = 2
LR = 1e-4
_PRELOAD = ["torch", "torch.distributed", "transformers", "megatron.core", "megatron.core.models.gpt"]
# Lengths differ (padding and uneven data-parallel shares are part of the check), rewards too.
BATCH_SPEC = (
    ((5, 17, 42, 99, 3, 250, 7, 8, 64, 12), 4, 1.0),
    ((200, 1, 2, 3, 4, 5, 6), 2, 0.0),
    ((9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 30), 5, 0.5),
    ((11, 22, 33, 44, 55, 66, 77, 88), 3, -0.25),
    ((101, 102, 103, 104, 105, 106), 1, 2.0),
)
# Losses: reduction order only (TP all-reduces, summed DP shares), float32: ~1e-7 relative.
LOSS_RTOL = 1e-5
# Weights after two Adam steps (lr 1e-4), every element: measured max |diff| 7.5e-7 (dense tp=2 pp=2). Adam moves an
# element by about lr * sign(g) at first, so an element whose gradient were within float noise of zero could differ
# by up to 2 * lr between layouts; none is on these models and batch, and the bound would catch one.
WEIGHT_ATOL = 1e-5


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str  # "dense" or "moe"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


SCENARIOS = (
    Scenario("dense_ref", "dense"),
    Scenario("dense_tp2_pp2", "dense", tp=2, pp=2),
    Scenario("dense_pp2", "dense", pp=2),
    Scenario("moe_ref", "moe"),
    Scenario("moe_dp2_ep2", "moe", dp=2, ep=2),
    Scenario("moe_pp2_dp2_ep2", "moe", pp=2, dp=2, ep=2),
    Scenario("moe_dp4_ep2", "moe", dp=4, ep=2),  # expert data parallelism: 2 replicas of each expert
    Scenario("moe_dp2_etp2", "moe", dp=2, etp=2),  # expert tensor parallelism across the data-parallel ranks
    # Sequence parallelism: the norms' and router's gradients summed over TP, the allgather dispatcher over TP x EP.
    Scenario("moe_tp2_ep2", "moe", tp=2, ep=2),
    Scenario("moe_tp2_pp2_ep2", "moe", tp=2, pp=2, ep=2),
    # The dense checkpoint in bfloat16: what the sync exports (build_exporter, as ModelSource does) is in its dtype.
    Scenario("bf16_tp2", "dense_bf16", tp=2),
)
COMPARED = tuple(s for s in SCENARIOS if s.model in ("dense", "moe") and not s.name.endswith("_ref"))


def _batch():
    from miles_sync.job.trainer import TrainBatch

    return TrainBatch(
        sequences=tuple(s for s, _, _ in BATCH_SPEC),
        num_prompt_tokens=tuple(n for _, n, _ in BATCH_SPEC),
        rewards=tuple(r for _, _, r in BATCH_SPEC),
    )


# ---- rank processes ---------------------------------------------------------------------------------------------


def _rank_main(rank: int, ports: list, checkpoints: dict[str, str], out_dir: str) -> None:
    from miles_sync.env import adopt_bind_host

    adopt_bind_host("127.0.0.1")  # this process's groups bind loopback
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    out = Path(out_dir)
    try:
        for scenario in SCENARIOS:
            if rank < scenario.world_size:
                result = _run(
                    scenario, rank=rank, port_queue=ports[scenario.name], checkpoint=checkpoints[scenario.model]
                )
                torch.save(result, out / f"{scenario.name}.rank{rank}.pt")
    except BaseException:
        (out / f"error.rank{rank}.txt").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def _run(scenario: Scenario, *, rank: int, port_queue, checkpoint: str) -> dict:
    import transformers

    from miles_sync.export.megatron import iter_hf_units
    from miles_sync.export.raw import create_converter
    from miles_sync.job.trainer import TrainerWorker

    layout = TrainerConfig(tp=scenario.tp, pp=scenario.pp, dp=scenario.dp, ep=scenario.ep, etp=scenario.etp, lr=LR)
    worker = TrainerWorker(rank=rank, trainer=layout, checkpoint_dir=checkpoint, timeout_s=TIMEOUT_S)
    if rank == 0:
        port = worker.host_store(host="127.0.0.1")
        for _ in range(scenario.world_size - 1):
            port_queue.put(port)
    else:
        port = port_queue.get(timeout=TIMEOUT_S)
    try:
        worker.setup(master_address="127.0.0.1", master_port=port)
        steps = [worker.train_step(_batch()) for _ in range(NUM_STEPS)]
        hf_config = transformers.AutoConfig.from_pretrained(checkpoint)
        converter = create_converter(hf_config.model_type, hf_config)
        weights = {}
        for unit in iter_hf_units(worker.model, converter=converter, source_rank_only=False, timeout_s=TIMEOUT_S):
            weights.update({name: tensor.clone() for name, tensor in unit.named()})
        return {
            "steps": steps,
            "weights": weights,
            "sequence_parallel": worker.model.config.sequence_parallel,
            "sync_dtypes": _sync_dtypes(worker.model, hf_config) if scenario.model == "dense_bf16" else None,
        }
    finally:
        worker.shutdown()


def _sync_dtypes(model, hf_config) -> dict[str, tuple[str, ...]]:
    """The dtypes of what a sync sends (ModelSource's exporter): its metadata's, and the source rank's tensors'."""
    from miles_sync.export.registry import ConversionMode, build_exporter

    units, metadata = build_exporter(model, hf_config=hf_config, conversion=ConversionMode.RAW, timeout_s=TIMEOUT_S)
    sent = [str(t.dtype) for unit in units() if unit.tensors is not None for t in unit.tensors]
    return {"metadata": tuple(sorted({str(t.dtype) for u in metadata for t in u.tensors})), "sent": tuple(sent)}


def _write_bf16_checkpoint(source: Path, out_dir: Path) -> Path:
    import json

    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(source / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    return out_dir


def _write_moe_checkpoint(out_dir: Path) -> Path:
    import transformers

    from miles_sync.parity.harness import ParityCase, tiny_hf_config

    config = tiny_hf_config(ParityCase(arch="qwen3_moe", num_layers=2, num_experts=4, vocab_size=256))
    config.mlp_only_layers = []  # both layers MoE: every pipeline stage holds experts
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


@pytest.fixture(scope="module")
def layout_runs(reference_checkpoints: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Every scenario's per-rank results; prints each scenario's per-step seconds (rank 0's)."""
    out_dir = tmp_path_factory.mktemp("trainer_layouts")
    checkpoints = {
        "dense": str(reference_checkpoints / "target"),
        "moe": str(_write_moe_checkpoint(out_dir / "moe_checkpoint")),
        "dense_bf16": str(_write_bf16_checkpoint(reference_checkpoints / "target", out_dir / "bf16_checkpoint")),
    }
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    ports = {scenario.name: context.Queue() for scenario in SCENARIOS}
    processes = [
        context.Process(target=_rank_main, args=(rank, ports, checkpoints, str(out_dir)))
        for rank in range(NUM_PROCESSES)
    ]
    started = time.monotonic()
    for process in processes:
        process.start()
    deadline = started + 4 * TIMEOUT_S
    # Stop at the first failed rank: its peers would otherwise sit in a collective until the timeout.
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in processes):
            break
        time.sleep(0.1)
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(5)
    errors = "\n".join(p.read_text() for p in sorted(out_dir.glob("error.rank*.txt")))
    exit_codes = [p.exitcode for p in processes]
    assert exit_codes == [0] * NUM_PROCESSES, f"rank exit codes {exit_codes}:\n{errors or '(no traceback written)'}"
    runs = {
        s.name: [torch.load(out_dir / f"{s.name}.rank{r}.pt", weights_only=False) for r in range(s.world_size)]
        for s in SCENARIOS
    }
    print(f"\ntrainer layouts: {time.monotonic() - started:.1f} s for all scenarios")
    for name, ranks in runs.items():
        print(f"  {name}: step seconds {[round(step.seconds, 3) for step in ranks[0]['steps']]}")
    return runs


# ---- tests --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("scenario", COMPARED, ids=lambda s: s.name)
def test_layout_takes_the_single_rank_steps(scenario: Scenario, layout_runs: dict[str, list[dict]]) -> None:
    reference = layout_runs[f"{scenario.model}_ref"][0]
    ranks = layout_runs[scenario.name]
    for rank, result in enumerate(ranks):
        # Every rank reports the same (last stage's, data-parallel-summed) numbers.
        assert _same_numbers(result["steps"], ranks[0]["steps"]), rank
    for mine, ref in zip(ranks[0]["steps"], reference["steps"], strict=True):
        assert mine.step == ref.step and mine.num_tokens == ref.num_tokens
        assert mine.loss == pytest.approx(ref.loss, rel=LOSS_RTOL, abs=1e-7)
        assert mine.mean_token_nll == pytest.approx(ref.mean_token_nll, rel=LOSS_RTOL)
    covered = set()
    for rank, result in enumerate(ranks):
        for name, tensor in result["weights"].items():
            expected = reference["weights"][name]
            worst = (tensor - expected).abs().max().item()
            assert worst <= WEIGHT_ATOL, f"rank {rank} {name}: max |diff| {worst:.3g} > {WEIGHT_ATOL}"
            covered.add(name)
    assert covered == set(reference["weights"]), sorted(covered ^ set(reference["weights"]))


@pytest.mark.slow
def test_training_moves_the_weights(layout_runs: dict[str, list[dict]]) -> None:
    # Guards the comparison above against a trainer that takes no step at all.
    for name in ("dense_ref", "moe_ref"):
        steps = layout_runs[name][0]["steps"]
        assert steps[0].loss != steps[1].loss and steps[0].mean_token_nll != steps[1].mean_token_nll, name


@pytest.mark.slow
def test_sequence_parallelism_is_on_for_moe_under_tensor_parallelism_only(layout_runs: dict[str, list[dict]]) -> None:
    # Dense models keep it off, so their layouts train exactly as before.
    for scenario in SCENARIOS:
        expected = scenario.model == "moe" and scenario.tp > 1
        assert [r["sequence_parallel"] for r in layout_runs[scenario.name]] == [expected] * scenario.world_size


@pytest.mark.slow
def test_a_bf16_trainer_syncs_every_tensor_in_the_checkpoints_dtype(layout_runs: dict[str, list[dict]]) -> None:
    # megatron's local-spec norms stay float32 under bf16; an engine holding the bf16 checkpoint refuses float32.
    ranks = layout_runs["bf16_tp2"]
    assert {dtype for r in ranks for dtype in r["sync_dtypes"]["metadata"]} == {"torch.bfloat16"}
    sent = ranks[0]["sync_dtypes"]["sent"]  # rank 0 is the source: it holds the full tensors
    assert sent and set(sent) == {"torch.bfloat16"}
    assert any(t.dtype == torch.float32 for r in ranks for t in r["weights"].values())  # the norms, as trained


def _same_numbers(a, b) -> bool:
    return all(x.loss == y.loss and x.mean_token_nll == y.mean_token_nll for x, y in zip(a, b, strict=True))


# ---- refused layouts ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "words"),
    [
        (dict(tp=2, dp=1, ep=4), "etp*ep=1*4=4 does not divide tp*dp=2*1=2"),
        (dict(tp=1, pp=0), "pp=0 must be at least 1"),
        (dict(tp=2, dp=2, ep=2, etp=4), "etp*ep=4*2=8 does not divide tp*dp=2*2=4"),
    ],
)
def test_invalid_layouts_are_refused_before_any_process(sizes: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("*", r"\*")):
        TrainerConfig(**sizes)


def test_trainer_worker_names_the_rank_and_micro_batch_factors() -> None:
    from miles_sync.job.trainer import TrainerWorker

    layout = TrainerConfig(tp=2, pp=2, dp=1, ep=2)
    with pytest.raises(
        ValueError, match=r"rank=4 is outside \[0, 4\) \(tp\*pp\*dp\).*micro_batch_size=0.*collective_timeout_s=0"
    ):
        TrainerWorker(rank=4, trainer=layout, checkpoint_dir="unused", micro_batch_size=0, collective_timeout_s=0)
    TrainerWorker(rank=3, trainer=layout, checkpoint_dir="unused")  # pp and ep above 1 are accepted
