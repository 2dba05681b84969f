"""Soak: many syncs back to back on the main job's fleet, watching every process for leaks.

    python benchmarks/soak.py [--syncs 100] [--warmup K] [--transport distributed|colocated] [--json PATH]
                              [--set key=value ...]

Starts the fleet the main job starts (local Ray cluster on 127.0.0.1, 2 trainer ranks at TP=2, 2 CPU reference
engines with the frozen MTP draft, the controller; conf/default.yaml, made small by SOAK_OVERRIDES and `--set`),
then runs one round of the job per sync: a policy-gradient step on every trainer rank (so each sync moves new
bytes), the sync with verification on, and a small rollout on every engine (each sample must carry the new
version). After each sync it samples, for every process of the fleet (driver, trainer actors, controller, engine
actors, engine servers and any child they spawn): RSS, open fds and threads, read from /proc; and the entries of
/dev/shm that processes of this run created or hold.

Verdict FAIL (exit 1) when, between the end of warm-up (sync K) and the end (sync N): any process grows its RSS by
5% or more, or its open fds by more than FD_TOLERANCE; any process of the fleet exits, or a new one appears and
stays; this run's /dev/shm entries grow, or any outlives the shutdown; any sync is not committed, verified, tagged
on its samples and carrying changed tensors; or any process of the run survives the shutdown.

After the last sample the driver and every actor run glibc's `malloc_trim`, and their RSS after it is reported too
(not judged): growth that the trim gives back is freed memory the allocator kept, growth that stays is live.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procstat import FleetProbe, ProcessSample, command_name, sample_process, shm_entries  # noqa: E402

from launch.cluster import connect_ray, prepare_environment
from miles_sync.config import MilesSyncConfig, load_config
from miles_sync.transport.base import TransportKind

MIB = 2**20
RSS_LIMIT_PCT = 5.0
# Open fds may differ by a few between two quiescent points without leaking: Ray's core worker opens and closes
# gRPC connections on its own schedule, and HTTP clients keep pooled keep-alive sockets that a server may close
# (the controller was seen 64 -> 65 over 100 syncs). A leak of one fd per sync passes this within 3 syncs.
FD_TOLERANCE = 2
SOAK_OVERRIDES = ("rollout.num_prompts=2", "rollout.max_new_tokens=8", "run_name=soak")
SHUTDOWN_GRACE_S = 15.0  # torch's shm manager unlinks segments once its clients are gone: give it time


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- the fleet ----------------------------------------------------------------------------------------------------


def _own_pid(actor: object) -> int:
    """Runs inside an actor (through `__ray_call__`)."""
    del actor
    return os.getpid()


def _trim_heap(actor: object) -> int:
    """Runs inside an actor, or on the driver: hand the heap's free pages back to the OS (glibc `malloc_trim`);
    returns RSS after it, in bytes. Growth that this takes back was freed memory the allocator kept, not live
    objects. Self-contained, because it runs in processes that cannot import this directory's modules."""
    import ctypes

    del actor
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@dataclass(frozen=True, kw_only=True)
class Fleet:
    trainers: Any  # actors.trainer.TrainerGroup
    engines: Any  # actors.rollout.EngineGroup
    controller: Any

    def roles(self, *, timeout_s: float) -> dict[str, int]:
        """Role name -> pid of every process the fleet started, the driver first."""
        import ray

        def pid_of(actor: Any) -> int:
            return ray.get(actor.__ray_call__.remote(_own_pid), timeout=timeout_s)

        roles = {"driver": os.getpid()}
        roles |= {f"trainer[{i}]": pid_of(a) for i, a in enumerate(self.trainers.actors)}
        roles["controller"] = pid_of(self.controller)
        for i, actor in enumerate(self.engines.actors):
            roles[f"engine-actor[{i}]"] = pid_of(actor)
            roles[f"engine-server[{i}]"] = ray.get(actor.pid.remote(), timeout=timeout_s)
        return roles

    def trim_heaps(self, *, timeout_s: float) -> dict[int, int]:
        """pid -> RSS after `_trim_heap`, for the driver and every actor (engine servers have no hook for it)."""
        import ray

        actors = [*self.trainers.actors, self.controller, *self.engines.actors]
        pids = ray.get([a.__ray_call__.remote(_own_pid) for a in actors], timeout=timeout_s)
        trimmed = ray.get([a.__ray_call__.remote(_trim_heap) for a in actors], timeout=timeout_s)
        return {os.getpid(): _trim_heap(None), **dict(zip(pids, trimmed))}


