"""Pipeline- and expert-parallel syncs side by side, for bench_sync.py (`--parallel-only` runs just this).

Real trainer actors (`actors.trainer.create_trainers`: megatron-core on CPU, gloo, the model loaded from the
checkpoint) sync through the controller actor into 2 reference engines (TP=1, no draft, no weight layout) over the
distributed transport. Every case's trainer group is up at once against the same engines; each (case, verify)
series (a controller, one warm-up sync for group set-up and first touch of buffers, then `repeats` measured syncs,
each phase time and the total its own median) runs once per repetition, the cases alternating (benchmarks/_repeat.py),
and each figure is the median over the repetitions:

  pipeline: a dense Qwen3 by trainer tp=1 pp=2 (two stage sources, two update groups, stage 1 packs ahead
      while stage 0 sends; `miles_sync.sync.pipeline`) against tp=1 pp=1 (the same model, one source);
  experts: a synthetic Qwen3-MoE (8 experts) by trainer tp=1 dp=2 ep=2 (EP rank 1's experts travel to the
      source rank by send/recv before packing; `miles_sync.export.megatron`) against tp=1 dp=1 ep=1.

Ratios are this case over its baseline (PP=2 / PP=1, EP=2 / EP=1) on GB/s = bytes / send_s and bytes / total_s.
export_s is the SyncReport's: the sum over stage sources of their export time (stages export concurrently, so at
PP=2 it is not wall time), which at EP=2 includes the expert gather; `gather_s` = export_s(EP=2) - export_s(EP=1)
is the gather's cost, over `gathered_bytes` (the experts EP rank 1 owns). Both models are synced in bf16, the
dtype of _sync_models' checkpoints (the trainer exports in the checkpoint's dtype).

What the numbers support (4 runs: quick, full, full, quick, the first two with the median sync by total rather than
per-phase medians; 2 cores shared with other test runs, loopback gloo; a run's figures are in its JSON's
`parallel` key). Two ratios per run (verify on, off) of GB/s on total time:
  PP=2 / PP=1: 0.61 1.02 | 1.33 0.86 | 1.25 1.24 | 0.97 0.44 -- no direction: a second source with its own update
      group, packing ahead while stage 0 sends, neither gains nor costs anything this host can resolve;
  EP=2 / EP=1: 0.60 0.56 | 0.89 1.10 | 0.75 0.42 | 0.56 0.47 -- 7 of 8 below 1; the export grew in 8 of 8, by
      0.04-0.31 s for 48-96 MiB of gathered experts (0.2-1 GB/s), 8-33% of the EP=2 sync. The rest of the loss is
      the second trainer rank competing for the 2 cores, which a per-EP-rank sender would keep busy as well.
Decision: keep gathering experts to the stage source. Sending from each EP rank could save only the gather's hop:
every engine still takes one update group at a time (the order rule of miles_sync.sync.pipeline), so the engines'
receive, the larger cost, does not parallelize, and the PP pair, the measured analogue of several sources with
their own groups, shows no gain. It would cost pp x ep update groups on every engine rank and a rendezvous per EP
rank per sync. If the gather grows (EP ranks on other hosts, the hop then crossing a NIC), first hide it behind
the previous bucket's send (gather the next bucket's experts while it is on the wire), which needs no new groups.
"""

from __future__ import annotations

import re
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from _repeat import alternate, median_of
from _sync_models import MODELS, MOE_MODELS, ModelSpec, MoeModelSpec, checkpoint_dir

from miles_sync.config import ModelConfig, SyncConfig, TrainerConfig
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.engine.reference.models import read_safetensors
from miles_sync.sync.report import SyncReport
from miles_sync.transport.base import TransportKind
from miles_sync.wire.protocol import PauseMode

__all__ = ["PARALLEL_MODELS", "bench_parallel", "print_parallel_table"]

MIB = 2**20
HOST = "127.0.0.1"
NUM_ENGINES = 2
CALL_TIMEOUT_S = 600.0
# (dense model, MoE model) per mode: big enough that bytes, not per-call overhead, dominate; small enough that 2
# engines and 2 trainer ranks of it fit beside whatever else shares the host.
PARALLEL_MODELS = {"quick": ("qwen3-55m", "qwen3moe-45m"), "full": ("qwen3-113m", "qwen3moe-73m")}
_EXPERT_NAME = re.compile(r"\.mlp\.experts\.(\d+)\.")


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    trainer: TrainerConfig


PIPELINE_CASES = (
    Case(name="pp1", trainer=TrainerConfig(tp=1, pp=1, dp=1)),
    Case(name="pp2", trainer=TrainerConfig(tp=1, pp=2, dp=1)),
)
EXPERT_CASES = (
    Case(name="ep1", trainer=TrainerConfig(tp=1, pp=1, dp=1, ep=1)),
    Case(name="ep2", trainer=TrainerConfig(tp=1, pp=1, dp=2, ep=2)),
)


