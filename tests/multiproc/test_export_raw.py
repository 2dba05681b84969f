"""Raw export across real gloo process groups: megatron-core (TP, PP, EP; MTP; tied) -> HF tensors.

One group of two spawned processes runs every case (imports are paid once): export parity against the matching
transformers model (strict load, logits within 1e-5 in fp32), HF checkpoint -> megatron -> export bit-exactness,
export -> import -> export bit-exactness, and MTP names/shapes plus loading into the reference engine's MTP runner.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_sync.parity.cli import LOGIT_TOLERANCE, check_case, expected_mtp_shapes, first_difference, split_mtp
from miles_sync.parity.harness import ParityCase, merge_exports, run_cases, tiny_hf_config, write_hf_checkpoint

# Slow as a module: export parity over the parallel matrix in gloo processes (this file and its bridge or raw
# twin take about a minute together). The unit tier covers the conversion rules without processes.
pytestmark = pytest.mark.slow


DENSE = ("llama", "qwen2", "qwen3")
ALL_ARCHS = (*DENSE, "qwen3_moe")

EXPORT_CASES = [
    *(
        ParityCase(arch=arch, tp=tp, pp=pp, everywhere=tp == 2, local=tp == 2)
        for arch in DENSE
        for tp, pp in ((1, 1), (2, 1), (1, 2))
    ),
    ParityCase(arch="qwen3_moe", ep=2, everywhere=True, local=True),
    ParityCase(arch="qwen3_moe", tp=2),
    ParityCase(arch="qwen3", pp=2, tie_word_embeddings=True, round_trip=True),
    ParityCase(arch="qwen2", tp=2, tie_word_embeddings=True),
    # bf16 over gloo, cast to one dtype on export (megatron keeps local-spec norms in fp32), bit-exact round trip.
    ParityCase(arch="qwen2", tp=2, dtype="bfloat16", round_trip=True),
    ParityCase(arch="qwen3_moe", ep=2, dtype="bfloat16", round_trip=True),
]
MTP_CASES = [
    ParityCase(arch="qwen3", tp=2, mtp_layers=1, round_trip=True),
    # MTP on the last stage reads the embedding the first stage owns.
    ParityCase(arch="llama", pp=2, mtp_layers=1, round_trip=True),
    ParityCase(arch="qwen3_moe", ep=2, mtp_layers=1, round_trip=True),
]
CHECKPOINT_LAYOUTS = ((2, 1), (1, 2))


def _label(case: ParityCase) -> str:
    extra = "-tied" if case.tie_word_embeddings else ""
    extra += f"-mtp{case.mtp_layers}" if case.mtp_layers else ""
    extra += "-bf16" if case.dtype == "bfloat16" else ""
    return f"{case.arch}-tp{case.tp}-pp{case.pp}-ep{case.ep}{extra}"


def _make_checkpoint(arch: str, out_dir: Path) -> Path:
    # transformers from config, noised so no norm is all ones and no bias all zeros, saved the standard way.
    import transformers

    config = tiny_hf_config(ParityCase(arch=arch))
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[ParityCase, Path]]:
    root = tmp_path_factory.mktemp("export_raw")
    checkpoints = {arch: _make_checkpoint(arch, root / f"hf_{arch}") for arch in ALL_ARCHS}
    checkpoint_cases = [
        ParityCase(arch=arch, tp=tp, pp=pp, seed=3, checkpoint_dir=str(checkpoints[arch]))
        for arch in ALL_ARCHS
        for tp, pp in CHECKPOINT_LAYOUTS
    ]
    cases = [*EXPORT_CASES, *MTP_CASES, *checkpoint_cases]
    dirs = run_cases(cases, world_size=2, workdir=root / "runs", timeout_s=600)
    return {f"{'ckpt-' if c.checkpoint_dir else ''}{_label(c)}": (c, d) for c, d in zip(cases, dirs, strict=True)}


@pytest.mark.parametrize("case", EXPORT_CASES, ids=_label)
def test_export_matches_transformers(results, case: ParityCase) -> None:
    case, case_dir = results[_label(case)]
    result = check_case(case, case_dir)
    assert result.is_ok, result.summary()
    exported = merge_exports(case_dir, "export")
    assert {t.dtype for t in exported.values()} == {case.torch_dtype}
    if case.dtype == "float32":
        assert result.max_abs_logit_diff <= LOGIT_TOLERANCE
    # Strict: exactly the transformers model's tensors (a tied lm_head is the embedding, not exported twice).
    import transformers

    with torch.device("meta"):
        names = set(transformers.AutoModelForCausalLM.from_config(tiny_hf_config(case)).state_dict())
    if case.tie_word_embeddings:
        names.discard("lm_head.weight")
    assert set(exported) == names


@pytest.mark.parametrize("case", [c for c in EXPORT_CASES if c.local], ids=_label)
def test_each_rank_converts_its_own_shards_into_slices_of_the_gathered_export(results, case: ParityCase) -> None:
    """No gather: every rank's own pieces (its TP shard, or its EP rank's experts, converted alone) are bit-exact
    slices of what the gathered export holds, and together they cover every exported tensor."""
    _, case_dir = results[_label(case)]
    exported = merge_exports(case_dir, "export")
    covered: dict[str, set[tuple[int | None, int, int]]] = {}
    for path in sorted(case_dir.glob("local.rank*.pt")):
        for name, dim, start, end, tensor in torch.load(path):
            expected = exported[name] if dim is None else exported[name].narrow(dim, start, end - start)
            assert torch.equal(tensor, expected), (path.name, name, dim, start, end)
            covered.setdefault(name, set()).add((dim, start, end))
    assert covered.keys() == exported.keys()
    for name, spans in covered.items():
        if (None, 0, 0) in spans:
            continue
        (dim,) = {d for d, _, _ in spans}
        position = 0
        for start, end in sorted((s, e) for _, s, e in spans):
            assert start == position, (name, sorted(spans))
            position = end
        assert position == exported[name].shape[dim], (name, sorted(spans))


@pytest.mark.parametrize("arch", ALL_ARCHS)
@pytest.mark.parametrize("layout", CHECKPOINT_LAYOUTS, ids=lambda tp_pp: f"tp{tp_pp[0]}-pp{tp_pp[1]}")
def test_checkpoint_round_trip_is_bit_exact(results, arch: str, layout: tuple[int, int]) -> None:
    tp, pp = layout
    case, case_dir = results[f"ckpt-{arch}-tp{tp}-pp{pp}-ep1"]
    result = check_case(case, case_dir)  # compares every exported tensor with the checkpoint, bit for bit
    assert result.is_ok, result.summary()
    from safetensors.torch import load_file

    original = load_file(str(Path(case.checkpoint_dir) / "model.safetensors"))
    assert first_difference(original, merge_exports(case_dir, "export"), what="round trip") is None


@pytest.mark.parametrize("case", MTP_CASES, ids=_label)
def test_mtp_names_shapes_and_round_trip(results, case: ParityCase) -> None:
    case, case_dir = results[_label(case)]
    result = check_case(case, case_dir)  # main model vs transformers, MTP names/shapes, export-import-export
    assert result.is_ok, result.summary()
    _, mtp = split_mtp(merge_exports(case_dir, "export"), num_layers=case.num_layers)
    expected = expected_mtp_shapes(tiny_hf_config(case), num_mtp_layers=case.mtp_layers)
    assert {n: tuple(t.shape) for n, t in mtp.items()} == expected
    n = case.num_layers
    for part, shape in (("enorm", (64,)), ("hnorm", (64,)), ("eh_proj", (64, 128)), ("shared_head.norm", (64,))):
        assert expected[f"model.layers.{n}.{part}.weight"] == shape


@pytest.mark.parametrize("case", [c for c in MTP_CASES if c.arch in DENSE], ids=_label)
def test_mtp_export_loads_into_reference_mtp_runner(results, case: ParityCase, tmp_path: Path) -> None:
    from miles_sync.engine.reference.runner import load_runners

    case, case_dir = results[_label(case)]
    exported = merge_exports(case_dir, "export")
    write_hf_checkpoint(exported, tiny_hf_config(case), tmp_path)
    target, draft = load_runners(tmp_path, draft_kind="mtp")
    _, mtp = split_mtp(exported, num_layers=case.num_layers)
    assert draft.owned_names() == frozenset(mtp)
    stored = draft.stored_tensors()
    for name, tensor in mtp.items():
        assert torch.equal(stored[name], tensor), name


def test_checks_catch_swapped_and_corrupted_tensors(results) -> None:
    # The parity checks can fail: swapping k/v of one layer moves the logits far past the tolerance, and a single
    # changed element is named by the bit-exact comparison.
    import transformers

    case, case_dir = results["qwen2-tp1-pp2-ep1"]
    exported = merge_exports(case_dir, "export")
    swapped = dict(exported)
    k, v = "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight"
    swapped[k], swapped[v] = exported[v], exported[k]
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(case), attn_implementation="eager")
    model.load_state_dict(swapped, strict=True)
    saved = torch.load(case_dir / "logits.pt")
    with torch.no_grad():
        diff = (model(saved["input_ids"]).logits - saved["logits"]).abs().max().item()
    assert diff > 100 * LOGIT_TOLERANCE
    corrupted = dict(exported)
    name = "model.layers.0.mlp.up_proj.weight"
    corrupted[name] = exported[name].clone()
    corrupted[name][3, 5] += 1e-3
    assert first_difference(exported, corrupted, what="test").startswith(name + ": values differ")