@contextlib.contextmanager
def start_fleet(config: MilesSyncConfig, *, log_dir: Path) -> Iterator[Fleet]:
    """The main job's actors, started and stopped by the job's own code; engine logs go to `log_dir`."""
    from launch.fleet import start_job_actors

    with start_job_actors(config, log=log, engine_log_dir=log_dir) as actors:
        yield Fleet(trainers=actors.trainers, engines=actors.engines, controller=actors.controller)


# ---- one sync -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SyncRecord:
    index: int
    version: str
    committed: bool
    verified: bool  # as the job's report counts it: every engine matched every sent tensor's checksum
    samples_tagged: bool  # every rollout sample after the sync carries the new version
    num_tensors: int
    num_changed_tensors: int | None  # tensors whose checksum differs from the previous sync's (None: first sync)
    num_bytes: int
    train_s: float
    sync_s: float  # driver-side wall time of controller.sync
    rollout_s: float
    error: str | None

    @property
    def is_ok(self) -> bool:
        moved = self.num_changed_tensors is None or self.num_changed_tensors > 0
        return self.committed and self.verified and self.samples_tagged and moved


class SyncLoop:
    """The job's round, once per sync: train step on the previous rollouts -> sync -> rollouts on every engine."""

    def __init__(self, fleet: Fleet, config: MilesSyncConfig) -> None:
        from miles_sync.wire.protocol import SamplingParams

        self._fleet = fleet
        self._config = config
        rollout = config.rollout
        self._sampling = SamplingParams(
            max_new_tokens=rollout.max_new_tokens,
            temperature=rollout.temperature,
            sampling_seed=config.seed if rollout.temperature > 0 else None,
        )
        # Beyond the sync's own deadline, so the controller's precise error arrives before ours.
        self._timeout_s = config.sync.sync_timeout_s + 60.0
        self._checksums: dict[str, str] | None = None
        self._samples = self._rollouts(0)

    def _rollouts(self, index: int) -> list[Any]:
        import ray

        from miles_sync.job.rl import make_prompts

        rollout = self._config.rollout
        prompts = make_prompts(index, num_prompts=rollout.num_prompts, length=rollout.prompt_length)
        refs = [a.generate.remote(prompts, sampling=self._sampling) for a in self._fleet.engines.actors]
        return [s for batch in ray.get(refs, timeout=self._config.sync.http_timeout_s + 60.0) for s in batch]

    def run(self, index: int) -> SyncRecord:
        import ray

        from miles_sync.job.rl import train_batch
        from miles_sync.job.run_report import round_record

        started = time.perf_counter()
        self._fleet.trainers.train_step(train_batch(self._samples), timeout_s=self._timeout_s)
        trained = time.perf_counter()
        report = ray.get(self._fleet.controller.sync.remote(raise_on_failure=False), timeout=self._timeout_s)
        synced = time.perf_counter()
        tagged = False
        if report.committed:
            self._samples = self._rollouts(index)
            tagged = bool(self._samples) and all(s.weight_version == report.version for s in self._samples)
        changed = None
        if self._checksums is not None:
            changed = sum(1 for name, digest in report.checksums.items() if self._checksums.get(name) != digest)
        self._checksums = dict(report.checksums)
        row = round_record(index, report, loss=0.0, trainer_step=index, rollouts=None)
        return SyncRecord(
            index=index,
            version=report.version,
            committed=report.committed,
            verified=row.verified,
            samples_tagged=tagged,
            num_tensors=report.num_tensors,
            num_changed_tensors=changed,
            num_bytes=report.num_bytes,
            train_s=trained - started,
            sync_s=synced - trained,
            rollout_s=time.perf_counter() - synced,
            error=report.error,
        )


