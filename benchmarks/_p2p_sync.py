"""Engines on their own, p2p against the distributed broadcast, for bench_sync.py (`--p2p-only` runs it alone).

Real trainer actors (megatron-core on CPU, 2 ranks, TP=2) and reference engines of their own (no placement ties an
engine rank to a trainer rank; started with the p2p loader as their custom weight loader), synced through the
controller actor, verify off, per layout:

  trainer TP=2 -> one TP=2 engine
  trainer TP=2 -> two TP=1 engines

distributed: the export source gathers every tensor and broadcasts each bucket to every engine rank over one gloo
group; p2p: every trainer rank sends its own shards, point to point, into the engine ranks that keep them (each
engine rank's own parameters; feeders spread over the trainer ranks). Each case: `repeats` rounds alternating the
two (A, B, A, B, ...), each a fresh controller whose first sync (group set-up, first touch of buffers) is not
counted and the median of the `syncs` after it is; figures per round, reported as their medians.

Bytes are read from the kernel's TCP counters (`ss -tinp`: bytes_received / bytes_sent of every socket a process
owns), per process, before and after the counted syncs: per engine rank (its TP rank process; the server process
at TP=1) what it took in, per trainer rank what it sent, each over the model's bytes. HTTP requests count too (a
few KiB). On this machine every process shares 2 cores, so the CPU seconds per sync (every process together) are
given beside the wall time: a sync takes at least cpu_s / cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from _fed_sync import CALL_TIMEOUT_S, bench_controller, checkpoint_bytes, section_rows, sync_once
from _procstat import machine_busy_seconds
from _repeat import median_of
from _sync_models import MODELS, checkpoint_dir

from miles_sync.config import TrainerConfig
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.transport.base import TransportKind, transport_spec

__all__ = ["P2P_MODEL", "bench_p2p", "p2p_topologies", "print_p2p_table"]

MIB = 2**20
P2P_MODEL = "qwen3-55m"
TRANSPORTS = (TransportKind.DISTRIBUTED, TransportKind.P2P)
_SOCKET_USER = re.compile(r"pid=(\d+)")
_COUNTER = re.compile(r"\b(bytes_sent|bytes_received):(\d+)")


@dataclass(frozen=True, kw_only=True)
class P2PCase:
    name: str
    num_engines: int
    engine_tp: int


P2P_CASES = (
    P2PCase(name="trainer tp2 -> engine tp2", num_engines=1, engine_tp=2),
    P2PCase(name="trainer tp2 -> 2 engines tp1", num_engines=2, engine_tp=1),
)


def log(message: str) -> None:
    print(f"[p2p_sync {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def socket_bytes() -> dict[int, tuple[int, int]]:
    """{pid: (bytes sent, bytes received)} over every TCP socket each process owns now (the kernel's counters)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=60, check=True).stdout
    totals: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    pids: list[int] = []
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):  # a socket's line: its owners
            pids = sorted({int(p) for p in _SOCKET_USER.findall(line)})
            continue
        counters = dict(_COUNTER.findall(line))
        for pid in pids:
            totals[pid][0] += int(counters.get("bytes_sent", 0))
            totals[pid][1] += int(counters.get("bytes_received", 0))
    return {pid: (sent, received) for pid, (sent, received) in totals.items()}


