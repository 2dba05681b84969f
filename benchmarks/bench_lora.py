"""LoRA adapter syncs against full syncs of the same model into the same engine, in one run.

    python benchmarks/bench_lora.py [--models qwen3-22m-deep,...] [--rank 16] [--repeats N] [--json PATH]

Per model (the BF16 Qwen3 checkpoints of _sync_models.py): one reference engine serving LoRA adapters
(`--enable-lora`, rank room `--rank`, q/k/v/o and gate/up/down projections) is synced twice over, by a SyncController
each: a full colocated sync of every base weight (an in-process Sender, verify on), then a LoRA sync of a random
rank-`--rank` PEFT adapter on every target module (`/load_lora_adapter_from_tensors`, the engine checks the expected
checksums). Colocated on both sides, since adapters travel through shared memory only. Reported per case, from the
median sync of `--repeats` after one warm-up: bytes sent, tensors, the sync wall and its pause window.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _sync_models import MODELS, checkpoint_dir, pause_window_s, sync_series, tensor_sender  # noqa: E402

from miles_sync.engine.process import EngineLauncher
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.engine.reference.models import read_safetensors
from miles_sync.engine.settings import LoraSettings
from miles_sync.env import read_environment
from miles_sync.sync.adapter import AdapterPayload, encode_adapter
from miles_sync.sync.report import SyncReport
from miles_sync.sync.weight_source import WeightSource

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def log(message: str) -> None:
    print(f"[bench_lora {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def random_adapter(tensors: dict[str, torch.Tensor], *, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """PEFT tensors (lora_A [rank, in], lora_B [out, rank], the base's dtype) for every TARGETS linear weight."""
    generator = torch.Generator().manual_seed(seed)
    adapter = {}
    for name, weight in tensors.items():
        module = name.removesuffix(".weight")
        if weight.dim() != 2 or module.rsplit(".", 1)[-1] not in TARGETS:
            continue
        out_features, in_features = weight.shape
        peft = f"base_model.model.{module}"
        for part, shape in (("lora_A", (rank, in_features)), ("lora_B", (out_features, rank))):
            adapter[f"{peft}.{part}.weight"] = (0.01 * torch.randn(shape, generator=generator)).to(weight.dtype)
    return adapter


class AdapterSource(WeightSource):
    """The controller's view of a trainer exporting an adapter: a fresh random adapter per sync (as a step would
    produce), kept alive until the controller releases it."""

    syncs_adapters = True

    def __init__(self, tensors: dict[str, torch.Tensor], *, rank: int) -> None:
        self._tensors = tensors
        self._rank = rank
        self._seed = 0
        self._kept: list[torch.Tensor] | None = None

    async def adapter_payload(self, *, tp_sizes) -> AdapterPayload:
        self._seed += 1
        config = {"peft_type": "LORA", "r": self._rank, "lora_alpha": 2 * self._rank, "target_modules": list(TARGETS)}
        adapter = random_adapter(self._tensors, rank=self._rank, seed=self._seed)
        payload, self._kept = encode_adapter(adapter, config_dict=config, tp_sizes=tp_sizes, flatten_min_bytes=0)
        return payload

    async def release_adapter(self) -> None:
        self._kept = None

    async def close(self) -> None:
        self._kept = None


def case_row(case: str, reports: Sequence[SyncReport]) -> dict:
    report = sorted(reports, key=lambda r: r.total_s)[len(reports) // 2]
    return {
        "case": case,
        "bytes": report.num_bytes,
        "tensors": report.num_tensors,
        "sync_s": report.total_s,
        "pause_window_s": pause_window_s(report),
        "verification": report.verification,
    }


def bench_model(name: str, *, cache: Path, rank: int, repeats: int, log_dir: Path) -> dict:
    model_dir = checkpoint_dir(MODELS[name], cache)
    tensors = read_safetensors(model_dir)
    lora = LoraSettings(max_rank=rank, target_modules=TARGETS)
    with ExitStack() as stack:
        launcher = EngineLauncher(spec=ReferenceEngineSpec(model_dir=str(model_dir), lora=lora), log_dir=log_dir)
        stack.callback(launcher.stop)
        launcher.start()
        log(f"{name}: full sync x{repeats}")
        full_source = tensor_sender(tensors, transport="colocated")
        full = case_row("full", sync_series([launcher.url], full_source, transport="colocated", repeats=repeats))
        log(f"{name}: LoRA rank {rank} sync x{repeats}")
        lora_source = AdapterSource(tensors, rank=rank)
        adapter = case_row(
            f"lora r{rank}",
            sync_series([launcher.url], lora_source, transport="colocated", repeats=repeats, lora_name="policy"),
        )
    return {
        "model": name,
        "rank": rank,
        "cases": [full, adapter],
        "bytes_ratio": adapter["bytes"] / full["bytes"],
        "sync_s_ratio": adapter["sync_s"] / full["sync_s"],
        "pause_window_ratio": adapter["pause_window_s"] / full["pause_window_s"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3-22m-deep,qwen3-55m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("outputs/bench_lora.json"))
    parser.add_argument("--cache", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cache = read_environment().cache_dir if args.cache is None else args.cache
    log_dir = args.json.parent / "bench_lora_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    models = [
        bench_model(m, cache=Path(cache), rank=args.rank, repeats=args.repeats, log_dir=log_dir.resolve())
        for m in args.models.split(",")
    ]
    args.json.write_text(json.dumps({"models": models, "torch": torch.__version__}, indent=2) + "\n")
    print(f"{'model':<16} {'case':<10} {'MB sent':>8} {'tensors':>8} {'sync s':>7} {'pause s':>7}")
    for model in models:
        for c in model["cases"]:
            print(
                f"{model['model']:<16} {c['case']:<10} {c['bytes'] / 1e6:>8.2f} {c['tensors']:>8} "
                f"{c['sync_s']:>7.3f} {c['pause_window_s']:>7.3f}"
            )
        print(
            f"{'':<16} lora/full: bytes x{model['bytes_ratio']:.4f}, sync wall x{model['sync_s_ratio']:.3f}, "
            f"pause window x{model['pause_window_ratio']:.3f}"
        )
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
