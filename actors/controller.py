"""The controller actor: `miles_sync.sync.controller.SyncController` itself, wrapped with `ray.remote` here.

One per engine fleet. It owns the update group, the weight version and the sync lease, and runs each sync as one
session across all engines; it reaches the trainer ranks through the models they attached (RemoteTrainerSource).
`controller_args` maps the job's config to its constructor; callers read its state with `status.remote()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from actors.remote_source import RemoteTrainerSource
from miles_sync.config import ModelConfig, SyncConfig, SyncMode
from miles_sync.sync.attach import DEFAULT_ATTACHMENT
from miles_sync.sync.controller import GroupSettings, SyncController
from miles_sync.sync.draft_canary import CanarySettings
from miles_sync.sync.routing import TrafficGate
from miles_sync.sync.sender import SenderSettings
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.wire.protocol import PauseMode

__all__ = ["controller_args", "create_controller"]


def controller_args(
    *,
    trainers: Sequence[Any],
    engine_urls: Sequence[str],
    sync: SyncConfig,
    model: ModelConfig,
    master_address: str | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    attachment: str = DEFAULT_ATTACHMENT,
    backend: str = "gloo",
    device: str = "cpu",
    show_progress: bool = False,
    canary_prompts: Sequence[Sequence[int]] = (),
    gate: TrafficGate | None = None,
) -> dict[str, Any]:
    """SyncController's keyword arguments for trainer actors and engine URLs configured by `sync` and `model`.
    Pure. `backend`/`device`: "gloo"/"cpu", or "nccl"/"cuda" where the trainers' models live on GPUs (buckets are
    packed on the device and CUDA IPC handles travel). `canary_prompts`: the draft canary's prompts as token ids (needed
    when `sync.draft_canary` is on). `gate`: the router whose worker list follows the syncs (a RouterClient; it
    connects from inside the actor)."""
    settings = SenderSettings(
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
    source = RemoteTrainerSource(
        trainers=trainers, settings=settings, attachment=attachment, control_timeout_s=sync.http_timeout_s
    )
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


def create_controller(
    *,
    trainers: Sequence[Any],
    engine_urls: Sequence[str],
    sync: SyncConfig,
    model: ModelConfig,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    attachment: str = DEFAULT_ATTACHMENT,
    backend: str = "gloo",
    device: str = "cpu",
    master_address: str | None = None,
    show_progress: bool = False,
    options: dict[str, Any] | None = None,
    timeout_s: float = 120.0,
    canary_prompts: Sequence[Sequence[int]] = (),
    gate: TrafficGate | None = None,
) -> Any:
    """Start the controller actor and connect it to every trainer rank and engine; returns its handle.

    `trainers`: the trainer actors in rank order, each of whose processes called `attach_model`. Raises what
    `connect` raised (e.g. an engine without the session endpoints, named) after ending the actor.
    `master_address`: where the update group meets (default None: on the source rank's node, at the address that
    rank binds).
    Then `ray.get(controller.sync.remote(), timeout=...)` runs one sync and returns its SyncReport
    (`sync.remote(raise_on_failure=False)` returns a failed one instead of raising SyncError), and
    `controller.status.remote()` reads its ControllerStatus.
    """
    kwargs = controller_args(
        trainers=list(trainers),
        engine_urls=engine_urls,
        sync=sync,
        model=model,
        master_address=master_address,
        api_key=api_key,
        admin_api_key=admin_api_key,
        attachment=attachment,
        backend=backend,
        device=device,
        show_progress=show_progress,
        canary_prompts=canary_prompts,
        gate=gate,
    )
    # An async actor (one event loop for its engine clients); it computes nothing, so it needs no CPU of its own.
    remote_class = ray.remote(SyncController)
    handle = remote_class.options(**({"num_cpus": 0} if options is None else options)).remote(**kwargs)
    try:
        ray.get(handle.connect.remote(), timeout=timeout_s)
    except BaseException:
        ray.kill(handle)
        raise
    return handle
