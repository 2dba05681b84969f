"""Fit the sizing model's costs on this machine, then validate it on real miles_sync syncs it was not fitted on.

    python benchmarks/sizing_fit.py [--write-costs miles_sync/sizing/costs_reference.json] [--json PATH]

1. Per-byte costs, measured directly: memcpy (one copy of a ~216 MiB state dict into a preallocated buffer), one
   copy into fresh allocations (page faults included: what a staged sync's packing pays), the verification hash
   (miles_sync.weights.checksum.tensor_checksum over the same tensors), and gloo broadcasts of one
   contiguous buffer among 2, 3 and 4 processes at two sizes (_baselines.ceiling_broadcast), to which the binomial
   model of miles_sync.sizing.collective is fitted (link GB/s and per-message latency); the table prints each
   measured broadcast next to the fitted model's.
2. The engines' load rate, the pipeline's overlap factor (both on a grid) and the per-call costs (per sync, per
   engine, per bucket, per tensor; non-negative), fitted to real syncs (bench_sync.run_syncs: SyncController +
   Sender against reference engines, the median of `--repeats` after a warm-up) of the three smallest models at 1-2
   engines, minimizing the relative squared error of the sync time.
3. Validation on held-out syncs: a larger model (~488 MiB) at 1-3 engines, 3 engines of the ~216 MiB one,
   distributed and colocated, other bucket sizes, verify off, and staged syncs (their pause windows), none used in
   the fit. Prints predicted vs measured
   sync (and pause window) seconds and the error; `--json` keeps every row.

Run it alone on the machine (it starts up to three engines per model): the shared lock of this project applies.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _baselines  # noqa: E402
import bench_sync  # noqa: E402
from _sync_models import MODELS, checkpoint_dir  # noqa: E402

from miles_sync.engine.reference.models import read_safetensors  # noqa: E402
from miles_sync.env import read_environment  # noqa: E402
from miles_sync.sizing.collective import BroadcastAlgorithm, binomial_depth, broadcast_seconds  # noqa: E402
from miles_sync.sizing.costs import Costs  # noqa: E402
from miles_sync.sizing.projection import Cluster, EngineFleet, TrainerLayout, Transport, project  # noqa: E402
from miles_sync.sizing.shapes import model_shape  # noqa: E402

MIB = 2**20
MAX_ENGINES = 3
TRANSPORTS = {"distributed": Transport.BROADCAST, "colocated": Transport.COLOCATED}


def log(message: str) -> None:
    print(f"[sizing_fit {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, kw_only=True)
class Run:
    """One measured point: a model synced to `engines` engines."""

    model: str
    transport: str
    engines: int
    bucket_mib: int
    verify: bool = True
    staged: bool = False
    is_fit: bool = False


FIT_RUNS = (
    Run(model="qwen3-22m-deep", transport="distributed", engines=1, bucket_mib=256, is_fit=True),
    Run(model="qwen3-22m-deep", transport="distributed", engines=2, bucket_mib=256, is_fit=True),
    Run(model="qwen3-22m-deep", transport="colocated", engines=1, bucket_mib=256, is_fit=True),
    Run(model="qwen3-55m", transport="distributed", engines=1, bucket_mib=256, is_fit=True),
    Run(model="qwen3-55m", transport="distributed", engines=2, bucket_mib=16, is_fit=True),
    Run(model="qwen3-55m", transport="distributed", engines=1, bucket_mib=16, verify=False, is_fit=True),
    Run(model="qwen3-55m", transport="colocated", engines=2, bucket_mib=256, is_fit=True),
    Run(model="qwen3-55m", transport="colocated", engines=1, bucket_mib=16, is_fit=True),
    Run(model="qwen3-113m", transport="distributed", engines=1, bucket_mib=64, is_fit=True),
    Run(model="qwen3-113m", transport="distributed", engines=2, bucket_mib=64, is_fit=True),
    Run(model="qwen3-113m", transport="colocated", engines=1, bucket_mib=64, is_fit=True),
)
HELD_OUT_RUNS = (
    Run(model="qwen3-113m", transport="distributed", engines=3, bucket_mib=64),
    Run(model="qwen3-113m", transport="colocated", engines=3, bucket_mib=64),
    Run(model="qwen3-113m", transport="distributed", engines=2, bucket_mib=256, staged=True),
    Run(model="qwen3-256m", transport="distributed", engines=1, bucket_mib=128),
    Run(model="qwen3-256m", transport="distributed", engines=2, bucket_mib=128),
    Run(model="qwen3-256m", transport="distributed", engines=3, bucket_mib=256),
    Run(model="qwen3-256m", transport="colocated", engines=2, bucket_mib=128),
    Run(model="qwen3-256m", transport="colocated", engines=3, bucket_mib=256),
    Run(model="qwen3-256m", transport="distributed", engines=2, bucket_mib=128, verify=False),
    Run(model="qwen3-256m", transport="distributed", engines=2, bucket_mib=256, staged=True),
)
LOAD_FACTORS = (1.0, 0.75, 0.5, 0.35, 0.25, 0.18, 0.125)  # load_gbps candidates, as fractions of memcpy


# ---- 1. per-byte costs ----------------------------------------------------------------------------------------


def copy_and_hash_gbps(tensors: dict[str, torch.Tensor], *, repeats: int) -> tuple[float, float, float]:
    """(memcpy into one preallocated buffer, copy into fresh allocations, tensor_checksum) GB/s over `tensors`."""
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    memcpy_s = _baselines.memcpy_seconds(tensors, repeats=repeats)
    # One new buffer of the whole size per copy, as large as a bucket: mmap'd, faulted in on copy.
    fresh_s = _baselines.median_seconds(
        lambda: _baselines.copy_into(torch.empty(num_bytes, dtype=torch.uint8), tensors), repeats=repeats
    )
    hash_s = _baselines.sha256_seconds(tensors, repeats=repeats)
    return num_bytes / memcpy_s / 1e9, num_bytes / fresh_s / 1e9, num_bytes / hash_s / 1e9


def fit_broadcast(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(link GB/s, latency s) of gloo's binomial broadcast on loopback, t = depth(p) * (latency + S / B) (no NIC
    shared by the root's concurrent sends), least squares on relative error."""
    rows = [[binomial_depth(p) / t, binomial_depth(p) * n / t] for p, n, t in points]
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.ones(len(points), dtype=torch.float64)
    latency, per_byte = torch.linalg.lstsq(a, b).solution.tolist()
    if latency < 0:  # latency not resolvable at these sizes: bandwidth alone
        latency, per_byte = 0.0, torch.linalg.lstsq(a[:, 1:], b).solution.item()
    return 1.0 / per_byte / 1e9, latency


