"""Run export cases in local gloo process groups: the machinery behind the parity CLI and the multiproc tests.

`run_cases` spawns `world_size` processes on 127.0.0.1 (rendezvous through a TCPStore the caller's process hosts
on an OS-chosen port), runs every case in order inside the same group (imports are paid once), and leaves per-case
files in `workdir/case{i}/`:

- `export.rank{r}.pt`: {HF name: tensor} exported by stage source rank r;
- `logits.pt`: {"input_ids", "logits"} from the last stage (vocabulary padding trimmed);
- `roundtrip.rank{r}.pt`: the export after importing the first export back (when `round_trip`);
- `everywhere.rank{r}.pt`: what every rank received exporting with `source_rank_only=False` (when `everywhere`);
- `local.rank{r}.pt`: every rank's own pieces, [(HF name, dim, start, end, tensor)] (when `local`).
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_sync.env import LOOPBACK_HOST, adopt_bind_host
from miles_sync.megatron.parallel_layout import parallel_layout_problems
from miles_sync.transport.group import start_store_server
from miles_sync.wire.text import raise_if

_HOST = LOOPBACK_HOST
_MODES = ("raw", "bridge")


@dataclass(frozen=True, kw_only=True)
class ParityCase:
    """One tiny model and one parallel layout. world_size / (tp * pp) is the data-parallel size."""

    arch: str
    mode: str = "raw"
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None: tp (megatron-core's default)
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 4
    mtp_layers: int = 0
    vocab_size: int = 250  # not a multiple of 128: every case exercises vocabulary padding
    tie_word_embeddings: bool = False
    seed: int = 0
    checkpoint_dir: str | None = None  # import this HF checkpoint instead of keeping megatron's random init
    round_trip: bool = False  # also import the export back into a fresh model and export again
    everywhere: bool = False  # also export with source_rank_only=False (every rank saves what it received)
    local: bool = (
        False  # also save each rank's own pieces, converted with no gather (export.megatron.iter_local_pieces)
    )
    dtype: str = "float32"  # megatron parameter dtype; "bfloat16" also exports every tensor as bfloat16

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def validate(self, *, world_size: int) -> None:
        """Raise ValueError naming every inconsistent field (unsupported arch first, with the supported list)."""
        from miles_sync.export.raw import check_arch

        check_arch(self.arch)
        is_moe = self.arch == "qwen3_moe"
        problems = []
        if self.mode not in _MODES:
            problems.append(f"mode={self.mode!r} (one of {', '.join(_MODES)})")
        for name in ("hidden_size", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} (must be >= 1)")
        if self.mtp_layers < 0:
            problems.append(f"mtp_layers={self.mtp_layers} (must be >= 0)")
        if self.dtype not in ("float32", "bfloat16"):
            problems.append(f"dtype={self.dtype!r} (float32 or bfloat16)")
        raise_if(problems, what="invalid parity case")
        # The trainer config checks the same rules with the same words (miles_sync.megatron.parallel_layout).
        problems = parallel_layout_problems(
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
            etp=self.etp,
            world_size=world_size,
            num_layers=self.num_layers,
            num_experts=self.num_experts if is_moe else None,
        )
        if self.num_heads % self.num_kv_heads or (self.tp >= 1 and self.num_kv_heads % self.tp):
            problems.append(
                f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, tp={self.tp} "
                "(kv heads must divide heads and be divisible by tp)"
            )
        if self.hidden_size % self.num_heads:
            problems.append(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
        if self.ep > 1 and not is_moe:
            problems.append(f"ep={self.ep} needs an MoE arch, got arch={self.arch!r}")
        raise_if(problems, what="invalid parity case")


def tiny_hf_config(case: ParityCase) -> Any:
    """The transformers config of the case's tiny model (built locally, nothing downloaded)."""
    import transformers

    common = dict(
        vocab_size=case.vocab_size,
        hidden_size=case.hidden_size,
        intermediate_size=2 * case.hidden_size,
        num_hidden_layers=case.num_layers,
        num_attention_heads=case.num_heads,
        num_key_value_heads=case.num_kv_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.05,
        tie_word_embeddings=case.tie_word_embeddings,
    )
    if case.mtp_layers > 0:
        common["num_nextn_predict_layers"] = case.mtp_layers  # DeepSeek-V3's key, read by the engines and builder
    head_dim = case.hidden_size // case.num_heads
    if case.arch == "llama":
        return transformers.LlamaConfig(**common, head_dim=head_dim)
    if case.arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if case.arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=head_dim)  # Qwen3Config defaults head_dim to 128
    if case.arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            head_dim=head_dim,
            num_experts=case.num_experts,
            num_experts_per_tok=2,
            moe_intermediate_size=case.hidden_size // 2,
            decoder_sparse_step=1,
            # The first layer stays dense, so a case covers dense and MoE layers side by side.
            mlp_only_layers=[0] if case.num_layers > 1 else [],
            norm_topk_prob=True,
        )
    from miles_sync.export.raw import check_arch

    check_arch(case.arch)  # raises the ValueError naming the supported archs
    raise AssertionError(case.arch)


