"""The same sync into one real SGLang 0.5.23 CPU server and into one reference engine, side by side, and what an
idle real server costs the machine.

    .venv/bin/python benchmarks/bench_sglang.py [--repeats 7] [--json out.json]

Needs the server venv of launch/install_sglang.sh. Both engines serve the built-in reference checkpoint (the model
a CPU server runs here); the sync is the main job's (distributed over gloo, verified: engine-exact on both, the
reference engine answering SGLang's engine-parameter digests). Measured in one run, in this order:

1. `reference`: syncs into the reference engine alone (one warm-up, then the median of `repeats`);
2. `idle_server_cores`: the CPU seconds an idle real server's process tree uses per second of wall time;
3. `reference_next_to_idle_server`: the same syncs into the reference engine while the idle server runs;
4. `sglang`: the same syncs into the real server (the reference engine idle beside it).

Ratios printed: sglang / reference (the server's own cost per sync) and reference next to the idle server /
reference alone (what one idle server costs everything else on a 2-core machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' own helper modules

from _procstat import cpu_seconds, descendants  # noqa: E402
from _sync_models import sync_series, tensor_sender  # noqa: E402

from launch.sglang_venv import SGLANG_VENV_PYTHON  # noqa: E402
from miles_sync.engine.process import EngineLauncher  # noqa: E402
from miles_sync.engine.reference.checkpoints import cached_checkpoints  # noqa: E402
from miles_sync.engine.reference.launch import ReferenceEngineSpec  # noqa: E402
from miles_sync.engine.reference.models import read_safetensors  # noqa: E402
from miles_sync.engine.sglang import SGLangEngineSpec  # noqa: E402
from miles_sync.env import read_environment  # noqa: E402
from miles_sync.wire.protocol import ChecksumNames  # noqa: E402

IDLE_WINDOW_S = 5.0


def median_sync_s(url: str, tensors, *, repeats: int) -> tuple[float, str]:
    reports = sync_series(
        [url], tensor_sender(tensors, transport="distributed"), transport="distributed", repeats=repeats
    )
    return statistics.median(r.total_s for r in reports), reports[-1].verification


def idle_cores(pid: int, *, window_s: float) -> float:
    """CPU seconds per wall second used by `pid` and its descendants over `window_s`."""

    def tree_cpu() -> float:
        total = 0.0
        for process in (pid, *descendants(pid)):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # exited meanwhile
                total += cpu_seconds(process)
        return total

    before, start = tree_cpu(), time.monotonic()
    time.sleep(window_s)
    return (tree_cpu() - before) / (time.monotonic() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not SGLANG_VENV_PYTHON.is_file():
        raise SystemExit(
            f"no SGLang server venv at {SGLANG_VENV_PYTHON.parent.parent}: run bash launch/install_sglang.sh"
        )
    model = cached_checkpoints(read_environment().cache_dir) / "target"
    tensors = {
        n: t for n, t in read_safetensors(model / "model.safetensors").items() if not n.startswith("model.layers.2.")
    }
    results: dict[str, float | str] = {}
    with tempfile.TemporaryDirectory() as log_dir, contextlib.ExitStack() as stack:
        reference = EngineLauncher(
            spec=ReferenceEngineSpec(model_dir=str(model), checksum_names=ChecksumNames.ENGINE), log_dir=log_dir
        )
        stack.callback(reference.stop)
        reference.start()
        results["reference_s"], results["reference_check"] = median_sync_s(reference.url, tensors, repeats=args.repeats)
        server = EngineLauncher(
            spec=SGLangEngineSpec(model_path=str(model), device="cpu", python=str(SGLANG_VENV_PYTHON)),
            log_dir=log_dir,
            startup_timeout_s=240.0,
        )
        stack.callback(server.stop)
        started = time.monotonic()
        server.start()
        results["sglang_start_s"] = time.monotonic() - started
        results["idle_server_cores"] = idle_cores(server.pid, window_s=IDLE_WINDOW_S)
        results["reference_next_to_idle_server_s"], _ = median_sync_s(reference.url, tensors, repeats=args.repeats)
        results["sglang_s"], results["sglang_check"] = median_sync_s(server.url, tensors, repeats=args.repeats)
    results["sglang_vs_reference"] = results["sglang_s"] / results["reference_s"]
    results["idle_server_slowdown"] = results["reference_next_to_idle_server_s"] / results["reference_s"]
    print(f"{'case':<34} {'median sync s':>13}  check")
    print(f"{'reference engine alone':<34} {results['reference_s']:>13.3f}  {results['reference_check']}")
    print(f"{'reference, idle real server beside':<34} {results['reference_next_to_idle_server_s']:>13.3f}")
    print(f"{'real SGLang server':<34} {results['sglang_s']:>13.3f}  {results['sglang_check']}")
    print(f"real server start: {results['sglang_start_s']:.1f} s; idle: {results['idle_server_cores']:.2f} cores busy")
    print(f"sglang_vs_reference {results['sglang_vs_reference']:.2f}")
    print(f"idle_server_slowdown {results['idle_server_slowdown']:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
