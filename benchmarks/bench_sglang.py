"""The same verified sync into a reference engine and into a real SGLang 0.5.23 CPU server, side by side in one run,
at two sizes, with each engine call's time; and what an idle real server costs the machine.

    .venv/bin/python benchmarks/bench_sglang.py [--repeats 7] [--sizes builtin,qwen3-55m] [--json out.json]

Needs the server venv of launch/install_sglang.sh. Per size, one reference engine (answering SGLang's
engine-parameter digests) and one real server serve the same checkpoint, and three cases sync the same float32
tensors into them (distributed over gloo, one update group each, retract pause, engine-exact verification):

- `reference`: into the reference engine, the prefix cache flushed with each update (the main job's default);
- `sglang`: the same into the real server;
- `sglang_session_flush`: into the real server with the session's own `/flush_cache` call after the pause (what
  every sync did before): on a CPU server that handler runs a full `gc.collect()` in the scheduler.

The cases alternate within each repetition (their order rotates), after one warm-up sync each, so a slow spell of
the host falls on all of them. Printed per case: the median sync and pause, their spread (min-max), the median of
each engine call (pause, flush, begin, end, version, verify-checksum, resume) and the send; per size the ratios
sglang / reference (total and pause) and the pause against the reference pause plus one copy of the bytes (a
memcpy of the same number of bytes into a preallocated buffer, measured beside it). Sizes: `builtin` (the main
job's checkpoint, 2.7 MB) and `qwen3-55m` (benchmarks/_sync_models.py, 55M parameters, sent as float32, the dtype
a CPU server holds them in: 221 MB). `idle_server_cores`: CPU seconds per wall second of an idle server's process
tree over 5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' own helper modules

import torch  # noqa: E402
from _procstat import cpu_seconds, descendants  # noqa: E402
from _sync_models import MODELS, benchmark_controller, checkpoint_dir, tensor_sender, write_checkpoint  # noqa: E402

from launch.sglang_venv import SGLANG_VENV_PYTHON  # noqa: E402
from miles_sync.engine.process import EngineLauncher  # noqa: E402
from miles_sync.engine.reference.checkpoints import cached_checkpoints  # noqa: E402
from miles_sync.engine.reference.launch import ReferenceEngineSpec  # noqa: E402
from miles_sync.engine.reference.models import read_safetensors  # noqa: E402
from miles_sync.engine.sglang import SGLangEngineSpec  # noqa: E402
from miles_sync.env import read_environment  # noqa: E402
from miles_sync.sync.report import SyncReport  # noqa: E402
from miles_sync.wire.protocol import ChecksumNames  # noqa: E402

IDLE_WINDOW_S = 5.0
CASES = ("reference", "sglang", "sglang_session_flush")
CALLS = ("pause", "flush", "begin", "end", "version", "verify-checksum", "resume")


def size_checkpoint(size: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """The checkpoint both engines serve and the float32 tensors every sync sends."""
    cache = read_environment().cache_dir
    if size == "builtin":
        model = cached_checkpoints(cache) / "target"
        # The built-in checkpoint's MTP layer (layer 2) is the draft's: the target runner holds no such names.
        keep = lambda name: not name.startswith("model.layers.2.")  # noqa: E731
        tensors = {n: t.float() for n, t in read_safetensors(model / "model.safetensors").items() if keep(n)}
        return model, tensors
    # Both engines must hold what the sync sends: a float32 copy of the bf16 checkpoint (a CPU server holds
    # float32 parameters; the reference engine refuses another dtype than the one it loaded).
    spec, bf16 = MODELS[size], checkpoint_dir(MODELS[size], cache)
    model = bf16.with_name(bf16.name + "-float32")
    tensors = {n: t.float() for n, t in read_safetensors(bf16 / "model.safetensors").items()}
    if not (model / "model.safetensors").is_file():
        config = spec.config()
        config.dtype = "float32"
        write_checkpoint(model, config=config, tensors=tensors)
    return model, tensors


def copy_once_s(num_bytes: int, *, repeats: int = 5) -> float:
    """Best time of a memcpy of `num_bytes` into a preallocated buffer."""
    source, target = torch.ones(num_bytes, dtype=torch.uint8), torch.empty(num_bytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return best


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


def alternating_syncs(
    targets: dict[str, tuple[str, bool]], tensors: dict[str, torch.Tensor], *, repeats: int
) -> dict[str, list[SyncReport]]:
    """Per case (name -> (engine URL, flush with updates)) one warm-up sync, then `repeats` rounds of one sync per
    case, the order rotating each round; the measured reports per case. Raises RuntimeError naming a failed sync."""

    async def go() -> dict[str, list[SyncReport]]:
        controllers = {}
        try:
            for case, (url, flush_with_updates) in targets.items():
                source = tensor_sender(tensors, transport="distributed", flush_cache=flush_with_updates)
                controllers[case] = benchmark_controller([url], source, transport="distributed", verify=True)
                await controllers[case].connect()
                await controllers[case].sync()
            names = list(targets)
            reports: dict[str, list[SyncReport]] = {case: [] for case in names}
            for i in range(repeats):
                for case in names[i % len(names) :] + names[: i % len(names)]:
                    reports[case].append(await controllers[case].sync())
            return reports
        finally:
            for controller in controllers.values():
                await controller.close()

    reports = asyncio.run(go())
    failed = [r.summary() for case in reports.values() for r in case if not r.committed]
    if failed:
        raise RuntimeError(f"benchmark sync failed: {failed}")
    return reports


def case_figures(reports: list[SyncReport]) -> dict[str, float | str]:
    """Medians and spreads of one case's syncs, and the median of each engine call."""
    totals = [r.total_s for r in reports]
    pauses = [r.phases.pause_s for r in reports]
    figures: dict[str, float | str] = {
        "total_s": statistics.median(totals),
        "total_min_s": min(totals),
        "total_max_s": max(totals),
        "pause_s": statistics.median(pauses),
        "pause_min_s": min(pauses),
        "pause_max_s": max(pauses),
        "send_s": statistics.median(r.phases.send_s for r in reports),
        "num_bytes": reports[-1].num_bytes,
        "check": reports[-1].verification,
    }
    for call in CALLS:
        seconds = [r.engines[0].call_s[call] for r in reports if call in r.engines[0].call_s]
        if seconds:
            figures[f"call_{call}_s"] = statistics.median(seconds)
    return figures


