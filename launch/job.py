"""The main job: an RL loop on Ray that syncs Megatron weights into rollout engines every round.

    round 0:    rollouts from the starting weights (the baseline)
    round r>0:  reward the previous rollouts -> one GRPO step on every trainer rank -> sync -> rollouts from the
                synced version (each sample tagged with the version that produced it) -> the trainer recomputes
                the sampled tokens' log-probs, compared with the engines' (train/rollout agreement)

With `sync.enabled` false (the control run) every round trains the same way but skips the sync: the engines keep
serving the checkpoint, and the log-prob gap shows how far the trainer's weights have moved from them.

`run_job(config)` starts (or joins) Ray, places and starts the engines, trainer ranks and controller, runs
`config.num_rounds` rounds, and writes `<output_dir>/<run_name>/report.json` and `report.png`. `launch.run` is its
Hydra entry point. Everything it starts is stopped in `finally`, also when a round fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import ray

from actors.controller import create_controller
from actors.placement import PlacedGroups, create_placement_groups
from actors.rollout import DEFAULT_ENGINE_RESOURCES, EngineGroup, create_engines
from actors.trainer import DEFAULT_TRAINER_RESOURCES, TrainerGroup, create_trainers
from launch.cluster import connect_ray
from launch.sglang_venv import SGLANG_VENV_PYTHON
from miles_sync.config import EngineConfig, MilesSyncConfig, SyncMode, TrainerConfig
from miles_sync.engine.client import EngineClient
from miles_sync.engine.kinds import EngineKind, engine_spec
from miles_sync.engine.reference.checkpoints import BUILT_IN_ARCHS, cached_checkpoints
from miles_sync.engine.reference.fp8_checkpoint import default_block, fp8_checkpoint, fp8_serving_problems
from miles_sync.engine.rollout import Sample, generate_samples
from miles_sync.env import node_of_url, read_environment
from miles_sync.job.placement import PlacementLayout, Resources, plan_colocated_feeds, plan_placement
from miles_sync.job.rl import grpo_batch, make_prompts, mean_accept_length, reward, rule_share, sampling_seed
from miles_sync.job.run_report import (
    BaselineRecord,
    RolloutStats,
    RoundRecord,
    RunReport,
    config_record,
    format_row,
    package_versions,
    read_reward_curve,
    round_record,
    table_header,
    unsynced_round_record,
    write_png,
)
from miles_sync.job.trainer import ScoreBatch
from miles_sync.megatron.lora import LoraSpec
from miles_sync.sync.draft_canary import CanaryMode
from miles_sync.sync.lora import adapter_name
from miles_sync.sync.report import ProgressBar, SyncReport
from miles_sync.transport.base import FeedPlan, transport_spec
from miles_sync.wire.protocol import SamplingParams

__all__ = ["JobActors", "JobResult", "run_job", "start_job_actors"]

_START_TIMEOUT_S = 600.0  # engines and trainer ranks import torch/megatron and load the checkpoint
_PLACEMENT_TIMEOUT_S = 120.0
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
    status = "completed"
    nodes: dict[str, Any] = {}
    try:
        with connect_ray(config.cluster) as connection, _Fleet.start(config, log=log) as fleet:
            log(f"ray {'local cluster' if connection.is_local else 'cluster'} at {connection.address}")
            nodes = fleet.nodes
            if config.engines.urls:
                fleet.sync_starting_weights()
            version = fleet.weight_version()
            samples = fleet.rollouts(0)
            stats = fleet.rollout_stats(samples, version=version)
            baseline = BaselineRecord(
                version=version,
                accept_length=stats.accept_length,
                reward=stats.reward,
                reward_per_engine=stats.reward_per_engine,
                rule_share=stats.rule_share,
                logprob_diff_max=stats.logprob_diff_max,
                logprob_diff_mean=stats.logprob_diff_mean,
            )
            log(table_header())
            log(format_row(baseline))
            with _progress(config.num_rounds, enabled=out is sys.stdout and sys.stderr.isatty(), log=log) as advance:
                for index in range(1, config.num_rounds + 1):
                    row, samples = fleet.round(index, samples)
                    rounds.append(row)
                    advance(format_row(row))
                    for warning in row.warnings:
                        log(f"  warning: {warning}")
                    if row.synced and not row.committed:
                        raise RuntimeError(f"round {index}: the sync failed: {row.error}")
                    if row.canary_flagged and config.sync.draft_canary is CanaryMode.HOLD:
                        raise RuntimeError(
                            f"round {index}: the draft canary held {', '.join(row.canary_flagged)} paused "
                            "(sync.draft_canary=hold); see the warnings above"
                        )
    except BaseException as exc:
        status = f"failed: {type(exc).__name__}: {exc}"
        raise
    finally:
        report = RunReport(
            run_name=config.run_name,
            status=status,
            config=config_record(config),
            packages=package_versions(),
            machine={**_machine(), "nodes": nodes},
            baseline=baseline,
            rounds=tuple(rounds),
        )
        json_path, png_path = run_dir / "report.json", run_dir / "report.png"
        report.write_json(json_path)
        control = None if config.control_report is None else read_reward_curve(Path(config.control_report))
        title = f"miles_sync run {config.run_name!r}" + ("" if config.sync.enabled else " (control: never synced)")
        write_png(png_path, baseline=baseline, rounds=rounds, title=title, control=control)
        log(f"wrote {json_path} and {png_path}")
    _summarize(baseline, rounds, log=log)
    return JobResult(report=report, json_path=json_path, png_path=png_path)


@dataclass(frozen=True, kw_only=True)
class JobActors:
    """The running actors of one job. `engines` is None when the job uses running servers (`engines.urls`)."""

    urls: tuple[str, ...]
    engines: EngineGroup | None
    trainers: TrainerGroup
    controller: Any


@contextlib.contextmanager
def start_job_actors(
    config: MilesSyncConfig, *, log: Callable[[str], None], engine_log_dir: Path | None = None
) -> Iterator[JobActors]:
    """Place and start the job's engines (unless given as URLs), trainer ranks and controller on the connected Ray
    cluster; stop them in reverse on exit. Engine logs go to `engine_log_dir` (default:
    <output_dir>/<run_name>/engine-logs)."""
    if engine_log_dir is None:
        engine_log_dir = Path(config.output_dir) / config.run_name / "engine-logs"
    with contextlib.ExitStack() as stack:
        checkpoint = _checkpoint_dir(config, log=log)
        config = _resolve_fp8_block(config, checkpoint, log=log)
        _check_checkpoint(config, checkpoint)  # what the trainers could not split or export fails before placement
        placed = _placement(config)
        if placed is not None:
            stack.callback(placed.remove)
        feeds = _feeds(config, placed)  # refuses a layout with an unfed engine rank before any actor starts
        engines = None
        if config.engines.urls:
            urls = config.engines.urls
            log(f"using {len(urls)} running engine server(s): {', '.join(urls)}")
        else:
            log(
                f"starting {config.engines.count} {config.engines.kind.value} engine(s) (TP={config.engines.tp}) "
                f"and {config.trainer.world_size} trainer rank(s) ({_layout(config.trainer)})"
            )
        # Engines and trainer ranks start at once: each side spends most of its start-up importing.
        with _Background(_start_engines, config, checkpoint, placed, engine_log_dir) as engine_start:
            trainers = create_trainers(
                trainer=config.trainer,
                checkpoint_dir=checkpoint,
                num_trained_mtp_layers=config.model.num_trained_mtp_layers,
                seed=config.seed,
                placement=placed,
                bind_host=config.cluster.bind_host,
                timeout_s=_START_TIMEOUT_S,
                collective_timeout_s=config.sync.collective_timeout_s,
                feeds=feeds,
                conversion=config.sync.conversion,
                lora=_lora_spec(config),
                lora_flatten_min_bytes=config.sync.lora.flatten_min_bytes,
            )
            stack.callback(trainers.shutdown)
            engines = engine_start.result()
        if engines is not None:
            stack.callback(engines.shutdown)
            urls = engines.urls
        controller = create_controller(
            trainers=trainers.actors,
            engine_urls=urls,
            sync=config.sync,
            model=config.model,
            api_key=config.engines.api_key,
            admin_api_key=config.engines.admin_api_key,
            timeout_s=_START_TIMEOUT_S,
            # The canary's prompts come from the task the draft predicts (round 0's): on them the baseline is high
            # enough that a collapse shows.
            canary_prompts=make_prompts(0, num_prompts=config.rollout.num_prompts, length=config.rollout.prompt_length),
        )
        stack.callback(_close_controller, controller)
        sources = [info for info in trainers.ranks if info.is_source]  # one per pipeline stage
        log(
            f"fleet ready: {len(urls)} engine(s), {len(trainers.actors)} trainer rank(s), "
            + (
                f"{sum(info.num_exported_tensors for info in sources)} tensors per sync"
                if config.sync.mode is SyncMode.FULL
                else "the LoRA adapter per sync (sync.mode=lora; the base is never sent)"
            )
            + (f" from {len(sources)} pipeline stages (one update group each)" if len(sources) > 1 else "")
        )
        yield JobActors(urls=tuple(urls), engines=engines, trainers=trainers, controller=controller)


class _Fleet:
    """The running actors of one job: engines (launched or given as URLs), trainer ranks and the controller."""

    def __init__(
        self,
        config: MilesSyncConfig,
        *,
        urls: Sequence[str],
        trainers: TrainerGroup,
        controller: Any,
        log: Callable[[str], None],
        nodes: dict[str, Any] | None = None,
    ) -> None:
        self._config = config
        self._urls = tuple(urls)
        self.nodes = {} if nodes is None else nodes  # where each trainer rank and engine runs (report.json)
        self._trainers = trainers
        self._controller = controller
        self._log = log
        self._sync_timeout_s = config.sync.sync_timeout_s + _ROUND_MARGIN_S
        # sync.mode=lora: rollouts name the adapter of the last committed version (adapter_name) once a sync loaded
        # one (before that the engines serve the base, which a fresh adapter, B = 0, leaves unchanged).
        self._lora_path: str | None = None
        self._show_progress = sys.stderr.isatty()

    @classmethod
    @contextlib.contextmanager
    def start(cls, config: MilesSyncConfig, *, log: Callable[[str], None]) -> Iterator[_Fleet]:
        with start_job_actors(config, log=log) as actors:
            nodes = node_record(actors.trainers, actors.engines, urls=actors.urls)
            log("nodes: " + ", ".join(f"trainer rank {r['rank']} on {r['node']}" for r in nodes["trainer_ranks"]))
            log("nodes: " + ", ".join(f"engine {e['url']} on {e['node']}" for e in nodes["engines"]))
            yield cls(
                config,
                urls=actors.urls,
                trainers=actors.trainers,
                controller=actors.controller,
                log=log,
                nodes=nodes,
            )

    def sync_starting_weights(self) -> None:
        """Servers given by URL may serve anything (measured: servers reused from an earlier run served its last
        weights, 8.6 nats of log-prob away from the checkpoint, at round 0): one verified sync of the trainer's
        starting weights before round 0, so the baseline is measured on them. A check without a send would need
        a verify-only session; the sync costs about as much and its verification proves the same. Raises when it
        does not commit or is not verified against the trainer's bytes."""
        report = self._sync_with_progress()
        record = round_record(0, report, loss=0.0, trainer_step=0, rollouts=None)
        if not report.committed or not record.verified:
            raise RuntimeError(f"syncing the starting weights into {list(self._urls)} failed: {report.summary()}")
        self._log(f"engines synced to the trainer's starting weights: version {report.version} ({report.verification})")

    def weight_version(self) -> str:
        return ray.get(self._controller.status.remote(), timeout=self._config.sync.http_timeout_s).weight_version

    def rollouts(self, index: int) -> list[Sample]:
        """Round `index`'s samples: `samples_per_prompt` of every prompt on every engine, each request with its own
        sampling seed (`rl.sampling_seed`), with the engines' log-probs. Engine-major, then prompt, then sample."""
        rollout = self._config.rollout
        prompts = make_prompts(index, num_prompts=rollout.num_prompts, length=rollout.prompt_length)
        requests = [
            [
                (
                    prompt,
                    SamplingParams(
                        max_new_tokens=rollout.max_new_tokens,
                        temperature=rollout.temperature,
                        sampling_seed=sampling_seed(
                            self._config.seed,
                            round_index=index,
                            engine_index=e,
                            prompt_index=p,
                            sample_index=k,
                        ),
                    ),
                )
                for p, prompt in enumerate(prompts)
                for k in range(rollout.samples_per_prompt)
            ]
            for e in range(len(self._urls))
        ]
        return _generate(
            self._urls,
            requests,
            api_key=self._config.engines.api_key,
            timeout_s=self._config.sync.http_timeout_s,
            lora_path=self._lora_path,
        )

    def rollout_stats(self, samples: Sequence[Sample], *, version: str) -> RolloutStats:
        """Reward, accept length and train/rollout log-prob agreement of `samples`: the trainer recomputes the
        log-prob of every sampled token with its current weights and compares it with the engine's."""
        diffs: list[float] = []
        scored = self._trainers.completion_logprobs(
            ScoreBatch(
                sequences=tuple(s.prompt_ids + s.output_ids for s in samples),
                num_prompt_tokens=tuple(len(s.prompt_ids) for s in samples),
                temperature=self._config.rollout.temperature,
            ),
            timeout_s=self._sync_timeout_s,
        )
        has_logprobs = all(s.output_logprobs is not None for s in samples)
        if has_logprobs:
            for sample, trainer in zip(samples, scored.logprobs, strict=True):
                diffs += [abs(a - b) for a, b in zip(trainer, sample.output_logprobs, strict=True)]
        return RolloutStats(
            reward=_mean_reward(samples),
            reward_per_engine=tuple(_mean_reward([s for s in samples if s.engine_url == u]) for u in self._urls),
            rule_share=sum(rule_share(s) for s in samples) / len(samples),
            accept_length=mean_accept_length(samples),
            logprob_diff_max=max(diffs) if diffs else None,
            logprob_diff_mean=sum(diffs) / len(diffs) if diffs else None,
            trainer_step=scored.weight_step,
            samples_tagged=all(s.weight_version == version for s in samples),
            num_samples=len(samples),
        )

    def round(self, index: int, previous: Sequence[Sample]) -> tuple[RoundRecord, list[Sample]]:
        steps = self._trainers.train_step(grpo_batch(previous), timeout_s=self._sync_timeout_s)
        losses = {s.loss for s in steps}
        if len(losses) != 1:  # tensor-parallel ranks compute one loss; anything else is a broken group
            raise RuntimeError(f"round {index}: trainer ranks computed different losses {sorted(losses)}")
        loss, step = steps[0].loss, steps[0].step
        if not self._config.sync.enabled:  # the control run: the engines keep what they serve
            version = self.weight_version()
            samples = self.rollouts(index)
            stats = self.rollout_stats(samples, version=version)
            return unsynced_round_record(index, version=version, loss=loss, trainer_step=step, rollouts=stats), samples
        report = self._sync_with_progress()
        if report.committed and self._config.sync.mode is SyncMode.LORA:
            self._lora_path = adapter_name(self._config.sync.lora.name, report.version)
        # A canary in hold mode paused the engines it flagged: no rollouts go to them, and the run stops.
        is_held = bool(report.canary_flagged) and self._config.sync.draft_canary is CanaryMode.HOLD
        if not report.committed or is_held:
            self._log(report.summary())
            return round_record(index, report, loss=loss, trainer_step=step, rollouts=None), []
        samples = self.rollouts(index)
        stats = self.rollout_stats(samples, version=report.version)
        return round_record(index, report, loss=loss, trainer_step=step, rollouts=stats), samples

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