def run_cases(
    cases: Sequence[ParityCase], *, world_size: int, workdir: str | Path, timeout_s: float = 300.0
) -> list[Path]:
    """Run `cases` in one freshly spawned gloo group of `world_size` processes; returns each case's directory.

    Raises RuntimeError with the failing rank's traceback if any process fails, TimeoutError past `timeout_s`
    (every process is stopped either way).
    """
    for case in cases:
        case.validate(world_size=world_size)
    workdir = Path(workdir)
    case_dirs = [workdir / f"case{i}" for i in range(len(cases))]
    for d in case_dirs:
        d.mkdir(parents=True, exist_ok=True)
    store = start_store_server(host=_HOST, timeout_s=timeout_s)
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(
            target=_worker,
            args=(rank, world_size, store.port, list(cases), [str(d) for d in case_dirs], timeout_s),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in processes:
        p.start()
    try:
        _join(processes, workdir=workdir, timeout_s=timeout_s)
    finally:
        for p in processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    return case_dirs


def _join(processes: list, *, workdir: Path, timeout_s: float) -> None:
    # Stop at the first failed rank: its peers would otherwise sit in a collective until the timeout.
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in processes):
        if any(p.exitcode not in (None, 0) for p in processes):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"export cases did not finish within {timeout_s} s")
        time.sleep(0.05)
    failed = [rank for rank, p in enumerate(processes) if p.exitcode not in (None, 0)]
    if failed:
        errors = sorted(workdir.glob("case*/error.rank*.txt"))
        detail = "\n".join(e.read_text() for e in errors) or "(no traceback written)"
        raise RuntimeError(f"export worker ranks {failed} failed:\n{detail}")


def _worker(
    rank: int, world_size: int, port: int, cases: list[ParityCase], case_dirs: list[str], timeout_s: float
) -> None:
    # Pin gloo to loopback before it creates any device; this process talks to no other host.
    adopt_bind_host(_HOST)
    torch.set_num_threads(1)
    # megatron-core warns at import that TE and Apex are absent (expected here), a dozen lines per process.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(_HOST, port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    from miles_sync.megatron.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    current = None
    try:
        for case, case_dir in zip(cases, case_dirs, strict=True):
            current = Path(case_dir)
            _run_case(case, current, timeout_s=timeout_s)
    except BaseException:
        if current is not None:
            (current / f"error.rank{rank}.txt").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def _run_case(case: ParityCase, case_dir: Path, *, timeout_s: float) -> None:
    from megatron.core import parallel_state as ps

    from miles_sync.export.loader import load_hf_checkpoint
    from miles_sync.export.raw import create_converter
    from miles_sync.megatron.forward import megatron_logits

    rank = dist.get_rank()
    ps.initialize_model_parallel(
        case.tp, case.pp, expert_model_parallel_size=case.ep, expert_tensor_parallel_size=case.etp
    )
    try:
        hf_config = tiny_hf_config(case)
        converter = create_converter(case.arch, hf_config)
        model = _build(case, hf_config, seed=case.seed)
        if case.checkpoint_dir is not None:
            load_hf_checkpoint(model, case.checkpoint_dir, converter=converter)
        exported = _export(case, model, converter, hf_config=hf_config, timeout_s=timeout_s)
        if exported is not None:
            torch.save(exported, case_dir / f"export.rank{rank}.pt")
        if case.everywhere:
            received = _export(case, model, converter, hf_config=hf_config, timeout_s=timeout_s, everywhere=True)
            torch.save(received, case_dir / f"everywhere.rank{rank}.pt")
        if case.local:
            from miles_sync.export.megatron import iter_local_pieces

            pieces = [
                (p.hf_name, p.dim, p.start, p.end, p.tensor.clone())
                for _, unit_pieces in iter_local_pieces(model, converter=converter)
                for p in unit_pieces
            ]
            torch.save(pieces, case_dir / f"local.rank{rank}.pt")
        input_ids = torch.randint(0, case.vocab_size, (2, 12), generator=torch.Generator().manual_seed(case.seed))
        logits = megatron_logits(model, input_ids, timeout_s=timeout_s)
        if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            torch.save(
                {"input_ids": input_ids, "logits": logits[..., : case.vocab_size].clone()}, case_dir / "logits.pt"
            )
        if case.round_trip:
            dist.barrier()
            if rank == 0:
                write_hf_checkpoint(merge_exports(case_dir, "export"), hf_config, case_dir / "hf")
            dist.barrier()
            fresh = _build(case, hf_config, seed=case.seed + 1)
            load_hf_checkpoint(fresh, case_dir / "hf", converter=converter)
            again = _export(case, fresh, converter, hf_config=hf_config, timeout_s=timeout_s)
            if again is not None:
                torch.save(again, case_dir / f"roundtrip.rank{rank}.pt")
        dist.barrier()
    finally:
        ps.destroy_model_parallel()


