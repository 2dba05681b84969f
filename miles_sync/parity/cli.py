"""Parity check users run before a big job: megatron-core export vs the transformers model, on local gloo ranks.

    python -m miles_sync.parity --arch qwen3 --mode raw --tp 2 --pp 1 --ep 1

builds the tiny model across the fewest local processes that hold the layout (pp * lcm(tp, etp * ep), which is
tp * pp * ep with the default etp = tp), exports it, loads the export into the matching transformers model
(strict: no missing or extra tensors), compares logits with megatron's, imports the export back into a fresh
megatron model and exports again (bit-exact). The last line printed is
`max_abs_logit_diff=<float> tensors=<count> OK`, or the same with `FAIL <first mismatching tensor>: <why>`
(exit status 1).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_sync.megatron.parallel_layout import smallest_world_size
from miles_sync.parity.harness import ParityCase, merge_exports, run_cases, tiny_hf_config

LOGIT_TOLERANCE = 1e-5  # fp32; observed differences are ~1e-6 (TP changes reduction order) or exactly 0
# bf16 activations round differently in megatron and transformers; the check then guards against layout errors only.
BF16_LOGIT_TOLERANCE = 5e-2

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True, kw_only=True)
class ParityResult:
    """Outcome of one case. `first_mismatch` names the first failing tensor (or "logits") and why; None if OK."""

    max_abs_logit_diff: float
    num_tensors: int
    first_mismatch: str | None

    @property
    def is_ok(self) -> bool:
        return self.first_mismatch is None

    def summary(self) -> str:
        verdict = "OK" if self.is_ok else f"FAIL {self.first_mismatch}"
        return f"max_abs_logit_diff={self.max_abs_logit_diff:.3e} tensors={self.num_tensors} {verdict}"


def split_mtp(tensors: dict[str, torch.Tensor], *, num_layers: int) -> tuple[dict, dict]:
    """(main model tensors, MTP tensors): MTP layers are `model.layers.{N}.*` with N >= num_layers."""
    main, mtp = {}, {}
    for name, tensor in tensors.items():
        match = _LAYER_NAME.fullmatch(name)
        (mtp if match is not None and int(match[1]) >= num_layers else main)[name] = tensor
    return main, mtp


def expected_mtp_shapes(hf_config: Any, *, num_mtp_layers: int) -> dict[str, tuple[int, ...]]:
    """Names and shapes the MTP layers must export: DeepSeek-V3 naming over the family's last decoder layer."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    num_layers, hidden = hf_config.num_hidden_layers, hf_config.hidden_size
    template = f"model.layers.{num_layers - 1}."  # megatron builds MTP layers from the last decoder layer's spec
    layer = {n[len(template) :]: tuple(t.shape) for n, t in model.state_dict().items() if n.startswith(template)}
    expected = {}
    for k in range(num_mtp_layers):
        prefix = f"model.layers.{num_layers + k}."
        expected.update({prefix + n: s for n, s in layer.items()})
        expected.update(
            {
                prefix + "enorm.weight": (hidden,),
                prefix + "hnorm.weight": (hidden,),
                prefix + "eh_proj.weight": (hidden, 2 * hidden),
                prefix + "shared_head.norm.weight": (hidden,),
            }
        )
    return expected


def check_case(case: ParityCase, case_dir: Path) -> ParityResult:
    """Compare one case's exported tensors and megatron logits (files left by `run_cases`) with transformers."""
    import transformers

    hf_config = tiny_hf_config(case)
    exported = merge_exports(case_dir, "export")
    main, mtp = split_mtp(exported, num_layers=case.num_layers)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, dtype=case.torch_dtype, attn_implementation="eager"
    )
    problem = _strict_load(model, main, hf_config=hf_config)
    if problem is None:
        problem = _compare_shapes(mtp, expected_mtp_shapes(hf_config, num_mtp_layers=case.mtp_layers), what="MTP")
    diff = float("nan")
    if problem is None:
        saved = torch.load(case_dir / "logits.pt")
        with torch.no_grad():
            logits = model(saved["input_ids"]).logits
        diff = (logits.float() - saved["logits"].float()).abs().max().item()
        tolerance = LOGIT_TOLERANCE if case.torch_dtype is torch.float32 else BF16_LOGIT_TOLERANCE
        if not diff <= tolerance:
            problem = f"logits: max abs difference {diff:.3e} exceeds {tolerance:.0e}"
    if problem is None and case.checkpoint_dir is not None:
        from safetensors.torch import load_file

        problem = first_difference(
            load_file(str(Path(case.checkpoint_dir) / "model.safetensors")),
            exported,
            what="checkpoint -> megatron -> export",
        )
    if problem is None and case.round_trip:
        problem = first_difference(exported, merge_exports(case_dir, "roundtrip"), what="export -> import -> export")
    if problem is None and case.everywhere:
        problem = _check_everywhere(exported, case_dir)
    return ParityResult(max_abs_logit_diff=diff, num_tensors=len(exported), first_mismatch=problem)


