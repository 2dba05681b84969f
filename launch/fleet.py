"""The main job's fleet on Ray: place and start the engines (unless given as URLs), the trainer ranks and the
controller from a resolved config (miles_sync.job.resolve), and stop them in reverse. `launch.job` drives the
rounds over what `start_job_actors` yields; benchmarks and tests start the same fleet through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from actors.controller import create_controller
from actors.placement import create_placement_groups
from actors.rollout import EngineGroup, create_engines
from actors.trainer import TrainerGroup, create_trainers
from launch.sglang_venv import SGLANG_VENV_PYTHON
from miles_sync.config import MilesSyncConfig, SyncMode
from miles_sync.engine.kinds import engine_spec
from miles_sync.engine.router import RouterClient, RouterProcess, RouterSpec
from miles_sync.env import bind_host, node_of_url
from miles_sync.job.placement import job_feed_plan, job_placement
from miles_sync.job.resolve import engine_device, engine_settings, resolve_job, trainer_lora
from miles_sync.job.rl import make_prompts

__all__ = ["JobActors", "node_record", "start_job_actors"]

_START_TIMEOUT_S = 600.0  # engines and trainer ranks import torch/megatron and load the checkpoint
_PLACEMENT_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class JobActors:
    """The running actors of one job. `engines` is None when the job uses running servers (`engines.urls`)."""

    urls: tuple[str, ...]
    engines: EngineGroup | None
    trainers: TrainerGroup
    controller: Any
    nodes: dict[str, Any]  # where each trainer rank and engine runs (node_record; report.json's machine.nodes)
    router: RouterClient | None = None  # the router every rollout goes through (rollout.router); None: none
    # engines.join_at_round: launches one more engine of the job's kind (stopped with the rest); returns its URL.
    start_joiner: Callable[[], str] | None = None


@contextlib.contextmanager
def start_job_actors(
    config: MilesSyncConfig, *, log: Callable[[str], None], engine_log_dir: Path | None = None
) -> Iterator[JobActors]:
    """Place and start the job's engines (unless given as URLs), trainer ranks and controller on the connected Ray
    cluster; stop them in reverse on exit. Engine logs go to `engine_log_dir` (default:
    <output_dir>/<run_name>/engine-logs)."""
    log_dir = Path(config.output_dir) / config.run_name / "engine-logs" if engine_log_dir is None else engine_log_dir
    with contextlib.ExitStack() as stack:
        job = resolve_job(config, log=log)  # what the trainers could not split or export fails before placement
        config, plan = job.config, job_placement(job.config)
        placed = (
            None
            if plan is None
            else create_placement_groups(plan, timeout_s=_PLACEMENT_TIMEOUT_S, name_prefix=config.run_name)
        )
        if placed is not None:
            stack.callback(placed.remove)
        feeds = job_feed_plan(config, plan)  # refuses a layout with an unfed engine rank before any actor starts
        if config.engines.urls:
            log(f"using {len(config.engines.urls)} running engine server(s): {', '.join(config.engines.urls)}")
        else:
            log(
                f"starting {config.engines.count} {config.engines.kind.value} engine(s) (TP={config.engines.tp}) "
                f"and {config.trainer.world_size} trainer rank(s) ({config.trainer.layout_name})"
            )

        sglang = config.engines.sglang_python or (str(SGLANG_VENV_PYTHON) if SGLANG_VENV_PYTHON.is_file() else None)

        def start_engines(count: int = config.engines.count, placement: Any = placed) -> EngineGroup | None:
            if config.engines.urls:
                return None
            settings = engine_settings(job, device=engine_device(config.engines.device), sglang_python=sglang)
            return create_engines(
                specs=[engine_spec(config.engines.kind, settings)] * count,
                log_dir=log_dir.resolve(),
                placement=placement,
                bind_host=config.cluster.bind_host,
                http_timeout_s=config.sync.http_timeout_s,
                timeout_s=_START_TIMEOUT_S,
            )

        def start_joiner() -> str:
            # Outside the placement groups (sized for engines.count); the job's distributed transport needs no
            # trainer rank beside it (config refuses join_at_round with a transport that would).
            group = start_engines(count=1, placement=None)
            assert group is not None  # join_at_round needs launched engines (config)
            stack.callback(group.shutdown)
            return group.urls[0]

        # Engines and trainer ranks start at once: each side spends most of its start-up importing.
        with _Background(start_engines) as engine_start:
            trainers = create_trainers(
                trainer=config.trainer,
                checkpoint_dir=job.checkpoint,
                num_trained_mtp_layers=config.model.num_trained_mtp_layers,
                seed=config.seed,
                placement=placed,
                bind_host=config.cluster.bind_host,
                timeout_s=_START_TIMEOUT_S,
                collective_timeout_s=config.sync.collective_timeout_s,
                feeds=feeds,
                conversion=config.sync.conversion,
                lora=trainer_lora(config),
                lora_flatten_min_bytes=config.sync.lora.flatten_min_bytes,
            )
            stack.callback(trainers.shutdown)
            engines = engine_start.result()
        if engines is not None:
            stack.callback(engines.shutdown)
        urls = config.engines.urls if engines is None else engines.urls
        router = stack.enter_context(_router(config, python=sglang, log_dir=log_dir, log=log))
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
            gate=router,
        )
        stack.callback(_close_controller, controller)
        sources = [info for info in trainers.ranks if info.is_source]  # one per pipeline stage
        per_sync = (
            f"{sum(info.num_exported_tensors for info in sources)} tensors per sync"
            if config.sync.mode is SyncMode.FULL
            else "the LoRA adapter per sync (sync.mode=lora; the base is never sent)"
        )
        stages = f" from {len(sources)} pipeline stages, sent one after another" if len(sources) > 1 else ""
        log(f"fleet ready: {len(urls)} engine(s), {len(trainers.actors)} trainer rank(s), {per_sync}{stages}")
        nodes = node_record(trainers, engines, urls=urls)
        log("nodes: " + ", ".join(f"trainer rank {r['rank']} on {r['node']}" for r in nodes["trainer_ranks"]))
        log("nodes: " + ", ".join(f"engine {e['url']} on {e['node']}" for e in nodes["engines"]))
        if router is not None:
            log(f"rollouts go through the router at {router.url}: {len(urls)} engine(s) admitted")
        yield JobActors(
            urls=tuple(urls),
            engines=engines,
            trainers=trainers,
            controller=controller,
            nodes=nodes,
            router=router,
            start_joiner=None if config.engines.join_at_round is None else start_joiner,
        )


@contextlib.contextmanager
def _router(
    config: MilesSyncConfig, *, python: str | None, log_dir: Path, log: Callable[[str], None]
) -> Iterator[RouterClient | None]:
    """The router of `rollout.router`: the user's (`rollout.router_url`), or sglang-router started here on this
    node's address and stopped on exit; None without one. Its worker list starts empty: the controller admits the
    engines that serve when it connects."""
    rollout = config.rollout
    if not rollout.router:
        yield None
        return
    if rollout.router_url is not None:
        log(f"using the router at {rollout.router_url}")
        yield RouterClient(rollout.router_url, timeout_s=config.sync.http_timeout_s)
        return
    if python is None:
        raise RuntimeError(
            "rollout.router=true starts sglang-router from the SGLang venv, which is missing: run "
            "`bash launch/install_sglang.sh` (or set engines.sglang_python, or give rollout.router_url)"
        )
    host = bind_host(override=config.cluster.bind_host, node_ip=ray.util.get_node_ip_address())
    process = RouterProcess(
        spec=RouterSpec(python=python, policy=rollout.router_policy),
        log_dir=log_dir.resolve(),
        host=host,
        timeout_s=config.sync.http_timeout_s,
    )
    client = process.start()
    log(f"started sglang-router at {client.url} (policy {rollout.router_policy})")
    try:
        yield client
    finally:
        process.stop()


def _close_controller(controller: Any) -> None:
    with contextlib.suppress(Exception):
        ray.get(controller.close.remote(), timeout=60)
    ray.kill(controller)


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


class _Background:
    """Run `fn(*args)` on a thread for the duration of a `with` block; `result()` joins it (re-raising)."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:

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
