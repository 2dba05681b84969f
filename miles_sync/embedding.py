"""The embedding API: a Miles/slime-style pipeline with its own Ray actors syncs weights through miles_sync.

Three steps, none of which needs miles_sync's launch code:

1. On every trainer rank, once its Megatron model exists (inside the pipeline's own trainer actor):

       from miles_sync.embedding import attach_model
       attach_model(model, hf_config=hf_config)          # the one call; `model` is this rank's model (chunks)

   torch.distributed and megatron-core model parallelism must already be initialized (the pipeline's own).
2. On the driver, with the trainer actors' handles (in rank order) and the URLs of running SGLang-compatible
   servers:

       from actors import create_controller
       controller = create_controller(trainers=trainer_actors, engine_urls=urls, sync=SyncConfig(...),
                                      model=ModelConfig(speculative_algorithm=..., num_trained_mtp_layers=0))
3. After each optimizer step (trainers idle, between steps):

       report = ray.get(controller.sync.remote(), timeout=...)   # SyncReport; raises SyncError if it failed

Pipeline parallelism: every rank of every stage calls `attach_model` with its own stage's model (chunks), and the
driver passes all trainer actors, in rank order, to one controller. `connect()` reads each rank's pipeline stage and
finds each stage's export source (its tp 0 / dp 0 rank): one source per stage, each with an update group of its
own, opened in stage order, and every engine receives stage 0's buckets before stage 1's (so engines that, like
SGLang, handle one weight update at a time never wait in two stages' broadcasts at once). Stages after the first
pack their buckets while the earlier ones send. A pipeline with its own sources (not trainer actors) composes
them the same way with `miles_sync.sync.pipeline.PipelineSource([stage0, stage1, ...])`, a WeightSource the
`SyncController` takes as its source. With the colocated transport and pipeline stages, pass no feed plan: each
stage's source feeds every engine rank itself. `examples/embed_in_pipeline.py --pp 2` runs a two-stage pipeline.

The controller reaches each rank's attached model through Ray's `__ray_call__` on the given actors, so the
pipeline's actor classes need no extra methods; a rank's export runs in its own process, on a thread of its own,
while the actor is otherwise idle (a sync actor runs it like any call; an async actor's event loop waits for it).
The attach calls live in `miles_sync.sync.attach`. Without Ray, `controller_from_config` builds the same controller
`create_controller` runs as an actor, over any `WeightSource` (it must subclass it), from the same `SyncConfig` and
`ModelConfig`; `sender_settings` is what a trainer-side `Sender` takes for that config.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_sync.config import ModelConfig, SyncConfig, SyncMode
from miles_sync.sync.attach import DEFAULT_ATTACHMENT, attach_model, attached_source, detach_model
from miles_sync.sync.controller import SyncController
from miles_sync.sync.draft_canary import CanarySettings
from miles_sync.sync.routing import TrafficGate
from miles_sync.sync.sender import SenderSettings
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.sync.update_group import GroupSettings
from miles_sync.sync.weight_source import WeightSource
from miles_sync.wire.protocol import PauseMode

__all__ = [
    "DEFAULT_ATTACHMENT",
    "attach_model",
    "attached_source",
    "controller_from_config",
    "controller_options",
    "detach_model",
    "sender_settings",
]


def sender_settings(
    sync: SyncConfig, *, device: str = "cpu", api_key: str | None = None, admin_api_key: str | None = None
) -> SenderSettings:
    """What each trainer rank's sender takes for `sync`. Pure. `device`: "cpu", or "cuda" where the trainers'
    models live on GPUs (buckets are packed on the device and CUDA IPC handles travel)."""
    return SenderSettings(
        transport=sync.transport.value,
        bucket_bytes=sync.bucket_bytes,
        bucket_timeout_s=sync.collective_timeout_s,
        open_timeout_s=sync.collective_timeout_s,
        http_timeout_s=sync.http_timeout_s,
        call_timeout_s=sync.sync_timeout_s,
        api_key=api_key,
        admin_api_key=admin_api_key,
        device=device,
        hash_buckets=sync.verify,
        quantization=sync.quantization_spec,
        # The engine flushes its prefix cache with each update where the pause empties it, instead of a
        # /flush_cache call per engine (a full gc pass in a CPU SGLang server's scheduler: ~0.45 s a sync).
        flush_cache=sync.pause_mode is not PauseMode.IN_PLACE,
    )


def controller_options(
    *,
    source: WeightSource,
    engine_urls: Sequence[str],
    sync: SyncConfig,
    model: ModelConfig,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    backend: str = "gloo",
    master_address: str | None = None,
    show_progress: bool = False,
    canary_prompts: Sequence[Sequence[int]] = (),
    gate: TrafficGate | None = None,
) -> dict[str, Any]:
    """`SyncController`'s keyword arguments for `source` and `engine_urls` as `sync` and `model` configure them
    (what a Ray actor over the controller is constructed with: see `controller_from_config`). Pure."""
    return {
        "engine_urls": list(engine_urls),
        "source": source,
        "transport": sync.transport.value,
        "selector_inputs": SelectorInputs(
            mode=sync.selector,
            speculative_algorithm=model.speculative_algorithm,
            num_trained_mtp_layers=model.num_trained_mtp_layers,
            conversion_mode=sync.conversion,
            check_coverage=sync.check_selector,
        ),
        "pause_mode": sync.pause_mode,
        "verify": sync.verify,
        "staged": sync.staged,
        "mechanism_check": sync.mechanism_check,
        "timeouts": SessionTimeouts(
            control_s=sync.http_timeout_s, sync_s=sync.sync_timeout_s, in_place_flush_s=sync.in_place_flush_s
        ),
        "group": GroupSettings(backend=backend, master_address=master_address),
        "api_key": api_key,
        "admin_api_key": admin_api_key,
        "show_progress": show_progress,
        "quantization": sync.quantization_spec,
        "lora_name": sync.lora.name if sync.mode is SyncMode.LORA else None,
        "draft_canary": CanarySettings(
            mode=sync.draft_canary,
            min_ratio=sync.draft_canary_min_ratio,
            prompts=tuple(tuple(p) for p in canary_prompts),
        ),
        "gate": gate,
        "version_file": sync.version_file,
    }


def controller_from_config(
    *,
    source: WeightSource,
    engine_urls: Sequence[str],
    sync: SyncConfig,
    model: ModelConfig,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    backend: str = "gloo",
    master_address: str | None = None,
    show_progress: bool = False,
    canary_prompts: Sequence[Sequence[int]] = (),
    gate: TrafficGate | None = None,
) -> SyncController:
    """A `SyncController` over `source` and `engine_urls` configured by `sync` and `model`, without Ray; call
    `connect()` on it, then `sync()` per step. `backend`: the update group's ("gloo", or "nccl" on GPUs).
    `master_address`: where the update group meets (None: on the source rank's node). `canary_prompts`: the draft
    canary's prompts as token ids (needed when `sync.draft_canary` is on). `gate`: the router whose worker list
    follows the syncs (miles_sync.sync.routing.TrafficGate). Raises what SyncController raises for a source that
    does not subclass WeightSource or a config it cannot run."""
    return SyncController(
        **controller_options(
            source=source,
            engine_urls=engine_urls,
            sync=sync,
            model=model,
            api_key=api_key,
            admin_api_key=admin_api_key,
            backend=backend,
            master_address=master_address,
            show_progress=show_progress,
            canary_prompts=canary_prompts,
            gate=gate,
        )
    )