# ---- 2. syncs -------------------------------------------------------------------------------------------------


def measure_runs(runs: tuple[Run, ...], *, cache: Path, repeats: int, log_dir: Path) -> list[dict]:
    rows = []
    for model, group in itertools.groupby(runs, key=lambda r: r.model):
        group = list(group)
        model_dir = checkpoint_dir(MODELS[model], cache)
        tensors = read_safetensors(model_dir / "model.safetensors")
        config = json.loads((model_dir / "config.json").read_text())
        count = max(r.engines for r in group)
        with ExitStack() as stack:
            log(f"{model}: starting {count} engines")
            fleet = bench_sync.EngineFleet(stack, model_dir, count=count, log_dir=log_dir)
            for run in group:
                sender = bench_sync.model_sender(
                    tensors, transport=run.transport, bucket_bytes=run.bucket_mib * MIB, verify=run.verify
                )
                measured = bench_sync.run_syncs(
                    fleet.urls(run.engines),
                    sender,
                    transport=run.transport,
                    verify=run.verify,
                    repeats=repeats,
                    staged=run.staged,
                )
                report = measured.report
                rows.append(
                    {
                        "run": run,
                        "config": config,
                        "sync_s": report.total_s,
                        "pause_s": bench_sync.pause_window_s(report),
                        "bytes": report.num_bytes,
                        "tensors": report.num_tensors,
                        "buckets": report.num_buckets,
                    }
                )
                log(f"  {describe(run)}: {report.summary()}")
    return rows


def print_broadcasts(points: list, *, link_gbps: float, latency_s: float) -> None:
    print(f"gloo broadcast, binomial fit (loopback): link {link_gbps:.2f} GB/s, latency {latency_s * 1e3:.2f} ms")
    print(f"  {'processes':>9}{'MiB':>6}{'measured s':>11}{'binomial s':>11}{'error':>8}")
    for p, size, seconds in points:
        model_s = broadcast_seconds(
            size,
            num_receivers=p - 1,
            link_gbps=link_gbps,
            algorithm=BroadcastAlgorithm.BINOMIAL,
            latency_s=latency_s,
            shares_nic=False,
        )
        print(f"  {p:>9}{size / MIB:>6.0f}{seconds:>11.4f}{model_s:>11.4f}{(model_s - seconds) / seconds:>+8.0%}")


def describe(run: Run) -> str:
    flags = ("" if run.verify else " verify off") + (" staged" if run.staged else "")
    return f"{run.model} {run.transport} x{run.engines} bucket {run.bucket_mib} MiB{flags}"


# ---- 3. the model on this machine -----------------------------------------------------------------------------