def _layout(trainer: TrainerConfig) -> str:
    """The trainer layout in a log line: TP always, every other factor where it is not 1."""
    factors = {"TP": trainer.tp, "PP": trainer.pp, "DP": trainer.dp, "EP": trainer.ep, "ETP": trainer.etp}
    return ", ".join(f"{name}={value}" for name, value in factors.items() if name == "TP" or value != 1)


def _checkpoint_dir(config: MilesSyncConfig, *, log: Callable[[str], None]) -> str:
    if config.model.checkpoint_dir is not None:
        return config.model.checkpoint_dir
    arch = config.model.arch
    if arch not in BUILT_IN_ARCHS:
        raise ValueError(
            f"model.checkpoint_dir is null and model.arch={arch!r} has no built-in reference checkpoint; "
            f"built-in archs: {', '.join(BUILT_IN_ARCHS)} (or set model.checkpoint_dir)"
        )
    cache = read_environment().cache_dir
    log(f"reference {arch} checkpoint: {cache} (built once, a few minutes, on the first run)")
    return str(cached_checkpoints(cache, arch=arch) / "target")


def _check_checkpoint(config: MilesSyncConfig, checkpoint: str) -> None:
    """Raise ValueError when the trainer layout cannot split the checkpoint's model (layers per pp, experts per ep)
    or `sync.conversion` cannot export it (its config.json may name another family than `model.arch`, or MoE
    experts). A directory without config.json is left to the engines."""
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        return
    hf_config = json.loads(path.read_text())
    problems = config.trainer.checkpoint_problems(hf_config) + config.sync.checkpoint_problems(
        hf_config, num_trained_mtp_layers=config.model.num_trained_mtp_layers
    )
    spec = config.sync.quantization_spec
    if spec is not None:  # SGLang's block-FP8 size check, at the engines' TP size (sync.fp8_block names the block)
        problems += [
            f"sync.fp8_block={list(spec.block)}: {p}"
            for p in fp8_serving_problems(hf_config, tp_size=config.engines.tp, spec=spec)
        ]
    if problems:
        raise ValueError(f"checkpoint {checkpoint}: " + "; ".join(problems))


