"""Shared pieces of the Ray tests: a local cluster on loopback, the two-trainer two-engine fleet, the synthetic
language's prompts and rewards, and small HTTP reads of an engine (its weight checksum) through the real client."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import subprocess
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import ray

from actors.placement import PlacedGroups, create_placement_groups
from actors.rollout import DEFAULT_ENGINE_RESOURCES, EngineGroup, create_engines
from actors.trainer import DEFAULT_TRAINER_RESOURCES, TrainerGroup, create_trainers
from miles_sync.config import TrainerConfig
from miles_sync.engine.client import EngineClient
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.engine.rollout import Sample
from miles_sync.job import rl
from miles_sync.job.placement import PlacementPlan, plan_colocated_feeds, plan_placement
from miles_sync.job.rl import make_prompts, reward, train_batch  # noqa: F401 - reward, train_batch: for the tests
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.draft import DraftKind
from miles_sync.wire.protocol import Selector, WeightsCheckerAction, WeightsCheckerRequest

RAY_TIMEOUT_S = 300.0  # every ray.get in these tests waits at most this long
OBJECT_STORE_BYTES = 128 * 2**20


@contextlib.contextmanager
def local_ray(*, num_cpus: int = 2) -> Iterator[None]:
    """A local Ray cluster bound to 127.0.0.1 only (no non-loopback address), shut down in finally."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=OBJECT_STORE_BYTES,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def listeners_off_loopback(pids: Sequence[int]) -> list[str]:
    """`ss -ltnp` lines of sockets that processes `pids` listen on outside loopback."""
    output = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout
    return [
        line
        for line in output.splitlines()
        if any(f"pid={pid}," in line for pid in pids) and not _is_loopback(line.split()[3].rpartition(":")[0])
    ]


def _is_loopback(host: str) -> bool:
    host = host.strip("[]").split("%")[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # "*" and "0.0.0.0"-style wildcards are every interface
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped if mapped is not None else address).is_loopback


def prompts(round_index: int, *, num_prompts: int = 4, length: int = 4) -> list[list[int]]:
    return make_prompts(round_index, num_prompts=num_prompts, length=length)


def mean_accept_length(samples: Sequence[Sample]) -> float:
    value = rl.mean_accept_length(samples)
    assert value is not None, "an engine with a draft reports spec_accept_length for every sample"
    return value


def _target_checker(url: str, *, timeout_s: float):
    """The engine's /weights_checker checksum answer for its target runner."""

    async def read():
        async with EngineClient(url, timeout_s=timeout_s) as client:
            request = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=Selector.TARGET)
            return await client.weights_checker(request)

    return asyncio.run(read())


def target_checksum(url: str, *, timeout_s: float = 60.0) -> str:
    """The engine's checksum over its target runner's tensors (/weights_checker)."""
    return _target_checker(url, timeout_s=timeout_s).per_engine_checksum


def rank_checksums(url: str, *, timeout_s: float = 60.0) -> list[dict[str, str]]:
    """Each engine TP rank's per-parameter digests of its target runner (/weights_checker), in rank order."""
    return [dict(rank.checksums) for rank in _target_checker(url, timeout_s=timeout_s).ranks]


def check_against_a_gathered_sync(trainers: TrainerGroup, urls: Sequence[str], *, model, sync: dict) -> None:
    """An anchor outside the routed build: a routed sync is verified against the digests its feeders computed from
    what they built, so a slice built wrong the same way on both sides would verify. Here the trainers' current
    weights (the ones the routed sync just sent) go again through the gathered distributed broadcast, whose
    expected digests come from the gathered HF tensors; it must verify and leave every engine rank's parameters
    exactly as the routed sync left them."""
    from actors.controller import create_controller
    from miles_sync.config import SyncConfig
    from miles_sync.transport.base import TransportKind

    routed = {url: rank_checksums(url) for url in urls}
    controller = create_controller(
        trainers=trainers.actors,
        engine_urls=list(urls),
        sync=SyncConfig(transport=TransportKind.DISTRIBUTED, **sync),
        model=model,
    )
    try:
        report = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
        assert report.committed and all(e.success for e in report.engines), report.summary()
    finally:
        ray.get(controller.close.remote(), timeout=RAY_TIMEOUT_S)
        ray.kill(controller)
    for url in urls:
        gathered = rank_checksums(url)
        differ = sorted({n for r, g in zip(routed[url], gathered) for n in r.keys() | g.keys() if r.get(n) != g.get(n)})
        assert len(gathered) == len(routed[url]) and not differ, f"{url}: the routed sync left {differ} otherwise"


def current_urls(engine_actors: Sequence[object]) -> tuple[str, ...]:
    return tuple(ray.get([a.url.remote() for a in engine_actors], timeout=RAY_TIMEOUT_S))


@dataclass
class Fleet:
    """Two trainer ranks and two reference engines (MTP draft, AITER layout), colocated bundle by bundle.
    `trainers` is replaced when a test re-creates the trainer group."""

    plan: PlacementPlan
    placed: PlacedGroups
    engines: EngineGroup
    trainers: TrainerGroup
    checkpoint_dir: str

    @property
    def source_rank(self) -> int:
        (rank,) = [info.rank for info in self.trainers.ranks if info.is_source]
        return rank

    @property
    def source(self) -> Any:
        return self.trainers.actors[self.source_rank]

    @property
    def num_tensors(self) -> int:
        return self.trainers.ranks[0].num_exported_tensors


@contextlib.contextmanager
def started_fleet(
    *,
    checkpoint_dir: str,
    log_dir: str,
    trainer: TrainerConfig,
    engine_collective_timeout_s: float,
    name: str,
) -> Iterator[Fleet]:
    """Start the fleet on the running cluster; shut down trainers, engines and placement groups on exit."""
    plan = plan_placement(
        layout="colocated",
        num_trainers=2,
        num_engines=2,
        trainer=DEFAULT_TRAINER_RESOURCES,
        engine=DEFAULT_ENGINE_RESOURCES,
    )
    spec = ReferenceEngineSpec(
        model_dir=checkpoint_dir,
        draft_kind=DraftKind.MTP,
        weight_layout=WeightLayout.AITER,
        collective_timeout_s=engine_collective_timeout_s,
    )
    with ExitStack() as stack:
        placed = create_placement_groups(plan, timeout_s=60.0, name_prefix=name)
        stack.callback(placed.remove)
        # Engines and trainers start at the same time: each side spends most of its start-up importing.
        with ThreadPoolExecutor(max_workers=2) as pool:
            engines_future = pool.submit(create_engines, specs=[spec, spec], log_dir=log_dir, placement=placed)
            # With the colocated transport each engine is fed by the trainer rank on its bundle.
            trainers_future = pool.submit(
                create_trainers,
                trainer=trainer,
                checkpoint_dir=checkpoint_dir,
                placement=placed,
                feeds=plan_colocated_feeds(plan),
            )
            engines, trainers = engines_future.result(), trainers_future.result()
        stack.callback(engines.shutdown)
        fleet = Fleet(plan=plan, placed=placed, engines=engines, trainers=trainers, checkpoint_dir=checkpoint_dir)
        stack.callback(lambda: fleet.trainers.shutdown())  # whichever trainer group is current at the end
        yield fleet
