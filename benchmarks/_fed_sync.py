"""Engines fed by the trainer ranks on their own devices, colocated against shard_direct, for bench_sync.py's TP
comparison (`--tp-only` runs it with the single-source table).

Real trainer actors (megatron-core on CPU, 2 ranks) and reference engines placed bundle by bundle
(`miles_sync.job.placement`: engine TP rank r fed by the trainer rank on its bundle), synced through the controller
actor, verify off, per layout:

  trainer TP=2 -> one TP=2 engine    (the export source gathers; each engine rank fed by its own trainer rank)
  trainer TP=2 -> two TP=1 engines   (each engine fed by one trainer rank)
  trainer TP=1 x DP=2 -> one TP=2 engine

Colocated hands every feeding rank the whole bucket (a gloo broadcast from the source) and every engine rank maps
all of it; shard_direct sends each feeding rank only its engine ranks' own parameters (point to point) and each
engine rank maps only those. Each case: `repeats` rounds alternating colocated and shard_direct (A, B, A, B, ...),
so drift hits both, each a fresh controller whose first sync (transport set-up, first touch of buffers) is not
counted and the median of the `syncs` after it is; every figure is computed per round (the ratio from the round's
own pair) and reported as its median over the rounds, times with their [min-max]; bytes per engine rank are what
each rank counted itself taking in per counted sync (`miles_sync_received_bytes`).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from _procstat import machine_busy_seconds
from _repeat import median_of
from _sync_models import MODELS, checkpoint_dir

from miles_sync.config import ModelConfig, SyncConfig, TrainerConfig
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.engine.reference.models import read_safetensors
from miles_sync.transport.base import TransportKind
from miles_sync.wire.protocol import PauseMode

__all__ = [
    "FED_MODEL",
    "bench_controller",
    "bench_fed",
    "checkpoint_bytes",
    "print_fed_table",
    "received_bytes",
    "section_rows",
    "sync_once",
]

MIB = 2**20
HOST = "127.0.0.1"
CALL_TIMEOUT_S = 600.0
FED_MODEL = "qwen3-55m"  # two trainer ranks of megatron-core plus two engine ranks must fit beside the rest
TRANSPORTS = (TransportKind.COLOCATED, TransportKind.SHARD_DIRECT)


@dataclass(frozen=True, kw_only=True)
class FedCase:
    name: str
    trainer: TrainerConfig
    num_engines: int
    engine_tp: int


FED_CASES = (
    FedCase(name="trainer tp2 -> engine tp2", trainer=TrainerConfig(tp=2), num_engines=1, engine_tp=2),
    FedCase(name="trainer tp2 -> 2 engines tp1", trainer=TrainerConfig(tp=2), num_engines=2, engine_tp=1),
    FedCase(name="trainer tp1 dp2 -> engine tp2", trainer=TrainerConfig(tp=1, dp=2), num_engines=1, engine_tp=2),
)


def log(message: str) -> None:
    print(f"[fed_sync {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def bench_fed(
    *, cache: Path, log_dir: Path, repeats: int, bucket_bytes: int, syncs: int = 1, model: str = FED_MODEL
) -> dict:
    """Every FedCase on a connected Ray cluster, one placed fleet at a time; the JSON section `fed`."""
    model_dir = checkpoint_dir(MODELS[model], cache)
    model_bytes = checkpoint_bytes(model_dir)
    per_case = [
        bench_case(
            case,
            model_dir=model_dir,
            log_dir=log_dir,
            repeats=repeats,
            syncs=syncs,
            bucket_bytes=bucket_bytes,
            model_bytes=model_bytes,
        )
        for case in FED_CASES
    ]
    return {"model": model, "model_bytes": model_bytes, "repeats": repeats} | section_rows(per_case, repeats)


def checkpoint_bytes(model_dir: Path) -> int:
    """The bytes of a checkpoint's tensors (what a sync moves of it, the denominator of the byte ratios)."""
    return sum(t.numel() * t.element_size() for t in read_safetensors(model_dir / "model.safetensors").values())