# ---- figures and verdict (pure) -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ProcessFigures:
    """One process between the end of warm-up and the end. `rss_series`: RSS after each sync (0: not alive)."""

    role: str
    pid: int
    rss_warmup: int | None  # None: the process appeared after warm-up
    rss_end: int | None  # None: the process was gone at the end
    rss_growth_pct: float | None
    fds_warmup: int | None
    fds_end: int | None
    fd_growth: int | None
    threads_warmup: int | None
    threads_end: int | None
    rss_series: list[int]
    rss_end_trimmed: int | None  # RSS after the last sync and a malloc_trim (None: not trimmed); not in the verdict


def process_figures(
    labels: dict[int, str], samples: Sequence[dict[int, ProcessSample]], *, warmup: int, trimmed: dict[int, int]
) -> list[ProcessFigures]:
    """`samples[i]`: the figures after sync i + 1. Processes never alive at or after warm-up are left out."""
    at_warmup, at_end = samples[warmup - 1], samples[-1]
    rows = []
    for pid, role in labels.items():
        before, after = at_warmup.get(pid), at_end.get(pid)
        if before is None and after is None:
            continue  # a transient child, gone before warm-up ended
        rows.append(
            ProcessFigures(
                role=role,
                pid=pid,
                rss_warmup=None if before is None else before.rss_bytes,
                rss_end=None if after is None else after.rss_bytes,
                rss_growth_pct=None if before is None or after is None else _pct(before.rss_bytes, after.rss_bytes),
                fds_warmup=None if before is None else before.num_fds,
                fds_end=None if after is None else after.num_fds,
                fd_growth=None if before is None or after is None else after.num_fds - before.num_fds,
                threads_warmup=None if before is None else before.num_threads,
                threads_end=None if after is None else after.num_threads,
                rss_series=[s[pid].rss_bytes if pid in s else 0 for s in samples],
                rss_end_trimmed=trimmed.get(pid),
            )
        )
    return rows


def failures(
    processes: Sequence[ProcessFigures],
    syncs: Sequence[SyncRecord],
    *,
    num_syncs: int,
    shm_at_warmup: set[str],
    shm_at_end: set[str],
    shm_leaked: set[str],
    survivors: Sequence[str],
) -> list[str]:
    """Every reason for a FAIL verdict (empty: PASS)."""
    reasons = []
    for p in processes:
        name = f"{p.role} (pid {p.pid})"
        if p.rss_warmup is None:
            reasons.append(f"{name} appeared after warm-up and is still running")
        elif p.rss_end is None:
            reasons.append(f"{name} exited during the run")
        else:
            if p.rss_growth_pct >= RSS_LIMIT_PCT:
                trimmed = p.rss_end_trimmed
                trim = "" if trimmed is None else f"; {_pct(p.rss_warmup, trimmed):.1f}% after malloc_trim"
                reasons.append(f"{name} grew RSS {p.rss_growth_pct:.1f}% after warm-up (limit {RSS_LIMIT_PCT}%{trim})")
            if p.fd_growth > FD_TOLERANCE:
                reasons.append(f"{name} has {p.fd_growth} more open fds than after warm-up (tolerance {FD_TOLERANCE})")
    grown = sorted(shm_at_end - shm_at_warmup)
    if grown:
        reasons.append(f"{len(grown)} /dev/shm entries of this run appeared after warm-up and remain: {grown[:5]}")
    if shm_leaked:
        leaked = sorted(shm_leaked)
        reasons.append(f"{len(leaked)} /dev/shm entries of this run outlived the shutdown: {leaked[:5]}")
    if survivors:
        reasons.append(f"processes of this run survived the shutdown: {list(survivors)}")
    if len(syncs) < num_syncs:
        reasons.append(f"only {len(syncs)} of {num_syncs} syncs ran")
    reasons += [f"sync {s.index} not ok: {_sync_problem(s)}" for s in syncs if not s.is_ok]
    return reasons


def _sync_problem(s: SyncRecord) -> str:
    if not s.committed:
        return f"not committed ({s.error})"
    if not s.verified:
        return "committed but not verified"
    if not s.samples_tagged:
        return f"rollout samples do not all carry version {s.version}"
    return "no tensor changed since the previous sync"


