"""Block-FP8 syncs against BF16 syncs of the same model, in one run.

    python benchmarks/bench_fp8.py [--models qwen3-55m,...] [--repeats N] [--block 128] [--json PATH] [--cache DIR]

Per model (the BF16 Qwen3 checkpoints of _sync_models.py): one reference engine serving the BF16 checkpoint and one
serving its block-FP8 copy (`fp8_checkpoint`, 128x128 blocks by default), each synced by an in-process Sender and
SyncController over a gloo update group (distributed, verify on). Reported per case, from the median sync of
`--repeats` after one warm-up: bytes on the wire, the sync wall, end-to-end GB/s of SOURCE weights (the BF16 bytes
the trainer holds, over the sync wall: the figure that compares the two cases), GB/s of wire bytes, and the source's
quantization time (`SendResult.quantize_s`, overlapped with sending) as a share of the sync wall.
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
from _sync_models import MODELS, checkpoint_dir, sync_series, tensor_sender  # noqa: E402

from miles_sync.engine.process import EngineLauncher
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.engine.reference.models import read_safetensors
from miles_sync.env import read_environment
from miles_sync.sync.sender import Sender
from miles_sync.sync.update_group import GroupSettings
from miles_sync.weights.fp8 import Fp8Block
from miles_sync.weights.fp8_checkpoint import fp8_checkpoint

HOST = "127.0.0.1"


def log(message: str) -> None:
    print(f"[bench_fp8 {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class RecordingSender(Sender):
    """A Sender that keeps every SendResult (the controller's report has no quantization time)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.results = []

    async def send(self, **kwargs):
        result = await super().send(**kwargs)
        self.results.append(result)
        return result


def sender(tensors: dict[str, torch.Tensor], *, quantization: Fp8Block | None) -> RecordingSender:
    return tensor_sender(tensors, transport="distributed", sender_class=RecordingSender, quantization=quantization)


def run_case(url: str, tensors: dict[str, torch.Tensor], *, quantization: Fp8Block | None, repeats: int) -> dict:
    source = sender(tensors, quantization=quantization)
    group = GroupSettings(master_address=HOST)
    reports = sync_series(
        [url], source, transport="distributed", repeats=repeats, group=group, quantization=quantization
    )
    results = source.results[1:]
    order = sorted(range(len(reports)), key=lambda i: reports[i].total_s)
    median = order[len(order) // 2]
    report, result = reports[median], results[median]
    source_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {
        "quantization": "none" if quantization is None else f"fp8_block {list(quantization.block)}",
        "wire_bytes": report.num_bytes,
        "source_bytes": source_bytes,
        "num_tensors": report.num_tensors,
        "sync_s": report.total_s,
        "send_s": report.phases.send_s,
        "source_gbps": source_bytes / report.total_s / 1e9,
        "wire_gbps": report.num_bytes / report.total_s / 1e9,
        "export_s": result.export_s,
        "pack_s": result.pack_s,
        "quantize_s": result.quantize_s,
        "quantize_share": result.quantize_s / report.total_s,
        "verification": report.verification,
    }


def bench_model(name: str, *, cache: Path, block: int, repeats: int, log_dir: Path) -> dict:
    spec = MODELS[name]
    bf16_dir = checkpoint_dir(spec, cache)
    fp8_dir = fp8_checkpoint(bf16_dir, Fp8Block(block=(block, block)))
    tensors = read_safetensors(bf16_dir)
    rows = []
    with ExitStack() as stack:
        launchers = {}
        for kind, model_dir in (("bf16", bf16_dir), ("fp8", fp8_dir)):
            launcher = EngineLauncher(spec=ReferenceEngineSpec(model_dir=str(model_dir)), log_dir=log_dir)
            stack.callback(launcher.stop)
            launcher.start()
            launchers[kind] = launcher
        for kind, quantization in (("bf16", None), ("fp8", Fp8Block(block=(block, block)))):
            log(f"{name}: {kind} sync x{repeats}")
            rows.append(run_case(launchers[kind].url, tensors, quantization=quantization, repeats=repeats))
    bf16, fp8 = rows
    return {
        "model": name,
        "cases": rows,
        "wire_bytes_ratio": fp8["wire_bytes"] / bf16["wire_bytes"],
        "sync_s_ratio": fp8["sync_s"] / bf16["sync_s"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3-55m,qwen3-113m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--json", type=Path, default=Path("outputs/bench_fp8.json"))
    parser.add_argument("--cache", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cache = read_environment().cache_dir if args.cache is None else args.cache
    log_dir = args.json.parent / "bench_fp8_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "models": [
            bench_model(m, cache=Path(cache), block=args.block, repeats=args.repeats, log_dir=log_dir.resolve())
            for m in args.models.split(",")
        ],
        "torch": torch.__version__,
    }
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    header = f"{'model':<12} {'case':<22} {'wire MB':>8} {'sync s':>7} {'src GB/s':>8} {'quant s':>7} {'quant %':>7}"
    print(header)
    for model in result["models"]:
        for c in model["cases"]:
            print(
                f"{model['model']:<12} {c['quantization']:<22} {c['wire_bytes'] / 1e6:>8.1f} {c['sync_s']:>7.3f} "
                f"{c['source_gbps']:>8.3f} {c['quantize_s']:>7.3f} {100 * c['quantize_share']:>6.1f}%"
            )
        print(f"{'':<12} fp8/bf16: wire bytes x{model['wire_bytes_ratio']:.3f}, sync wall x{model['sync_s_ratio']:.3f}")
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