def engine_rank_pids(url: str) -> list[int]:
    """The processes that hold an engine's TP ranks: its rank processes, or at TP=1 the server itself (the one
    listening on the URL's port)."""
    with urllib.request.urlopen(f"{url}/get_server_info", timeout=CALL_TIMEOUT_S) as response:
        ranks = json.load(response)["internal_states"][0]["tp_rank_pids"]
    if ranks:
        return [int(p) for p in ranks]
    port = urlsplit(url).port
    out = subprocess.run(
        ["ss", "-tlnpH", f"sport = :{port}"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return sorted({int(p) for p in _SOCKET_USER.findall(out)})


def bench_p2p(*, cache: Path, log_dir: Path, repeats: int, bucket_bytes: int, syncs: int = 1) -> dict:
    """Every P2PCase on a connected Ray cluster, one fleet at a time; the JSON section `p2p`."""
    model_dir = checkpoint_dir(MODELS[P2P_MODEL], cache)
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
        for case in P2P_CASES
    ]
    return {"model": P2P_MODEL, "model_bytes": model_bytes, "repeats": repeats} | section_rows(per_case, repeats)


def bench_case(
    case: P2PCase, *, model_dir: Path, log_dir: Path, repeats: int, syncs: int, bucket_bytes: int, model_bytes: int
) -> tuple[list[dict], list[list[dict]]]:
    """One case's rows (medians over the rounds) and each round's rows."""
    import ray

    from actors.rollout import create_engines
    from actors.trainer import create_trainers

    log(f"{case.name}: starting trainers and engines")
    loaders = transport_spec(TransportKind.P2P).engine_weight_loaders()
    spec = ReferenceEngineSpec(model_dir=str(model_dir), tp_size=case.engine_tp, custom_weight_loaders=loaders)
    with ExitStack() as stack:
        engines = create_engines(specs=[spec] * case.num_engines, log_dir=log_dir)
        stack.callback(engines.shutdown)
        trainers = create_trainers(trainer=TrainerConfig(tp=2), checkpoint_dir=str(model_dir), timeout_s=CALL_TIMEOUT_S)
        stack.callback(trainers.shutdown)
        trainer_pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in trainers.actors], timeout=60)
        rank_pids = [pid for url in engines.urls for pid in engine_rank_pids(url)]
        measured: dict[TransportKind, list[dict]] = {t: [] for t in TRANSPORTS}
        for _ in range(repeats):
            for transport in TRANSPORTS:
                controller = bench_controller(trainers, engines.urls, transport=transport, bucket_bytes=bucket_bytes)
                try:
                    sync_once(controller)
                    before, busy = socket_bytes(), machine_busy_seconds()
                    counted = sorted((sync_once(controller) for _ in range(syncs)), key=lambda r: r.total_s)
                    cpu_s = (machine_busy_seconds() - busy) / syncs
                    after = socket_bytes()
                    measured[transport].append(
                        {
                            "report": counted[len(counted) // 2],
                            "cpu_s": cpu_s,
                            "received": [_delta(after, before, pid, 1) / syncs for pid in rank_pids],
                            "sent": [_delta(after, before, pid, 0) / syncs for pid in trainer_pids],
                        }
                    )
                finally:
                    ray.get(controller.close.remote(), timeout=CALL_TIMEOUT_S)
                    ray.kill(controller)
    reps = [p2p_rows(case, measured, i, model_bytes=model_bytes) for i in range(repeats)]
    rows = median_of(reps)
    for row, transport in zip(rows, TRANSPORTS):
        row["total_s_each"] = [m["report"].total_s for m in measured[transport]]
    log(f"  {case.name}: p2p / distributed total {rows[1]['total_s_over_distributed']:.2f}")
    return rows, reps


def _delta(after: dict, before: dict, pid: int, index: int) -> int:
    return after.get(pid, (0, 0))[index] - before.get(pid, (0, 0))[index]


def p2p_rows(case: P2PCase, measured: dict, i: int, *, model_bytes: int) -> list[dict]:
    """Repetition `i`'s row per transport; p2p's with its ratios over the broadcast's of the same repetition."""
    rows = []
    for transport in TRANSPORTS:
        m = measured[transport][i]
        rows.append(
            {
                "case": case.name,
                "transport": transport.value,
                "total_s": m["report"].total_s,
                "send_s": m["report"].phases.send_s,
                "cpu_s": m["cpu_s"],
                "bytes_per_engine_rank": m["received"],
                "bytes_per_trainer_rank": m["sent"],
                "recv_per_rank_over_model": max(m["received"]) / model_bytes,
                "busiest_trainer_sent_over_model": max(m["sent"]) / model_bytes,
            }
        )
    broadcast, p2p = rows
    p2p["total_s_over_distributed"] = p2p["total_s"] / broadcast["total_s"]
    p2p["cpu_s_over_distributed"] = p2p["cpu_s"] / broadcast["cpu_s"]
    return rows


def p2p_topologies(section: dict) -> dict[str, float]:
    """Per case, p2p over the broadcast (wall and CPU seconds), and each transport's bytes per engine rank and from
    the busiest trainer rank, over the model's."""
    out = {}
    for c in section["cases"]:
        key = c["case"].replace(" -> ", "_to_").replace(" ", "_")
        transport = c["transport"]
        out[f"p2p_{key}_{transport}_recv_per_rank_over_model"] = c["recv_per_rank_over_model"]
        out[f"p2p_{key}_{transport}_busiest_trainer_sent_over_model"] = c["busiest_trainer_sent_over_model"]
        if transport == TransportKind.P2P.value:
            out[f"p2p_{key}_p2p_vs_distributed_total_s"] = c["total_s_over_distributed"]
            out[f"p2p_{key}_p2p_vs_distributed_cpu_s"] = c["cpu_s_over_distributed"]
    return out


def print_p2p_table(section: dict) -> None:
    print(
        f"\nEngines on their own: p2p against the distributed broadcast ({section['model']}, "
        f"{section['model_bytes'] / MIB:.1f} MiB, trainer TP=2, verify off; medians [min-max] of {section['repeats']}"
        " alternating syncs; bytes from the kernel's TCP counters per process, over the model's)"
    )
    print(
        f"  {'case':<31}{'transport':<13}{'total s':>22}{'recv/rank':>11}{'busiest sent':>14}{'/broadcast':>12}"
        f"{'CPU s':>8}{'CPU /broadcast':>16}"
    )
    for c in section["cases"]:
        spread = f"{c['total_s']:.3f} [{min(c['total_s_each']):.3f}-{max(c['total_s_each']):.3f}]"
        ratio = f"{c['total_s_over_distributed']:.2f}" if "total_s_over_distributed" in c else "-"
        cpu_ratio = f"{c['cpu_s_over_distributed']:.2f}" if "cpu_s_over_distributed" in c else "-"
        print(
            f"  {c['case']:<31}{c['transport']:<13}{spread:>22}{c['recv_per_rank_over_model']:>11.3f}"
            f"{c['busiest_trainer_sent_over_model']:>14.3f}{ratio:>12}{c['cpu_s']:>8.3f}{cpu_ratio:>16}"
        )