def _pct(before: int, after: int) -> float:
    return 100.0 * (after - before) / before


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in (0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def _show(value: float | int | None, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def print_table(processes: Sequence[ProcessFigures]) -> None:
    print(
        f"{'process':<34}{'pid':>8}{'rss@warm MiB':>14}{'rss@end MiB':>13}{'growth %':>10}{'trimmed MiB':>13}"
        f"{'fds@warm':>10}{'fds@end':>9}{'thr@warm':>10}{'thr@end':>9}"
    )
    for p in processes:
        print(
            f"{p.role:<34}{p.pid:>8}{_mib(p.rss_warmup):>14}{_mib(p.rss_end):>13}{_show(p.rss_growth_pct, '.2f'):>10}"
            f"{_mib(p.rss_end_trimmed):>13}"
            f"{_show(p.fds_warmup):>10}{_show(p.fds_end):>9}{_show(p.threads_warmup):>10}"
            f"{_show(p.threads_end):>9}"
        )


# ---- the run ------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class SoakRun:
    """What the fleet phase hands to the verdict (filled as it goes, so a failed run still reports)."""

    labels: dict[int, str] = field(default_factory=dict)
    samples: list[dict[int, ProcessSample]] = field(default_factory=list)
    shm: list[set[str]] = field(default_factory=list)
    syncs: list[SyncRecord] = field(default_factory=list)
    run_pids: set[int] = field(default_factory=set)
    run_shm: set[str] = field(default_factory=set)
    trimmed: dict[int, int] = field(default_factory=dict)  # pid -> RSS after the run and a malloc_trim
    error: str | None = None


def soak(config: MilesSyncConfig, *, num_syncs: int, log_dir: Path, shm_before: set[str]) -> SoakRun:
    """Start Ray and the fleet, run and sample `num_syncs` syncs, stop everything (also on failure)."""
    run = SoakRun()
    probe: FleetProbe | None = None
    try:
        with connect_ray(config.cluster) as connection, start_fleet(config, log_dir=log_dir) as fleet:
            roles = fleet.roles(timeout_s=config.sync.http_timeout_s)
            log(f"ray at {connection.address}; fleet ready: {', '.join(f'{r}={p}' for r, p in roles.items())}")
            probe = FleetProbe(roles, shm_before=shm_before)
            loop = SyncLoop(fleet, config)
            for index in range(1, num_syncs + 1):
                record = loop.run(index)
                run.syncs.append(record)
                figures, shm = probe.sample()
                run.samples.append(figures)
                run.shm.append(shm)
                _log_sync(record, figures, shm, num_syncs=num_syncs)
                if not record.committed:
                    break  # the engines are stale now; later syncs would only repeat the failure
            run.trimmed = fleet.trim_heaps(timeout_s=config.sync.http_timeout_s)  # after the last sample
    except Exception as exc:
        run.error = f"{type(exc).__name__}: {exc}"
        log(f"run failed: {run.error}")
    finally:
        if probe is not None:
            run.labels, run.run_pids, run.run_shm = dict(probe.labels), probe.run_pids, probe.run_shm
    return run


def _log_sync(record: SyncRecord, figures: dict[int, ProcessSample], shm: set[str], *, num_syncs: int) -> None:
    outcome = "ok" if record.is_ok else f"NOT OK ({_sync_problem(record)})"
    changed = "-" if record.num_changed_tensors is None else record.num_changed_tensors
    rss = sum(f.rss_bytes for f in figures.values())
    fds = sum(f.num_fds for f in figures.values())
    log(
        f"sync {record.index:>3}/{num_syncs} v{record.version} {outcome}: sync {record.sync_s:.2f}s "
        f"(train {record.train_s:.2f}s, rollout {record.rollout_s:.2f}s), {changed}/{record.num_tensors} tensors "
        f"changed; {len(figures)} processes: rss {rss / MIB:.0f} MiB, {fds} fds; {len(shm)} shm entries"
    )


def _survivors(run: SoakRun) -> list[str]:
    """Processes of the run (fleet or Ray's own) still alive after the shutdown, waiting up to the grace time."""
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    while True:
        alive = sorted(p for p in run.run_pids - {os.getpid()} if sample_process(p) is not None)
        if not alive or time.monotonic() > deadline:
            return [f"{run.labels.get(p, command_name(p))} (pid {p})" for p in alive]
        time.sleep(0.5)


def _leaked_shm(run: SoakRun) -> set[str]:
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    while True:
        leaked = shm_entries() & run.run_shm
        if not leaked or time.monotonic() > deadline:
            return leaked
        time.sleep(0.5)


def build_config(transport: str, overrides: Sequence[str]) -> MilesSyncConfig:
    config = load_config(overrides=[*SOAK_OVERRIDES, f"sync.transport={transport}", *overrides])
    if not config.sync.verify:
        raise ValueError("sync.verify=false: the soak checks that every sync is verified; leave verification on")
    if config.engines.urls:
        raise ValueError("engines.urls: the soak samples the engine servers it starts; it cannot use running ones")
    return config


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--syncs", type=int, default=100, help="syncs to run back to back (at least 2)")
    parser.add_argument("--warmup", type=int, default=None, help="syncs before the baseline (default min(10, N//4))")
    parser.add_argument(
        "--transport", choices=[t.value for t in TransportKind], default=TransportKind.DISTRIBUTED.value
    )
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override (repeatable), as in launch.run: rollout.max_new_tokens=16",
    )
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = max(1, min(10, args.syncs // 4))
    if args.syncs < 2 or not 1 <= args.warmup < args.syncs:
        parser.error(f"--syncs={args.syncs} --warmup={args.warmup}: need 1 <= warmup < syncs")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = build_config(args.transport, args.overrides)
    except ValueError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    prepare_environment(config.cluster)  # before Ray is imported
    shm_before = shm_entries()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="soak-engines-") as log_dir:
        run = soak(config, num_syncs=args.syncs, log_dir=Path(log_dir), shm_before=shm_before)
    survivors, leaked = _survivors(run), _leaked_shm(run)
    ran_past_warmup = len(run.samples) > args.warmup
    processes = []
    if ran_past_warmup:
        processes = process_figures(run.labels, run.samples, warmup=args.warmup, trimmed=run.trimmed)
    shm_at_warmup = run.shm[args.warmup - 1] if ran_past_warmup else set()
    shm_at_end = run.shm[-1] if run.shm else set()
    reasons = failures(
        processes,
        run.syncs,
        num_syncs=args.syncs,
        shm_at_warmup=shm_at_warmup,
        shm_at_end=shm_at_end,
        shm_leaked=leaked,
        survivors=survivors,
    )
    if run.error is not None:
        reasons.insert(0, f"the run failed: {run.error}")
    sync_times = [s.sync_s for s in run.syncs]
    print_table(processes)
    p50, p95 = percentile(sync_times, 50), percentile(sync_times, 95)
    print(
        f"sync wall time p50 {_show(p50, '.3f')}s p95 {_show(p95, '.3f')}s over "
        f"{len(sync_times)} syncs ({args.transport}); /dev/shm entries of this run: {len(run.run_shm)} seen, "
        f"{len(shm_at_end)} at the end, {len(leaked)} after shutdown"
    )
    verdict = "FAIL" if reasons else "PASS"
    for reason in reasons:
        print(f"  - {reason}")
    print(f"verdict: {verdict}")
    if args.json is not None:
        payload = {
            "verdict": verdict,
            "reasons": reasons,
            "error": run.error,
            "num_syncs": args.syncs,
            "warmup": args.warmup,
            "transport": args.transport,
            "overrides": [*SOAK_OVERRIDES, *args.overrides],
            "limits": {"rss_growth_pct": RSS_LIMIT_PCT, "fd_tolerance": FD_TOLERANCE},
            "sync_s_p50": p50,
            "sync_s_p95": p95,
            "sync_s_mean": statistics.fmean(sync_times) if sync_times else None,
            "wall_s": time.monotonic() - started,
            "processes": [asdict(p) for p in processes],
            "syncs": [{**asdict(s), "is_ok": s.is_ok} for s in run.syncs],
            "shm": {
                "seen": sorted(run.run_shm),
                "at_warmup": sorted(shm_at_warmup),
                "at_end": sorted(shm_at_end),
                "leaked_after_shutdown": sorted(leaked),
            },
            "survivors": survivors,
            "cpus": os.cpu_count(),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if reasons else 0


if __name__ == "__main__":
    sys.exit(main())