def log(message: str) -> None:
    print(f"[parallel_sync {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("nan")


def bench_parallel(
    *, quick: bool, cache: Path, log_dir: Path, repeats: int, repetitions: int, bucket_bytes: int
) -> dict:
    """Both comparisons on a connected Ray cluster; the JSON section `parallel`: each figure the median over
    `repetitions` alternating repetitions (`repetitions` keeps each one's section). Starts and stops its own engines
    and trainer groups."""
    dense_name, moe_name = PARALLEL_MODELS["quick" if quick else "full"]
    settings = dict(repeats=repeats, repetitions=repetitions, bucket_bytes=bucket_bytes, log_dir=log_dir)
    pipeline = compare(MODELS[dense_name], PIPELINE_CASES, cache=cache, **settings)
    experts = compare(MOE_MODELS[moe_name], EXPERT_CASES, cache=cache, **settings)
    gathered = gathered_expert_bytes(experts[0]["model_dir"], ep_size=2)
    sections = [
        {
            "engines": NUM_ENGINES,
            "transport": "distributed",
            "pipeline": p,
            "experts": e | {"gathered_bytes": gathered, "gather": expert_gather(e, gathered_bytes=gathered)},
        }
        for p, e in zip(pipeline, experts)
    ]
    return median_of(sections) | {"repetitions": sections}


def expert_gather(experts: dict, *, gathered_bytes: int) -> list[dict]:
    """The expert gather's cost per verify setting: EP=2's export time over EP=1's."""
    out = []
    for verify in (True, False):
        ep1, ep2 = (
            next(r for r in experts["cases"] if (r["case"], r["verify"]) == (n, verify)) for n in ("ep1", "ep2")
        )
        gather_s = ep2["export_s"] - ep1["export_s"]
        out.append(
            {
                "verify": verify,
                "gather_s": gather_s,
                "gather_gbps": gbps(gathered_bytes, gather_s),
                "share_of_ep2_total": gather_s / ep2["total_s"],
            }
        )
    return out


def compare(
    spec: ModelSpec | MoeModelSpec,
    cases: Sequence[Case],
    *,
    cache: Path,
    repeats: int,
    repetitions: int,
    bucket_bytes: int,
    log_dir: Path,
) -> list[dict]:
    """`cases` against one engine fleet, every trainer group up at once, each (case, verify) series once per
    repetition in the same order (alternating); per repetition, the rows with ratios over the first case's (same
    verify setting)."""
    from actors.rollout import create_engines
    from actors.trainer import create_trainers

    model_dir = checkpoint_dir(spec, cache)
    arch = "qwen3_moe" if isinstance(spec, MoeModelSpec) else "qwen3"
    log(f"{spec.name}: starting {NUM_ENGINES} engines and the trainers of {', '.join(c.name for c in cases)}")
    engine_spec = ReferenceEngineSpec(model_dir=str(model_dir))
    with ExitStack() as stack:
        engines = create_engines(specs=[engine_spec] * NUM_ENGINES, log_dir=log_dir, timeout_s=CALL_TIMEOUT_S)
        stack.callback(engines.shutdown)
        groups = {}
        for case in cases:
            groups[case.name] = create_trainers(
                trainer=case.trainer, checkpoint_dir=str(model_dir), timeout_s=CALL_TIMEOUT_S
            )
            stack.callback(groups[case.name].shutdown)

        def series(case: Case, verify: bool) -> dict:
            trainers = groups[case.name]
            reports = measure(
                trainers.actors, engines.urls, arch=arch, verify=verify, repeats=repeats, bucket_bytes=bucket_bytes
            )
            num_sources = sum(info.is_source for info in trainers.ranks)
            return case_row(reports, case=case, verify=verify, num_sources=num_sources)

        keys = [(case, verify) for case in cases for verify in (True, False)]
        runs = alternate(
            [(f"{c.name} verify={v}", lambda c=c, v=v: series(c, v)) for c, v in keys],
            repetitions=repetitions,
            log=log,
        )
    out = []
    for i in range(repetitions):
        rows = [dict(runs[f"{c.name} verify={v}"][i]) for c, v in keys]
        for row in rows:
            base = next(r for r in rows if r["case"] == cases[0].name and r["verify"] == row["verify"])
            row["send_gbps_ratio"] = row["send_gbps"] / base["send_gbps"]
            row["total_gbps_ratio"] = row["total_gbps"] / base["total_gbps"]
        out.append({"model": spec.name, "model_dir": str(model_dir), "cases": rows})
    return out


def measure(
    trainer_actors: Sequence[object],
    engine_urls: Sequence[str],
    *,
    arch: str,
    verify: bool,
    repeats: int,
    bucket_bytes: int,
) -> list[SyncReport]:
    """One controller over the trainers: a warm-up sync, then `repeats` measured syncs (their reports)."""
    import ray

    from actors.controller import create_controller

    sync = SyncConfig(
        transport=TransportKind.DISTRIBUTED,
        bucket_bytes=bucket_bytes,
        pause_mode=PauseMode.RETRACT,  # as bench_sync's own syncs
        verify=verify,
        http_timeout_s=CALL_TIMEOUT_S,
        collective_timeout_s=CALL_TIMEOUT_S,
        sync_timeout_s=CALL_TIMEOUT_S,
    )
    controller = create_controller(
        trainers=trainer_actors,
        engine_urls=engine_urls,
        sync=sync,
        model=ModelConfig(arch=arch, speculative_algorithm=None),
        master_address=HOST,
        timeout_s=CALL_TIMEOUT_S,
    )
    try:
        ray.get(controller.sync.remote(), timeout=CALL_TIMEOUT_S)
        reports = [ray.get(controller.sync.remote(), timeout=CALL_TIMEOUT_S) for _ in range(repeats)]
    finally:
        ray.get(controller.close.remote(), timeout=CALL_TIMEOUT_S)
        ray.kill(controller)
    failed = [r.summary() for r in reports if not r.committed]
    if failed:
        raise RuntimeError(f"parallel benchmark sync failed: {failed}")
    return reports


def case_row(reports: Sequence[SyncReport], *, case: Case, verify: bool, num_sources: int) -> dict:
    """Each time is its own median over the measured syncs (a slow export and a slow send in different syncs do
    not hide each other); GB/s from those medians."""
    first = reports[0]
    phases = {name: statistics.median(vars(r.phases)[name] for r in reports) for name in vars(first.phases)}
    total_s = statistics.median(r.total_s for r in reports)
    return {
        "case": case.name,
        "layout": layout_name(case.trainer),
        "verify": verify,
        "num_sources": num_sources,
        "bytes": first.num_bytes,
        "tensors": first.num_tensors,
        "buckets": first.num_buckets,
        "send_gbps": gbps(first.num_bytes, phases["send_s"]),
        "total_gbps": gbps(first.num_bytes, total_s),
        "export_s": phases["export_s"],
        "send_s": phases["send_s"],
        "total_s": total_s,
        "phases": phases,
        "total_s_each": [r.total_s for r in reports],
        "verification": first.verification,
    }


def layout_name(trainer: TrainerConfig) -> str:
    return f"tp{trainer.tp} pp{trainer.pp} dp{trainer.dp} ep{trainer.ep}"


def gathered_expert_bytes(model_dir: str, *, ep_size: int) -> int:
    """Bytes of the routed experts EP ranks 1.. own (megatron gives each EP rank a contiguous block of experts),
    i.e. what the export moves to EP rank 0."""
    tensors = read_safetensors(Path(model_dir) / "model.safetensors")
    experts = {int(m.group(1)) for name in tensors if (m := _EXPERT_NAME.search(name))}
    owned_by_rank0 = len(experts) // ep_size
    return sum(
        t.numel() * t.element_size()
        for name, t in tensors.items()
        if (m := _EXPERT_NAME.search(name)) and int(m.group(1)) >= owned_by_rank0
    )


def print_parallel_table(section: dict) -> None:
    print(
        f"\nparallel trainer layouts ({section['engines']} reference engines TP=1, {section['transport']}): each time"
        " the median of the measured syncs after a warm-up;\n  ratio = GB/s over the pair's first case, same verify"
    )
    print(
        f"  {'model':<14}{'case':<6}{'layout':<17}{'verify':<7}{'MiB':>6}{'GB/s send':>10}{'GB/s total':>11}"
        f"{'export s':>9}{'send s':>8}{'total s':>8}{'ratio send':>11}{'ratio total':>12}"
    )
    for pair in (section["pipeline"], section["experts"]):
        for c in pair["cases"]:
            print(
                f"  {pair['model']:<14}{c['case']:<6}{c['layout']:<17}{'on' if c['verify'] else 'off':<7}"
                f"{c['bytes'] / MIB:>6.0f}{c['send_gbps']:>10.2f}{c['total_gbps']:>11.2f}{c['export_s']:>9.3f}"
                f"{c['send_s']:>8.3f}{c['total_s']:>8.3f}{c['send_gbps_ratio']:>11.2f}{c['total_gbps_ratio']:>12.2f}"
            )
    experts = section["experts"]
    for g in experts["gather"]:
        print(
            f"  expert gather (EP=2 export s - EP=1 export s, verify {'on' if g['verify'] else 'off'}): "
            f"{g['gather_s']:.3f} s for {experts['gathered_bytes'] / MIB:.0f} MiB ({g['gather_gbps']:.2f} GB/s), "
            f"{g['share_of_ep2_total']:.0%} of the EP=2 sync"
        )