def _resolve_fp8_block(config: MilesSyncConfig, checkpoint: str, *, log: Callable[[str], None]) -> MilesSyncConfig:
    """sync.quantization=fp8_block with fp8_block null: the block `default_block` picks for the checkpoint's model
    at the engines' TP size (128x128 for real models, smaller for the tiny built-in ones)."""
    spec = config.sync.quantization_spec
    path = Path(checkpoint) / "config.json"
    if spec is None or config.sync.fp8_block is not None or not path.is_file():
        return config
    block = default_block(json.loads(path.read_text()), tp_size=config.engines.tp).block
    log(f"block FP8: sync.fp8_block=null resolves to {list(block)} for this model at engine TP={config.engines.tp}")
    return dataclasses.replace(config, sync=dataclasses.replace(config.sync, fp8_block=block))


def _placement(config: MilesSyncConfig) -> PlacedGroups | None:
    """Colocated transport: each trainer rank shares a bundle with an engine; otherwise trainers and engines get
    bundles of their own. None when the engines are external servers (only trainers are placed, by Ray)."""
    if config.engines.urls:
        return None
    # A transport that feeds engines from every trainer rank maps memory across processes on one device: colocate.
    is_colocated = transport_spec(config.sync.transport).feeds_from_every_rank
    cluster = config.cluster
    plan = plan_placement(
        layout=PlacementLayout.COLOCATED if is_colocated else PlacementLayout.DISAGGREGATED,
        num_trainers=config.trainer.world_size,
        num_engines=config.engines.count,
        trainer=_on_nodes(DEFAULT_TRAINER_RESOURCES, cluster.trainer_node_resource),
        engine=_on_nodes(DEFAULT_ENGINE_RESOURCES, cluster.engine_node_resource),
        engine_tp_size=config.engines.tp,
        strategy=cluster.trainer_strategy,
        engine_strategy=cluster.engine_strategy,
    )
    return create_placement_groups(plan, timeout_s=_PLACEMENT_TIMEOUT_S, name_prefix=config.run_name)


