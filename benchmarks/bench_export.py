"""Export throughput, raw vs bridge mode, at TP=1 and TP=2, side by side in one run on the same model.

Two gloo processes on 127.0.0.1 hold one Llama-style model (~100M parameters, fp32; built from an HF checkpoint
generated locally and cached), and for each tensor-parallel size every rank iterates the whole export stream,
as a sync does. Throughput is the HF-named bytes the stage source rank receives divided by the wall time of
one full stream (from a barrier to the last unit); the best of `--repeats` after a warm-up is reported, with
the median beside it. At TP=1 the second rank is a data-parallel replica. Tensors are yielded, not copied
into buckets: this measures gather + conversion, not packing. At TP=1 both streams hand out (mostly) views of the
parameters, so those figures measure per-unit overhead rather than bandwidth; at TP=2 every sharded byte crosses
gloo (megatron-bridge all-gathers to every rank, the raw gather only to the source rank).

    python benchmarks/bench_export.py [--quick] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

HOST = "127.0.0.1"
WORLD_SIZE = 2
TP_SIZES = (1, 2)
MODES = ("raw", "bridge")
TIMEOUT_S = 600.0

# ~99.5M parameters: 2 x 32000 x 768 embedding/output + 8 layers of 6.3M.
FULL_MODEL = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=4,
)
# ~6M parameters, for a smoke run.
QUICK_MODEL = dict(
    vocab_size=8000,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
)


def checkpoint_dir(sizes: dict, cache_dir: str) -> Path:
    """A cached HF checkpoint of the Llama model `sizes` describes (random weights, seed 0); built if missing."""
    key = hashlib.sha256(json.dumps(sizes, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(cache_dir) / "bench_export" / f"llama-{key}"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**sizes, max_position_embeddings=2048, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(str(tmp), safe_serialization=True)
    tmp.rename(out)  # atomic: a concurrent run never sees a half-written checkpoint
    return out


def _num_params(checkpoint: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        return sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _timed_stream(make_stream, *, repeats: int) -> tuple[list[float], int, int]:
    """Seconds of each timed run (after one warm-up), HF bytes and unit count seen by this rank's last run."""
    import torch.distributed as dist

    times, num_bytes, num_units = [], 0, 0
    for run in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        num_bytes, num_units = 0, 0
        for unit in make_stream():
            num_units += 1
            if unit.tensors is not None:
                num_bytes += sum(t.numel() * t.element_size() for t in unit.tensors)
        elapsed = time.perf_counter() - start
        if run > 0:
            times.append(elapsed)
    return times, num_bytes, num_units


def _worker(rank: int, port: int, checkpoint: str, repeats: int, out_dir: str) -> None:
    from miles_sync.env import adopt_bind_host

    adopt_bind_host(HOST)  # this process's groups bind loopback (gloo's interface derived from it)
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        timeout = timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timeout)
        from megatron.core import parallel_state as ps

        from miles_sync.export import bridge
        from miles_sync.export.megatron import is_export_source, iter_hf_units
        from miles_sync.export.raw import create_converter

        bridge.prepare_megatron_bridge()
        rows = []
        for tp in TP_SIZES:
            ps.initialize_model_parallel(tensor_model_parallel_size=tp)
            start = time.perf_counter()
            auto_bridge = bridge.load_bridge(checkpoint)
            model = bridge.build_bridge_model(auto_bridge)
            build_s = time.perf_counter() - start
            converter = create_converter(auto_bridge.hf_pretrained.config.model_type, auto_bridge.hf_pretrained.config)
            exporter = bridge.BridgeExporter(auto_bridge, model)
            streams = {
                "raw": functools.partial(iter_hf_units, model, converter=converter, timeout_s=TIMEOUT_S),
                "bridge": exporter.iter_units,
            }
            for mode in MODES:
                times, num_bytes, num_units = _timed_stream(streams[mode], repeats=repeats)
                if is_export_source() and rank == 0:
                    rows.append(
                        {
                            "mode": mode,
                            "tp": tp,
                            "dp": WORLD_SIZE // tp,
                            "num_units": num_units,
                            "num_bytes": num_bytes,
                            "build_s": build_s,
                            "best_s": min(times),
                            "median_s": statistics.median(times),
                            "gb_per_s": num_bytes / min(times) / 1e9,
                            "gb_per_s_median": num_bytes / statistics.median(times) / 1e9,
                        }
                    )
            model = exporter = auto_bridge = None  # free before the next mode
            ps.destroy_model_parallel()
        if rank == 0:
            (Path(out_dir) / "rows.json").write_text(json.dumps(rows))
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        raise


def run(*, quick: bool, repeats: int, cache_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    sizes = QUICK_MODEL if quick else FULL_MODEL
    start = time.perf_counter()
    checkpoint = checkpoint_dir(sizes, cache_dir)
    checkpoint_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as out_dir:
        store = dist.TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        processes = [
            context.Process(target=_worker, args=(r, store.port, str(checkpoint), repeats, out_dir), daemon=True)
            for r in range(WORLD_SIZE)
        ]
        for p in processes:
            p.start()
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
                if any(p.exitcode not in (None, 0) for p in processes):
                    break
                time.sleep(0.1)
        finally:
            for p in processes:
                if p.is_alive():
                    p.terminate()
                p.join(10)
        errors = "\n".join(e.read_text() for e in sorted(Path(out_dir).glob("error.rank*.txt")))
        if errors or any(p.exitcode != 0 for p in processes):
            raise RuntimeError(
                f"export benchmark workers failed (exit codes {[p.exitcode for p in processes]}):\n"
                f"{errors or '(timed out)'}"
            )
        rows = json.loads((Path(out_dir) / "rows.json").read_text())
    num_params = _num_params(checkpoint)
    return {
        "benchmark": "export",
        "model": {"arch": "llama", **sizes, "num_params": num_params, "dtype": "float32"},
        "world_size": WORLD_SIZE,
        "repeats": repeats,
        "quick": quick,
        "checkpoint_s": checkpoint_s,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "results": rows,
    }


def print_report(report: dict) -> None:
    model = report["model"]
    print(
        f"export throughput, llama {model['num_params'] / 1e6:.1f}M params fp32, {report['world_size']} gloo "
        f"processes, best of {report['repeats']} (median)"
    )
    by_key = {(r["mode"], r["tp"]): r for r in report["results"]}
    print(f"{'':>6} " + "".join(f"{mode + ' GB/s':>22}" for mode in MODES) + f"{'units':>8}{'MB':>9}{'build s':>9}")
    for tp in TP_SIZES:
        cells = "".join(
            f"{by_key[(m, tp)]['gb_per_s']:>12.2f} ({by_key[(m, tp)]['gb_per_s_median']:>6.2f})  " for m in MODES
        )
        row = by_key[("raw", tp)]
        print(f"TP={tp:<3} {cells}{row['num_units']:>8}{row['num_bytes'] / 1e6:>9.1f}{row['build_s']:>9.1f}")
    for r in report["results"]:
        print(f"  {r['mode']:<6} TP={r['tp']} best {r['best_s'] * 1e3:8.1f} ms  median {r['median_s'] * 1e3:8.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a ~6M-parameter model and one timed run")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per mode and TP (default 3, quick 1)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results to this JSON file")
    args = parser.parse_args()
    repeats = (1 if args.quick else 3) if args.repeats is None else args.repeats
    if repeats <= 0:
        parser.error(f"--repeats must be positive; got {repeats}")
    from miles_sync.env import read_environment

    report = run(quick=args.quick, repeats=repeats, cache_dir=read_environment().cache_dir)
    print_report(report)
    if args.json_path is not None:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