def measure_size(size: str, *, repeats: int, log_dir: str, results: dict) -> None:
    model, tensors = size_checkpoint(size)
    with contextlib.ExitStack() as stack:
        reference = EngineLauncher(
            spec=ReferenceEngineSpec(model_dir=str(model), checksum_names=ChecksumNames.ENGINE), log_dir=log_dir
        )
        stack.callback(reference.stop)
        reference.start()
        server = EngineLauncher(
            spec=SGLangEngineSpec(model_path=str(model), device="cpu", python=str(SGLANG_VENV_PYTHON)),
            log_dir=log_dir,
            startup_timeout_s=240.0,
        )
        stack.callback(server.stop)
        started = time.monotonic()
        server.start()
        results[f"{size}_sglang_start_s"] = time.monotonic() - started
        if "idle_server_cores" not in results:
            results["idle_server_cores"] = idle_cores(server.pid, window_s=IDLE_WINDOW_S)
        targets = {
            "reference": (reference.url, True),
            "sglang": (server.url, True),
            "sglang_session_flush": (server.url, False),
        }
        reports = alternating_syncs(targets, tensors, repeats=repeats)
    figures = {case: case_figures(reports[case]) for case in CASES}
    ref, sgl = figures["reference"], figures["sglang"]
    copy_s = copy_once_s(int(sgl["num_bytes"]))
    results[size] = {
        **figures,
        "copy_once_s": copy_s,
        "sglang_vs_reference_total": sgl["total_s"] / ref["total_s"],
        "sglang_vs_reference_pause": sgl["pause_s"] / ref["pause_s"],
        "sglang_pause_over_bound": sgl["pause_s"] / (2 * ref["pause_s"] + copy_s),
        "session_flush_vs_flush_with_updates_total": figures["sglang_session_flush"]["total_s"] / sgl["total_s"],
    }


def print_size(size: str, figures: dict) -> None:
    print(f"\n{size}: {figures['sglang']['num_bytes'] / 1e6:.1f} MB per sync, copy once {figures['copy_once_s']:.4f} s")
    header = f"{'case':<22} {'sync s (min-max)':>22} {'pause s (min-max)':>22} {'send s':>7}"
    print(header + "".join(f" {c:>9}" for c in CALLS) + "  check")
    for case in CASES:
        f = figures[case]
        calls = "".join(f" {1e3 * f[f'call_{c}_s']:>7.1f}ms" if f"call_{c}_s" in f else f" {'-':>9}" for c in CALLS)
        print(
            f"{case:<22} {f['total_s']:>7.3f} ({f['total_min_s']:.3f}-{f['total_max_s']:.3f})"
            f" {f['pause_s']:>7.4f} ({f['pause_min_s']:.4f}-{f['pause_max_s']:.4f}) {f['send_s']:>7.3f}{calls}"
            f"  {f['check']}"
        )
    for key in (
        "sglang_vs_reference_total",
        "sglang_vs_reference_pause",
        "sglang_pause_over_bound",
        "session_flush_vs_flush_with_updates_total",
    ):
        print(f"{size} {key} {figures[key]:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sizes", default="builtin,qwen3-55m", help="comma-separated: builtin and/or a MODELS name")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not SGLANG_VENV_PYTHON.is_file():
        raise SystemExit(
            f"no SGLang server venv at {SGLANG_VENV_PYTHON.parent.parent}: run bash launch/install_sglang.sh"
        )
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s != "builtin" and s not in MODELS]
    if unknown:
        raise SystemExit(f"unknown sizes {unknown}: builtin or one of {sorted(MODELS)}")
    results: dict = {"repeats": args.repeats}
    with tempfile.TemporaryDirectory() as log_dir:
        for size in sizes:
            measure_size(size, repeats=args.repeats, log_dir=log_dir, results=results)
            print_size(size, results[size])
    print(f"\nidle real server: {results['idle_server_cores']:.2f} cores busy")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