def _on_nodes(resources: Resources, node_resource: str | None) -> Resources:
    """`resources` plus one unit of the custom node resource that marks the nodes this role may run on."""
    return resources if node_resource is None else resources + Resources(custom=((node_resource, 1.0),))


def _feeds(config: MilesSyncConfig, placed: PlacedGroups | None) -> FeedPlan | None:
    """Colocated transport on placed engines: each engine rank is fed by the trainer rank on its bundle (engine j
    by trainer rank j with TP=1 engines). Running servers (`engines.urls`) have no placement here: the export
    source feeds them all. With pipeline stages each stage's source feeds every engine rank itself: a feed plan spans
    the whole trainer group, and the stages open one after another (miles_sync.sync.pipeline)."""
    if placed is None or not transport_spec(config.sync.transport).feeds_from_every_rank or config.trainer.pp > 1:
        return None
    return plan_colocated_feeds(placed.plan)


def _start_engines(
    config: MilesSyncConfig, checkpoint: str, placed: PlacedGroups | None, log_dir: Path
) -> EngineGroup | None:
    if config.engines.urls:
        return None
    spec = config.sync.quantization_spec
    # Block FP8: the engines serve the block-FP8 copy of the checkpoint (their quantization follows it, as SGLang's).
    served = checkpoint if spec is None else str(fp8_checkpoint(checkpoint, spec))
    settings = config.engines.launch_settings(
        model_dir=served,
        collective_timeout_s=config.sync.collective_timeout_s,
        speculative_algorithm=config.model.speculative_algorithm,
        lora=config.sync.lora.engine_settings() if config.sync.mode is SyncMode.LORA else None,
        device=_engine_device(config.engines.device),
        server_python=_sglang_python(config.engines) if config.engines.kind is EngineKind.SGLANG else None,
    )
    spec = engine_spec(config.engines.kind, settings)
    return create_engines(
        specs=[spec] * config.engines.count,
        log_dir=log_dir.resolve(),
        placement=placed,
        bind_host=config.cluster.bind_host,
        http_timeout_s=config.sync.http_timeout_s,
        timeout_s=_START_TIMEOUT_S,
    )


