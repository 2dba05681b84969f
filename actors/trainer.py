"""Trainer actors: one `miles_sync.job.trainer.TrainerWorker` per Megatron rank, wrapped with `ray.remote` here.

`create_trainers` starts every rank (in its placement bundle when given one), each adopting its node's address
(actors.node), lets rank 0 host the trainer group's rendezvous store at its node's address, and sets every rank up at
once (they join one gloo group, so setup is collective).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray

from actors.node import NodeAddress, adopt_node_address, node_address_of
from actors.placement import PlacedGroups
from miles_sync.config import TrainerConfig
from miles_sync.export.registry import ConversionMode
from miles_sync.job.placement import DEFAULT_TRAINER_RESOURCES, Resources
from miles_sync.job.trainer import CompletionLogprobs, ScoreBatch, TrainBatch, TrainerWorker, TrainStepResult
from miles_sync.megatron.lora import LoraSpec
from miles_sync.sync.source import RankInfo
from miles_sync.transport.feeds import FeedPlan

__all__ = ["DEFAULT_TRAINER_RESOURCES", "NodeTrainerWorker", "TrainerGroup", "create_trainers"]

# A sliver of a CPU: on small machines every actor must schedule, and a rank's work is bounded by its threads.


class NodeTrainerWorker(TrainerWorker):
    """A TrainerWorker that first adopts its node's address (actors.node): the trainer group's store, the update
    groups it hosts as a stage source and the colocated fan-out bind there. `bind_host`: `cluster.bind_host`."""

    def __init__(self, *, bind_host: str | None = None, **kwargs: Any) -> None:
        self.node_address = adopt_node_address(bind_host)
        super().__init__(**kwargs)


@dataclass(frozen=True, kw_only=True)
class TrainerGroup:
    """The trainer actors in rank order, what each rank reported at setup, and the node each rank runs on."""

    actors: tuple[Any, ...]
    ranks: tuple[RankInfo, ...]
    nodes: tuple[NodeAddress, ...] = ()

    def train_step(self, batch: TrainBatch, *, timeout_s: float) -> tuple[TrainStepResult, ...]:
        """One optimizer step on every rank with the same batch."""
        return tuple(ray.get([a.train_step.remote(batch) for a in self.actors], timeout=timeout_s))

    def completion_logprobs(self, batch: ScoreBatch, *, timeout_s: float) -> CompletionLogprobs:
        """The current weights' completion-token log-probs, computed on every rank; raises RuntimeError unless every
        rank computed exactly the same (one model, one answer)."""
        results = ray.get([a.completion_logprobs.remote(batch) for a in self.actors], timeout=timeout_s)
        if any(r != results[0] for r in results[1:]):
            raise RuntimeError("trainer ranks computed different completion log-probs")
        return results[0]

    def shutdown(self, *, timeout_s: float = 60.0) -> None:
        """Release each rank's groups, then end the actors. Best effort, never raises."""
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=timeout_s)
        except Exception:  # a dead or stuck rank must not keep the others alive
            pass
        for actor in self.actors:
            ray.kill(actor)


def create_trainers(
    *,
    trainer: TrainerConfig,
    checkpoint_dir: str,
    num_trained_mtp_layers: int = 0,
    seed: int = 0,
    placement: PlacedGroups | None = None,
    resources: Resources = DEFAULT_TRAINER_RESOURCES,
    bind_host: str | None = None,
    env_vars: Mapping[str, str] | None = None,
    num_threads: int | None = 1,
    backend: str | None = None,
    timeout_s: float = 300.0,
    collective_timeout_s: float | None = None,
    feeds: FeedPlan | None = None,
    max_concurrency: int = 1,
    conversion: ConversionMode | str = ConversionMode.RAW,
    lora: LoraSpec | None = None,
    lora_flatten_min_bytes: int = 2**20,
) -> TrainerGroup:
    """Start `trainer.world_size` trainer actors and set them up; raises (after killing them) if any rank fails.

    `backend`: the trainer group's (None: nccl where CUDA is available, else gloo). Every rank binds its node's
    address (`bind_host`: an explicit override for all, `cluster.bind_host`), with the gloo/NCCL interface derived
    from it (miles_sync.env); rank 0 hosts the trainer group's store there. `env_vars` go into every rank's
    environment. `feeds`: the colocated feed plan every rank
    follows with the colocated transport (`placement.plan_colocated_feeds(placement.plan)`); None feeds every
    engine rank from the export source. `max_concurrency`: calls a rank's actor runs at once; 1 suffices (bucket
    progress is pushed to the controller, nothing polls a rank), more lets a caller query a rank mid-send.
    `conversion`: how every rank exports its weights (`sync.conversion`: raw converters or megatron-bridge).
    `lora`: train LoRA adapters on a frozen base and sync only them (`sync.mode=lora`); None: every weight.
    `timeout_s` bounds start-up and set-up; `collective_timeout_s` (None: `timeout_s`) every rank's collectives
    after set-up (training steps and syncs; `sync.collective_timeout_s`), so a rank whose peer died fails sooner.
    """
    remote_class = ray.remote(NodeTrainerWorker)
    actors = []
    for rank in range(trainer.world_size):
        options = resources.as_actor_options() if placement is None else placement.trainer_options(rank)
        if env_vars:
            options["runtime_env"] = {"env_vars": dict(env_vars)}
        options["max_concurrency"] = max_concurrency
        actors.append(
            remote_class.options(**options).remote(
                bind_host=bind_host,
                rank=rank,
                trainer=trainer,
                checkpoint_dir=checkpoint_dir,
                num_trained_mtp_layers=num_trained_mtp_layers,
                seed=seed,
                num_threads=num_threads,
                timeout_s=timeout_s,
                collective_timeout_s=collective_timeout_s,
                backend=backend,
                feeds=feeds,
                conversion=conversion,
                lora=lora,
                lora_flatten_min_bytes=lora_flatten_min_bytes,
            )
        )
    try:
        nodes = [node_address_of(a, timeout_s=timeout_s) for a in actors]
        master_address = nodes[0].bind_host
        port = ray.get(actors[0].host_store.remote(host=master_address), timeout=timeout_s)
        infos = ray.get(
            [a.setup.remote(master_address=master_address, master_port=port) for a in actors], timeout=timeout_s
        )
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        raise
    return TrainerGroup(actors=tuple(actors), ranks=tuple(infos), nodes=tuple(nodes))
