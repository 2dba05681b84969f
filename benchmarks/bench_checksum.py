"""Checksum throughput next to memcpy throughput, measured in the same run on the same bytes.

Memcpy (copy into a preallocated tensor) is the ceiling any checksum pass is judged against: verification after a
sync reads every byte once, so its cost relative to moving the bytes decides whether it can run on every step.

    python benchmarks/bench_checksum.py [--size-mib 256] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import time
import zlib
from collections.abc import Callable

import torch

from miles_sync.weights.checksum import tensor_checksum

# zlib.crc32 is listed as a non-cryptographic reference point only; 32 bits are too few for weight verification.
_HASHLIB_ALGORITHMS = ("sha256", "sha1", "blake2b", "md5")


def best_seconds(fn: Callable[[], object], *, repeats: int) -> float:
    """Fastest of `repeats` runs after one warm-up: compare methods at their best, not at their noisiest."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run(*, size_mib: int, repeats: int) -> dict:
    torch.set_num_threads(1)  # one core per method, like a checksum pass beside other work
    numel = size_mib * (1 << 20) // 2
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(numel, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    data = src.view(torch.uint8).numpy()
    num_bytes = data.nbytes

    methods: dict[str, Callable[[], object]] = {"memcpy": lambda: dst.copy_(src)}
    for name in _HASHLIB_ALGORITHMS:
        methods[f"hashlib.{name}"] = lambda name=name: hashlib.new(name, data).digest()
    methods["zlib.crc32"] = lambda: zlib.crc32(data)
    methods["tensor_checksum"] = lambda: tensor_checksum(src)

    results = {}
    for name, fn in methods.items():
        seconds = best_seconds(fn, repeats=repeats)
        results[name] = {"seconds": seconds, "gb_per_s": num_bytes / seconds / 1e9}
    memcpy = results["memcpy"]["gb_per_s"]
    for r in results.values():
        r["fraction_of_memcpy"] = r["gb_per_s"] / memcpy
    return {
        "benchmark": "checksum",
        "tensor": {"dtype": "bfloat16", "numel": numel, "num_bytes": num_bytes},
        "repeats": repeats,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256, help="bf16 tensor size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method; the best is kept")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results to this JSON file")
    args = parser.parse_args()
    if args.size_mib <= 0 or args.repeats <= 0:
        parser.error(f"--size-mib and --repeats must be positive; got {args.size_mib} and {args.repeats}")

    report = run(size_mib=args.size_mib, repeats=args.repeats)
    print(f"{args.size_mib} MiB of bfloat16, best of {args.repeats}")
    print(f"{'method':<18} {'GB/s':>8} {'ms':>9} {'vs memcpy':>10}")
    for name, r in report["results"].items():
        print(f"{name:<18} {r['gb_per_s']:>8.2f} {r['seconds'] * 1e3:>9.1f} {r['fraction_of_memcpy']:>9.1%}")
    if args.json_path is not None:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