def section_rows(per_case: Sequence[tuple[list[dict], list[list[dict]]]], repeats: int) -> dict:
    """A section's `cases` (every case's median rows) and `repetitions` (per round, every case's rows of that
    round: what a figure's spread is taken over) from each case's (rows, rows per round)."""
    return {
        "cases": [row for rows, _ in per_case for row in rows],
        "repetitions": [{"cases": [row for _, reps in per_case for row in reps[i]]} for i in range(repeats)],
    }


def bench_case(
    case: FedCase, *, model_dir: Path, log_dir: Path, repeats: int, syncs: int, bucket_bytes: int, model_bytes: int
) -> tuple[list[dict], list[list[dict]]]:
    """One case's rows (medians over the rounds) and each round's rows."""
    import ray

    from actors.placement import create_placement_groups
    from actors.rollout import DEFAULT_ENGINE_RESOURCES, create_engines
    from actors.trainer import DEFAULT_TRAINER_RESOURCES, create_trainers
    from miles_sync.job.placement import plan_colocated_feeds, plan_placement

    log(f"{case.name}: starting trainers and engines")
    plan = plan_placement(
        layout="colocated",
        num_trainers=case.trainer.tp * case.trainer.dp,
        num_engines=case.num_engines,
        trainer=DEFAULT_TRAINER_RESOURCES,
        engine=DEFAULT_ENGINE_RESOURCES,
        engine_tp_size=case.engine_tp,
    )
    spec = ReferenceEngineSpec(model_dir=str(model_dir), tp_size=case.engine_tp)
    with ExitStack() as stack:
        placed = create_placement_groups(plan, timeout_s=120.0, name_prefix="fed")
        stack.callback(placed.remove)
        engines = create_engines(specs=[spec] * case.num_engines, log_dir=log_dir, placement=placed)
        stack.callback(engines.shutdown)
        trainers = create_trainers(
            trainer=case.trainer,
            checkpoint_dir=str(model_dir),
            placement=placed,
            feeds=plan_colocated_feeds(plan),
            timeout_s=CALL_TIMEOUT_S,
        )
        stack.callback(trainers.shutdown)
        reports = {t: [] for t in TRANSPORTS}
        received = {t: [] for t in TRANSPORTS}
        cpu = {t: [] for t in TRANSPORTS}
        # One controller at a time (each opens its own transport on the trainer ranks), alternating transports so
        # that drift hits both; its first sync sets the transport up and touches every buffer, the median of the
        # `syncs` after it counts.
        for _ in range(repeats):
            for transport in TRANSPORTS:
                controller = bench_controller(trainers, engines.urls, transport=transport, bucket_bytes=bucket_bytes)
                try:
                    sync_once(controller)
                    before, busy = received_bytes(engines.urls), machine_busy_seconds()
                    counted = sorted((sync_once(controller) for _ in range(syncs)), key=lambda r: r.total_s)
                    cpu[transport].append((machine_busy_seconds() - busy) / syncs)
                    reports[transport].append(counted[len(counted) // 2])
                    after = received_bytes(engines.urls)
                    received[transport].append([(a - b) // syncs for a, b in zip(after, before)])
                finally:
                    ray.get(controller.close.remote(), timeout=CALL_TIMEOUT_S)
                    ray.kill(controller)
    reps = [fed_rows(case, reports, received, cpu, i, model_bytes=model_bytes) for i in range(repeats)]
    rows = median_of(reps)
    for row, transport in zip(rows, TRANSPORTS):  # every repetition's times beside their medians
        row["total_s_each"] = [r.total_s for r in reports[transport]]
        row["send_s_each"] = [r.phases.send_s for r in reports[transport]]
    direct = rows[1]
    direct["total_s_over_colocated_each"] = [rep[1]["total_s_over_colocated"] for rep in reps]
    log(f"  {case.name}: shard_direct / colocated total {direct['total_s_over_colocated']:.2f}")
    return rows, reps


def fed_rows(case: FedCase, reports: dict, received: dict, cpu: dict, i: int, *, model_bytes: int) -> list[dict]:
    """Repetition `i`'s row per transport; shard_direct's with its ratios over colocated's of the same
    repetition. `cpu_s`: the machine's busy CPU seconds per counted sync (every trainer, engine and controller
    process together): on this machine's cores a sync takes at least cpu_s / cores of wall time, so the CPU-time
    ratio beside the wall-time one is what the cores allow."""
    rows = []
    for transport in TRANSPORTS:
        report, per_rank = reports[transport][i], received[transport][i]
        rows.append(
            {
                "case": case.name,
                "transport": transport.value,
                "total_s": report.total_s,
                "send_s": report.phases.send_s,
                "bytes_per_engine_rank": per_rank,
                "recv_per_rank_over_model": max(per_rank) / model_bytes,
                "cpu_s": cpu[transport][i],
            }
        )
    colocated, direct = rows
    direct["total_s_over_colocated"] = direct["total_s"] / colocated["total_s"]
    direct["cpu_s_over_colocated"] = direct["cpu_s"] / colocated["cpu_s"]
    direct["send_s_over_colocated"] = direct["send_s"] / colocated["send_s"]
    return rows


def bench_controller(trainers, urls: Sequence[str], *, transport: TransportKind, bucket_bytes: int):
    """A controller actor over `trainers` and the engines at `urls` as every benchmark fleet syncs: retract pause,
    verify off, the long call timeouts."""
    from actors.controller import create_controller

    return create_controller(
        trainers=trainers.actors,
        engine_urls=list(urls),
        sync=SyncConfig(
            transport=transport,
            bucket_bytes=bucket_bytes,
            pause_mode=PauseMode.RETRACT,
            verify=False,
            http_timeout_s=CALL_TIMEOUT_S,
            collective_timeout_s=CALL_TIMEOUT_S,
            sync_timeout_s=CALL_TIMEOUT_S,
        ),
        model=ModelConfig(arch="qwen3", speculative_algorithm=None),
        master_address=HOST,
        timeout_s=CALL_TIMEOUT_S,
    )


def sync_once(controller) -> object:
    import ray

    report = ray.get(controller.sync.remote(), timeout=CALL_TIMEOUT_S)
    if not report.committed:
        raise RuntimeError(f"fed benchmark sync failed: {report.summary()}")
    return report


def received_bytes(urls: Sequence[str]) -> list[int]:
    """Every engine rank's own count of the tensor bytes it took in so far, engines in order."""
    counts = []
    for url in urls:
        with urllib.request.urlopen(f"{url}/get_server_info", timeout=CALL_TIMEOUT_S) as response:
            counts += [int(n) for n in json.load(response)["miles_sync_received_bytes"]]
    return counts


def print_fed_table(section: dict) -> None:
    print(
        f"\nEngines fed by the trainer ranks on their devices ({section['model']}, "
        f"{section['model_bytes'] / MIB:.1f} MiB, verify off; medians [min-max] of {section['repeats']} alternating"
        " syncs; recv/model: the busiest engine rank's bytes over the model's)"
    )
    print(
        f"  {'case':<31}{'transport':<14}{'total s':>22}{'recv/rank MiB':>22}{'recv/model':>11}{'/colocated':>11}"
        f"{'CPU s':>7}{'CPU /colocated':>15}"
    )
    for c in section["cases"]:
        spread = f"{c['total_s']:.3f} [{min(c['total_s_each']):.3f}-{max(c['total_s_each']):.3f}]"
        per_rank = "/".join(f"{n / MIB:.1f}" for n in c["bytes_per_engine_rank"])
        ratio = f"{c['total_s_over_colocated']:.2f}" if "total_s_over_colocated" in c else "-"
        cpu_ratio = f"{c['cpu_s_over_colocated']:.2f}" if "cpu_s_over_colocated" in c else "-"
        print(
            f"  {c['case']:<31}{c['transport']:<14}{spread:>22}{per_rank:>22}{c['recv_per_rank_over_model']:>11.3f}"
            f"{ratio:>11}{c['cpu_s']:>7.3f}{cpu_ratio:>15}"
        )