def first_difference(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], *, what: str) -> str | None:
    """First tensor (sorted by name) that is missing, extra, or not bit-identical, with the reason; else None."""
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            return f"{name}: missing after {what}"
        if name not in expected:
            return f"{name}: unexpected after {what}"
        a, b = expected[name], actual[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{name}: {tuple(a.shape)} {a.dtype} became {tuple(b.shape)} {b.dtype} after {what}"
        if not torch.equal(a, b):
            return f"{name}: values differ after {what} (max abs {(a.float() - b.float()).abs().max().item():.3e})"
    return None


def _check_everywhere(exported: dict[str, torch.Tensor], case_dir: Path) -> str | None:
    # Every rank holds its whole stage: each file is a subset of the source export, together they cover it.
    covered: set[str] = set()
    for path in sorted(case_dir.glob("everywhere.rank*.pt")):
        received = torch.load(path)
        if not received:
            return f"{path.name}: a rank received no tensors with source_rank_only=False"
        unknown = sorted(set(received) - set(exported))
        if unknown:
            return f"{unknown[0]}: received with source_rank_only=False, never exported to the source"
        problem = first_difference({n: exported[n] for n in received}, received, what=f"export to {path.stem}")
        if problem is not None:
            return problem
        covered |= set(received)
    missing = sorted(set(exported) - covered)
    return None if not missing else f"{missing[0]}: no rank received it with source_rank_only=False"


def _strict_load(model: torch.nn.Module, tensors: dict[str, torch.Tensor], *, hf_config: Any) -> str | None:
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    tied_keys = getattr(model, "_tied_weights_keys", None)
    tied = set(tied_keys) if hf_config.tie_word_embeddings and tied_keys is not None else set()
    problem = _compare_shapes(tensors, {n: s for n, s in expected.items() if n not in tied}, what="transformers")
    if problem is not None:
        return problem
    # A tied lm_head is the embedding itself: fill the alias the way from_pretrained ties it, then load strictly.
    state = dict(tensors)
    for name in tied:
        state[name] = tensors["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return None


def _compare_shapes(actual: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], *, what: str) -> str | None:
    for name in sorted(set(actual) | set(expected)):
        if name not in actual:
            return f"{name}: the {what} model has it, the export does not"
        if name not in expected:
            return f"{name}: exported, but the {what} model has no such tensor"
        if tuple(actual[name].shape) != expected[name]:
            return f"{name}: exported shape {tuple(actual[name].shape)}, the {what} model needs {expected[name]}"
    return None


def _parse(argv: list[str] | None) -> tuple[ParityCase, float]:
    parser = argparse.ArgumentParser(prog="python -m miles_sync.parity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", required=True, help="llama, qwen2, qwen3 or qwen3_moe")
    parser.add_argument("--mode", choices=("raw", "bridge"), default="raw")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: tp)")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--num-experts", type=int, default=4)
    parser.add_argument("--mtp-layers", type=int, default=0)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    case = ParityCase(
        arch=args.arch,
        mode=args.mode,
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        etp=args.etp,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        num_experts=args.num_experts,
        mtp_layers=args.mtp_layers,
        tie_word_embeddings=args.tie_word_embeddings,
        seed=args.seed,
        round_trip=True,
    )
    return case, args.timeout_s


def main(argv: list[str] | None = None) -> int:
    from miles_sync.export.raw import check_arch

    try:
        case, timeout_s = _parse(argv)
        check_arch(case.arch)
        world_size = smallest_world_size(tp=case.tp, pp=case.pp, ep=case.ep, etp=case.etp)
        case.validate(world_size=world_size)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    etp = case.tp if case.etp is None else case.etp
    print(
        f"parity: arch={case.arch} mode={case.mode} tp={case.tp} pp={case.pp} ep={case.ep} etp={etp} "
        f"world_size={world_size} mtp_layers={case.mtp_layers}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="miles_sync_parity_") as workdir:
        try:
            (case_dir,) = run_cases([case], world_size=world_size, workdir=workdir, timeout_s=timeout_s)
            result = check_case(case, case_dir)
        except (RuntimeError, TimeoutError) as e:
            print(str(e), file=sys.stderr)
            print(f"max_abs_logit_diff=nan tensors=0 FAIL run: {str(e).splitlines()[0]}")
            return 1
    print(result.summary())
    return 0 if result.is_ok else 1


if __name__ == "__main__":
    sys.exit(main())