def _engine_device(device: str) -> str | None:
    """`engines.device` on this node: auto is cpu where torch sees no CUDA device (the engines' nodes are
    assumed to be of the driver's kind; give cpu or cuda explicitly for a mixed cluster)."""
    if device != "auto":
        return device
    import torch

    return None if torch.cuda.is_available() else "cpu"


def _sglang_python(engines: EngineConfig) -> str | None:
    """The SGLang server's interpreter: `engines.sglang_python`, else the venv launch/install_sglang.sh made
    (launch/local.sh installs it for engines.kind=sglang), else None (this interpreter: SGLang installed beside
    miles_sync, as on a GPU image)."""
    if engines.sglang_python is not None:
        return engines.sglang_python
    return str(SGLANG_VENV_PYTHON) if SGLANG_VENV_PYTHON.is_file() else None


def _lora_spec(config: MilesSyncConfig) -> LoraSpec | None:
    """What the trainer ranks adapt under sync.mode=lora (None: they train every weight)."""
    if config.sync.mode is not SyncMode.LORA:
        return None
    lora = config.sync.lora
    return LoraSpec(rank=lora.rank, alpha=lora.alpha, target_modules=lora.target_modules)


def _close_controller(controller: Any) -> None:
    with contextlib.suppress(Exception):
        ray.get(controller.close.remote(), timeout=60)
    ray.kill(controller)