def merge_exports(case_dir: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Union of the per-source-rank export files `prefix.rank*.pt`; a name exported twice is an error."""
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(Path(case_dir).glob(f"{prefix}.rank*.pt")):
        for name, tensor in torch.load(path).items():
            if name in merged:
                raise ValueError(f"{name} was exported by more than one stage ({path.name})")
            merged[name] = tensor
    return merged


def write_hf_checkpoint(tensors: dict[str, torch.Tensor], hf_config: Any, out_dir: Path) -> None:
    """An HF checkpoint directory: config.json plus one model.safetensors."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(out_dir))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))


def _build(case: ParityCase, hf_config: Any, *, seed: int) -> torch.nn.Module:
    from miles_sync.megatron.model_builder import build_gpt_model

    torch.manual_seed(seed)
    model = build_gpt_model(hf_config, dtype=case.torch_dtype, mtp_num_layers=case.mtp_layers)
    _perturb(model, case=case, seed=seed)
    return model


def _perturb(model: torch.nn.Module, *, case: ParityCase, seed: int) -> None:
    # megatron initializes norms to one, biases to zero and every EP rank's local experts from the same stream,
    # which would hide swapped norms, dropped biases or misnumbered experts. Add noise seeded by the canonical
    # name and shard rank: the same on every replica of a tensor, different between tensors.
    from megatron.core import parallel_state as ps

    from miles_sync.export.stage import collect_local_params

    tp_rank, etp_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    num_local = max(1, case.num_experts // case.ep)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for record in collect_local_params([model]):
            is_tied_copy = record.canonical in ("embedding.word_embeddings.weight", "output_layer.weight")
            if is_tied_copy and case.tie_word_embeddings and case.pp > 1:
                continue  # megatron made the two stages' copies equal at build; keep them equal
            name = record.canonical
            shard = tp_rank
            if record.is_expert:
                name = name.format(expert=ps.get_expert_model_parallel_rank() * num_local + record.local_expert)
                shard = etp_rank
            if record.partition_dim is None:
                shard = 0
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{name}#{shard}".encode()))
            param = params[record.local_name]
            param.add_(0.05 * torch.randn(param.shape, generator=generator, dtype=torch.float32).to(param.dtype))


def _export(
    case: ParityCase, model, converter, *, hf_config: Any, timeout_s: float, everywhere: bool = False
) -> dict[str, torch.Tensor] | None:
    from miles_sync.export.megatron import export_metadata, is_export_source, iter_hf_units

    if case.mode == "bridge":
        from miles_sync.export import bridge

        units = list(bridge.iter_hf_units(model, hf_config=hf_config, source_rank_only=not everywhere))
    else:
        # A bf16 model's local-spec norms stay fp32 in megatron; export it uniformly, as a bf16 checkpoint holds it.
        dtype = None if case.torch_dtype is torch.float32 else case.torch_dtype
        units = list(
            iter_hf_units(model, converter=converter, source_rank_only=not everywhere, dtype=dtype, timeout_s=timeout_s)
        )
        metadata = export_metadata(model, converter=converter, dtype=dtype)
        assert [u.meta for u in units] == metadata, "export_metadata differs from the exported stream"
    if not everywhere and not is_export_source():
        assert all(u.tensors is None for u in units), "a non-source rank received tensors"
        return None
    exported = {}
    for unit in units:
        for meta, (name, tensor) in zip(unit.meta.tensors, unit.named(), strict=True):
            assert tuple(tensor.shape) == meta.shape and tensor.dtype == meta.dtype, (name, tensor.shape, meta)
            exported[name] = tensor.clone()
    return exported