def predict(row: dict, costs: Costs) -> tuple[float, float, int]:
    """(sync s, pause window s, buckets) the sizing model projects for a measured row."""
    run: Run = row["run"]
    projection = project(
        model_shape(row["config"]),
        transport=TRANSPORTS[run.transport],
        trainer=TrainerLayout(),
        engines=EngineFleet(count=run.engines, tp=1),
        cluster=Cluster(link_gbps=costs.link_gbps, gpus_per_node=1, shared_cores=costs.shared_cores, shares_nic=False),
        costs=costs,
        bucket_bytes=run.bucket_mib * MIB,
        verify=run.verify,
        staged=run.staged,
    )
    return projection.sync_s, projection.pause_s, projection.num_buckets


CALL_KEYS = ("per_sync_s", "per_engine_s", "per_bucket_s", "per_tensor_s")


def fit_calls(rows: list[dict], base: Costs) -> Costs:
    """The engines' load rate (a fraction of memcpy, on a grid), the overlap (on a grid) and the per-call costs
    (non-negative least squares) minimizing the relative squared error of the sync time. At a given load rate and
    overlap the projection is linear in the per-call costs, so each is a column: its prediction at 1 minus at 0."""
    best = None
    measured = [r["sync_s"] for r in rows]
    for factor, overlap in itertools.product(LOAD_FACTORS, [i / 10 for i in range(11)]):
        zero = replace(base, load_gbps=base.memcpy_gbps * factor, overlap=overlap, **dict.fromkeys(CALL_KEYS, 0.0))
        offsets = [predict(r, zero)[0] for r in rows]
        columns = [[predict(r, replace(zero, **{k: 1.0}))[0] - o for r, o in zip(rows, offsets)] for k in CALL_KEYS]
        for active in itertools.product((False, True), repeat=len(CALL_KEYS)):
            keys = [i for i, on in enumerate(active) if on]
            values = [0.0] * len(CALL_KEYS)
            if keys:
                a = torch.tensor([[columns[i][j] / measured[j] for i in keys] for j in range(len(rows))])
                b = torch.tensor([(m - o) / m for m, o in zip(measured, offsets)])
                solution = torch.linalg.lstsq(a.double(), b.double()).solution.tolist()
                if min(solution) < 0:
                    continue
                for i, v in zip(keys, solution):
                    values[i] = v
            pred = [o + sum(v * c[j] for v, c in zip(values, columns)) for j, o in enumerate(offsets)]
            error = sum(((p - m) / m) ** 2 for p, m in zip(pred, measured))
            if best is None or error < best[0]:
                best = (error, replace(zero, **dict(zip(CALL_KEYS, values))))
    assert best is not None
    return best[1]


def validation_rows(rows: list[dict], costs: Costs) -> list[dict]:
    out = []
    for r in rows:
        sync_s, pause_s, buckets = predict(r, costs)
        run: Run = r["run"]
        out.append(
            {
                "run": describe(run),
                "set": "fit" if run.is_fit else "held-out",
                "mib": r["bytes"] / MIB,
                "buckets": r["buckets"],
                "predicted_buckets": buckets,
                "measured_sync_s": r["sync_s"],
                "predicted_sync_s": sync_s,
                "sync_error": (sync_s - r["sync_s"]) / r["sync_s"],
                "measured_pause_s": r["pause_s"] if run.staged else None,
                "predicted_pause_s": pause_s if run.staged else None,
                "pause_error": (pause_s - r["pause_s"]) / r["pause_s"] if run.staged else None,
            }
        )
    return out


def print_validation(rows: list[dict]) -> None:
    print(f"\n{'set':<9}{'run':<52}{'MiB':>6}{'K':>3}{'measured s':>11}{'predicted s':>12}{'error':>8}")
    for r in rows:
        print(
            f"{r['set']:<9}{r['run']:<52}{r['mib']:>6.0f}{r['buckets']:>3}{r['measured_sync_s']:>11.3f}"
            f"{r['predicted_sync_s']:>12.3f}{r['sync_error']:>+8.0%}"
        )
        if r["measured_pause_s"] is not None:
            print(
                f"{'':<9}{'  pause window of the staged sync':<52}{'':>9}{r['measured_pause_s']:>11.3f}"
                f"{r['predicted_pause_s']:>12.3f}{r['pause_error']:>+8.0%}"
            )
    held = [r for r in rows if r["set"] == "held-out"]
    errors = [abs(r["sync_error"]) for r in held] + [abs(r["pause_error"]) for r in held if r["pause_error"]]
    within = sum(e <= 0.25 for e in errors)
    print(
        f"\nheld-out: {len(errors)} predictions, median |error| {statistics.median(errors):.0%}, "
        f"max {max(errors):.0%}, {within}/{len(errors)} within +-25%"
    )


