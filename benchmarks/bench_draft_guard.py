"""What the frozen-draft guard adds to a sync's verification, measured side by side in one run.

    python benchmarks/bench_draft_guard.py [--models qwen3-55m] [--repeats N] [--json PATH] [--cache DIR]

Per model (a Qwen3 checkpoint of _sync_models.py plus one MTP layer, random-initialized, as the frozen draft): two
reference engines serving it with the MTP draft in the AITER layout, synced with selector `target` by an in-process
Sender and SyncController over a gloo update group (distributed, verify on), so every sync runs the guard. Measured:

  checker: the verification's checker call on both engines at once, as the session issues it, alternating the
      target-only request (selector `target`: what verification read before the guard) with the guard's request
      (selector `all`: target and draft in one call), `--repeats` x 5 pairs; the medians and their difference are the
      guard's cost, since nothing else in the session changes;
  sync: the median of `--repeats` guarded syncs after one warm-up (verify phase and total), each reporting
      `draft unchanged`; the guard's added checker seconds as a share of each.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _sync_models import (  # noqa: E402
    CALL_TIMEOUT_S,
    MODELS,
    benchmark_controller,
    checkpoint_dir,
    tensor_sender,
    write_checkpoint,
)

from miles_sync.engine.client import EngineClient
from miles_sync.engine.process import EngineLauncher
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.engine.reference.models import MTPHead, read_safetensors
from miles_sync.env import read_environment
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs
from miles_sync.sync.update_group import GroupSettings
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.draft import DraftKind
from miles_sync.wire.protocol import Selector, WeightsCheckerAction, WeightsCheckerRequest

HOST = "127.0.0.1"
ENGINES = 2
FROZEN_MTP = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)


def log(message: str) -> None:
    print(f"[bench_draft_guard {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def mtp_checkpoint(name: str, cache: Path) -> Path:
    """`name`'s checkpoint with one MTP layer appended (seed 1, bf16), cached next to it; written atomically."""
    target = checkpoint_dir(MODELS[name], cache)
    key = hashlib.sha256(f"{target.name}-mtp1".encode()).hexdigest()[:12]
    out = cache / "bench_draft_guard" / f"{name}-mtp-{key}"
    if (out / "model.safetensors").is_file():
        return out
    config = MODELS[name].config()
    config.num_nextn_predict_layers = 1
    head = MTPHead(config, seed=1)
    tensors = {
        **read_safetensors(target),
        **{k: v.detach().to(torch.bfloat16) for k, v in head.hf_parameters().items()},
    }
    return write_checkpoint(out, config=config, tensors=tensors)


async def checker_seconds(urls: Sequence[str], *, pairs: int) -> dict[str, list[float]]:
    """Alternating A/B: one checker call on every engine at once with selector target, then with selector all."""
    requests = {
        s: WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=s)
        for s in (Selector.TARGET, Selector.ALL)
    }
    clients = [EngineClient(u, timeout_s=CALL_TIMEOUT_S) for u in urls]
    seconds: dict[str, list[float]] = {s.value: [] for s in requests}
    try:
        for _ in range(pairs):
            for selector, request in requests.items():
                start = time.perf_counter()
                await asyncio.gather(*(c.weights_checker(request) for c in clients))
                seconds[selector.value].append(time.perf_counter() - start)
    finally:
        for client in clients:
            await client.close()
    return seconds


async def guarded_syncs(urls: Sequence[str], tensors: dict[str, torch.Tensor], *, repeats: int) -> list:
    source = tensor_sender(tensors, transport="distributed", hash_buckets=True)
    controller = benchmark_controller(
        list(urls),
        source,
        transport="distributed",
        verify=True,
        selector_inputs=FROZEN_MTP,
        group=GroupSettings(master_address=HOST),
    )
    await controller.connect()
    try:
        await controller.sync()
        return [await controller.sync() for _ in range(repeats)]
    finally:
        await controller.close()
        await source.close()


def bench_draft_guard_model(name: str, *, cache: Path, repeats: int, log_dir: Path) -> dict:
    model_dir = mtp_checkpoint(name, cache)
    tensors = read_safetensors(checkpoint_dir(MODELS[name], cache))  # the target only: the draft is frozen
    spec = ReferenceEngineSpec(model_dir=str(model_dir), draft_kind=DraftKind.MTP, weight_layout=WeightLayout.AITER)
    with ExitStack() as stack:
        urls = []
        for _ in range(ENGINES):
            launcher = EngineLauncher(spec=spec, log_dir=log_dir)
            stack.callback(launcher.stop)
            launcher.start()
            urls.append(launcher.url)
        log(f"{name}: checker target vs all x{repeats * 5}")
        seconds = asyncio.run(checker_seconds(urls, pairs=repeats * 5))
        log(f"{name}: guarded syncs x{repeats}")
        reports = asyncio.run(guarded_syncs(urls, tensors, repeats=repeats))
    failed = [r.summary() for r in reports if not r.committed or r.draft_guard != "draft unchanged"]
    if failed:
        raise RuntimeError(f"benchmark sync did not pass the guard: {failed}")
    target_s, all_s = statistics.median(seconds["target"]), statistics.median(seconds["all"])
    added_s = all_s - target_s
    median = sorted(reports, key=lambda r: r.total_s)[len(reports) // 2]
    draft_bytes = sum(v.numel() * 2 for k, v in read_safetensors(model_dir).items() if k not in tensors)
    return {
        "model": name,
        "engines": len(urls),
        "draft_bytes": draft_bytes,
        "target_bytes": median.num_bytes,
        "checker_target_s": target_s,
        "checker_all_s": all_s,
        "checker_all_vs_target": all_s / target_s,
        "added_s": added_s,
        "verify_s": median.phases.verify_s,
        "sync_s": median.total_s,
        "added_share_of_verify": added_s / median.phases.verify_s,
        "added_share_of_sync": added_s / median.total_s,
        "draft_guard": median.draft_guard,
    }


def print_rows(rows: Sequence[dict]) -> None:
    print(
        f"{'model':<12} {'draft MB':>8} {'target MB':>9} {'chk tgt s':>9} {'chk all s':>9} {'added s':>8} "
        f"{'verify s':>8} {'sync s':>7} {'% verify':>8} {'% sync':>7}"
    )
    for r in rows:
        print(
            f"{r['model']:<12} {r['draft_bytes'] / 1e6:>8.1f} {r['target_bytes'] / 1e6:>9.1f} "
            f"{r['checker_target_s']:>9.3f} {r['checker_all_s']:>9.3f} {r['added_s']:>8.3f} {r['verify_s']:>8.3f} "
            f"{r['sync_s']:>7.3f} {100 * r['added_share_of_verify']:>7.1f}% {100 * r['added_share_of_sync']:>6.1f}%"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3-55m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("outputs/bench_draft_guard.json"))
    parser.add_argument("--cache", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cache = Path(read_environment().cache_dir if args.cache is None else args.cache).expanduser()
    log_dir = (args.json.parent / "bench_draft_guard_logs").resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = [
        bench_draft_guard_model(m, cache=cache, repeats=args.repeats, log_dir=log_dir) for m in args.models.split(",")
    ]
    args.json.write_text(json.dumps({"models": rows, "torch": torch.__version__}, indent=2) + "\n")
    print_rows(rows)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
