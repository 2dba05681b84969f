"""The controller actor: `miles_sync.sync.controller.SyncController` itself, wrapped with `ray.remote` here.

One per engine fleet. It owns the update group, the weight version and the sync lease, and runs each sync as one
session across all engines; it reaches the trainer ranks through the models they attached (RemoteTrainerSource).
`miles_sync.embedding.controller_options` maps the job's config to its constructor (the same mapping a Ray-free
`controller_from_config` uses); callers read its state with `status.remote()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from actors.remote_source import RemoteTrainerSource
from miles_sync.config import ModelConfig, SyncConfig
from miles_sync.embedding import controller_options, sender_settings
from miles_sync.sync.attach import DEFAULT_ATTACHMENT
from miles_sync.sync.controller import SyncController
from miles_sync.sync.routing import TrafficGate

__all__ = ["create_controller"]


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
    source = RemoteTrainerSource(
        trainers=list(trainers),
        settings=sender_settings(sync, device=device, api_key=api_key, admin_api_key=admin_api_key),
        attachment=attachment,
        control_timeout_s=sync.http_timeout_s,
    )
    kwargs = controller_options(
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
    # An async actor (one event loop for its engine clients); it computes nothing, so it needs no CPU of its own.
    remote_class = ray.remote(SyncController)
    handle = remote_class.options(**({"num_cpus": 0} if options is None else options)).remote(**kwargs)
    try:
        ray.get(handle.connect.remote(), timeout=timeout_s)
    except BaseException:
        ray.kill(handle)
        raise
    return handle