def machine_record() -> str:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=30).stdout
        commit += " with uncommitted changes" if dirty.strip() else ""
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    return (
        f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, gloo on "
        f"loopback, reference engines; commit {commit}; {datetime.date.today().isoformat()}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path(read_environment().cache_dir))  # MILES_SYNC_CACHE_DIR
    parser.add_argument("--log-dir", type=Path, default=Path("outputs/sizing_fit_logs"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write-costs", type=Path, default=None, help="write the fitted costs JSON here")
    parser.add_argument("--json", type=Path, default=Path("outputs/sizing_fit.json"))
    parser.add_argument("--refit", type=Path, default=None, help="reuse the measurements of an earlier --json")
    args = parser.parse_args(argv)
    args.cache = args.cache.expanduser()
    torch.set_num_threads(1)  # as bench_sync runs
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    started = time.perf_counter()

    if args.refit is not None:
        return refit(args)
    log("per-byte costs: memcpy, hash, gloo broadcasts")
    tensors = read_safetensors(checkpoint_dir(MODELS["qwen3-113m"], args.cache) / "model.safetensors")
    micro_repeats = 3 * args.repeats  # cheap, and this machine is shared: medians of more samples
    memcpy_gbps, fresh_copy_gbps, hash_gbps = copy_and_hash_gbps(tensors, repeats=micro_repeats)
    del tensors
    points = []
    for world_size in (2, 3, 4):
        for size in (8 * MIB, 128 * MIB):
            seconds = _baselines.ceiling_broadcast(size, world_size=world_size, repeats=micro_repeats).seconds
            points.append((world_size, size, seconds))
    link_gbps, latency_s = fit_broadcast(points)
    base = Costs(
        memcpy_gbps=memcpy_gbps,
        fresh_copy_gbps=fresh_copy_gbps,
        load_gbps=memcpy_gbps,  # fitted below
        hash_gbps=hash_gbps,
        link_gbps=link_gbps,
        link_latency_s=latency_s,
        algorithm=BroadcastAlgorithm.BINOMIAL,
        shared_cores=os.cpu_count(),
        machine=machine_record(),
    )
    print(f"memcpy {memcpy_gbps:.2f} GB/s, fresh copy {fresh_copy_gbps:.2f} GB/s, hash {hash_gbps:.2f} GB/s")
    print_broadcasts(points, link_gbps=link_gbps, latency_s=latency_s)
    rows = measure_runs(FIT_RUNS + HELD_OUT_RUNS, cache=args.cache, repeats=args.repeats, log_dir=args.log_dir)
    finish(args, base=base, rows=rows, points=points, started=started)
    return 0


def refit(args) -> int:
    """Fit and validate again on the measurements an earlier run saved (no syncs run)."""
    saved = json.loads(args.refit.read_text())
    measured = saved["measured"]
    points = [(b["processes"], b["bytes"], b["seconds"]) for b in saved["broadcasts"]]
    link_gbps, latency_s = fit_broadcast(points)
    base = replace(
        Costs.from_dict(saved["costs"]),
        link_gbps=link_gbps,
        link_latency_s=latency_s,
        **dict.fromkeys(CALL_KEYS, 0.0),
        overlap=0.0,
    )
    print(f"refit of {args.refit}: memcpy {base.memcpy_gbps:.2f} GB/s, hash {base.hash_gbps:.2f} GB/s")
    print_broadcasts(points, link_gbps=link_gbps, latency_s=latency_s)
    rows = [{**m, "run": Run(**m["run"])} for m in measured]
    finish(args, base=base, rows=rows, points=points, started=time.perf_counter())
    return 0


def finish(args, *, base: Costs, rows: list[dict], points: list, started: float) -> None:
    fit = [r for r in rows if r["run"].is_fit]
    costs = replace(
        fit_calls(fit, base),
        notes=(
            f"load, overlap and per-call costs fitted on {len(fit)} syncs of qwen3-22m-deep, -55m and -113m; "
            "memcpy, fresh copy, hash and link measured directly"
        ),
    )
    print(
        f"\nfit: engine load {costs.load_gbps:.2f} GB/s, per sync {costs.per_sync_s * 1e3:.1f} ms, "
        f"per engine {costs.per_engine_s * 1e3:.1f} ms, "
        f"per bucket {costs.per_bucket_s * 1e3:.1f} ms, per tensor {costs.per_tensor_s * 1e6:.0f} us, "
        f"overlap {costs.overlap:.2f}"
    )
    table = validation_rows(rows, costs)
    print_validation(table)
    if args.write_costs is not None:
        args.write_costs.write_text(costs.to_json())
        print(f"wrote {args.write_costs}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "costs": json.loads(costs.to_json()),
                "broadcasts": [{"processes": p, "bytes": n, "seconds": s} for p, n, s in points],
                "validation": table,
                "measured": [{**r, "run": asdict(r["run"])} for r in rows],
                "wall_s": time.perf_counter() - started,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.json} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
