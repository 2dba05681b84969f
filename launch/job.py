"""The main job: an RL loop on Ray that syncs Megatron weights into rollout engines every round.

    round 0:    rollouts from the starting weights (the baseline)
    round r>0:  reward the previous rollouts -> one GRPO step on every trainer rank -> sync -> rollouts from the
                synced version (each sample tagged with the version that produced it) -> the trainer recomputes
                the sampled tokens' log-probs, compared with the engines' (train/rollout agreement)

With `rollout.overlap` (Miles' async mode) round r's rollouts start before its GRPO step, on the version the
engines serve, and run through the step and the sync (retract or in_place keep them): their tokens come from that
version and, after the sync, from the new one; the record counts each version's tokens (`tokens_by_version`) and
compares only the new version's log-probs with the trainer's.

With `sync.enabled` false (the control run) every round trains the same way but skips the sync: the engines keep
serving the checkpoint, and the log-prob gap shows how far the trainer's weights have moved from them.

`run_job(config)` starts (or joins) Ray, places and starts the engines, trainer ranks and controller, runs
`config.num_rounds` rounds, and writes `<output_dir>/<run_name>/report.json` and `report.png`. `launch.run` is its
Hydra entry point. Everything it starts is stopped in `finally`, also when a round fails.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

import ray

from launch.cluster import connect_ray
from launch.fleet import JobActors, start_job_actors
from miles_sync.config import MilesSyncConfig, SyncMode
from miles_sync.engine.rollout import Sample
from miles_sync.job.rl import grpo_batch
from miles_sync.job.rollouts import generate_rollouts, rollout_stats, round_requests, score_batch
from miles_sync.job.run_report import (
    BaselineRecord,
    RolloutStats,
    RoundRecord,
    RunReport,
    config_record,
    format_row,
    machine_record,
    package_versions,
    round_record,
    summary_line,
    table_header,
    unsynced_round_record,
    why_stop,
    write_run_files,
)
from miles_sync.sync.draft_canary import CanaryMode
from miles_sync.sync.lora import adapter_name
from miles_sync.sync.report import ProgressBar, SyncReport

__all__ = ["JobResult", "run_job"]

_ROUND_MARGIN_S = 60.0  # beyond the sync's own timeout, for the controller to report its precise error
_PROGRESS_POLL_S = 0.2


@dataclass(frozen=True, kw_only=True)
class JobResult:
    report: RunReport
    json_path: Path
    png_path: Path


def run_job(config: MilesSyncConfig, *, out: IO[str] | None = None) -> JobResult:
    """Run the main job (module docstring). Raises after writing the report when a round fails."""
    out = sys.stdout if out is None else out

    def log(message: str) -> None:
        print(message, file=out, flush=True)

    run_dir = Path(config.output_dir) / config.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    baseline: BaselineRecord | None = None
    rounds: list[RoundRecord] = []
    status, nodes, starting = "completed", {}, ("", "")
    try:
        with connect_ray(config.cluster) as connection, _Fleet.start(config, log=log) as fleet:
            log(f"ray {'local cluster' if connection.is_local else 'cluster'} at {connection.address}")
            nodes = fleet.nodes
            starting = fleet.start_from_trainer_weights()
            version = fleet.weight_version()
            samples = fleet.rollouts(0)
            stats = fleet.rollout_stats(samples, version=version)
            baseline = BaselineRecord.of(stats, version=version)
            log(table_header())
            log(format_row(baseline))
            with _progress(config.num_rounds, enabled=out is sys.stdout and sys.stderr.isatty(), log=log) as advance:
                for index in range(1, config.num_rounds + 1):
                    row, samples = fleet.round(index, samples)
                    rounds.append(row)
                    advance(format_row(row))
                    for warning in row.warnings:
                        log(f"  warning: {warning}")
                    stop = why_stop(row, holds_on_canary=config.sync.draft_canary is CanaryMode.HOLD)
                    if stop is not None:
                        raise RuntimeError(f"round {index}: {stop}")
    except BaseException as exc:
        status = f"failed: {type(exc).__name__}: {exc}"
        raise
    finally:
        report = RunReport(
            run_name=config.run_name,
            status=status,
            config=config_record(config),
            packages=package_versions(),
            machine={**machine_record(), "nodes": nodes},
            baseline=baseline,
            rounds=tuple(rounds),
            starting_check=starting[0],
            starting_sync=starting[1],
        )
        json_path, png_path = write_run_files(report, run_dir, control_report=config.control_report)
        log(f"wrote {json_path} and {png_path}")
    line = summary_line(baseline, rounds)
    if line is not None:
        log(line)
    return JobResult(report=report, json_path=json_path, png_path=png_path)


class _Fleet:
    """The running actors of one job: engines (launched or given as URLs), trainer ranks and the controller."""

    def __init__(self, config: MilesSyncConfig, actors: JobActors, *, log: Callable[[str], None]) -> None:
        self._config = config
        self._urls = actors.urls
        self._router = actors.router
        self._start_joiner = actors.start_joiner
        self._num_route_changes = 0  # the controller's route changes already in a round's record
        self.nodes = actors.nodes  # where each trainer rank and engine runs (report.json)
        self._trainers = actors.trainers
        self._controller = actors.controller
        self._log = log
        self._sync_timeout_s = config.sync.sync_timeout_s + _ROUND_MARGIN_S
        # Overlapped rollouts run through a step and a sync: they may take both, and each request its own timeout.
        self._rollout_timeout_s = self._sync_timeout_s * 2 + config.sync.http_timeout_s
        # sync.mode=lora: rollouts name the adapter of the last committed version (adapter_name) once a sync loaded
        # one (before that the engines serve the base, which a fresh adapter, B = 0, leaves unchanged).
        self._lora_path: str | None = None
        self._show_progress = sys.stderr.isatty()

    @classmethod
    @contextlib.contextmanager
    def start(cls, config: MilesSyncConfig, *, log: Callable[[str], None]) -> Iterator[_Fleet]:
        with start_job_actors(config, log=log) as actors:
            yield cls(config, actors, log=log)

    def start_from_trainer_weights(self) -> tuple[str, str]:
        """Round 0 must sample the trainer's starting weights, but servers may serve anything (reused ones served an
        earlier run's last weights, 8.6 nats off at round 0). The controller checks every engine against them
        without a sync (`check_engines`); engines not shown to hold them get one verified sync first. Returns (the
        check's summary, that sync's version or ""). LoRA runs skip it (the engines serve the base; a fresh adapter,
        B = 0, leaves it unchanged), and so do runs with `sync.verify` off, whose servers given by URL are synced."""
        if self._config.sync.mode is SyncMode.LORA or not self._config.sync.verify:
            return "", (self._sync_starting_weights() if self._config.engines.urls else "")
        check = ray.get(self._controller.check_engines.remote(), timeout=self._sync_timeout_s)
        self._log(check.summary())
        return check.summary(), (self._sync_starting_weights() if check.to_sync else "")

    def _sync_starting_weights(self) -> str:
        """One verified sync of the starting weights; its version. Raises when it does not commit or is not
        verified against the trainer's bytes."""
        report = self._sync_with_progress()
        record = round_record(0, report, loss=0.0, trainer_step=0, rollouts=None)
        if not report.committed or not record.verified:
            raise RuntimeError(f"syncing the starting weights into {list(self._urls)} failed: {report.summary()}")
        self._log(f"engines synced to the trainer's starting weights: version {report.version} ({report.verification})")
        return report.version

    def weight_version(self) -> str:
        return ray.get(self._controller.status.remote(), timeout=self._config.sync.http_timeout_s).weight_version

    @property
    def _rollout_urls(self) -> tuple[str, ...]:
        """Where each engine's share of a round's requests goes: the engine, or the router (which picks one)."""
        return self._urls if self._router is None else (self._router.url,) * len(self._urls)

    def rollouts(self, index: int) -> list[Sample]:
        """Round `index`'s samples (miles_sync.job.rollouts.round_requests), with the engines' log-probs."""
        return generate_rollouts(
            self._rollout_urls,
            round_requests(self._config, index, num_engines=len(self._urls)),
            api_key=self._config.engines.api_key,
            timeout_s=self._config.sync.http_timeout_s,
            lora_path=self._lora_path,
        )

    def rollout_stats(self, samples: Sequence[Sample], *, version: str, earlier: str | None = None) -> RolloutStats:
        """What `samples` show, with the trainer's log-probs of every sampled token under its current weights
        (`earlier`: the version overlapped rollouts started under; miles_sync.job.rollouts.rollout_stats)."""
        batch = score_batch(samples, temperature=self._config.rollout.temperature)
        scored = self._trainers.completion_logprobs(batch, timeout_s=self._sync_timeout_s)
        urls = self._urls if self._router is None else (self._router.url,)  # behind a router: one reward
        return rollout_stats(samples, scored, urls=urls, version=version, earlier=earlier)

    def round(self, index: int, previous: Sequence[Sample]) -> tuple[RoundRecord, list[Sample]]:
        # rollout.overlap: this round's rollouts start now, on the weights the engines serve, and run through the
        # step and the sync (which retracts or keeps them, never aborts them); otherwise they start after the sync.
        early = _Background(lambda: self.rollouts(index)) if self._config.rollout.overlap else None
        earlier = self.weight_version() if early is not None else None
        steps = self._trainers.train_step(grpo_batch(previous), timeout_s=self._sync_timeout_s)
        losses = {s.loss for s in steps}
        if len(losses) != 1:  # tensor-parallel ranks compute one loss; anything else is a broken group
            raise RuntimeError(f"round {index}: trainer ranks computed different losses {sorted(losses)}")
        loss, step = steps[0].loss, steps[0].step
        joined = self._join(index)
        if not self._config.sync.enabled:  # the control run: the engines keep what they serve
            version = self.weight_version()
            samples = self.rollouts(index) if early is None else early.result(self._rollout_timeout_s)
            stats = self.rollout_stats(samples, version=version)
            return unsynced_round_record(index, version=version, loss=loss, trainer_step=step, rollouts=stats), samples
        report = self._sync_with_progress()
        routing = self._routing(joined=joined)
        if report.committed and self._config.sync.mode is SyncMode.LORA:
            self._lora_path = adapter_name(self._config.sync.lora.name, report.version)
        # A canary in hold mode paused the engines it flagged: no rollouts go to them, and the run stops.
        is_held = bool(report.canary_flagged) and self._config.sync.draft_canary is CanaryMode.HOLD
        if not report.committed or is_held:
            # Overlapped rollouts on held engines wait there; the run stops (why_stop), and they end with it.
            self._log(report.summary())
            return replace(round_record(index, report, loss=loss, trainer_step=step, rollouts=None), **routing), []
        samples = self.rollouts(index) if early is None else early.result(self._rollout_timeout_s)
        stats = self.rollout_stats(samples, version=report.version, earlier=earlier)
        if early is not None:
            counts = ", ".join(f"{'v' if v.isdigit() else ''}{v}: {n}" for v, n in stats.tokens_by_version)
            self._log(f"  round {index}: rollouts overlapped the step and the sync; sampled tokens {counts}")
        return replace(round_record(index, report, loss=loss, trainer_step=step, rollouts=stats), **routing), samples

    def _join(self, index: int) -> tuple[str, ...]:
        """engines.join_at_round: before round `index`'s sync, launch one more engine and add it to the fleet
        (paused, not routed, stale until that sync verifies on it). The joiner's URL, or () on other rounds."""
        if self._start_joiner is None or index != self._config.engines.join_at_round:
            return ()
        url = self._start_joiner()
        ray.get(self._controller.add_engine.remote(url), timeout=self._sync_timeout_s)
        self._urls = (*self._urls, url)
        self._log(f"round {index}: engine {url} joined the fleet; it serves once this round's sync verifies on it")
        return (url,)

    def _routing(self, *, joined: tuple[str, ...]) -> dict:
        """The round record's fleet fields: the engines, those routed, and the router's changes since last round."""
        status = ray.get(self._controller.status.remote(), timeout=self._config.sync.http_timeout_s)
        changes = status.route_changes[self._num_route_changes :]
        self._num_route_changes = len(status.route_changes)
        for change in changes:
            self._log(f"  router: {change.action.value} {change.url} ({change.reason})")
        return {
            "engines": status.engine_urls,
            "routed_engines": status.routed_engines,
            "route_changes": tuple(f"{c.action.value} {c.url}: {c.reason}" for c in changes),
            "joined": joined,
        }

    def _sync_with_progress(self) -> SyncReport:
        """One sync on the controller; meanwhile a per-bucket bar on this driver, fed by polling the controller."""
        get_timeout = self._config.sync.http_timeout_s
        previous = ray.get(self._controller.status.remote(), timeout=get_timeout).progress
        ref = self._controller.sync.remote(raise_on_failure=False)
        bar = ProgressBar(description="sync", is_enabled=self._show_progress, file=sys.stderr)
        num_shown = 0
        deadline = time.monotonic() + self._sync_timeout_s
        try:
            while True:
                ready, _ = ray.wait([ref], timeout=_PROGRESS_POLL_S)
                progress = ray.get(self._controller.status.remote(), timeout=get_timeout).progress
                if progress is not None and progress != previous:  # the running sync's, not the last one's
                    for event in progress.buckets[num_shown:]:
                        bar.update(event)
                    num_shown = len(progress.buckets)
                if ready:
                    return ray.get(ref, timeout=get_timeout)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the sync did not return within {self._sync_timeout_s} s")
        finally:
            bar.close()


class _Background:
    """`work()` on a daemon thread of its own (a run that stops does not wait for it); `result` waits for it, at
    most `timeout_s`, and raises what it raised."""

    def __init__(self, work: Callable[[], list[Sample]]) -> None:
        self._work = work
        self._value: list[Sample] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="overlapped-rollouts", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._work()
        except BaseException as exc:  # raised again in the caller's thread by result()
            self._error = exc

    def result(self, timeout_s: float) -> list[Sample]:
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the overlapped rollouts did not finish within {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error
        if self._value is None:
            raise RuntimeError("the overlapped rollouts ended without samples")
        return self._value


@contextlib.contextmanager
def _progress(total: int, *, enabled: bool, log: Callable[[str], None]) -> Iterator[Callable[[str], None]]:
    """A live bar over the rounds (on stderr, when `enabled`); each finished round's row is printed above it."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc="rounds", unit="round", disable=not enabled, file=sys.stderr, leave=False)

    def advance(row: str) -> None:
        if enabled:
            bar.write(row, file=sys.stdout)
        else:
            log(row)
        bar.update(1)

    try:
        yield advance
    finally:
        bar.close()