def _generate(
    urls: Sequence[str],
    requests: Sequence[Sequence[tuple[Sequence[int], SamplingParams]]],
    *,
    api_key: str | None,
    timeout_s: float,
    lora_path: str | None = None,
) -> list[Sample]:
    """`requests[e]` (prompt, sampling) pairs on engine `urls[e]`, every request of every engine at once, from this
    process over HTTP, with the engines' log-probs; the samples in request order, engine after engine."""

    async def run() -> list[Sample]:
        clients = [EngineClient(u, timeout_s=timeout_s, api_key=api_key) for u in urls]
        try:
            batches = await asyncio.gather(
                *(
                    generate_samples(client, [prompt], sampling=sampling, return_logprob=True, lora_path=lora_path)
                    for client, pairs in zip(clients, requests, strict=True)
                    for prompt, sampling in pairs
                )
            )
        finally:
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        return [s for batch in batches for s in batch]

    return asyncio.run(run())


def _mean_reward(samples: Sequence[Sample]) -> float:
    return sum(reward(s) for s in samples) / len(samples) if samples else 0.0


def node_record(trainers: TrainerGroup, engines: EngineGroup | None, *, urls: Sequence[str]) -> dict[str, Any]:
    """Where each trainer rank and engine ran, for report.json's `machine.nodes`: Ray's node IP and the address it
    bound. Engines given as URLs (`engines.urls`) are recorded by the host of their URL."""
    trainer_ranks = [
        {"rank": info.rank, "node": node.node_ip, "bind_host": node.bind_host, "is_source": info.is_source}
        for info, node in zip(trainers.ranks, trainers.nodes)
    ]
    if engines is not None and engines.nodes:
        engine_rows = [
            {"url": url, "node": node.node_ip, "bind_host": node.bind_host} for url, node in zip(urls, engines.nodes)
        ]
    else:
        engine_rows = [{"url": url, "node": node_of_url(url), "bind_host": node_of_url(url)} for url in urls]
    return {"trainer_ranks": trainer_ranks, "engines": engine_rows}


def _machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform()}


def _summarize(baseline: BaselineRecord | None, rounds: Sequence[RoundRecord], *, log: Callable[[str], None]) -> None:
    if baseline is None or not rounds:
        return
    first, last = baseline.accept_length, rounds[-1].accept_length
    verified = sum(r.verified for r in rounds)
    diffs = [r.logprob_diff_max for r in rounds if r.logprob_diff_max is not None]
    log(
        f"{len(rounds)} rounds, {verified} verified; accept length {first} -> {last}; "
        f"mean reward {baseline.reward:.3f} -> {rounds[-1].reward:.3f}"
        + (f"; max |trainer - engine| log-prob over the rounds {max(diffs):.2e}" if diffs else "")
    )


class _Background:
    """Run `fn(*args)` on a thread for the duration of a `with` block; `result()` joins it (re-raising)."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1)
        self._future = self._pool.submit(fn, *args)

    def __enter__(self) -> _Background:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # On an error in the block, wait for the engines and stop them: nothing else holds them yet.
        self._pool.shutdown(wait=True)
        if exc_type is not None and self._future.exception() is None:
            group = self._future.result()
            if group is not None:
                group.shutdown()

    def result(self) -> Any:
        return self._future.result(timeout=_START_TIMEOUT_S)


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
